"""Multi-start L-BFGS-B fit of a law in log space, bootstrap over runs, extrapolation checks.

Objective (DESIGN.md "Scaling law"; Hoffmann et al. 2022 App. D.2; Besiroglu et al. 2024):

    min_theta  sum_i w_i * Huber_delta( LSE_k(F_k,i . theta) - log y_i )

with theta = (log coefficients, exponents), so every term of the law is linear in
theta and log L = log-sum-exp of the terms: no overflow anywhere in the bounds,
and the gradient is exact and cheap:  sum_i w_i psi(r_i) sum_k softmax_ik F_k,i,
psi = clip(r, -delta, delta). The Huber loss is summed, not averaged (a mean
makes L-BFGS stop early). Starts: a scrambled Sobol design over each free
parameter's start range (deterministic for a seed); every start is optimised
and its outcome recorded (converged, reached the best, or why it stopped).

Bootstrap, hold-out and leave-one-out act on runs (all evaluation points of a
training run go together), never on single points, because the points of one
loss curve are not independent.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from scaling_fits.data import RunData
from scaling_fits.errors import FitDataError
from scaling_fits.laws import Law, field_name, formula_name, get_law
from scaling_fits.model import Model, as_model

Progress = Callable[[str, int, int], None]   # (stage, done, total)


@dataclass(frozen=True)
class FitOptions:
    """Fitter settings (all recorded in a fit file's provenance)."""

    n_starts: int = 128           # start grid size (Sobol points); benchmarks/fit_speed.py times the default
    huber_delta: float = 1e-3     # on log-loss residuals (Hoffmann et al. 2022)
    seed: int = 0                 # start grid and bootstrap resampling
    fixed: Mapping[str, float] = field(default_factory=dict)   # formula name -> value held fixed (a prior)
    maxiter: int = 2000           # L-BFGS-B iterations per start
    ftol: float = 1e-12           # L-BFGS-B relative objective tolerance
    gtol: float = 1e-9            # L-BFGS-B projected-gradient tolerance
    maxcor: int = 30              # L-BFGS memory (30 vs scipy's 10: ~30% fewer evaluations on the bundled data)
    best_rtol: float = 1e-6       # a start "reached the best" if its objective is within this of the best
    n_jobs: int = 1               # processes over starts (1 = in process)
    per_source: tuple[str, ...] = ()          # constant coefficients fitted once per data source (e.g. ("e",))
    reference_source: Optional[str] = None    # source whose values the law keeps (None: the first by name)

    def as_dict(self) -> dict[str, Any]:
        return {"n_starts": self.n_starts, "huber_delta": self.huber_delta, "seed": self.seed,
                "fixed": dict(self.fixed), "maxiter": self.maxiter, "ftol": self.ftol, "gtol": self.gtol,
                "maxcor": self.maxcor, "best_rtol": self.best_rtol, "n_jobs": self.n_jobs,
                "per_source": list(self.per_source), "reference_source": self.reference_source}

    def model(self, law: Law, data: RunData) -> Model:
        return Model.for_data(law, data, tuple(self.per_source), self.reference_source)


@dataclass(frozen=True)
class StartReport:
    """What happened to the starts of one fit."""

    n_starts: int
    n_converged: int            # L-BFGS-B reported convergence
    n_at_best: int              # converged to within best_rtol of the best objective
    failures: dict[str, int]    # reason -> count, for starts that did not reach the best

    def as_dict(self) -> dict[str, Any]:
        return {"n_starts": self.n_starts, "n_converged": self.n_converged, "n_at_best": self.n_at_best,
                "failures": dict(self.failures)}


@dataclass(frozen=True, eq=False)
class FitResult:
    """Best fit of one law to one data set."""

    law: Law
    theta: np.ndarray               # full fit-space vector (fixed entries included; per-source entries last)
    objective: float
    fixed: dict[str, float]         # formula name -> value
    options: FitOptions
    report: StartReport
    optima: np.ndarray              # distinct local optima (full theta), best first; warm starts for refits
    seconds: float
    model: Optional[Model] = None   # law + per-source coefficients (None: the law alone)

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", Model(self.law))

    @property
    def params(self) -> Any:
        """The law's parameters for the reference source."""
        return self.law.params_from_theta(self.model.project(self.theta))

    def predict(self, data: RunData) -> np.ndarray:
        return self.model.predict(self.theta, data)


# ---------------------------------------------------------------------------
# objective

class Objective:
    """Summed weighted Huber loss on log residuals, with exact gradient; picklable.

    Optimised coordinates x are the free entries of a *centred* theta: for a term
    coef * prod f_j^-x_j whose coefficient is free, the fitted coordinate is
    log coef - sum_j x_j mean(log f_j) and the features are centred, so the
    coefficient and its exponents are not collinear (log D spans only
    24.7-25.6 in typical data). `full_theta` maps back to plain theta.
    The objective is sum_i w_i Huber_delta(r_i) / delta: the same minimiser as
    the plain sum, on the scale of the residuals, so L-BFGS-B's stopping rule
    (relative to max(|f|, 1)) does not end the search early.
    """

    def __init__(self, law: Law | Model, data: RunData, delta: float, fixed: Mapping[str, float],
                 weight: Optional[np.ndarray] = None):
        if not delta > 0:
            raise FitDataError(f"huber_delta must be > 0, got {delta}")
        model = as_model(law)
        law = model.law
        self.model = model
        self.law = law
        self.delta = float(delta)
        for name in fixed:
            if name in model.per_source and model.extra:
                raise FitDataError(f"'{name}' is fitted per source; it cannot also be held fixed")
        P = model.n_params
        self.fixed_theta: dict[int, float] = {}
        dropped: set[int] = set()
        for name, value in fixed.items():
            i = law.index(name)
            value = float(value)
            if not math.isfinite(value):
                raise FitDataError(f"fixed value of '{formula_name(field_name(name))}' must be finite")
            if law.is_coef(name):
                if value < 0:
                    raise FitDataError(f"fixed coefficient '{name}' must be >= 0 (0 removes its term)")
                if value == 0:
                    dropped.update(k for k, t in enumerate(law.terms) if t.coef == field_name(name))
                    self.fixed_theta[i] = -np.inf
                    continue
                self.fixed_theta[i] = float(np.log(value))
            else:
                self.fixed_theta[i] = value
        keep_terms = [k for k in range(len(law.terms)) if k not in dropped]
        # exponents that only appear in dropped terms are not identifiable: hold them at 0
        used = {law.index(t.coef) for k, t in enumerate(law.terms) if k in keep_terms}
        used |= {law.index(e) for k, t in enumerate(law.terms) if k in keep_terms for e, _ in t.powers}
        used |= {model.column(c, s) for c, s in model.extra if law.index(c) in used}
        for i in range(P):
            if i not in used and i not in self.fixed_theta:
                self.fixed_theta[i] = 0.0
        self.free = np.array([i for i in range(P) if i not in self.fixed_theta], dtype=int)
        if self.free.size == 0:
            raise FitDataError("every parameter is fixed; nothing to fit")
        feats = law.features(data.n_total, data.sparsity, data.tokens, data.granularity)
        mu = {k: float(v.mean()) for k, v in feats.items()}
        # centring: theta_c = M theta (unit triangular), only for terms with a free coefficient
        M = np.eye(P)
        F = np.zeros((len(keep_terms), data.n_points, P))
        for row, k in enumerate(keep_terms):
            term = law.terms[k]
            ci = law.index(term.coef)
            centre = ci not in self.fixed_theta
            F[row, :, ci] = 1.0
            for exp_name, feat in term.powers:
                ei = law.index(exp_name)
                F[row, :, ei] -= feats[feat] - (mu[feat] if centre else 0.0)
                if centre:
                    M[ci, ei] -= mu[feat]
            for c, s in model.extra:   # rows of another source read this constant from its own column
                if term.coef == field_name(c):
                    rows = data.source_index == s
                    F[row, rows, model.column(c, s)] = F[row, rows, ci]
                    F[row, rows, ci] = 0.0
        self.M = M
        self.M_inv = np.linalg.inv(M)
        self.shape = F.shape[:2]                                                        # (K, n)
        self.F_free = np.ascontiguousarray(F[:, :, self.free].reshape(-1, self.free.size))  # (K*n, p)
        fixed_idx = np.array(sorted(i for i in self.fixed_theta if np.isfinite(self.fixed_theta[i])), dtype=int)
        fixed_val = np.array([self.fixed_theta[i] for i in fixed_idx])
        self.offset = F[:, :, fixed_idx] @ fixed_val if fixed_idx.size else np.zeros(F.shape[:2])  # (K, n)
        self.log_y = np.log(data.loss)
        self.weight = np.asarray(data.weight if weight is None else weight, dtype=float)

    def with_weight(self, weight: np.ndarray) -> Objective:
        clone = object.__new__(Objective)
        clone.__dict__.update(self.__dict__)
        clone.weight = np.asarray(weight, dtype=float)
        return clone

    def _finite_fixed(self) -> np.ndarray:
        theta = np.zeros(self.model.n_params)
        for i, v in self.fixed_theta.items():
            theta[i] = v if np.isfinite(v) else 0.0
        return theta

    def full_theta(self, x: np.ndarray) -> np.ndarray:
        """Plain theta (log coefficients, exponents) from optimiser coordinates."""
        theta_c = self._finite_fixed()
        theta_c[self.free] = x
        theta = self.M_inv @ theta_c
        for i, v in self.fixed_theta.items():
            theta[i] = v
        return theta

    def free_part(self, theta: np.ndarray) -> np.ndarray:
        """Optimiser coordinates of a plain theta."""
        theta = np.where(np.isfinite(theta), np.asarray(theta, dtype=float), 0.0)
        return (self.M @ theta)[self.free]

    def bounds(self) -> list[tuple[float, float]]:
        """Box bounds in optimiser coordinates (centred coefficients: widened by interval arithmetic)."""
        b = self.model.theta_bounds()
        out = []
        for i in self.free:
            lo, hi = b[i]
            for j in np.flatnonzero(self.M[i] != 0):
                if j == i:
                    continue
                m = self.M[i, j]
                elo, ehi = b[j] if j not in self.fixed_theta else (self.fixed_theta[j], self.fixed_theta[j])
                lo += min(m * elo, m * ehi)
                hi += max(m * elo, m * ehi)
            out.append((float(lo), float(hi)))
        return out

    def __call__(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        T = (self.F_free @ x).reshape(self.shape)          # (K, n) log terms
        T += self.offset
        m = T.max(axis=0)
        E = np.exp(T - m)
        s = E.sum(axis=0)
        r = m + np.log(s) - self.log_y                      # log residual per point
        a = np.abs(r)
        c = np.minimum(a, self.delta)
        h = c * (a - 0.5 * c)                               # delta * Huber_delta(r): quadratic inside, linear outside
        f = float(self.weight @ h) / self.delta
        psi = self.weight * np.copysign(c, r) / (self.delta * s)   # dObjective/dr / s
        g = (E * psi).ravel() @ self.F_free                 # sum_i psi_i sum_k softmax_ki F_ki
        return f, g


def start_grid(obj: Objective, n_starts: int, seed: int) -> np.ndarray:
    """Scrambled Sobol points over the free parameters' start ranges, as optimiser coordinates (n_starts, p)."""
    from scipy.stats import qmc

    if n_starts < 1:
        raise FitDataError(f"n_starts must be >= 1, got {n_starts}")
    ranges = np.array([obj.model.theta_start_ranges()[i] for i in obj.free])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Sobol balance warning for non-powers of two
        u = qmc.Sobol(d=len(obj.free), scramble=True, seed=seed).random(n_starts)
    theta = np.tile(obj._finite_fixed(), (n_starts, 1))
    theta[:, obj.free] = ranges[:, 0] + u * (ranges[:, 1] - ranges[:, 0])
    return np.array([obj.free_part(t) for t in theta])


def single_thread() -> Any:
    """Limit BLAS to one thread: L-BFGS-B's tiny BLAS calls run ~7x slower when OpenBLAS
    spreads them over threads (measured: 1.3 s vs 0.19 s per start on a loaded 2-core host)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        return contextlib.nullcontext()
    return threadpool_limits(limits=1)


def _run_starts(obj: Objective, starts: np.ndarray, bounds: list[tuple[float, float]], options: FitOptions,
                tick: Optional[Callable[[], None]] = None) -> list[tuple[np.ndarray, float, bool, str]]:
    with single_thread():
        return _run_starts_inner(obj, starts, bounds, options, tick)


def _run_starts_inner(obj: Objective, starts: np.ndarray, bounds: list[tuple[float, float]], options: FitOptions,
                      tick: Optional[Callable[[], None]] = None) -> list[tuple[np.ndarray, float, bool, str]]:
    from scipy.optimize import minimize

    out = []
    for x0 in starts:
        with np.errstate(all="ignore"):
            res = minimize(obj, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                           options={"maxiter": options.maxiter, "ftol": options.ftol, "gtol": options.gtol,
                                    "maxcor": options.maxcor})
        fun = float(res.fun) if np.isfinite(res.fun) else np.inf
        message = res.message if isinstance(res.message, str) else res.message.decode()
        out.append((np.asarray(res.x, dtype=float), fun, bool(res.success), message))
        if tick is not None:
            tick()
    return out


def _chunk_worker(args: tuple[Objective, np.ndarray, list[tuple[float, float]], FitOptions]) -> list:
    obj, starts, bounds, options = args
    return _run_starts(obj, starts, bounds, options)


def _reason(message: str) -> str:
    msg = message.upper()
    if "ITERATIONS" in msg or "MAXITER" in msg:
        return "iteration limit"
    if "LNSRCH" in msg or "LINE SEARCH" in msg:
        return "line search failed"
    if "NAN" in msg or "INF" in msg:
        return "non-finite objective"
    return message.strip().lower() or "unknown"


def _summarise(obj: Objective, outcomes: list[tuple[np.ndarray, float, bool, str]],
               options: FitOptions) -> tuple[np.ndarray, float, StartReport, np.ndarray]:
    funs = np.array([o[1] for o in outcomes])
    if not np.isfinite(funs).any():
        raise FitDataError("every start failed with a non-finite objective; check the data for extreme values")
    best = int(np.argmin(funs))
    best_f = funs[best]
    tol = options.best_rtol * max(abs(best_f), 1e-300) + 1e-15
    failures: Counter[str] = Counter()
    n_conv = n_best = 0
    for _, f, ok, msg in outcomes:
        at_best = f <= best_f + tol
        n_conv += ok
        n_best += ok and at_best
        if not (ok and at_best):
            failures["converged to a worse local minimum" if ok else _reason(msg)] += 1
    order = np.argsort(funs)
    optima: list[np.ndarray] = []
    for i in order:
        if not np.isfinite(funs[i]):
            break
        x = outcomes[i][0]
        if all(np.max(np.abs(x - y)) > 1e-3 for y in optima):
            optima.append(x)
        if len(optima) >= 16:
            break
    report = StartReport(len(outcomes), int(n_conv), int(n_best), dict(sorted(failures.items())))
    return outcomes[best][0], float(best_f), report, np.array([obj.full_theta(x) for x in optima])


def fit(law: Law | str, data: RunData, options: Optional[FitOptions] = None,
        progress: Optional[Progress] = None) -> FitResult:
    """Best fit of `law` to `data` from a grid of starts (see module docstring)."""
    law = get_law(law) if isinstance(law, str) else law
    options = options or FitOptions()
    t0 = time.perf_counter()
    model = options.model(law, data)
    obj = Objective(model, data, options.huber_delta, options.fixed)
    bounds = obj.bounds()
    starts = start_grid(obj, options.n_starts, options.seed)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress("starts", done[0], len(starts))

    if options.n_jobs > 1 and len(starts) >= 2 * options.n_jobs:
        chunks = np.array_split(starts, 4 * options.n_jobs)
        outcomes = []
        with ProcessPoolExecutor(max_workers=options.n_jobs) as pool:
            for part in pool.map(_chunk_worker, [(obj, c, bounds, options) for c in chunks]):
                outcomes.extend(part)
                for _ in part:
                    tick()
    else:
        outcomes = _run_starts(obj, starts, bounds, options, tick)
    x, f, report, optima = _summarise(obj, outcomes, options)
    fixed = {formula_name(field_name(k)): float(v) for k, v in options.fixed.items()}
    return FitResult(law, obj.full_theta(x), f, fixed, options, report, optima, time.perf_counter() - t0, model)


def refit(result: FitResult, data: RunData, weight: Optional[np.ndarray] = None, n_warm: int = 4) -> np.ndarray:
    """Refit from the best `n_warm` local optima of `result` (warm starts); returns full theta."""
    obj = Objective(result.model, data, result.options.huber_delta, result.options.fixed, weight)
    bounds = obj.bounds()
    starts = np.array([obj.free_part(t) for t in result.optima[:max(1, n_warm)]])
    outcomes = _run_starts(obj, starts, bounds, result.options)
    best = min(outcomes, key=lambda o: o[1])
    return obj.full_theta(best[0])


# ---------------------------------------------------------------------------
# uncertainty and honesty

def mape(law: Law | Model, theta: np.ndarray, data: RunData) -> float:
    """Mean absolute percentage error (fraction), weighted by the rows' weights."""
    pred = as_model(law).predict(theta, data)
    ape = np.abs(pred / data.loss - 1.0)
    w = data.weight
    return float((w @ ape) / w.sum()) if w.sum() > 0 else float(ape.mean())


def bootstrap(result: FitResult, data: RunData, n_boot: int, seed: int = 0, n_warm: int = 4,
              progress: Optional[Progress] = None) -> np.ndarray:
    """(n_boot, P) fit-space samples: refits on runs resampled with replacement (warm starts)."""
    if n_boot < 1:
        raise FitDataError(f"bootstrap count must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    obj = Objective(result.model, data, result.options.huber_delta, result.options.fixed)
    bounds = obj.bounds()
    starts = np.array([obj.free_part(t) for t in result.optima[:max(1, n_warm)]])
    out = np.empty((n_boot, result.model.n_params))
    for b in range(n_boot):
        counts = np.bincount(rng.integers(0, data.n_runs, data.n_runs), minlength=data.n_runs)
        boot = obj.with_weight(data.weight * counts[data.run_index])
        best = min(_run_starts(boot, starts, bounds, result.options), key=lambda o: o[1])
        out[b] = obj.full_theta(best[0])
        if progress is not None:
            progress("bootstrap", b + 1, n_boot)
    return out


def intervals(law: Law | Model, samples: np.ndarray, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of every parameter (natural units) from bootstrap samples."""
    model = as_model(law)
    nat = model.natural(samples)
    lo, hi = np.quantile(nat, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return {name: (float(a), float(b)) for name, a, b in zip(model.param_names, lo, hi)}


def holdout_top(law: Law, data: RunData, options: FitOptions, fraction: float,
                progress: Optional[Progress] = None) -> dict[str, Any]:
    """Fit on all but the largest-compute runs (full start grid), MAPE on those held out."""
    if not 0 < fraction < 1:
        raise FitDataError(f"holdout fraction must be in (0, 1), got {fraction}")
    compute = data.run_compute_flops()
    n_hold = max(1, int(round(fraction * data.n_runs)))
    if n_hold >= data.n_runs:
        raise FitDataError(f"holding out {n_hold} of {data.n_runs} runs leaves nothing to fit; lower the fraction")
    order = np.argsort(compute)[::-1]
    held = np.zeros(data.n_runs, dtype=bool)
    held[order[:n_hold]] = True
    train, test = data.subset_runs(~held), data.subset_runs(held)

    def relay(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress("holdout", done, total)

    res = fit(law, train, options, relay)
    trained = np.isin(test.source_index, np.unique(train.source_index))
    scored = test.subset_runs(np.isin(np.arange(test.n_runs), np.unique(test.run_index[trained])))
    out = {"fraction": fraction, "n_runs_held_out": n_hold, "n_points_held_out": test.n_points,
           "min_compute_held_out_flops": float(compute[held].min()),
           "max_compute_train_flops": float(compute[~held].max()),
           "mape": mape(res.model, res.theta, scored) if scored.n_points else None,
           "mape_train": mape(res.model, res.theta, train),
           "params": dict(zip(res.model.param_names, map(float, res.model.natural(res.theta))))}
    if data.n_sources > 1:
        out["mape_by_source"] = {data.source_names[s]: mape(res.model, res.theta, scored.subset_sources((data.source_names[s],)))
                                 for s in np.unique(scored.source_index)}
    return out


def leave_one_out(result: FitResult, data: RunData, n_warm: int = 1,
                  progress: Optional[Progress] = None) -> dict[str, Any]:
    """Leave-one-run-out: refit without each run (warm start from the full fit), MAPE on that run."""
    errors = np.empty(data.n_runs)
    for r in range(data.n_runs):
        keep = np.ones(data.n_runs, dtype=bool)
        keep[r] = False
        theta = refit(result, data.subset_runs(keep), n_warm=n_warm)
        errors[r] = mape(result.model, theta, data.subset_runs(~keep))
        if progress is not None:
            progress("leave-one-out", r + 1, data.n_runs)
    worst = int(np.argmax(errors))
    return {"mape": float(errors.mean()), "max_run_mape": float(errors[worst]), "worst_run": data.run_ids[worst],
            "n_runs": data.n_runs, "warm_starts": n_warm}


IDENTIFIABILITY_LIMITS = {"relative_se": 0.25, "correlation": 0.9, "bound_tol": 1e-6, "bound_r2": 0.999,
                          "bound_share": 0.1}
"""A parameter is flagged when its standard error exceeds 25% of its value (coefficients: 0.25 in log
units; exponents: of max(|value|, 0.01)), i.e. its ~95% interval spans more than +-50%, or when it sits on
a bound; partners are the parameters it correlates with at |r| >= 0.9. A parameter on a bound trades off
with the others when the others' Jacobian columns explain its own to R^2 >= 0.999 (moving it is undone by
moving them): its partners are those whose share of that fit, |c_k| |J_k| / |J_b|, is >= 0.1."""


def _bound_partners(J: np.ndarray, inner: np.ndarray, free_names: list[str], sw: np.ndarray,
                    lim: Mapping[str, float]) -> dict[str, list[list[Any]]]:
    """Per parameter on a bound (~inner): [partner, sign] where the inner parameters' weighted Jacobian
    columns explain its own to R^2 >= lim["bound_r2"] (IDENTIFIABILITY_LIMITS), partners by share;
    sign +1 where they move together to leave the fit unchanged (J_b ~ sum c_k J_k: dtheta_k = -c_k)."""
    X = J[:, inner] * sw[:, None]
    inner_names = [n for n, k in zip(free_names, inner) if k]
    out: dict[str, list[list[Any]]] = {}
    if X.shape[1] == 0:
        return out
    norms = np.linalg.norm(X, axis=0)
    for j in np.flatnonzero(~inner):
        y = J[:, j] * sw
        yy = float(y @ y)
        if yy <= 0.0:
            continue
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        r2 = 1.0 - float(np.sum((y - X @ coef) ** 2)) / yy
        if r2 < lim["bound_r2"]:
            continue
        share = np.abs(coef) * norms / np.sqrt(yy)
        out[free_names[j]] = [[inner_names[k], float(-np.sign(coef[k]))] for k in np.argsort(-share)
                              if share[k] >= lim["bound_share"]]
    return out


def identifiability(result: FitResult, data: RunData,
                    limits: Optional[Mapping[str, float]] = None) -> dict[str, Any]:
    """Which parameters the data pin down, and which trade off (Gauss-Newton covariance at the optimum).

    With r_i the log residuals and J = d log L_i / d theta (the softmax-weighted design rows, mapped from
    the centred optimiser coordinates back to theta), Cov = s^2 (J^T W J)^+ with
    s^2 = sum w r^2 / (sum w - p): the least-squares approximation of the estimator's spread. It is what
    the data could tell apart, not a bootstrap interval (for the Huber loss s^2 is scaled by the
    M-estimator's variance ratio, `huber_variance_ratio`): a flagged parameter's value is a trade-off
    with its partners (only their combination is measured), so report the combination, not the number.
    """
    lim = {**IDENTIFIABILITY_LIMITS, **dict(limits or {})}
    model = result.model
    obj = Objective(model, data, result.options.huber_delta, result.options.fixed)
    x = obj.free_part(result.theta)
    names = model.param_names
    bounds = model.theta_bounds()
    at_bound: dict[str, str] = {}
    for i in obj.free:
        lo, hi = bounds[i]
        v = result.theta[i]
        if v - lo <= lim["bound_tol"] * max(1.0, abs(lo)):
            at_bound[names[i]] = "lower"
        elif hi - v <= lim["bound_tol"] * max(1.0, abs(hi)):
            at_bound[names[i]] = "upper"
    K, n = obj.shape
    p = obj.free.size
    T = (obj.F_free @ x).reshape(K, n) + obj.offset
    m = T.max(axis=0)
    E = np.exp(T - m)
    soft = E / E.sum(axis=0)
    r = m + np.log(E.sum(axis=0)) - obj.log_y
    J = np.einsum("kn,knp->np", soft, obj.F_free.reshape(K, n, p)) @ obj.M[np.ix_(obj.free, obj.free)]
    inner = np.array([names[i] not in at_bound for i in obj.free])
    w = obj.weight
    bound_partners = _bound_partners(J, inner, [names[i] for i in obj.free], np.sqrt(w), lim)
    J = J[:, inner]
    kept = [names[i] for i, k in zip(obj.free, inner) if k]
    dof = float(w.sum()) - J.shape[1]
    out: dict[str, Any] = {"method": "Gauss-Newton covariance of the log residuals at the optimum",
                           "limits": lim, "relative_se": {}, "flagged": {}, "condition_number": None}
    for name, side in at_bound.items():
        out["flagged"][name] = {"reason": f"at its {side} bound (the data push it past the fit range)",
                                "trades_off_with": bound_partners.get(name, [])}
    if not kept:
        return out
    H = J.T @ (w[:, None] * J)
    scale = np.sqrt(np.maximum(np.diag(H), 0.0))
    flat = scale <= 1e-12 * max(float(scale.max()), 1e-300)
    for j in np.flatnonzero(flat):
        out["flagged"][kept[j]] = {"reason": "no information: its term is ~0 or its input does not vary in the data",
                                   "trades_off_with": []}
    live = np.flatnonzero(~flat)
    if live.size == 0:
        return out
    Hn = H[np.ix_(live, live)] / np.outer(scale[live], scale[live])
    eig, vec = np.linalg.eigh(Hn)
    null = eig <= 1e-10 * eig.max()
    out["condition_number"] = float(eig.max() / eig.min()) if eig.min() > 0 else float("inf")
    s2 = float(w @ (r * r)) / dof if dof > 0 else np.inf
    # Huber, not least squares: scale by the M-estimator's variance ratio E[psi^2] / E[psi']^2 / sigma^2
    # (Huber 1981, Robust Statistics, sec. 7.6), from the residuals; pi/2 (the median's) for delta << noise
    psi = np.clip(r, -obj.delta, obj.delta)
    inside = float(w @ (np.abs(r) < obj.delta)) / float(w.sum())
    mean_r2 = float(w @ (r * r)) / float(w.sum())
    ratio = (float(w @ (psi * psi)) / float(w.sum())) / inside ** 2 / mean_r2 if inside > 0 and mean_r2 > 0 else 1.0
    out["huber_variance_ratio"] = float(ratio)
    s2 *= max(ratio, 1.0)
    inv = (vec[:, ~null] / eig[~null]) @ vec[:, ~null].T
    cov = s2 * inv / np.outer(scale[live], scale[live])
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        corr = cov / np.outer(se, se)
    names_live = [kept[j] for j in live]
    unmeasured: dict[str, list[list[Any]]] = {}
    for v in vec[:, null].T:   # a direction the data do not see: only the orthogonal combination is measured
        members = [k for k in np.argsort(-np.abs(v)) if abs(v[k]) > 0.1]
        for k in members:
            unmeasured.setdefault(names_live[k], []).extend(
                [names_live[q], float(np.sign(v[k] * v[q]))] for q in members if q != k)
    theta = result.theta
    for j, name in enumerate(names_live):
        i = names.index(name)
        if name in unmeasured:
            out["relative_se"][name] = float("inf")
            out["flagged"][name] = {"reason": "not identified: the data measure only its combination with others",
                                    "trades_off_with": unmeasured[name]}
            continue
        rel = se[j] if model.is_coef(i) else se[j] / max(abs(theta[i]), 0.01)
        out["relative_se"][name] = float(rel)
        partners = [[names_live[k], float(corr[j, k])] for k in np.argsort(-np.abs(np.nan_to_num(corr[j])))
                    if k != j and abs(corr[j, k]) >= lim["correlation"]]
        if not np.isfinite(rel) or rel > lim["relative_se"]:
            out["flagged"][name] = {"reason": f"standard error {rel:.0%} of its value", "trades_off_with": partners}
    return out


def describe_identifiability(report: Mapping[str, Any]) -> str:
    """One line naming the flagged parameters and their partners ('' when everything is identified)."""
    parts = []
    for name, item in report.get("flagged", {}).items():
        partners = ", ".join(f"{other} (r={c:+.2f})" for other, c in item["trades_off_with"][:3])
        parts.append(f"{name}: {item['reason']}" + (f"; trades off with {partners}" if partners else ""))
    return "; ".join(parts)


def residual_diagnostics(law: Law | Model, theta: np.ndarray, data: RunData) -> dict[str, float]:
    """Log residuals (pred/obs) summary and their correlation with the inputs (trends = misfit)."""
    pred = as_model(law).predict(theta, data)
    r = np.log(pred) - np.log(data.loss)
    ape = np.abs(pred / data.loss - 1.0)

    def corr(x: np.ndarray) -> float:
        if np.ptp(x) == 0 or np.ptp(r) == 0:
            return 0.0
        return float(np.corrcoef(x, r)[0, 1])

    return {"mape": mape(law, theta, data), "max_ape": float(ape.max()), "median_ape": float(np.median(ape)),
            "mean_log_residual": float(r.mean()), "rms_log_residual": float(np.sqrt(np.mean(r * r))),
            "corr_log_compute": corr(np.log(data.compute_flops)), "corr_log_n_total": corr(np.log(data.n_total)),
            "corr_log_tokens": corr(np.log(data.tokens)), "corr_sparsity": corr(data.sparsity)}


__all__ = ["IDENTIFIABILITY_LIMITS", "FitOptions", "FitResult", "Objective", "StartReport", "bootstrap",
           "describe_identifiability", "fit", "holdout_top", "identifiability", "intervals", "leave_one_out", "mape",
           "refit", "residual_diagnostics", "start_grid"]

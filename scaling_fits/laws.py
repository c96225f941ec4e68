"""Scaling laws as data plus pure, vectorised functions.

Symbols (DESIGN.md): N_tot total non-embedding parameters, S = 1 - N_act/N_tot
(fraction of parameters a token does not use), D training tokens, G = d_ff_ref/d_expert.

Each law has
- a params NamedTuple (field names as in the formula; ``lambda`` is spelled
  ``lambda_`` because it is a Python keyword) with class attributes ``BOUNDS``
  (fit bounds, natural units) and ``START`` (the range the start grid covers),
  and derived quantities as properties;
- a pure reference function ``<law>(params, n_total, sparsity, tokens, granularity)``
  written exactly as the formula;
- a `Law` record (terms of a sum of power laws) that the fitter uses: every law
  here is  L = sum_k exp(log c_k - sum_j x_kj * log f_kj),  so log L is a
  log-sum-exp of terms *linear* in theta = (log coefficients, exponents).
  `Law.predict` (the fast path, also used by `FittedLaw`) is tested equal to the
  reference function.

Sources: Hoffmann et al. 2022 (arXiv 2203.15556) for `chinchilla`; Krajewski et
al. 2024 (arXiv 2402.07871) for `krajewski2024`; Abnar et al. 2025 (arXiv
2501.12370) for `abnar2025`; the MOSAIC paper (arXiv 2608.10605) for `mosaic4d`;
`mosaic4d_lg2` is mosaic4d with the granularity factor of Tian et al. 2025
("Towards Greater Leverage", arXiv 2507.17702, eq. 11/13: a quadratic in log G,
so there is an optimal granularity) in place of the power law G^-eta.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from scaling_fits.errors import FitDataError

# Inputs a term can depend on (all logs, natural log).
FEATURES = ("log_n_total", "log_n_active", "log_active_frac", "log_tokens", "log_g", "log_g_sq")

# Natural-unit bounds shared by the laws. Coefficients are fitted as their logs,
# so a coefficient bound (lo, hi) is (exp(lo_log), exp(hi_log)).
_COEF_BOUNDS = (np.exp(-30.0), np.exp(40.0))
_EXP_BOUNDS = (0.0, 1.5)          # power-law exponents on N, D, G: published values 0.07-0.6
_S_EXP_BOUNDS = (-3.0, 3.0)       # exponents on (1 - S): Abnar et al. 2025 fit a negative lambda


class ChinchillaParams(NamedTuple):
    """L = E + A / N^alpha + B / D^beta  (Hoffmann et al. 2022, eq. 2), N = N_act."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    BOUNDS = {"E": _COEF_BOUNDS, "A": _COEF_BOUNDS, "B": _COEF_BOUNDS, "alpha": _EXP_BOUNDS, "beta": _EXP_BOUNDS}
    START = {"E": (0.3, 3.0), "A": (1.0, 2e4), "B": (1.0, 2e4), "alpha": (0.05, 0.6), "beta": (0.05, 0.6)}

    @property
    def n_opt_exponent(self) -> float:
        """N_opt ∝ C^a with a = beta / (alpha + beta) (Hoffmann et al. 2022, eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def d_opt_exponent(self) -> float:
        """D_opt ∝ C^b with b = alpha / (alpha + beta)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def derived(self) -> dict[str, float]:
        return {"n_opt_exponent": self.n_opt_exponent, "d_opt_exponent": self.d_opt_exponent}


class Krajewski2024Params(NamedTuple):
    """L = c + (g / G^gamma + a) / N^alpha + b / D^beta  (Krajewski et al. 2024, eq. 8), N = N_tot."""

    c: float
    g: float
    gamma: float
    a: float
    alpha: float
    b: float
    beta: float

    BOUNDS = {"c": _COEF_BOUNDS, "g": _COEF_BOUNDS, "gamma": (0.0, 2.0), "a": _COEF_BOUNDS,
              "alpha": _EXP_BOUNDS, "b": _COEF_BOUNDS, "beta": _EXP_BOUNDS}
    START = {"c": (0.3, 3.0), "g": (0.1, 100.0), "gamma": (0.1, 1.0), "a": (1.0, 2e4), "alpha": (0.05, 0.6),
             "b": (1.0, 2e4), "beta": (0.05, 0.6)}

    @property
    def granularity_share(self) -> float:
        """Fraction g/(g+a) of the N term that granularity can remove (at G = 1)."""
        return self.g / (self.g + self.a)

    @property
    def derived(self) -> dict[str, float]:
        return {"granularity_share": self.granularity_share}


class Abnar2025Params(NamedTuple):
    """L = a/N^alpha + b/D^beta + c/(1-S)^lambda + d/((1-S)^delta N^gamma) + e  (Abnar et al. 2025), N = N_tot."""

    a: float
    alpha: float
    b: float
    beta: float
    c: float
    lambda_: float
    d: float
    delta: float
    gamma: float
    e: float

    BOUNDS = {"a": _COEF_BOUNDS, "alpha": _EXP_BOUNDS, "b": _COEF_BOUNDS, "beta": _EXP_BOUNDS, "c": _COEF_BOUNDS,
              "lambda_": _S_EXP_BOUNDS, "d": _COEF_BOUNDS, "delta": _S_EXP_BOUNDS, "gamma": _EXP_BOUNDS,
              "e": _COEF_BOUNDS}
    START = {"a": (1.0, 2e4), "alpha": (0.05, 0.6), "b": (1.0, 2e4), "beta": (0.05, 0.6), "c": (0.01, 2.0),
             "lambda_": (-1.0, 1.0), "d": (0.1, 2e4), "delta": (-1.0, 1.0), "gamma": (0.05, 0.6), "e": (0.3, 3.0)}

    @property
    def dense_irreducible(self) -> float:
        """Loss floor of a dense model (S = 0, N, D -> inf): c + e."""
        return self.c + self.e

    @property
    def derived(self) -> dict[str, float]:
        return {"dense_irreducible": self.dense_irreducible}


class Mosaic4DParams(NamedTuple):
    """L = a/N^alpha + b/D^beta + c/(1-S)^lambda + j/((1-S)^delta N^gamma G^eta) + e  (MOSAIC), N = N_tot."""

    a: float
    alpha: float
    b: float
    beta: float
    c: float
    lambda_: float
    j: float
    delta: float
    gamma: float
    eta: float
    e: float

    BOUNDS = {"a": _COEF_BOUNDS, "alpha": _EXP_BOUNDS, "b": _COEF_BOUNDS, "beta": _EXP_BOUNDS, "c": _COEF_BOUNDS,
              "lambda_": _S_EXP_BOUNDS, "j": _COEF_BOUNDS, "delta": _S_EXP_BOUNDS, "gamma": _EXP_BOUNDS,
              "eta": (0.0, 2.0), "e": _COEF_BOUNDS}
    START = {"a": (1.0, 2e4), "alpha": (0.05, 0.6), "b": (1.0, 2e4), "beta": (0.05, 0.6), "c": (0.01, 2.0),
             "lambda_": (-1.0, 1.0), "j": (0.1, 2e4), "delta": (-1.0, 1.0), "gamma": (0.05, 0.6),
             "eta": (0.1, 1.0), "e": (0.3, 3.0)}

    @property
    def dense_irreducible(self) -> float:
        """Loss floor of a dense model (S = 0, N, D -> inf): c + e."""
        return self.c + self.e

    @property
    def granularity_factor_g8(self) -> float:
        """How much G = 8 shrinks the interaction term relative to G = 1: 8^-eta."""
        return 8.0 ** -self.eta

    @property
    def derived(self) -> dict[str, float]:
        return {"dense_irreducible": self.dense_irreducible, "granularity_factor_g8": self.granularity_factor_g8}


class Mosaic4DLG2Params(NamedTuple):
    """mosaic4d with G^-(eta + eta2 ln G) in the interaction term: log-quadratic in G (Tian et al. 2025)."""

    a: float
    alpha: float
    b: float
    beta: float
    c: float
    lambda_: float
    j: float
    delta: float
    gamma: float
    eta: float
    eta2: float
    e: float

    BOUNDS = {**Mosaic4DParams.BOUNDS, "eta2": (-1.0, 1.0)}
    START = {**Mosaic4DParams.START, "eta2": (-0.2, 0.2)}

    @property
    def optimal_granularity(self) -> float:
        """G minimising the interaction term: exp(-eta / (2 eta2)) when eta2 < 0 (else inf: no optimum)."""
        return float(np.exp(-self.eta / (2.0 * self.eta2))) if self.eta2 < 0 else float("inf")

    @property
    def derived(self) -> dict[str, float]:
        return {"dense_irreducible": self.c + self.e, "optimal_granularity": self.optimal_granularity}


# ---------------------------------------------------------------------------
# Reference functions: the formulas as written (numpy broadcasting).

def _inputs(n_total: Any, sparsity: Any, tokens: Any, granularity: Any) -> tuple[np.ndarray, ...]:
    n = np.asarray(n_total, dtype=float)
    s = np.asarray(sparsity, dtype=float)
    d = np.asarray(tokens, dtype=float)
    g = np.asarray(granularity, dtype=float)
    check_inputs(n, s, d, g)
    return n, s, d, g


def chinchilla(p: ChinchillaParams, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
    """E + A/N_act^alpha + B/D^beta with N_act = N_tot (1 - S)."""
    n, s, d, _ = _inputs(n_total, sparsity, tokens, granularity)
    n_act = n * (1.0 - s)
    return p.E + p.A / n_act ** p.alpha + p.B / d ** p.beta


def krajewski2024(p: Krajewski2024Params, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
    """c + (g/G^gamma + a)/N^alpha + b/D^beta with N = N_tot."""
    n, _, d, g = _inputs(n_total, sparsity, tokens, granularity)
    return p.c + (p.g / g ** p.gamma + p.a) / n ** p.alpha + p.b / d ** p.beta


def abnar2025(p: Abnar2025Params, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
    """a/N^alpha + b/D^beta + c/(1-S)^lambda + d/((1-S)^delta N^gamma) + e with N = N_tot."""
    n, s, d, _ = _inputs(n_total, sparsity, tokens, granularity)
    act = 1.0 - s
    return (p.a / n ** p.alpha + p.b / d ** p.beta + p.c / act ** p.lambda_
            + p.d / (act ** p.delta * n ** p.gamma) + p.e)


def mosaic4d(p: Mosaic4DParams, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
    """a/N^alpha + b/D^beta + c/(1-S)^lambda + j/((1-S)^delta N^gamma G^eta) + e with N = N_tot."""
    n, s, d, g = _inputs(n_total, sparsity, tokens, granularity)
    act = 1.0 - s
    return (p.a / n ** p.alpha + p.b / d ** p.beta + p.c / act ** p.lambda_
            + p.j / (act ** p.delta * n ** p.gamma * g ** p.eta) + p.e)


def mosaic4d_lg2(p: Mosaic4DLG2Params, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
    """mosaic4d with G^eta replaced by G^(eta + eta2 ln G) = exp(eta ln G + eta2 (ln G)^2)."""
    n, s, d, g = _inputs(n_total, sparsity, tokens, granularity)
    act = 1.0 - s
    lg = np.log(g)
    return (p.a / n ** p.alpha + p.b / d ** p.beta + p.c / act ** p.lambda_
            + p.j / (act ** p.delta * n ** p.gamma * np.exp(p.eta * lg + p.eta2 * lg * lg)) + p.e)


def check_inputs(n: np.ndarray, s: np.ndarray, d: np.ndarray, g: np.ndarray) -> None:
    """Raise FitDataError naming the first impossible input (vectorised checks)."""
    if not np.all(np.isfinite(n) & (n > 0)):
        raise FitDataError("n_total must be finite and > 0 (non-embedding parameters)")
    if not np.all(np.isfinite(s) & (s >= 0) & (s < 1)):
        raise FitDataError("sparsity must be in [0, 1) (S = 1 - N_act/N_tot)")
    if not np.all(np.isfinite(d) & (d > 0)):
        raise FitDataError("tokens must be finite and > 0")
    if not np.all(np.isfinite(g) & (g > 0)):
        raise FitDataError("granularity must be finite and > 0 (G = d_ff_ref/d_expert; 1 for standard experts)")


# ---------------------------------------------------------------------------
# Laws as data: a sum of terms, each a coefficient times powers of the inputs.

@dataclass(frozen=True)
class Term:
    """coef * prod_j f_j^(-x_j): `coef` a parameter, `powers` (exponent parameter, feature) pairs."""

    coef: str
    powers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Law:
    """A scaling law: parameter names (formula spelling), terms, reference function, source."""

    name: str
    formula: str
    params_type: type
    terms: tuple[Term, ...]
    reference: Any
    source: str

    @property
    def fields(self) -> tuple[str, ...]:
        """NamedTuple field names (``lambda_`` for lambda), in params order."""
        return tuple(self.params_type._fields)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Names as in the formula (``lambda``), in params order."""
        return tuple(formula_name(f) for f in self.fields)

    @property
    def coef_names(self) -> frozenset[str]:
        return frozenset(t.coef for t in self.terms)

    def index(self, name: str) -> int:
        name = field_name(name)
        if name not in self.fields:
            raise FitDataError(f"law '{self.name}' has no parameter '{formula_name(name)}'; "
                               f"its parameters are {', '.join(self.param_names)}")
        return self.fields.index(name)

    def is_coef(self, name: str) -> bool:
        return field_name(name) in self.coef_names

    # theta: fit-space vector (log of coefficients, exponents as they are)
    def theta_from_params(self, params: Mapping[str, float] | Any) -> np.ndarray:
        values = params._asdict() if hasattr(params, "_asdict") else {field_name(k): v for k, v in params.items()}
        theta = np.empty(len(self.fields))
        for i, f in enumerate(self.fields):
            v = float(values[f])
            if self.is_coef(f):
                if not v > 0:
                    raise FitDataError(f"law '{self.name}': coefficient '{formula_name(f)}' must be > 0, got {v}")
                theta[i] = np.log(v)
            else:
                theta[i] = v
        return theta

    def params_from_theta(self, theta: np.ndarray) -> Any:
        theta = np.asarray(theta, dtype=float)
        values = [float(np.exp(t)) if self.is_coef(f) else float(t) for f, t in zip(self.fields, theta)]
        return self.params_type(*values)

    def natural(self, theta: np.ndarray) -> np.ndarray:
        """Natural-unit values of a (..., P) theta array."""
        theta = np.asarray(theta, dtype=float)
        mask = np.array([self.is_coef(f) for f in self.fields])
        return np.where(mask, np.exp(np.where(mask, theta, 0.0)), theta)

    def theta_bounds(self) -> list[tuple[float, float]]:
        out = []
        for f in self.fields:
            lo, hi = self.params_type.BOUNDS[f]
            out.append((float(np.log(lo)), float(np.log(hi))) if self.is_coef(f) else (float(lo), float(hi)))
        return out

    def theta_start_ranges(self) -> list[tuple[float, float]]:
        out = []
        for f in self.fields:
            lo, hi = self.params_type.START[f]
            out.append((float(np.log(lo)), float(np.log(hi))) if self.is_coef(f) else (float(lo), float(hi)))
        return out

    def features(self, n_total: Any, sparsity: Any, tokens: Any, granularity: Any) -> dict[str, np.ndarray]:
        """log inputs, broadcast to one shape."""
        n, s, d, g = _inputs(n_total, sparsity, tokens, granularity)
        n, s, d, g = np.broadcast_arrays(n, s, d, g)
        log_act = np.log1p(-s)
        log_n = np.log(n)
        log_g = np.log(g)
        return {"log_n_total": log_n, "log_n_active": log_n + log_act, "log_active_frac": log_act,
                "log_tokens": np.log(d), "log_g": log_g, "log_g_sq": log_g * log_g}

    def design(self, feats: Mapping[str, np.ndarray]) -> np.ndarray:
        """F with log term_k = F[k] @ theta: shape (K, n, P) for 1-D features."""
        n = next(iter(feats.values())).shape[0]
        F = np.zeros((len(self.terms), n, len(self.fields)))
        for k, term in enumerate(self.terms):
            F[k, :, self.index(term.coef)] = 1.0
            for exp_name, feat in term.powers:
                F[k, :, self.index(exp_name)] -= feats[feat]
        return F

    def log_terms(self, theta: np.ndarray, feats: Mapping[str, np.ndarray]) -> np.ndarray:
        """log of each term: (K, *theta batch, *input shape)."""
        theta = np.asarray(theta, dtype=float)
        batch = theta.shape[:-1]
        shape = next(iter(feats.values())).shape
        expand = batch + (1,) * len(shape)
        out = []
        for term in self.terms:
            t = theta[..., self.index(term.coef)].reshape(expand)
            for exp_name, feat in term.powers:
                t = t - theta[..., self.index(exp_name)].reshape(expand) * feats[feat]
            out.append(np.broadcast_to(t, batch + shape))
        return np.stack(out)

    def predict_theta(self, theta: np.ndarray, n_total: Any, sparsity: Any, tokens: Any,
                      granularity: Any = 1.0) -> np.ndarray:
        """Loss from fit-space theta (P,) or (B, P); output shape (*B, *broadcast(inputs))."""
        T = self.log_terms(theta, self.features(n_total, sparsity, tokens, granularity))
        m = T.max(axis=0)
        return np.exp(m + np.log(np.exp(T - m).sum(axis=0)))

    def predict(self, params: Any, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
        return self.predict_theta(self.theta_from_params(params), n_total, sparsity, tokens, granularity)


def field_name(name: str) -> str:
    return "lambda_" if name == "lambda" else name


def formula_name(field: str) -> str:
    return "lambda" if field == "lambda_" else field


LAWS: dict[str, Law] = {
    "chinchilla": Law(
        name="chinchilla",
        formula="E + A/N_act^alpha + B/D^beta",
        params_type=ChinchillaParams,
        terms=(Term("E"), Term("A", (("alpha", "log_n_active"),)), Term("B", (("beta", "log_tokens"),))),
        reference=chinchilla,
        source="Hoffmann et al. 2022, arXiv 2203.15556, eq. 2 (N = active parameters)",
    ),
    "krajewski2024": Law(
        name="krajewski2024",
        formula="c + (g/G^gamma + a)/N_tot^alpha + b/D^beta",
        params_type=Krajewski2024Params,
        terms=(Term("c"), Term("g", (("gamma", "log_g"), ("alpha", "log_n_total"))),
               Term("a", (("alpha", "log_n_total"),)), Term("b", (("beta", "log_tokens"),))),
        reference=krajewski2024,
        source="Krajewski et al. 2024, arXiv 2402.07871 (fine-grained MoE)",
    ),
    "abnar2025": Law(
        name="abnar2025",
        formula="a/N_tot^alpha + b/D^beta + c/(1-S)^lambda + d/((1-S)^delta N_tot^gamma) + e",
        params_type=Abnar2025Params,
        terms=(Term("a", (("alpha", "log_n_total"),)), Term("b", (("beta", "log_tokens"),)),
               Term("c", (("lambda_", "log_active_frac"),)),
               Term("d", (("delta", "log_active_frac"), ("gamma", "log_n_total"))), Term("e")),
        reference=abnar2025,
        source="Abnar et al. 2025, arXiv 2501.12370 (S law, N = total parameters)",
    ),
    "mosaic4d": Law(
        name="mosaic4d",
        formula="a/N_tot^alpha + b/D^beta + c/(1-S)^lambda + j/((1-S)^delta N_tot^gamma G^eta) + e",
        params_type=Mosaic4DParams,
        terms=(Term("a", (("alpha", "log_n_total"),)), Term("b", (("beta", "log_tokens"),)),
               Term("c", (("lambda_", "log_active_frac"),)),
               Term("j", (("delta", "log_active_frac"), ("gamma", "log_n_total"), ("eta", "log_g"))), Term("e")),
        reference=mosaic4d,
        source="MOSAIC, arXiv 2608.10605",
    ),
    "mosaic4d_lg2": Law(
        name="mosaic4d_lg2",
        formula="a/N_tot^alpha + b/D^beta + c/(1-S)^lambda + j/((1-S)^delta N_tot^gamma G^(eta + eta2 ln G)) + e",
        params_type=Mosaic4DLG2Params,
        terms=(Term("a", (("alpha", "log_n_total"),)), Term("b", (("beta", "log_tokens"),)),
               Term("c", (("lambda_", "log_active_frac"),)),
               Term("j", (("delta", "log_active_frac"), ("gamma", "log_n_total"), ("eta", "log_g"),
                          ("eta2", "log_g_sq"))), Term("e")),
        reference=mosaic4d_lg2,
        source="MOSAIC law with the log-quadratic granularity factor of Tian et al. 2025, arXiv 2507.17702",
    ),
}


def get_law(name: str) -> Law:
    if name not in LAWS:
        raise FitDataError(f"unknown law '{name}'; choose one of {', '.join(LAWS)}")
    return LAWS[name]


__all__ = ["FEATURES", "LAWS", "Abnar2025Params", "ChinchillaParams", "Krajewski2024Params", "Law",
           "Mosaic4DLG2Params", "Mosaic4DParams", "Term", "abnar2025", "check_inputs", "chinchilla", "field_name",
           "formula_name", "get_law", "krajewski2024", "mosaic4d", "mosaic4d_lg2"]

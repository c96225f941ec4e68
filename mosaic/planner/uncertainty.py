"""Decision under uncertainty: which plans the evidence cannot tell apart, and a robust pick among them.

Two measured uncertainties, drawn jointly (DRAWS draws, seeded):
  fit          the scaling-law fit's bootstrap (`FittedLaw.predict_bootstrap`: refits over
               resampled runs; draw i uses bootstrap fit i mod n_boot)
  throughput   the performance model's measured error, r = measured / predicted tokens/s
               = predicted / measured step time, in logs:
                 ln r_ij = mu_i + eps_ij
               mu_i (shared by every candidate of draw i: the cluster's bias) = the mean of a
               resample of this cluster's own rows when it has MIN_ROWS of them, else one of the
               per-cluster mean errors the other accelerators show (its bias is unmeasured);
               eps_ij = a within-cluster residual (row minus its cluster's mean), pooled over
               every cluster, of the candidate's kind (dense, moe), one per layout class:
               candidates with the same layout (`layout_classes`: the same kernels and
               collectives, priced alike) share it, different layouts draw their own.
               Rows: the cluster's `calibration.from_runs` leave-one-out predictions when it
               was calibrated from runs, else `mosaic validate` on the bundled published runs
               (`perfmodel.validation`).
Loss of candidate j in draw i: law_i(N_tot, S, D_j r_ij, G).

  P(best)_j            share of draws in which j has the lowest loss of the candidates
  indistinguishable    P(j beats the nominal best) >= P_INDISTINGUISHABLE (the best is not
                       below j in the 90% interval of their paired difference)
  robust rule          among the nominal best and its indistinguishable alternatives, the plan
                       with the lowest ROBUST_QUANTILE (90th percentile) loss over the draws:
                       the one that loses least when the draws go against it (e.g. its MFU comes
                       in lower than predicted, or the fit's D exponent is smaller)

Candidates: the exact search's best `top` geometries; when some in the outer half of their loss
band are still indistinguishable, the exact MAX_CANDIDATES best (and the statement says when even
those do not reach a distinguishable one: `capped`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mosaic.planner import law as lawmod
from mosaic.planner.enumerate import Ranked, rank_cluster_optimal
from mosaic.planner.problem import Problem
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import LAYOUT_FIELDS, OVERLAP_FIELDS

DRAWS = 400
SEED = 20
MIN_ROWS = 3
"""Rows of its own a cluster needs for its bias to be measured rather than borrowed."""
P_INDISTINGUISHABLE = 0.05
ROBUST_QUANTILE = 0.90
MAX_CANDIDATES = 64
ROBUST_RULE = ("among the nominal best and the alternatives indistinguishable from it, the plan with the lowest "
               "90th-percentile loss over the joint draws (fit bootstrap x measured throughput error)")


@dataclass(frozen=True)
class ThroughputError:
    """Measured error of the performance model for one cluster, as ln(measured / predicted tokens/s)."""

    own: dict[str, np.ndarray]
    """kind -> this cluster's rows."""
    residuals: dict[str, np.ndarray]
    """kind -> within-cluster residuals pooled over every cluster."""
    cluster_means: dict[str, np.ndarray]
    """kind -> each cluster's mean error (the biases a cluster without rows borrows)."""
    source: str

    def draw(self, kinds: np.ndarray, groups: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
        """ln r of shape (draws, candidates), candidates of `kinds` ('dense' or 'moe'); candidates of
        one `groups` value (one layout) share their residual draw."""
        out = np.zeros((draws, len(kinds)))
        shared: dict[int, np.ndarray] = {}  # kinds whose rows are one set (a calibration) share mu
        for kind in np.unique(kinds):
            cols = np.flatnonzero(kinds == kind)
            own = self.own.get(kind, np.zeros(0))
            if len(own) >= MIN_ROWS:
                if id(own) not in shared:
                    shared[id(own)] = rng.choice(own, size=(draws, len(own)), replace=True).mean(axis=1)
                mu = shared[id(own)]
            elif len(self.cluster_means.get(kind, ())):
                mu = rng.choice(self.cluster_means[kind], size=draws, replace=True)
            else:
                mu = np.zeros(draws)
            res = self.residuals.get(kind, np.zeros(0))
            eps = 0.0
            if len(res):
                _, group = np.unique(groups[cols], return_inverse=True)
                eps = rng.choice(res, size=(draws, int(group.max()) + 1), replace=True)[:, group.ravel()]
            out[:, cols] = mu[:, None] + eps
        return out

    def summary(self, kind: str) -> dict[str, Any]:
        own = self.own.get(kind, np.zeros(0))
        res = self.residuals.get(kind, np.zeros(0))
        means = self.cluster_means.get(kind, np.zeros(0))
        measured = len(own) >= MIN_ROWS
        bias = float(np.mean(own)) if measured else None
        return {"kind": kind, "source": self.source, "own_rows": int(len(own)), "bias_measured": measured,
                "bias_pct": None if bias is None else 100.0 * (math.exp(bias) - 1.0),
                "borrowed_bias_range_pct": None if measured or not len(means) else
                [100.0 * (math.exp(float(means.min())) - 1.0), 100.0 * (math.exp(float(means.max())) - 1.0)],
                "spread_pct": 100.0 * float(np.std(res)) if len(res) else None, "residual_rows": int(len(res))}


_VALIDATION: dict[str, Any] = {}


def _validation_frame() -> Any:
    """`mosaic validate` of the bundled published runs (computed once per process, or taken from
    `prefetch_validation`)."""
    if "frame" not in _VALIDATION:
        future = _VALIDATION.pop("future", None)
        if future is not None:
            _VALIDATION["frame"] = future.result()
        else:
            from perfmodel.validation import bundled_runs_path, validate_runs

            _VALIDATION["frame"] = validate_runs(bundled_runs_path())[0]
    return _VALIDATION["frame"]


def prefetch_validation() -> None:
    """Start `_validation_frame` in a process of its own (it reads only the bundled runs), so that
    it runs on a free core while the search's serial start (the loss bound) runs in this one."""
    if "frame" in _VALIDATION or "future" in _VALIDATION:
        return
    from concurrent.futures import ProcessPoolExecutor

    executor = ProcessPoolExecutor(max_workers=1)
    _VALIDATION["future"] = executor.submit(_validation_frame)
    executor.shutdown(wait=False)


def throughput_error(cluster: ClusterSpec) -> ThroughputError:
    """The measured error of the model for `cluster` (module doc: calibration, else validation)."""
    frame = _validation_frame()
    scored = frame[frame["signed_error"].notna()]
    log_r = np.log1p(scored["signed_error"].to_numpy(dtype=float))  # predicted/measured step = measured/predicted tokens/s
    kinds = scored["kind"].to_numpy()
    names = scored["cluster"].to_numpy()
    residuals, means, own = {}, {}, {}
    for kind in ("dense", "moe"):
        sel = kinds == kind
        res, mus = [], []
        for name in np.unique(names[sel]):
            vals = log_r[sel & (names == name)]
            mus.append(vals.mean())
            res.extend(vals - vals.mean())
        residuals[kind] = np.asarray(res)
        means[kind] = np.asarray(mus)
        own[kind] = log_r[sel & (names == cluster.name)]
    source = "mosaic validate: the bundled published runs (perfmodel/data/published_runs.csv)"
    per_run = ((cluster.calibration or {}).get("from_runs") or {}).get("per_run") or []
    loo = [(r["predicted_leave_one_out_s"], r["measured_step_time_s"]) for r in per_run
           if r.get("predicted_leave_one_out_s") and r.get("measured_step_time_s")]
    if len(loo) >= MIN_ROWS:
        mine = np.log(np.asarray([p / m for p, m in loo], dtype=float))
        own = {"dense": mine, "moe": mine}
        residuals = {k: mine - mine.mean() for k in ("dense", "moe")}
        source = f"the cluster's calibration from {len(loo)} runs (leave-one-out predictions)"
    return ThroughputError(own=own, residuals=residuals, cluster_means=means, source=source)


def layout_classes(problem: Problem, layout_index: np.ndarray) -> np.ndarray:
    """One integer per distinct layout (every field but the overlap switches and gbs): the plans the
    model prices with the same kernels and collectives, so share one throughput residual."""
    grid = problem.evaluator.grid.take(np.asarray(layout_index, dtype=np.int64))
    cols = grid.key_columns([f for f in LAYOUT_FIELDS if f not in OVERLAP_FIELDS + ("gbs",)])
    return np.unique(cols, axis=0, return_inverse=True)[1].ravel()


def _kinds(problem: Problem, index: np.ndarray) -> np.ndarray:
    return np.where(np.asarray(problem.geoms.archs.n_experts)[index] > 0, "moe", "dense")


def draw_losses(problem: Problem, index: np.ndarray, tokens: np.ndarray, error: ThroughputError,
                layouts: np.ndarray, draws: int = DRAWS, seed: int = SEED) -> Optional[np.ndarray]:
    """Loss of each candidate in each joint draw, shape (draws, candidates); `layouts`: each
    candidate's layout class (`layout_classes`). None without any measured uncertainty."""
    rng = np.random.default_rng(seed)
    law = problem.law
    has_boot = getattr(law, "bootstrap_params", None) is not None and hasattr(law, "predict_bootstrap")
    kinds = _kinds(problem, index)
    has_error = any(len(error.residuals.get(k, ())) for k in np.unique(kinds))
    if not has_boot and not has_error:
        return None
    log_r = error.draw(kinds, layouts, draws, rng) if has_error else np.zeros((draws, len(index)))
    d = tokens[None, :] * np.exp(log_r)
    n_tot, s, g = lawmod.law_inputs(problem.geoms.archs.take(index))
    if not has_boot:
        return np.asarray(law.predict(n_tot[None, :], s[None, :], d, g[None, :]), dtype=float)
    n_boot = int(np.asarray(law.bootstrap_params).shape[0])
    out = np.empty_like(d)
    for b in range(n_boot):  # draw i takes bootstrap fit i mod n_boot
        rows = np.arange(b, draws, n_boot)
        if not len(rows):
            continue
        if hasattr(law, "law") and getattr(law, "bootstrap_theta", None) is not None:  # scaling_fits.FittedLaw
            out[rows] = law.law.predict_theta(law.bootstrap_theta[b], n_tot[None, :], s[None, :], d[rows], g[None, :])
        else:
            out[rows] = np.asarray(law.predict_bootstrap(n_tot[None, :], s[None, :], d[rows], g[None, :]))[b]
    return out


def _analyse(losses: np.ndarray, best: int) -> dict[str, np.ndarray]:
    winner = np.argmin(losses, axis=1)
    p_best = np.bincount(winner, minlength=losses.shape[1]) / losses.shape[0]
    p_beats = np.mean(losses < losses[:, [best]], axis=0)
    return {"p_best": p_best, "p_beats_best": p_beats, "q_robust": np.quantile(losses, ROBUST_QUANTILE, axis=0),
            "q_low": np.quantile(losses, 0.05, axis=0), "q_high": np.quantile(losses, 0.95, axis=0)}


def decide(problem: Problem, ranked: Ranked, top: int, workers: int = 1) -> tuple[Ranked, dict[str, Any]]:
    """(candidates ranked by nominal loss, the decision): widen the exact band until its outer half
    is distinguishable from the best (module doc), then apply the robust rule."""
    error = throughput_error(problem.cluster)
    cands, wide = ranked, top
    while True:
        finite = np.flatnonzero(np.isfinite(cands.loss))
        # the search is complete up to its top-`wide` threshold only: the candidates are those
        band = float(cands.loss[finite[min(wide, len(finite)) - 1]] - cands.loss[0]) if len(finite) > 1 else 0.0
        ok = np.flatnonzero(np.isfinite(cands.loss) & (cands.loss <= cands.loss[0] + band))[:wide]
        layouts = layout_classes(problem, cands.results.best_layout[ok])
        losses = draw_losses(problem, cands.index[ok], cands.tokens[ok], error, layouts)
        if losses is None:
            return ranked, {"available": False, "note": "no measured uncertainty: the fit has no bootstrap samples "
                            "(refit with `mosaic fit --bootstrap N`) and no validation rows cover this cluster's kind"}
        stats = _analyse(losses, 0)
        outer = (cands.loss[ok] >= cands.loss[0] + band / 2.0) & (np.arange(len(ok)) > 0)
        settled = len(ok) < wide or not np.any(stats["p_beats_best"][outer] >= P_INDISTINGUISHABLE)
        if settled or wide >= MAX_CANDIDATES:
            break
        wide = MAX_CANDIDATES  # one wider exact search: the MAX_CANDIDATES best (unless `ranked` holds them)
        if ranked.exact_top < wide:
            cands = rank_cluster_optimal(problem, top=wide, workers=workers)
    capped = not settled
    indist = np.flatnonzero(stats["p_beats_best"] >= P_INDISTINGUISHABLE)
    indist = indist[indist != 0]
    pool = np.r_[0, indist]
    chosen = int(pool[np.argmin(stats["q_robust"][pool])])
    kinds = _kinds(problem, cands.index[ok])
    decision = {
        "available": True,
        "rule": ROBUST_RULE,
        "draws": int(losses.shape[0]),
        "fit_draws": int(np.asarray(problem.law.bootstrap_params).shape[0])
        if getattr(problem.law, "bootstrap_params", None) is not None else 0,
        "throughput_error": error.summary(str(kinds[0])),
        "candidates": int(len(ok)),
        "band_nats": band,
        "capped": bool(capped),
        "indistinguishable": int(len(indist)),
        "p_nominal_best_is_best": float(stats["p_best"][0]),
        "chosen_rank": chosen,
        "p_chosen_is_best": float(stats["p_best"][chosen]),
        "per_candidate": [{"rank": int(i), "geometry_index": int(cands.index[ok][i]), "loss": float(cands.loss[ok][i]),
                           "p_best": float(stats["p_best"][i]), "p_beats_best": float(stats["p_beats_best"][i]),
                           "loss_q90": float(stats["q_robust"][i]),
                           "loss_interval_90": [float(stats["q_low"][i]), float(stats["q_high"][i])],
                           "indistinguishable": bool(i == 0 or i in set(indist.tolist()))}
                          for i in range(len(ok))],
    }
    return cands, decision


__all__ = ["DRAWS", "MAX_CANDIDATES", "P_INDISTINGUISHABLE", "ROBUST_QUANTILE", "ROBUST_RULE", "ThroughputError",
           "decide", "draw_losses", "prefetch_validation", "throughput_error"]

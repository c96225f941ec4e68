"""Sweeps: the best loss per value of sparsity, granularity, devices or days, under both budgets.

The MOSAIC picture: under a fixed model-FLOPs budget the best loss keeps
falling towards the sparsest edge of the space; under deliverable compute
(memory, communication and MFU of real layouts) the optimum can sit inside.

  sparsity     groups the space's geometries by expert sparsity 1 - k/E (0 = dense)
  granularity  groups the MoE geometries by the G they were built from
  devices      one plan per device count (default: the cluster's count / 8, 4, 2, 1)
  days         one plan per wall time (default 5, 10, 20, 40, 80 days)

Each row carries the budget's C_model (`c_model_flops`) and the model FLOPs each answer
trains (`compute_optimal_model_flops` = C_model; `cluster_optimal_model_flops` =
C_deliverable of the chosen geometry and layout).

`sweep(...)` returns a pandas DataFrame (one row per value) for notebooks;
`mosaic sweep` writes it as CSV and optionally plots it.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mosaic.planner.enumerate import Ranked, auto_workers, rank_cluster_optimal, rank_compute_optimal
from mosaic.planner.problem import Problem, build_problem
from mosaic.planner.space import geometry_label
from perfmodel.errors import InputError, Param
from perfmodel.specs.architecture import active_params, expert_sparsity, granularity, sparsity, total_params
from perfmodel.specs.strict import save_figure_atomic

OVER = ("sparsity", "granularity", "devices", "days")
DEFAULT_DAYS = (5.0, 10.0, 20.0, 40.0, 80.0)


def _describe(problem: Problem, ranked: Ranked, prefix: str, with_layout: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ok = len(ranked.loss) > 0 and np.isfinite(ranked.loss[0])
    if not ok:
        return {f"{prefix}_loss": np.nan, f"{prefix}_feasible": False}
    g = int(ranked.index[0])
    arch = problem.geoms.archs.take(np.asarray([g]))
    out[f"{prefix}_feasible"] = True
    out[f"{prefix}_loss"] = float(ranked.loss[0])
    out[f"{prefix}_tokens"] = float(ranked.tokens[0])
    out[f"{prefix}_n_total_params"] = float(total_params(arch)[0])
    out[f"{prefix}_n_active_params"] = float(active_params(arch)[0])
    out[f"{prefix}_sparsity"] = float(sparsity(arch)[0])
    out[f"{prefix}_expert_sparsity"] = float(expert_sparsity(arch)[0])
    out[f"{prefix}_granularity"] = float(granularity(arch)[0])
    # Model FLOPs of the answer: C_model for the compute-optimal side, C_deliverable for the
    # cluster-optimal side (there D = C_deliverable / FLOPs per token).
    out[f"{prefix}_model_flops"] = float(ranked.tokens[0]) * float(problem.flops_per_token[g])
    out[f"{prefix}_geometry"] = geometry_label(problem.geoms.archs.row(g))
    if with_layout and ranked.results is not None:
        res = ranked.results
        lay = problem.evaluator.layout(res.best_layout[0], res.best_gbs[0])
        out[f"{prefix}_mfu"] = float(res.mfu[0])
        out[f"{prefix}_layout"] = lay.to_string()
    return out


def _compute_side(problem: Problem, subset: Optional[np.ndarray]) -> dict[str, Any]:
    """Compute-optimal answer of the subset, plus the loss it reaches on this cluster in the budget."""
    co = rank_compute_optimal(problem, subset)
    out = _describe(problem, co, "compute_optimal", with_layout=False)
    if out.get("compute_optimal_feasible"):
        res = problem.evaluate(co.index[:1])
        if res.best_layout[0] >= 0:
            from mosaic.planner import law as lawmod

            tokens = problem.tokens_in_budget(res.tokens_per_s)
            out["compute_optimal_mfu"] = float(res.mfu[0])
            out["compute_optimal_loss_in_budget"] = float(lawmod.loss(problem.law, problem.geoms.archs.take(co.index[:1]), tokens)[0])
            out["compute_optimal_days_needed"] = float(co.tokens[0] / (res.tokens_per_s[0] * problem.eta) / 86400.0)
        else:
            out["compute_optimal_mfu"] = np.nan
            out["compute_optimal_loss_in_budget"] = np.nan
            out["compute_optimal_days_needed"] = np.nan
    return out


def _row(problem: Problem, over: str, value: float, subset: Optional[np.ndarray], workers: int) -> dict[str, Any]:
    row: dict[str, Any] = {"over": over, "value": value, "devices": problem.budget.devices,
                           "days": problem.budget.wall_time_s / 86400.0, "c_model_flops": problem.c_model}
    if subset is not None and len(subset) == 0:
        row.update({"cluster_optimal_loss": np.nan, "compute_optimal_loss": np.nan})
        return row
    row.update(_describe(problem, rank_cluster_optimal(problem, top=1, subset=subset, workers=auto_workers(problem, workers)),
                         "cluster_optimal", with_layout=True))
    row.update(_compute_side(problem, subset))
    return row


def sweep(cluster: Any, over: str, values: Optional[list[float]] = None, devices: Optional[int] = None,
          days: Optional[float] = None, hours: Optional[float] = None, fit: Any = None, space: Any = None,
          workers: int = 0) -> Any:
    """Best loss per value under both budgets, as a pandas DataFrame (`workers`: `auto_workers`)."""
    import pandas as pd

    if over not in OVER:
        raise InputError(Param("over", over), f" is unknown; use one of {', '.join(OVER)}")
    rows = []
    if over in ("sparsity", "granularity"):
        problem = build_problem(cluster, devices=devices, days=days, hours=hours, fit=fit, space=space)
        archs = problem.geoms.archs
        if over == "sparsity":
            key = np.round(np.asarray(expert_sparsity(archs), dtype=float), 6)
            pool = np.ones(len(key), dtype=bool)
        else:
            key = np.round(problem.geoms.granularity_nominal, 6)
            pool = np.asarray(archs.n_experts) > 0
        wanted = sorted(set(key[pool].tolist())) if values is None else [float(v) for v in values]
        for v in wanted:
            subset = np.flatnonzero(pool & np.isclose(key, v, rtol=1e-6, atol=1e-6))
            rows.append(_row(problem, over, v, subset, workers))
    else:
        if over == "days":
            grid = list(DEFAULT_DAYS) if values is None else [float(v) for v in values]
            for v in grid:
                problem = build_problem(cluster, devices=devices, days=v, fit=fit, space=space)
                rows.append(_row(problem, over, v, None, workers))
        else:
            from perfmodel.clusters import load_cluster
            from perfmodel.specs.cluster import ClusterSpec

            spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(str(cluster))
            grid = ([max(1, spec.devices // d) for d in (8, 4, 2, 1)] if values is None else [int(v) for v in values])
            for v in sorted(set(grid)):
                problem = build_problem(spec, devices=int(v), days=days, hours=hours, fit=fit, space=space)
                rows.append(_row(problem, over, v, None, workers))
    return pd.DataFrame(rows)


def optima(frame: Any) -> list[dict[str, Any]]:
    """Where each budget's best loss sits in a sweep: the value, whether it is at an end of the swept
    values (boundary) or inside them (interior), the geometry, and for the compute-optimal side
    what its geometry needs on this cluster (days, or infeasible)."""
    out = []
    values = frame["value"].to_numpy(dtype=float)
    for side in ("compute_optimal", "cluster_optimal"):
        loss = frame[f"{side}_loss"].to_numpy(dtype=float)
        if not np.any(np.isfinite(loss)):
            continue
        i = int(np.nanargmin(loss))
        finite = np.flatnonzero(np.isfinite(loss))
        where = "boundary" if i in (finite.min(), finite.max()) else "interior"
        row = {"over": str(frame["over"].iloc[0]), "budget": side, "value": float(values[i]), "where": where,
               "loss": float(loss[i]), "geometry": str(frame[f"{side}_geometry"].iloc[i])}
        if side == "compute_optimal":
            days = frame["compute_optimal_days_needed"].iloc[i] if "compute_optimal_days_needed" in frame else np.nan
            row["days_needed"] = None if not np.isfinite(days) else float(days)
            row["feasible_here"] = bool(np.isfinite(frame["compute_optimal_loss_in_budget"].iloc[i]))
        else:
            row["mfu"] = float(frame["cluster_optimal_mfu"].iloc[i])
        out.append(row)
    return out


def optima_line(frame: Any) -> str:
    """`optima` in one sentence (what `mosaic sweep` prints under its table)."""
    rows = {r["budget"]: r for r in optima(frame)}
    parts = []
    for side, name in (("compute_optimal", "fixed model FLOPs"), ("cluster_optimal", "deliverable compute")):
        if side in rows:
            r = rows[side]
            text = f"{name}: best at {r['value']:.4g} ({r['where']}, loss {r['loss']:.4f})"
            if side == "compute_optimal":
                text += (f", needs {r['days_needed']:.1f} days here" if r.get("days_needed")
                         else ", no layout fits here" if not r.get("feasible_here") else "")
            parts.append(text)
    return "; ".join(parts)


def plot_sweep(frame: Any, path: str, title: str = "") -> None:
    """Best loss per value under both budgets (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    over = str(frame["over"].iloc[0]) if len(frame) else "value"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = frame["value"].to_numpy(dtype=float)
    ax.plot(x, frame["compute_optimal_loss"].to_numpy(dtype=float), "o--", label="compute-optimal (fixed C_model)")
    if "compute_optimal_loss_in_budget" in frame:
        ax.plot(x, frame["compute_optimal_loss_in_budget"].to_numpy(dtype=float), "x:",
                label="compute-optimal choice, run on this cluster")
    ax.plot(x, frame["cluster_optimal_loss"].to_numpy(dtype=float), "s-", label="cluster-optimal (deliverable)")
    if over in ("devices", "days"):
        ax.set_xscale("log")
    ax.set_xlabel({"sparsity": "expert sparsity 1 - k/E", "granularity": "granularity G"}.get(over, over))
    ax.set_ylabel("best predicted loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    plt.close(fig)


__all__ = ["OVER", "optima", "optima_line", "plot_sweep", "sweep"]

"""How the cluster-optimal plan moves when the inputs move (`mosaic plan --sensitivity`).

  budget     wall time x 0.8 and x 1.2
  bandwidth  every fabric level's per-device bandwidth x 0.8 and x 1.2
  hbm        usable HBM (and the label) x 0.8 and x 1.2
and, with a bootstrapped fit, the probability that the chosen plan's loss is
below the runner-up's across the bootstrap fits (each at its own tokens D).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mosaic.planner.budget import Budget
from mosaic.planner.enumerate import rank_cluster_optimal
from mosaic.planner.law import law_inputs
from mosaic.planner.plan import Choice, PlanResult
from mosaic.planner.problem import make_problem
from mosaic.planner.space import geometry_label
from perfmodel.errors import InfeasibleError
from perfmodel.specs.cluster import ClusterSpec

FACTORS = (0.8, 1.2)


def scale_bandwidth(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    levels = tuple(dataclasses.replace(lv, bandwidth_bytes_per_s=lv.bandwidth_bytes_per_s * factor) for lv in cluster.levels)
    return dataclasses.replace(cluster, levels=levels)


def scale_hbm(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    acc = cluster.accelerator
    usable = acc.usable_hbm_bytes * factor
    acc2 = dataclasses.replace(acc, hbm_bytes=max(acc.hbm_bytes * factor, usable), hbm_usable_bytes=usable)
    return dataclasses.replace(cluster, accelerator=acc2)


def sensitivity_table(result: PlanResult) -> list[dict[str, Any]]:
    base = result.problem
    chosen = geometry_label(result.cluster_optimal.arch)
    rows = []
    for what in ("budget", "bandwidth", "hbm"):
        for f in FACTORS:
            cluster, budget = base.cluster, base.budget
            if what == "budget":
                budget = Budget(devices=budget.devices, wall_time_s=budget.wall_time_s * f,
                                days=None if budget.days is None else budget.days * f,
                                hours=None if budget.hours is None else budget.hours * f)
            elif what == "bandwidth":
                cluster = scale_bandwidth(cluster, f)
            else:
                cluster = scale_hbm(cluster, f)
            problem = make_problem(cluster, budget, base.space, base.law)
            ranked = rank_cluster_optimal(problem, top=1)
            change = f"{what} x{f:g}"
            if len(ranked.loss) == 0 or not np.isfinite(ranked.loss[0]):
                rows.append({"change": change, "geometry": "infeasible", "loss": None, "mfu": None, "same_geometry": False})
                continue
            arch = problem.geoms.archs.row(int(ranked.index[0]))
            rows.append({"change": change, "geometry": geometry_label(arch), "loss": float(ranked.loss[0]),
                         "mfu": float(ranked.results.mfu[0]) if ranked.results is not None else None,
                         "same_geometry": geometry_label(arch) == chosen})
    return rows


def _boot_losses(law: Any, choice: Choice) -> np.ndarray:
    n_tot, s, g = law_inputs(choice.arch)
    return np.asarray(law.predict_bootstrap(n_tot, s, np.asarray(choice.tokens, dtype=float), g), dtype=float).ravel()


def bootstrap_comparison(result: PlanResult) -> dict[str, Any]:
    law = result.problem.law
    if not result.alternatives:
        return {"p_beats_runner_up": None, "note": "no runner-up in the space"}
    if getattr(law, "bootstrap_params", None) is None or not hasattr(law, "predict_bootstrap"):
        return {"p_beats_runner_up": None, "note": f"fit '{getattr(law, 'name', 'law')}' has no bootstrap samples; "
                                                   "refit with `mosaic fit --bootstrap N`"}
    best = _boot_losses(law, result.cluster_optimal)
    runner = _boot_losses(law, result.alternatives[0])
    return {"p_beats_runner_up": float(np.mean(best < runner)), "samples": int(best.size),
            "loss_interval_90": [float(np.quantile(best, 0.05)), float(np.quantile(best, 0.95))]}


__all__ = ["FACTORS", "InfeasibleError", "bootstrap_comparison", "scale_bandwidth", "scale_hbm", "sensitivity_table"]

"""The planner's answer: both budgets side by side, and the versioned plan file.

`solve` runs a search (enumeration or MINLP) and assembles a `PlanResult`:
cluster-optimal (fixed deliverable compute, memory enforced), compute-optimal
(fixed C_model at the nominal MFU, systems ignored) with what that choice
really costs on this cluster, the top alternatives, and the binding
constraint. `PlanResult.to_plan()` is the plan file's content (`mosaic.planfile`):
the cluster-optimal choice as model, layout and tokens, the rest as its report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mosaic import __version__
from mosaic.planfile import Plan, PlanBudget, PlanCluster, PlanFit
from mosaic.planner import law as lawmod
from mosaic.planner.enumerate import Ranked, rank_cluster_optimal, rank_compute_optimal
from mosaic.planner.problem import Problem
from perfmodel.errors import InfeasibleError, InputError, Param
from perfmodel.specs.architecture import (
    ARCH_FIELDS,
    MoEArchitecture,
    active_params,
    expert_sparsity,
    granularity,
    model_card_active_params,
    model_flops_per_token,
    sparsity,
    total_params,
)
from perfmodel.specs.layout import LAYOUT_FIELDS, ParallelLayout
from perfmodel.specs.strict import plain

SOLVERS = ("enumerate", "scip", "bonmin", "mindtpy")
PICKS = ("robust", "nominal")
MEMORY_TIGHT = 0.05
"""Headroom below which the plan's own memory is reported as binding too."""


def model_dict(arch: MoEArchitecture) -> dict[str, Any]:
    """The MoEArchitecture keys plus derived sizes (non-embedding unless named)."""
    out: dict[str, Any] = {name: getattr(arch, name) for name in ARCH_FIELDS}
    out["n_total_params"] = float(total_params(arch))
    out["n_active_params"] = float(active_params(arch))
    out["n_total_params_with_embeddings"] = float(total_params(arch, embeddings=True))
    out["n_active_params_model_card"] = float(model_card_active_params(arch))
    out["sparsity"] = float(sparsity(arch))
    out["expert_sparsity"] = float(expert_sparsity(arch))
    out["granularity"] = float(granularity(arch))
    return out


def layout_dict(layout: Optional[ParallelLayout]) -> Optional[dict[str, Any]]:
    return None if layout is None else {name: getattr(layout, name) for name in LAYOUT_FIELDS}


@dataclass
class Choice:
    """One planned (geometry, layout, tokens) with its predictions."""

    arch: MoEArchitecture
    layout: Optional[ParallelLayout]
    tokens: float
    predicted: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"model": model_dict(self.arch), "layout": layout_dict(self.layout), "tokens": float(self.tokens),
                "predicted": self.predicted}


@dataclass
class PlanResult:
    problem: Problem
    cluster_optimal: Choice
    compute_optimal: Choice
    alternatives: list[Choice]
    binding: dict[str, Any]
    search: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    """Sensitivity and bootstrap results when asked for."""
    decision: dict[str, Any] = field(default_factory=dict)
    """`uncertainty.decide`'s statement: indistinguishable plans, P(best), the rule and its pick."""

    def to_plan(self) -> Plan:
        """The plan file's content: the cluster-optimal choice, its cluster, fit and budget, and
        the report (predictions, derived sizes, the compute-optimal side, binding constraint,
        alternatives, search statistics, analysis)."""
        p = self.problem
        chosen = self.cluster_optimal
        report = {
            "predicted": chosen.predicted,
            "derived": {k: v for k, v in model_dict(chosen.arch).items() if k not in ARCH_FIELDS},
            "compute_optimal": self.compute_optimal.as_dict(),
            "binding": self.binding,
            "alternatives": [a.as_dict() for a in self.alternatives],
            "search": self.search,
            "decision": self.decision,
            **({"analysis": self.extra} if self.extra else {}),
        }
        return Plan(model=chosen.arch, layout=chosen.layout, budget=PlanBudget(**p.budget.as_dict()),
                    tokens=float(chosen.tokens),
                    cluster=PlanCluster(name=p.cluster.name, hash=p.cluster.content_hash(), file=p.cluster_file),
                    fit=PlanFit(name=getattr(p.law, "name", "law"), hash=p.law.content_hash()),
                    tool_version=__version__, report=plain(report))


def predicted_from(problem: Problem, arch: MoEArchitecture, layout: ParallelLayout,
                   row: dict[str, Any]) -> dict[str, Any]:
    """`mosaic predict` keys (`row`: the search's `EvalResult.row` of this pair) plus loss, tokens,
    wall time, model and deliverable FLOPs, goodput; tokens D = tokens/s x eta_good x wall time."""
    wall = problem.budget.wall_time_s
    tokens = float(problem.tokens_in_budget(row["tokens_per_s"] or 0.0)) if row["feasible"] else 0.0
    fpt = float(model_flops_per_token(arch))
    peak = problem.cluster.accelerator.peak(layout.precision)
    deliverable = problem.budget.devices * peak * (row["mfu"] or 0.0) * problem.eta * wall
    out = dict(row)
    out.update({
        "loss": float(lawmod.loss(problem.law, arch, tokens)) if tokens > 0 else None,
        "wall_time_s": wall,
        "goodput": problem.eta,
        "model_flops": fpt * tokens,
        "deliverable_flops": deliverable if row["feasible"] else 0.0,
        "flops_per_token": fpt,
    })
    return out


def _geometry(problem: Problem, g: int) -> MoEArchitecture:
    return problem.geoms.archs.row(int(g))


def _choice_from_ranked(problem: Problem, ranked: Ranked, i: int) -> Choice:
    g = int(ranked.index[i])
    res = ranked.results
    assert res is not None
    layout = problem.evaluator.layout(res.best_layout[i], res.best_gbs[i])
    arch = _geometry(problem, g)
    return Choice(arch, layout, float(ranked.tokens[i]), predicted_from(problem, arch, layout, res.evaluation(i)))


def compute_optimal_choice(problem: Problem, co: Ranked) -> Choice:
    """The classic answer, plus what it really costs on this cluster (`on_cluster`)."""
    g = int(co.index[0])
    arch = _geometry(problem, g)
    tokens = float(co.tokens[0])
    res = problem.evaluate(np.asarray([g]))
    co_spec = problem.space.compute_optimal
    predicted: dict[str, Any] = {
        "loss": float(co.loss[0]),
        "model_flops": problem.c_model,
        "nominal_mfu": co_spec.nominal_mfu,
        "nominal_mfu_source": co_spec.source.strip(),
        "wall_time_s": problem.budget.wall_time_s,
        "goodput": problem.eta,
        "flops_per_token": float(problem.flops_per_token[g]),
    }
    layout = None
    if res.best_layout[0] >= 0:
        layout = problem.evaluator.layout(res.best_layout[0], res.best_gbs[0])
        real = predicted_from(problem, arch, layout, res.evaluation(0))
        tokens_per_s = real["tokens_per_s"]
        days_needed = tokens / (tokens_per_s * problem.eta) / 86400.0
        on_cluster = {
            "feasible": True,
            "mfu": real["mfu"],
            "tokens_per_s": tokens_per_s,
            "step_time_s": real["step_time_s"],
            "memory_per_device_bytes": real["memory_per_device_bytes"],
            "days_needed": days_needed,
            "tokens_in_budget": real_tokens(problem, tokens_per_s),
            "loss_in_budget": real["loss"],
            "deliverable_flops": real["deliverable_flops"],
        }
    else:
        hbm = problem.cluster.accelerator.usable_hbm_bytes
        need = float(res.min_memory_bytes[0])
        on_cluster = {
            "feasible": False,
            "reason": "memory" if np.isfinite(need) else "invalid_layout",
            "min_memory_per_device_bytes": need if np.isfinite(need) else None,
            "usable_hbm_bytes": hbm,
            "days_needed": None,
            "loss_in_budget": None,
        }
    predicted["on_cluster"] = on_cluster
    return Choice(arch, layout, tokens, predicted)


def real_tokens(problem: Problem, tokens_per_s: float) -> float:
    return float(problem.tokens_in_budget(tokens_per_s))


def binding_constraint(problem: Problem, chosen: Choice, co_choice: Choice, ranked: Ranked) -> dict[str, Any]:
    """What keeps the cluster-optimal plan from the compute-optimal one."""
    hbm = problem.cluster.accelerator.usable_hbm_bytes
    mem = chosen.predicted.get("memory_per_device_bytes") or 0.0
    out: dict[str, Any] = {"memory_headroom": 1.0 - mem / hbm}
    on = co_choice.predicted["on_cluster"]
    if model_dict(chosen.arch) == model_dict(co_choice.arch):
        out["constraint"] = "none"
        out["detail"] = "the compute-optimal geometry is also cluster-optimal"
    elif not on["feasible"]:
        out["constraint"] = "memory"
        need = on.get("min_memory_per_device_bytes")
        need_txt = f"at least {need / 1e9:.1f} GB" if need else "no valid layout"
        out["detail"] = (f"the compute-optimal geometry has no layout within usable HBM ({need_txt} per device, "
                         f"usable {hbm / 1e9:.1f} GB)")
    else:
        out["constraint"] = "throughput"
        out["detail"] = (f"the compute-optimal geometry reaches MFU {on['mfu']:.3f} on this cluster "
                         f"(nominal {problem.space.compute_optimal.nominal_mfu:.2f}); the chosen geometry reaches "
                         f"{chosen.predicted['mfu']:.3f} and a lower loss in the wall time")
    if out["memory_headroom"] < MEMORY_TIGHT:
        out["detail"] += f"; memory also binds the chosen layout ({100 * out['memory_headroom']:.1f}% headroom)"
    return out


def infeasible_error(problem: Problem, ranked: Ranked) -> InfeasibleError:
    """No geometry has a feasible layout: name the binding constraint and the nearest relaxation."""
    res = ranked.results
    hbm = problem.cluster.accelerator.usable_hbm_bytes
    if res is None or len(res.index) == 0 or not np.any(np.isfinite(res.min_memory_bytes)):
        return InfeasibleError(
            f"no valid layout: no tp/pp/ep/etp of the search space fits {problem.budget.devices} devices and the "
            "geometries (divisibility rules); nearest relaxation: add tp/pp/ep values that divide the device count "
            "and the head/expert counts to the search space (", Param("space"), ")")
    j = int(np.argmin(res.min_memory_bytes))
    need = float(res.min_memory_bytes[j])
    arch = _geometry(problem, int(res.index[j]))
    return InfeasibleError(
        f"memory binds: every candidate needs more than the usable HBM ({hbm / 1e9:.1f} GB per device); the smallest "
        f"needs {need / 1e9:.1f} GB (d_model={arch.d_model}, n_layers={arch.n_layers}, n_experts={arch.n_experts}); "
        f"nearest feasible relaxation: usable HBM >= {need / 1e9:.1f} GB, or smaller geometries in the space "
        "(geometry.active_params / d_model), or more devices (", Param("devices"), ")")


def search_counts(problem: Problem) -> dict[str, Any]:
    """What the searches of this problem considered, pruned and evaluated: candidates = geometry x
    layout pairs of the space; pruned by overlap dominance (layouts dropped from the grid), by the
    loss bound (geometries whose pairs were never built), by the layout-table bound (pairs of the
    geometries searched that were never built), after building (validity, memory, recompute
    dominance, the pair's compute bound); timed by `perfmodel.evaluate`."""
    ev = problem.evaluator
    grid = len(ev.grid)
    built = ev.counts["built"]
    timed = ev.counts["timed"]  # worker processes' counts included (problem.evaluate)
    held = ev.counts["held"]
    searched = {g for g in problem._cache}
    return {"evaluated_geometries": len(searched), "pruned_geometries": len(problem.geoms) - len(searched),
            "candidates": built, "candidates_in_space": len(problem.geoms) * ev.space_layouts,
            "pruned_overlap_dominance": len(problem.geoms) * (ev.space_layouts - grid),
            "pruned_loss_bound": len(problem.geoms) * grid - built,
            "pruned_layout_table_bound": held, "timed": timed, "pruned_after_building": built - held - timed}


def _put_first(ranked: Ranked, g: int) -> Ranked:
    """`ranked` with geometry `g` first (the MINLP's compute-optimal choice; ties keep its pick)."""
    pos = int(np.flatnonzero(ranked.index == g)[0])
    order = np.r_[pos, np.delete(np.arange(len(ranked.index)), pos)]
    return Ranked(ranked.index[order], ranked.loss[order], ranked.tokens[order], None, ranked.evaluated,
                  ranked.pairs_seen, ranked.pruned_geometries)


def solve(problem: Problem, solver: str = "enumerate", top: int = 10, progress: Optional[Callable[[int], None]] = None,
          workers: int = 1, time_limit_s: Optional[float] = None, decide: bool = True,
          pick: str = "robust") -> PlanResult:
    """Both budgets' answers. `decide`: the decision under uncertainty (`uncertainty.decide`) picks
    the plan among those the evidence cannot tell apart (`pick` robust) or keeps the nominal best
    (`pick` nominal); the plan's alternatives are the next candidates by nominal loss."""
    if pick not in PICKS:
        raise InputError(Param("pick", pick), f" is unknown; use one of {', '.join(PICKS)}")
    if solver not in SOLVERS:
        raise InputError(Param("solver", solver), f" is unknown; use one of {', '.join(SOLVERS)}")
    if len(problem.geoms) == 0:
        raise InfeasibleError("the search space has no geometry in its active-parameter band; nearest relaxation: "
                              "widen geometry.active_params or tokens_per_param, or add d_model/n_layers values")
    t0 = time.perf_counter()
    if decide and workers > 1:
        from mosaic.planner.uncertainty import prefetch_validation

        prefetch_validation()  # on a core the search's serial start leaves free
    co = rank_compute_optimal(problem)
    search: dict[str, Any] = {"solver": solver, "geometries": len(problem.geoms),
                              "layouts_per_geometry": len(problem.evaluator.grid),
                              "space_layouts": problem.evaluator.space_layouts}
    if problem.framework is not None:
        search.update(framework=problem.framework, framework_excluded_layouts=problem.framework_excluded_layouts)
    if solver == "enumerate":
        # the decision widens to MAX_CANDIDATES where its band is not settled (it is on the bundled
        # spaces): one search that deep costs less than a narrow one and a wide one after it
        from mosaic.planner.uncertainty import MAX_CANDIDATES

        ranked = rank_cluster_optimal(problem, top=max(top + 1, MAX_CANDIDATES) if decide else top + 1,
                                      progress=progress, workers=workers)
    else:
        from mosaic.planner import minlp

        limit = minlp.TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
        ranked, report = minlp.solve_cluster_optimal(problem, solver, top=top + 1, progress=progress,
                                                     time_limit_s=limit, workers=workers)
        search.update(report)
        g, csol = minlp.solve_compute_optimal(problem, solver, limit)
        search["compute_optimal"] = {"status": csol.status, "gap": csol.gap, "solver_seconds": csol.seconds,
                                     "objective": csol.objective}
        co = _put_first(co, g)
    feasible = np.isfinite(ranked.loss)
    if not np.any(feasible):
        if solver != "enumerate":  # the enumeration's per-geometry memory minima name the relaxation
            ranked = rank_cluster_optimal(problem, top=1)
        raise infeasible_error(problem, ranked)
    decision: dict[str, Any] = {"available": False, "note": "not asked for (decide=False)"}
    pick_rank = 0
    if decide:
        from mosaic.planner.uncertainty import decide as decide_under_uncertainty

        base = ranked if solver == "enumerate" else rank_cluster_optimal(problem, top=top + 1, workers=workers)
        cands, decision = decide_under_uncertainty(problem, base, top=top + 1, workers=workers)
        if decision.get("available"):
            if solver != "enumerate":
                decision["minlp_agrees"] = bool(int(cands.index[0]) == int(ranked.index[0]))
            ranked = cands
            pick_rank = int(decision["chosen_rank"]) if pick == "robust" else 0
            decision["pick"] = pick
            decision["chosen_rank"] = pick_rank
            decision["p_chosen_is_best"] = decision["per_candidate"][pick_rank]["p_best"]
    feasible = np.isfinite(ranked.loss)
    n_ok = int(feasible.sum())
    shown = [pick_rank] + [i for i in range(min(top + 1, n_ok)) if i != pick_rank][:top]
    choices = [_choice_from_ranked(problem, ranked, i) for i in shown]
    if decision.get("available"):
        for i, c in zip(shown, choices):
            row = decision["per_candidate"][i] if i < len(decision["per_candidate"]) else None
            c.predicted["decision"] = ({k: row[k] for k in ("rank", "p_best", "p_beats_best", "loss_q90",
                                                              "loss_interval_90", "indistinguishable")}
                                       if row else {"rank": i, "indistinguishable": False})
    chosen, alternatives = choices[0], choices[1:]
    co_choice = compute_optimal_choice(problem, co)
    if solver == "enumerate":
        search.update(search_counts(problem))
    search["seconds"] = time.perf_counter() - t0
    if search.get("candidates"):
        search["candidates_per_s"] = search["candidates"] / max(search["seconds"], 1e-9)
    binding = binding_constraint(problem, chosen, co_choice, ranked)
    return PlanResult(problem, chosen, co_choice, alternatives, binding, search, decision=decision)


__all__ = ["SOLVERS", "Choice", "PlanResult", "layout_dict", "model_dict", "predicted_from", "solve"]

"""The planning problem as a Pyomo MINLP, built from the same data and formulas as enumeration.

Data, per geometry g: its best feasible layout from the layout search every solver reads
(`Problem.evaluate`: the same cached `perfmodel.evaluate` results enumeration ranks), its
tokens/s and memory per device, D_max,g = tokens/s x eta_good x wall time. Within a geometry
the layouts compete for one choice under one memory row, so the fastest layout within usable
HBM dominates every other: one pair per geometry is the whole choice, exactly.

  variables   x[g] in {0, 1}, sum_g x[g] = 1;  D >= 0 (units of D_SCALE tokens);  t (the loss)
              integer geometry and layout variables (n_layers, d_model, n_experts, top_k,
              d_expert, n_shared_experts, n_dense_layers, tp, pp, vpp, ep, mbs) = sum_g x[g] value[g]
  compute     C_model = F_g D <= C_deliverable(g) = F_g D_max,g;  x one-hot:  D <= sum_g D_max,g x[g]
  memory      sum_g x[g] mem_g / usable HBM <= 1
  law         t >= sum_g x[g] K_g + z,  z >= b / D^beta   (the fit split by law.tokens_term:
              K_g = law(N_tot, S, ., G) without its D term, checked against predict)
  hull        t >= sum_g x[g] (K_g + b / D_max,g^beta)
  objective   min t

The hull row is implied by the others (x[g] = 1 forces D <= D_max,g, and the law falls with D),
so the problem is unchanged; it is the convex hull of the disjunction "one geometry at its own
D_max", which makes the relaxation's bound the optimum: SCIP proves optimality at the root
instead of branching over thousands of binaries with a bound that mixes one geometry's K with
another's D_max (what timed out before).

Presolve (`presolve_geometries`), exact as any MINLP presolve: enumeration's branch and bound
for the best geometry (`enumerate.rank_cluster_optimal` with top 1): geometries in increasing
loss bound (`Problem.loss_lower_bound`), an incumbent U being the best loss found so far;
geometries whose bound reaches U + TIE_NATS, or whose layout search shows they cannot reach it
(`PairEvaluator.run`'s floor), cannot be optimal and are left out of the model.

The compute-optimal problem is the same model over the geometries with D <= C_model / F_g and
no memory row. Solvers: `scip` (Pyomo writes the .nl file, pyscipopt reads and solves it),
`bonmin` (AMPL executable on PATH, e.g. from idaes-pse's `idaes get-extensions`), `mindtpy`
(Pyomo's outer approximation; needs a MIP and an NLP solver). `geometry_minlp` is the model
where the geometry itself is integer variables (spaces too large to enumerate).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mosaic.planner import law as lawmod
from mosaic.planner.candidates import GeometryResults
from mosaic.planner.enumerate import Ranked, rank_cluster_optimal
from mosaic.planner.problem import Problem
from perfmodel.errors import Param, SolverError

D_SCALE = 1.0e12
"""Tokens per unit of the D variable (keeps the model well scaled)."""
GEOMETRY_VARS = ("n_layers", "d_model", "n_experts", "top_k", "d_expert", "n_shared_experts", "n_dense_layers")
LAYOUT_VARS = ("tp", "pp", "vpp", "ep", "mbs")
GAP = 1e-9
FEASTOL = 1e-9
TIME_LIMIT_S = 300.0
SOLVERS = ("scip", "bonmin", "mindtpy")


# ---------------------------------------------------------------------------
# Model builders (plain data in, ConcreteModel out).

def _loss_model(name: str, constant: np.ndarray, coef: float, exponent: float, d_max: np.ndarray,
                values: dict[str, np.ndarray]) -> Any:
    """One-hot choice x over rows, continuous D <= d_max of the choice, t >= K + coef D^-exponent
    and the hull row t >= K + coef d_max^-exponent (module doc)."""
    import pyomo.environ as pyo

    n = len(constant)
    m = pyo.ConcreteModel(name=name)
    m.P = pyo.RangeSet(0, n - 1)
    m.x = pyo.Var(m.P, domain=pyo.Binary)
    hi = float(np.max(d_max)) / D_SCALE
    lo = min(1e-9, hi)
    m.D = pyo.Var(bounds=(lo, hi), initialize=hi)
    scale = coef * D_SCALE ** (-exponent)
    at_max = constant + scale * (np.maximum(d_max / D_SCALE, lo)) ** (-exponent)
    m.t = pyo.Var(bounds=(float(np.min(constant)), float(np.max(at_max))))
    m.one = pyo.Constraint(expr=sum(m.x[p] for p in m.P) == 1)
    m.compute = pyo.Constraint(expr=m.D <= sum(float(d_max[p]) / D_SCALE * m.x[p] for p in m.P))
    _integer_links(m, values)
    # the D term apart (z >= b D^-beta: one variable's convex row), so the long rows stay linear
    m.z = pyo.Var(bounds=(0.0, scale * lo ** (-exponent)))
    m.tokens_term = pyo.Constraint(expr=m.z >= scale * m.D ** (-exponent))
    m.law = pyo.Constraint(expr=m.t >= sum(float(constant[p]) * m.x[p] for p in m.P) + m.z)
    m.hull = pyo.Constraint(expr=m.t >= sum(float(at_max[p]) * m.x[p] for p in m.P))
    m.loss = pyo.Objective(expr=m.t, sense=pyo.minimize)
    m.exact_root = True
    return m


def build_cluster_model(constant: np.ndarray, coef: float, exponent: float, d_max: np.ndarray, memory: np.ndarray,
                        hbm: float, values: dict[str, np.ndarray]) -> Any:
    """Cluster-optimal MINLP over rows p: constant[p] = K of p's geometry, d_max[p] tokens, memory row."""
    import pyomo.environ as pyo

    m = _loss_model("mosaic_cluster_optimal", constant, coef, exponent, d_max, values)
    m.memory = pyo.Constraint(expr=sum(float(memory[p]) / hbm * m.x[p] for p in m.P) <= 1.0)
    return m


def build_compute_model(constant: np.ndarray, coef: float, exponent: float, d_max: np.ndarray,
                        values: dict[str, np.ndarray]) -> Any:
    """Compute-optimal MINLP over geometries: D <= C_model / F_g, no memory row."""
    return _loss_model("mosaic_compute_optimal", constant, coef, exponent, d_max, values)


def _integer_links(m: Any, values: dict[str, np.ndarray]) -> None:
    """Integer geometry/layout variables tied to the one-hot choice (what the solution reports)."""
    import pyomo.environ as pyo

    for name, vals in values.items():
        lo, hi = float(np.min(vals)), float(np.max(vals))
        var = pyo.Var(domain=pyo.NonNegativeIntegers, bounds=(lo, hi))
        m.add_component(name, var)
        m.add_component(f"link_{name}", pyo.Constraint(expr=var == sum(float(vals[p]) * m.x[p] for p in m.P)))


# ---------------------------------------------------------------------------
# Solvers.

@dataclass
class Solution:
    choice: int
    """Index of the chosen row in the model's data (-1 for `geometry_minlp`)."""
    objective: float
    tokens: float
    status: str
    gap: Optional[float]
    seconds: float
    solver: str
    values: Optional[dict[str, float]] = None
    """Every variable's value by name."""


def solver_available(name: str) -> tuple[bool, str]:
    """(available, reason if not; for mindtpy the MIP+NLP pair it would use)."""
    if name == "scip":
        try:
            import pyscipopt  # noqa: F401
        except ImportError:
            return False, "pyscipopt is not installed (pip install pyscipopt)"
        return True, ""
    if name == "bonmin":
        if shutil.which("bonmin") is None:
            return False, "bonmin is not on PATH (pip install idaes-pse, then `idaes get-extensions`)"
        return True, ""
    if name == "mindtpy":
        nlp = [s for s in ("ipopt",) if _quiet_available(s)]
        if _quiet_available("cyipopt") and _pynumero_asl():  # Pyomo's cyipopt path needs the ASL library
            nlp.append("cyipopt")
        mip = [s for s in ("appsi_highs", "glpk", "cbc") if _quiet_available(s)]
        if not nlp or not mip:
            missing = ("an NLP solver (ipopt or cyipopt)" if not nlp else "") + \
                      (" and " if not nlp and not mip else "") + ("a MIP solver (highspy, glpk or cbc)" if not mip else "")
            return False, f"mindtpy needs {missing}, none found"
        return True, f"{mip[0]}+{nlp[0]}"
    return False, f"unknown solver {name!r}; use one of {', '.join(SOLVERS)}"


def _pynumero_asl() -> bool:
    try:
        from pyomo.contrib.pynumero.asl import AmplInterface

        return bool(AmplInterface.available())
    except Exception:  # not built (`pyomo build-extensions`)
        return False


def _quiet_available(name: str) -> bool:
    import pyomo.environ as pyo

    try:
        return bool(pyo.SolverFactory(name).available(exception_flag=False))
    except Exception:  # some plugins raise instead of answering
        return False


def _failure(solver: str, status: str, gap: Optional[float], seconds: float, time_limit_s: float) -> SolverError:
    """A solver that did not prove an optimum: why, and what to do."""
    where = f"status {status} after {seconds:.1f} s" + (f", gap {gap:.2g}" if gap is not None and np.isfinite(gap) else "")
    if status in ("timelimit", "maxTimeLimit", "maxIterations", "nodelimit", "userinterrupt"):
        todo = f"raise --time-limit (now {time_limit_s:g} s) or use "
    elif status in ("infeasible", "infeasibleOrUnbounded"):
        todo = "the model has no feasible choice (check the space and the budget), or use "
    else:
        todo = "numerical trouble in the solver; use "
    return SolverError(Param("solver", solver), f": no proven optimum ({where}); {todo}", Param("solver", "enumerate"))


def solve_model(model: Any, solver: str, time_limit_s: float = TIME_LIMIT_S, choice: bool = True) -> Solution:
    """Solve `model` (a `build_*_model` or `geometry_minlp` model); SolverError unless proven optimal."""
    ok, why = solver_available(solver)
    if not ok:
        raise SolverError(Param("solver", solver), f": {why}; or use ", Param("solver", "enumerate"))
    t0 = time.perf_counter()
    if solver == "scip":
        status, gap, values, objective = solve_nl_scip(model, time_limit_s, exact_root=getattr(model, "exact_root", False))
        _load_values(model, values)
    else:
        status, gap, values, objective = _solve_pyomo(model, solver, why, time_limit_s)
    seconds = time.perf_counter() - t0
    if status not in ("optimal", "gaplimit") or not values:
        raise _failure(solver, status, gap, seconds, time_limit_s)
    picked = -1
    if choice:
        x = np.asarray([values.get(f"x[{p}]", 0.0) for p in range(len(model.x))])
        if x.size == 0 or x.max() < 0.5:
            raise _failure(solver, "no choice in the solution", gap, seconds, time_limit_s)
        picked = int(np.argmax(x))
    tokens = float(values.get("D", float("nan"))) * D_SCALE
    return Solution(choice=picked, objective=float(objective), tokens=tokens, status=status, gap=gap, seconds=seconds,
                    solver=solver, values=values)


def _load_values(model: Any, values: dict[str, float]) -> None:
    """Put a solution read by name (the .nl symbolic labels) back into the Pyomo model."""
    import pyomo.environ as pyo

    for var in model.component_data_objects(pyo.Var):
        if var.name in values:
            value = values[var.name]
            var.set_value(round(value) if var.is_integer() or var.is_binary() else value, skip_validation=True)


def solve_nl_scip(model: Any, time_limit_s: float, gap: float = GAP, feastol: Optional[float] = FEASTOL,
                  exact_root: bool = False) -> tuple[str, Optional[float], dict[str, float], float]:
    """(status, gap, values by name, objective) of a Pyomo model written as .nl (symbolic labels)
    and solved by pyscipopt's SCIP; `exact_root` turns presolve and the primal heuristics off
    (for a formulation whose root relaxation is its optimum); gap and objective None/nan without
    a solution. feastol None keeps SCIP's own."""
    import pyscipopt

    with tempfile.TemporaryDirectory(prefix="mosaic_minlp_") as tmp:
        path = Path(tmp) / "model.nl"
        model.write(str(path), format="nl", io_options={"symbolic_solver_labels": True})
        scip = pyscipopt.Model()
        scip.hideOutput()
        scip.readProblem(str(path))
        scip.setParam("limits/gap", gap)
        scip.setParam("limits/time", time_limit_s)
        if feastol is not None:
            scip.setParam("numerics/feastol", feastol)
        if exact_root:
            # the hull row makes the root relaxation's solution the optimum: presolve's probing and the
            # primal heuristics over thousands of binaries cost more than the solve (measured, docs/design.md)
            scip.setPresolve(pyscipopt.SCIP_PARAMSETTING.OFF)
            scip.setHeuristics(pyscipopt.SCIP_PARAMSETTING.OFF)
        scip.optimize()
        status = scip.getStatus()
        solved = scip.getNSols() > 0
        values = {v.name: scip.getVal(v) for v in scip.getVars()} if solved else {}
        found_gap = float(scip.getGap()) if solved else None
        objective = float(scip.getObjVal()) if solved else float("nan")
    return status, found_gap, values, objective


def _solve_pyomo(model: Any, solver: str, detail: str, time_limit_s: float) -> tuple[str, Optional[float], dict[str, float], float]:
    import pyomo.environ as pyo

    if solver == "bonmin":
        opt = pyo.SolverFactory("bonmin")
        result = opt.solve(model, options={"bonmin.allowable_gap": 0.0, "bonmin.allowable_fraction_gap": GAP,
                                           "bonmin.time_limit": time_limit_s})
    else:
        mip, nlp = detail.split("+")
        result = pyo.SolverFactory("mindtpy").solve(model, strategy="OA", mip_solver=mip, nlp_solver=nlp,
                                                    absolute_bound_tolerance=1e-10, relative_bound_tolerance=GAP,
                                                    time_limit=time_limit_s)
    term = str(result.solver.termination_condition)
    status = "optimal" if term in ("optimal", "locallyOptimal") else term
    values = {v.name: float(pyo.value(v)) for v in model.component_data_objects(pyo.Var) if v.value is not None}
    lb = getattr(result.problem, "lower_bound", None)
    ub = getattr(result.problem, "upper_bound", None)
    gap = None
    try:
        if lb is not None and ub is not None and np.isfinite(float(lb)) and np.isfinite(float(ub)):
            gap = abs(float(ub) - float(lb)) / max(abs(float(ub)), 1e-12)
    except (TypeError, ValueError):
        gap = None
    return status, gap, values, float(pyo.value(model.loss))


# ---------------------------------------------------------------------------
# The planner's entry points.

def _values(problem: Problem, geometry: np.ndarray, layout: Optional[np.ndarray]) -> dict[str, np.ndarray]:
    archs = problem.geoms.archs
    out = {name: np.asarray(getattr(archs, name))[geometry] for name in GEOMETRY_VARS}
    if layout is not None:
        grid = problem.evaluator.grid
        for name in LAYOUT_VARS:
            out[name] = np.asarray(getattr(grid, name))[layout]
    return out


def cluster_model(problem: Problem, results: GeometryResults) -> tuple[Any, np.ndarray]:
    """(model, D_max per row) of the cluster-optimal problem over `results`' feasible geometries
    (each at its best layout; rows in `results` order)."""
    term = lawmod.tokens_term(problem.law, problem.geoms.archs.take(results.index))
    d_max = problem.tokens_in_budget(results.tokens_per_s)
    model = build_cluster_model(term.constant, term.coef, term.exponent, d_max, results.memory_bytes,
                                problem.cluster.accelerator.usable_hbm_bytes,
                                _values(problem, results.index, results.best_layout))
    return model, d_max


def compute_model(problem: Problem, geometries: Optional[np.ndarray] = None) -> tuple[Any, np.ndarray]:
    """(model, geometry index per row) of the compute-optimal problem."""
    index = np.arange(len(problem.geoms)) if geometries is None else np.asarray(geometries, dtype=np.int64)
    term = lawmod.tokens_term(problem.law, problem.geoms.archs.take(index))
    d_max = problem.compute_optimal_tokens()[index]
    return build_compute_model(term.constant, term.coef, term.exponent, d_max, _values(problem, index, None)), index


TIE_NATS = 1e-9
"""Losses this close to the presolve's incumbent stay in the model (a tie may be the optimum)."""


def presolve_geometries(problem: Problem, subset: Optional[np.ndarray] = None,
                        progress: Optional[Callable[[int], None]] = None,
                        workers: int = 1) -> tuple[GeometryResults, dict[str, Any]]:
    """The geometries that can be optimal, with their layout search (module doc): enumeration's
    branch and bound for the best geometry (`enumerate.rank_cluster_optimal`, top 1, keeping the
    geometries within TIE_NATS of it), over `workers` processes; those with a feasible layout."""
    ranked = rank_cluster_optimal(problem, top=1, subset=subset, progress=progress, workers=workers, within=TIE_NATS)
    res = ranked.results if ranked.results is not None else GeometryResults.empty()
    feasible = np.asarray(res.best_layout) >= 0
    finite = ranked.loss[np.isfinite(ranked.loss)]
    report = {"presolve_incumbent_loss": float(finite.min()) if len(finite) else None,
              "presolve_bound_dropped": int(ranked.pruned_geometries - ranked.bounded_geometries),
              "presolve_search_dropped": int(ranked.bounded_geometries),
              "presolve_infeasible": int((~feasible).sum()),
              "geometries_in_model": int(feasible.sum())}
    return res.take(np.flatnonzero(feasible)), report


def solve_cluster_optimal(problem: Problem, solver: str, top: int = 10,
                          progress: Optional[Callable[[int], None]] = None,
                          time_limit_s: float = TIME_LIMIT_S, workers: int = 1) -> tuple[Ranked, dict[str, Any]]:
    """MINLP optimum first, then the other geometries of the model's data ranked by loss (the data's
    layout searches over `workers` processes)."""
    ok, why = solver_available(solver)
    if not ok:
        raise SolverError(Param("solver", solver), f": {why}; or use ", Param("solver", "enumerate"))
    t0 = time.perf_counter()
    data, report = presolve_geometries(problem, progress=progress, workers=workers)
    report["data_seconds"] = time.perf_counter() - t0
    if len(data.index) == 0:  # nothing fits: the enumeration's memory minima name the relaxation
        empty = GeometryResults.empty()
        return Ranked(np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), empty, 0, 0, len(problem.geoms)), report
    t1 = time.perf_counter()
    model, _ = cluster_model(problem, data)
    report["build_seconds"] = time.perf_counter() - t1
    sol = solve_model(model, solver, time_limit_s)
    report.update({"status": sol.status, "gap": sol.gap, "solver_seconds": sol.seconds, "objective": sol.objective,
                   "candidates": int(len(data.index))})
    tokens = problem.tokens_in_budget(data.tokens_per_s)
    loss = lawmod.loss(problem.law, problem.geoms.archs.take(data.index), tokens)
    rank = np.lexsort((data.index, loss))
    rank = np.r_[sol.choice, rank[rank != sol.choice]][: max(top, 1)]
    return Ranked(index=data.index[rank], loss=loss[rank], tokens=tokens[rank], results=data.take(rank),
                  evaluated=len(data.index), pairs_seen=0, pruned_geometries=len(problem.geoms) - len(data.index)), report


def solve_compute_optimal(problem: Problem, solver: str, time_limit_s: float = TIME_LIMIT_S) -> tuple[int, Solution]:
    """(geometry index, solution) of the compute-optimal MINLP over every geometry."""
    model, index = compute_model(problem)
    sol = solve_model(model, solver, time_limit_s)
    return int(index[sol.choice]), sol


__all__ = ["D_SCALE", "SOLVERS", "Solution", "build_cluster_model", "build_compute_model", "cluster_model",
           "compute_model", "TIE_NATS", "presolve_geometries", "solve_cluster_optimal", "solve_compute_optimal", "solve_model",
           "solver_available"]

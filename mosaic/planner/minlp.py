"""The planning problem as a Pyomo MINLP, built from the same data and formulas as enumeration.

Data (from `perfmodel.evaluate`, per geometry g and valid layout l): tokens/s,
memory per device; D_max(g, l) = tokens/s x eta_good x wall time. Layouts
dominated within their geometry (no more tokens/s at no less memory) can never
be the unique optimum and are dropped before the model is built.

  variables   x[p] in {0, 1} for each (geometry, layout) pair p, sum_p x[p] = 1
              integer geometry and layout variables (n_layers, d_model, n_experts,
              top_k, d_expert, tp, pp, ep, mbs) = sum_p x[p] * value[p]
              D >= 0 continuous (in units of D_SCALE tokens)
  compute     C_model = F_g D <= C_deliverable(g, l) = F_g D_max(g, l); x is one-hot,
              so with F_g of the chosen geometry this is  D <= sum_p x[p] D_max[p]
  memory      sum_p x[p] mem[p] <= usable HBM
  objective   loss = sum_p x[p] K_g(p) + b / D^beta   (the fit split by law.tokens_term:
              K_g = law(N_tot, S, ., G) without its D term, checked against predict)

Presolve (`solve_cluster_optimal`): geometries whose loss bound (MFU at most its
cap, see enumerate) cannot beat an incumbent are dropped, as any MINLP presolve
would; the agreement tests build the model on the whole reduced space instead.

The compute-optimal problem is the same model over geometries with
D <= C_model / F_g and no memory row. Solvers: `scip` (Pyomo writes the .nl
file, pyscipopt reads and solves it), `bonmin` (AMPL executable on PATH, e.g.
from idaes-pse's `idaes get-extensions`), `mindtpy` (Pyomo's outer
approximation; needs a MIP and an NLP solver).
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

import perfmodel
from mosaic.planner import law as lawmod
from mosaic.planner.candidates import GeometryResults
from mosaic.planner.enumerate import Ranked
from mosaic.planner.problem import Problem
from perfmodel.errors import Param, SolverError

D_SCALE = 1.0e12
"""Tokens per unit of the D variable (keeps the model well scaled)."""
GEOMETRY_VARS = ("n_layers", "d_model", "n_experts", "top_k", "d_expert")
LAYOUT_VARS = ("tp", "pp", "ep", "mbs")
GAP = 1e-9
FEASTOL = 1e-9


@dataclass
class PairTable:
    """(geometry, layout) pairs as MINLP data, non-dominated within each geometry."""

    geometry: np.ndarray
    """Index into problem.geoms."""
    layout: np.ndarray
    """Index into the layout grid."""
    gbs: np.ndarray
    tokens_per_s: np.ndarray
    memory_bytes: np.ndarray
    mfu: np.ndarray
    step_time_s: np.ndarray
    evaluations: Optional[perfmodel.EvalResult] = None
    """`perfmodel.evaluate` of each pair (row for row), carried to the plan."""

    def __len__(self) -> int:
        return len(self.geometry)

    def take(self, idx: np.ndarray) -> PairTable:
        arrays = {k: np.asarray(getattr(self, k))[idx] for k in _PAIR_ARRAYS}
        return PairTable(**arrays, evaluations=None if self.evaluations is None else self.evaluations.take(idx))

    @staticmethod
    def concat(parts: list[PairTable]) -> PairTable:
        arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in _PAIR_ARRAYS}
        stores = [p.evaluations for p in parts if p.evaluations is not None]
        return PairTable(**arrays, evaluations=perfmodel.EvalResult.concat(stores) if stores else None)


_PAIR_ARRAYS = ("geometry", "layout", "gbs", "tokens_per_s", "memory_bytes", "mfu", "step_time_s")


def pair_table(problem: Problem, geometries: Optional[np.ndarray] = None,
               progress: Optional[Callable[[int], None]] = None, reduce: bool = True) -> PairTable:
    """Every valid pair that `evaluate` times (memory-infeasible ones included, the MINLP's
    memory row excludes them), then the (tokens/s, memory) Pareto front per geometry (taken
    per chunk as well: a chunk holds whole geometries, so the front is the same)."""
    ev = problem.evaluator
    index = np.arange(len(problem.geoms)) if geometries is None else np.asarray(geometries, dtype=np.int64)
    per_chunk = max(1, 65536 // max(len(ev.grid), 1))
    parts = []
    for start in range(0, len(index), per_chunk):
        chunk = index[start:start + per_chunk]
        archs, lays, g, lay_i = ev.pairs(chunk)
        valid = np.flatnonzero(perfmodel.validity.valid_mask(archs, lays, ev.devices))
        if len(valid):
            res = perfmodel.evaluate(archs.take(valid), lays.take(valid), ev.cluster, ev.devices)
            usable = (res.reason == perfmodel.REASONS.index("ok")) | (res.reason == perfmodel.REASONS.index("memory"))
            keep = valid[usable]
            part = PairTable(geometry=g[keep], layout=lay_i[keep], gbs=np.asarray(lays.gbs)[keep],
                             tokens_per_s=res.tokens_per_s[usable], memory_bytes=res.memory_per_device_bytes[usable],
                             mfu=res.mfu[usable], step_time_s=res.step_time_s[usable], evaluations=res.take(usable))
            parts.append(pareto(part) if reduce else part)
        if progress is not None:
            progress(len(chunk) * len(ev.grid))
    if not parts:
        return PairTable(*(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.int64, float, float, float, float)))
    table = PairTable.concat(parts)
    return pareto(table) if reduce else table


def pareto(table: PairTable) -> PairTable:
    """Keep, per geometry, pairs that no other pair beats on tokens/s at no more memory."""
    order = np.lexsort((-table.tokens_per_s, table.memory_bytes, table.geometry))
    t = table.take(order)
    keep = np.zeros(len(t), dtype=bool)
    starts = np.flatnonzero(np.r_[True, t.geometry[1:] != t.geometry[:-1]])
    ends = np.r_[starts[1:], len(t)]
    for s, e in zip(starts, ends):
        tok = t.tokens_per_s[s:e]
        prev_best = np.r_[-np.inf, np.maximum.accumulate(tok)[:-1]]
        keep[s:e] = tok > prev_best
    return t.take(np.flatnonzero(keep))


# ---------------------------------------------------------------------------
# Model builders (plain data in, ConcreteModel out).

def _loss_model(name: str, constant: np.ndarray, coef: float, exponent: float, d_max: np.ndarray,
                values: dict[str, np.ndarray]) -> Any:
    """One-hot choice x over rows, continuous D <= d_max of the choice, loss = K_choice + coef * D^-exponent."""
    import pyomo.environ as pyo

    n = len(constant)
    m = pyo.ConcreteModel(name=name)
    m.P = pyo.RangeSet(0, n - 1)
    m.x = pyo.Var(m.P, domain=pyo.Binary)
    hi = float(np.max(d_max)) / D_SCALE
    m.D = pyo.Var(bounds=(min(1e-9, hi), hi), initialize=hi)
    m.one = pyo.Constraint(expr=sum(m.x[p] for p in m.P) == 1)
    m.compute = pyo.Constraint(expr=m.D <= sum(float(d_max[p]) / D_SCALE * m.x[p] for p in m.P))
    _integer_links(m, values)
    scale = coef * D_SCALE ** (-exponent)
    m.loss = pyo.Objective(expr=sum(float(constant[p]) * m.x[p] for p in m.P) + scale * m.D ** (-exponent),
                           sense=pyo.minimize)
    return m


def build_cluster_model(constant: np.ndarray, coef: float, exponent: float, d_max: np.ndarray, memory: np.ndarray,
                        hbm: float, values: dict[str, np.ndarray]) -> Any:
    """Cluster-optimal MINLP over pairs p: constant[p] = K of p's geometry, d_max[p] tokens, memory row."""
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
    """Index of the chosen pair/geometry in the model's data."""
    objective: float
    tokens: float
    status: str
    gap: Optional[float]
    seconds: float
    solver: str


def solver_available(name: str) -> tuple[bool, str]:
    """(available, reason if not)."""
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
    return False, f"unknown solver {name!r}"


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


def solve_model(model: Any, solver: str, time_limit_s: float = 300.0) -> Solution:
    ok, why = solver_available(solver)
    if not ok:
        raise SolverError(Param("solver", solver), f": {why}; or use ", Param("solver", "enumerate"))
    t0 = time.perf_counter()
    if solver == "scip":
        status, gap, values, objective = _solve_scip(model, time_limit_s)
        _load_values(model, values)
    else:
        status, gap, values, objective = _solve_pyomo(model, solver, why, time_limit_s)
    seconds = time.perf_counter() - t0
    x = np.asarray([values.get(f"x[{p}]", 0.0) for p in range(len(model.x))])
    if status not in ("optimal", "gaplimit") or x.size == 0 or x.max() < 0.5:
        raise SolverError(Param("solver", solver), f": no optimal solution (status {status}); use ",
                          Param("solver", "enumerate"))
    return Solution(choice=int(np.argmax(x)), objective=float(objective), tokens=float(values["D"]) * D_SCALE,
                    status=status, gap=gap, seconds=seconds, solver=solver)


def _load_values(model: Any, values: dict[str, float]) -> None:
    """Put a solution read by name (the .nl symbolic labels) back into the Pyomo model."""
    import pyomo.environ as pyo

    for var in model.component_data_objects(pyo.Var):
        if var.name in values:
            value = values[var.name]
            var.set_value(round(value) if var.is_integer() or var.is_binary() else value, skip_validation=True)


def _solve_scip(model: Any, time_limit_s: float) -> tuple[str, Optional[float], dict[str, float], float]:
    import pyscipopt

    with tempfile.TemporaryDirectory(prefix="mosaic_minlp_") as tmp:
        path = Path(tmp) / "plan.nl"
        model.write(str(path), format="nl", io_options={"symbolic_solver_labels": True})
        scip = pyscipopt.Model()
        scip.hideOutput()
        scip.readProblem(str(path))
        scip.setParam("limits/gap", GAP)
        scip.setParam("limits/time", time_limit_s)
        scip.setParam("numerics/feastol", FEASTOL)
        scip.optimize()
        status = scip.getStatus()
        values = {v.name: scip.getVal(v) for v in scip.getVars()} if scip.getNSols() > 0 else {}
        gap = float(scip.getGap()) if scip.getNSols() > 0 else None
        objective = float(scip.getObjVal()) if scip.getNSols() > 0 else float("nan")
    return status, gap, values, objective


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

def _values(problem: Problem, geometry: np.ndarray, table: Optional[PairTable]) -> dict[str, np.ndarray]:
    archs = problem.geoms.archs
    out = {name: np.asarray(getattr(archs, name))[geometry] for name in GEOMETRY_VARS}
    if table is not None:
        grid = problem.evaluator.grid
        for name in LAYOUT_VARS:
            out[name] = np.asarray(getattr(grid, name))[table.layout]
    return out


def cluster_model(problem: Problem, table: PairTable) -> tuple[Any, np.ndarray]:
    """(model, D_max per pair) of the cluster-optimal problem on `table`."""
    term = lawmod.tokens_term(problem.law, problem.geoms.archs.take(table.geometry))
    d_max = problem.tokens_in_budget(table.tokens_per_s)
    model = build_cluster_model(term.constant, term.coef, term.exponent, d_max, table.memory_bytes,
                                problem.cluster.accelerator.usable_hbm_bytes, _values(problem, table.geometry, table))
    return model, d_max


def compute_model(problem: Problem, geometries: Optional[np.ndarray] = None) -> tuple[Any, np.ndarray]:
    index = np.arange(len(problem.geoms)) if geometries is None else np.asarray(geometries, dtype=np.int64)
    term = lawmod.tokens_term(problem.law, problem.geoms.archs.take(index))
    d_max = problem.compute_optimal_tokens()[index]
    return build_compute_model(term.constant, term.coef, term.exponent, d_max, _values(problem, index, None)), index


def solve_cluster_optimal(problem: Problem, solver: str, top: int = 10,
                          progress: Optional[Callable[[int], None]] = None,
                          geometries: Optional[np.ndarray] = None, presolve: bool = True) -> tuple[Ranked, dict[str, Any]]:
    """MINLP optimum first, then the other geometries of the same data ranked by loss."""
    ok, why = solver_available(solver)
    if not ok:
        raise SolverError(Param("solver", solver), f": {why}; or use ", Param("solver", "enumerate"))
    report: dict[str, Any] = {}
    if geometries is None and presolve:
        geometries, report = presolve_geometries(problem)
    table = pair_table(problem, geometries, progress)
    hbm = problem.cluster.accelerator.usable_hbm_bytes
    fits = table.memory_bytes <= hbm
    report.update({"candidates": int(len(table)), "pairs_in_model": int(len(table))})
    if not np.any(fits):  # every pair above HBM: loss inf, memories kept for the error message
        ranked = _ranked_from_table(problem, table, None)
        ranked.loss[:] = np.inf
        return ranked, report
    model, d_max = cluster_model(problem, table)
    sol = solve_model(model, solver)
    report.update({"status": sol.status, "gap": sol.gap, "solver_seconds": sol.seconds, "objective": sol.objective})
    return _ranked_from_table(problem, table.take(np.flatnonzero(fits)), table.take(np.asarray([sol.choice]))), report


def presolve_geometries(problem: Problem, incumbent_geometries: int = 64) -> tuple[np.ndarray, dict[str, Any]]:
    """Drop geometries that cannot beat an incumbent (exact, as in any MINLP presolve).

    The incumbent U is the best loss among the `incumbent_geometries` geometries with the
    smallest loss bound (enumerate.Problem.loss_lower_bound: MFU at most its cap); a geometry
    whose bound is >= U cannot be optimal. Without a feasible incumbent nothing is dropped."""
    lb = problem.loss_lower_bound()
    order = np.argsort(lb, kind="stable")
    first = order[:incumbent_geometries]
    res = problem.evaluate(first)
    loss = lawmod.loss(problem.law, problem.geoms.archs.take(res.index), problem.tokens_in_budget(res.tokens_per_s))
    finite = loss[np.isfinite(loss)]
    if len(finite) == 0:
        return np.arange(len(problem.geoms)), {"presolve": "no incumbent; all geometries kept"}
    incumbent = float(finite.min())
    keep = np.flatnonzero(lb < incumbent)
    keep = np.union1d(keep, first[np.isfinite(loss)])
    return keep, {"presolve_kept_geometries": int(len(keep)), "presolve_incumbent_loss": incumbent}


def _ranked_from_table(problem: Problem, table: PairTable, first: Optional[PairTable]) -> Ranked:
    """Best feasible pair per geometry ranked by loss; the solver's choice (if any) first."""
    if len(table) == 0:
        empty = GeometryResults.empty()
        return Ranked(np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), empty, 0, 0, len(problem.geoms))
    order = np.lexsort((-table.tokens_per_s, table.geometry))
    t = table.take(order)
    head = np.flatnonzero(np.r_[True, t.geometry[1:] != t.geometry[:-1]])
    best = t.take(head)
    if first is not None:
        best = PairTable.concat([first, best.take(np.flatnonzero(best.geometry != first.geometry[0]))])
    tokens = problem.tokens_in_budget(best.tokens_per_s)
    loss = lawmod.loss(problem.law, problem.geoms.archs.take(best.geometry), tokens)
    rank = np.lexsort((best.geometry, loss))
    if first is not None:
        rank = np.r_[0, rank[rank != 0]]
    res = GeometryResults(index=best.geometry[rank], best_layout=best.layout[rank], best_gbs=best.gbs[rank],
                          tokens_per_s=best.tokens_per_s[rank], mfu=best.mfu[rank], step_time_s=best.step_time_s[rank],
                          memory_bytes=best.memory_bytes[rank], min_memory_bytes=best.memory_bytes[rank],
                          min_memory_layout=best.layout[rank], n_valid=np.zeros(len(rank)), n_memory_ok=np.zeros(len(rank)),
                          n_timed=np.zeros(len(rank)),
                          evaluation_row=np.arange(len(rank), dtype=np.int64) if best.evaluations is not None else np.full(len(rank), -1),
                          evaluations=best.evaluations.take(rank) if best.evaluations is not None else None)
    return Ranked(best.geometry[rank], loss[rank], tokens[rank], res, len(np.unique(best.geometry)), len(table), 0)


__all__ = ["D_SCALE", "PairTable", "Solution", "build_cluster_model", "build_compute_model", "cluster_model",
           "compute_model", "pair_table", "pareto", "solve_cluster_optimal", "solve_model", "solver_available"]

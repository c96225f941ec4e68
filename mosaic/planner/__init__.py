"""The planner: search space, exact enumeration, Pyomo MINLP, plans, sweeps, sensitivity.

Modules, one job each:
  space        the search-space YAML and its expansion into geometries and layouts
  budget       devices x wall time; compute-optimal C_model; goodput
  problem      the prepared problem (make_problem / build_problem) every solver reads
  law          the scaling law as the planner uses it (N_tot, S, G of an architecture)
  candidates   best feasible layout per geometry through perfmodel.evaluate (with pruning)
  bounds       the compute bound: tokens/s no layout can beat, from perfmodel's block tables
  enumerate    exact search (branch and bound over geometries) under both budgets
  minlp        the same problem as a Pyomo MINLP (SCIP via pyscipopt, Bonmin, MindtPy)
  geometry_minlp  the geometry as integer variables (spaces too large to list)
  uncertainty  the decision under uncertainty: indistinguishable plans, P(best), the robust pick
  plan         assemble both answers (PlanResult.to_plan: the plan file, mosaic.planfile)
  sweep        best loss per value of sparsity, granularity, devices or days
  sensitivity  +-20% budget, bandwidth, HBM; bootstrap probability of the choice
"""

from __future__ import annotations

from typing import Any

from mosaic.planner.problem import Problem, build_problem, make_problem


def plan(cluster: Any, **kwargs: Any) -> Any:
    """Python API: `plan("ascend_superpod", days=20)` -> PlanResult (see mosaic.planner.plan)."""
    from mosaic.planner.plan import solve

    options = {k: kwargs.pop(k) for k in ("solver", "top", "workers", "time_limit_s", "decide", "pick") if k in kwargs}
    return solve(build_problem(cluster, **kwargs), **options)


__all__ = ["Problem", "build_problem", "make_problem", "plan"]

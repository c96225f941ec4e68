"""The planner: search space, exact enumeration, Pyomo MINLP, plans, sweeps, sensitivity.

Modules, one job each:
  space        the search-space YAML and its expansion into geometries and layouts
  budget       devices x wall time; compute-optimal C_model; goodput
  law          the scaling law as the planner uses it (N_tot, S, G of an architecture)
  candidates   best feasible layout per geometry through perfmodel.evaluate (with pruning)
  enumerate    exact search (branch and bound over geometries) under both budgets
  minlp        the same problem as a Pyomo MINLP (SCIP via pyscipopt, Bonmin, MindtPy)
  plan         assemble both answers; the versioned plan file
  sweep        best loss per value of sparsity, granularity, devices or days
  sensitivity  +-20% budget, bandwidth, HBM; bootstrap probability of the choice
"""

from __future__ import annotations

from typing import Any, Optional

from perfmodel.specs.cluster import ClusterSpec


def build_problem(cluster: Any, devices: Optional[int] = None, days: Optional[float] = None,
                  hours: Optional[float] = None, fit: Any = None, space: Any = None, prune: bool = True) -> Any:
    """A `Problem` from names/paths or objects (cluster spec, fitted law, SearchSpace)."""
    from mosaic.planner.budget import make_budget
    from mosaic.planner.enumerate import Problem
    from mosaic.planner.law import load_law
    from mosaic.planner.space import SearchSpace, load_space
    from perfmodel.clusters import bundled_cluster_paths, load_cluster, resolve_cluster_path

    cluster_file = None
    if isinstance(cluster, ClusterSpec):
        spec = cluster
    else:
        spec = load_cluster(str(cluster))
        path = resolve_cluster_path(str(cluster)).resolve()
        if path not in {p.resolve() for p in bundled_cluster_paths().values()}:
            cluster_file = str(path)
    law = fit if (fit is not None and hasattr(fit, "predict")) else load_law(fit)
    sp = space if isinstance(space, SearchSpace) else load_space(space)
    budget = make_budget(spec, devices=devices, days=days, hours=hours)
    return Problem(spec, budget, sp, law, prune=prune, cluster_file=cluster_file)


def plan(cluster: Any, **kwargs: Any) -> Any:
    """Python API: `plan("ascend_superpod", days=20)` -> PlanResult (see mosaic.planner.plan)."""
    from mosaic.planner.plan import solve

    solver = kwargs.pop("solver", "enumerate")
    top = kwargs.pop("top", 10)
    workers = kwargs.pop("workers", 1)
    return solve(build_problem(cluster, **kwargs), solver=solver, top=top, workers=workers)


__all__ = ["build_problem", "plan"]

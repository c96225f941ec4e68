"""The Pyomo MINLP: a known optimum on synthetic data, the enumeration's optimum on the real default
space of every bundled cluster (each solver; skipped with the reason where a solver is absent)."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic.planner import build_problem
from mosaic.planner.enumerate import auto_workers, rank_cluster_optimal, rank_compute_optimal
from mosaic.planner.law import tokens_term
from mosaic.planner.minlp import (
    D_SCALE,
    build_cluster_model,
    cluster_model,
    presolve_geometries,
    solve_cluster_optimal,
    solve_compute_optimal,
    solve_model,
    solver_available,
)
from mosaic.planner.plan import solve
from perfmodel.clusters import bundled_cluster_paths
from perfmodel.errors import SolverError

SOLVERS = ["scip", "bonmin", "mindtpy"]
DEFAULT_CASES = [(name, None, 20.0) for name in sorted(bundled_cluster_paths())] + [("b200", 16, 2.0)]
"""Every bundled cluster at its full size for 20 days, and the small job that used to time out."""


def _need(solver: str) -> None:
    ok, why = solver_available(solver)
    if not ok:
        pytest.skip(f"{solver} unavailable: {why}")


@pytest.mark.parametrize("solver", SOLVERS)
def test_synthetic_table_known_optimum(solver):
    """Three options: the fastest does not fit in memory, so the optimum is the second (hand-computed)."""
    _need(solver)
    constant = np.array([1.00, 1.05, 1.20])
    d_max = np.array([4.0e12, 2.0e12, 8.0e12])
    memory = np.array([50e9, 70e9, 90e9])
    coef, exponent = 30.0, 0.15
    values = {"tp": np.array([1, 2, 4])}
    model = build_cluster_model(constant, coef, exponent, d_max, memory, 80e9, values)
    sol = solve_model(model, solver)
    expected = [c + coef * d ** -exponent for c, d in zip(constant, d_max)]
    assert sol.choice == int(np.argmin(expected[:2]))
    assert sol.objective == pytest.approx(min(expected[:2]), rel=1e-6)
    assert sol.tokens == pytest.approx(d_max[sol.choice], rel=1e-6)
    assert round(model.tp.value) == values["tp"][sol.choice]


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("cluster,devices,days", DEFAULT_CASES, ids=[f"{c}-{d or 'all'}-{t:g}d" for c, d, t in DEFAULT_CASES])
def test_minlp_proves_the_enumeration_optimum_on_the_default_space(solver, cluster, devices, days):
    """The bundled fit and the default space, as `mosaic plan` runs them: both budgets' optima equal
    exact enumeration's (objective within 1e-6 relative, the same geometry), status optimal."""
    _need(solver)
    minlp_problem = build_problem(cluster, devices=devices, days=days)
    workers = auto_workers(minlp_problem)  # as `mosaic plan` searches (every core on these spaces)
    ranked, report = solve_cluster_optimal(minlp_problem, solver, workers=workers)
    g, csol = solve_compute_optimal(minlp_problem, solver)
    reference = build_problem(cluster, devices=devices, days=days)  # its own search, no shared cache
    best = rank_cluster_optimal(reference, top=1, workers=workers)
    co = rank_compute_optimal(reference)
    assert report["status"] in ("optimal", "gaplimit") and report["gap"] <= 1e-6
    assert report["objective"] == pytest.approx(best.loss[0], rel=1e-6)
    assert int(ranked.index[0]) == int(best.index[0])
    assert csol.objective == pytest.approx(co.loss[0], rel=1e-6) and g == int(co.index[0])


def test_the_hull_row_changes_nothing_but_the_proof(law, space):
    """Without the hull row (the implied inequality) the same model has the same optimum."""
    _need("scip")
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    data, _ = presolve_geometries(p)
    every = p.evaluate(np.arange(len(p.geoms)))
    every = every.take(np.flatnonzero(every.best_layout >= 0))
    with_hull, _ = cluster_model(p, every)
    without, _ = cluster_model(p, every)
    without.hull.deactivate()
    a, b = solve_model(with_hull, "scip"), solve_model(without, "scip")
    assert a.objective == pytest.approx(b.objective, rel=1e-9) and a.choice == b.choice
    assert int(every.index[a.choice]) in set(data.index.tolist())  # the presolve kept the optimum


def test_presolve_drops_only_geometries_that_cannot_win(law, make_space):
    p = build_problem("ascend_superpod", devices=128, days=20, fit=law, space=make_space(n_shared_experts=(0, 1)))
    data, report = presolve_geometries(p)
    full = rank_cluster_optimal(build_problem("ascend_superpod", devices=128, days=20, fit=law,
                                              space=make_space(n_shared_experts=(0, 1)), prune=False), top=10**6)
    dropped = np.setdiff1d(full.index[np.isfinite(full.loss)], data.index)
    assert report["presolve_incumbent_loss"] >= full.loss[0]
    losses = dict(zip(full.index.tolist(), full.loss.tolist()))
    assert all(losses[int(g)] >= report["presolve_incumbent_loss"] * (1 - 1e-12) for g in dropped)
    assert int(full.index[0]) in set(data.index.tolist())


def test_solve_with_scip_reports_status_gap_time(law, space):
    _need("scip")
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    result = solve(p, solver="scip", top=3)
    reference = solve(build_problem("h100", devices=64, days=5, fit=law, space=space), top=3)
    s = result.search
    assert s["status"] == "optimal" and s["gap"] <= 1e-6 and s["solver_seconds"] > 0
    assert s["compute_optimal"]["status"] == "optimal"
    assert result.cluster_optimal.predicted["loss"] == pytest.approx(reference.cluster_optimal.predicted["loss"], rel=1e-6)
    assert result.cluster_optimal.arch == reference.cluster_optimal.arch
    assert result.compute_optimal.arch == reference.compute_optimal.arch


def test_a_solver_that_runs_out_of_time_says_why_and_what_to_do():
    _need("scip")
    import pyomo.environ as pyo

    m = pyo.ConcreteModel()  # a knapsack SCIP cannot finish in a millisecond
    rng = np.random.default_rng(0)
    n = 400
    w, v = rng.integers(50, 100, n), rng.integers(50, 100, n)
    m.x = pyo.Var(range(n), domain=pyo.Binary)
    m.D = pyo.Var(bounds=(1, 2))
    m.cap = pyo.Constraint(expr=sum(int(w[i]) * m.x[i] for i in range(n)) <= int(w.sum() // 2) + 0.5)
    m.loss = pyo.Objective(expr=-sum(int(v[i]) * m.x[i] for i in range(n)) + m.D ** -0.5)
    with pytest.raises(SolverError, match=r"no proven optimum \(status timelimit after .* raise --time-limit"):
        solve_model(m, "scip", time_limit_s=1e-3)


def test_tokens_term_matches_predict_and_rejects_a_coupled_law(law, planted_law_cls, space):
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    term = tokens_term(law, p.geoms.archs)
    from mosaic.planner.law import law_inputs

    n, s, g = law_inputs(p.geoms.archs)
    for d in (1e10, 3e11, 7e12):
        np.testing.assert_allclose(term.constant + term.coef * d ** -term.exponent, law.predict(n, s, d, g), rtol=1e-12)

    class Coupled(planted_law_cls):
        def predict(self, n_total, sparsity, tokens, granularity):
            return super().predict(n_total, sparsity, tokens, granularity) + 1e3 / (np.asarray(n_total) * np.asarray(tokens)) ** 0.1

    with pytest.raises(SolverError, match="not of the form"):
        tokens_term(Coupled(), p.geoms.archs)


def test_missing_solver_is_a_solver_error(law, space):
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    for name in ("bonmin", "mindtpy"):
        ok, _ = solver_available(name)
        if not ok:
            with pytest.raises(SolverError, match=f"solver='{name}'") as info:  # the parameter, for Python callers
                solve(p, solver=name)
            from mosaic.cli.common import flag_of
            assert info.value.message_for(flag_of).startswith(f"--solver '{name}': ")  # the flag, for the CLI
    assert D_SCALE > 0

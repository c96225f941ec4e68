"""The Pyomo MINLP: known optimum on synthetic data, equal to enumeration on reduced spaces."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic.planner import build_problem
from mosaic.planner.enumerate import rank_cluster_optimal, rank_compute_optimal
from mosaic.planner.law import tokens_term
from mosaic.planner.minlp import (
    D_SCALE,
    PairTable,
    build_cluster_model,
    cluster_model,
    compute_model,
    pair_table,
    pareto,
    solve_model,
    solver_available,
)
from mosaic.planner.plan import solve
from perfmodel.errors import SolverError

SOLVERS = ["scip", "bonmin", "mindtpy"]


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
@pytest.mark.parametrize("case", [
    {"cluster": "h100", "devices": 64, "days": 5.0, "geometry": {}},
    {"cluster": "ascend_superpod", "devices": 128, "days": 20.0, "geometry": {"n_shared_experts": (0, 1)}},
    {"cluster": "h100", "devices": 32, "days": 2.0, "geometry": {"d_model": (1024, 2048), "n_experts": (0, 8, 32), "top_k": (1, 2, 4)}},
])
def test_minlp_optimum_equals_enumeration(law, make_space, solver, case):
    _need(solver)
    space = make_space(**case["geometry"])
    p = build_problem(case["cluster"], devices=case["devices"], days=case["days"], fit=law, space=space)
    ranked = rank_cluster_optimal(p, top=1)
    table = pair_table(p)
    model, _ = cluster_model(p, table)
    sol = solve_model(model, solver)
    assert sol.objective == pytest.approx(ranked.loss[0], rel=1e-6)
    assert int(table.geometry[sol.choice]) == int(ranked.index[0])
    cm, idx = compute_model(p)
    csol = solve_model(cm, solver)
    co = rank_compute_optimal(p)
    assert csol.objective == pytest.approx(co.loss[0], rel=1e-6)
    assert int(idx[csol.choice]) == int(co.index[0])


def test_solve_with_scip_reports_status_gap_time(law, space):
    _need("scip")
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    result = solve(p, solver="scip", top=3)
    reference = solve(build_problem("h100", devices=64, days=5, fit=law, space=space), top=3)
    assert result.search["status"] == "optimal" and result.search["gap"] <= 1e-6 and result.search["solver_seconds"] > 0
    assert result.cluster_optimal.predicted["loss"] == pytest.approx(reference.cluster_optimal.predicted["loss"], rel=1e-6)
    assert result.cluster_optimal.arch == reference.cluster_optimal.arch


def test_pareto_keeps_exactly_the_non_dominated_pairs():
    rng = np.random.default_rng(0)
    n = 300
    table = PairTable(geometry=rng.integers(0, 5, n), layout=np.arange(n), gbs=np.ones(n, dtype=np.int64),
                      tokens_per_s=rng.uniform(1, 10, n).round(1), memory_bytes=rng.uniform(1, 10, n).round(1),
                      mfu=np.zeros(n), step_time_s=np.ones(n))
    kept = set(pareto(table).layout.tolist())
    for i in range(n):
        same = table.geometry == table.geometry[i]
        better = same & (table.tokens_per_s >= table.tokens_per_s[i]) & (table.memory_bytes <= table.memory_bytes[i]) & (
            (table.tokens_per_s > table.tokens_per_s[i]) | (table.memory_bytes < table.memory_bytes[i]))
        if better.any():
            assert i not in kept
    # every geometry keeps its fastest pair and its smallest-memory pair
    for g in range(5):
        sel = np.flatnonzero(table.geometry == g)
        fastest = sel[table.tokens_per_s[sel] == table.tokens_per_s[sel].max()]
        assert kept & set(fastest.tolist())


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

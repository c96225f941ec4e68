"""Sweep rows carry the FLOPs of both budgets (the notebooks plot loss against them)."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic.planner import build_problem
from mosaic.planner.plan import solve
from mosaic.planner.sweep import sweep


def test_sweep_rows_carry_c_model_and_deliverable_flops(law, space):
    frame = sweep("h100", "sparsity", devices=64, days=5, fit=law, space=space)
    problem = build_problem("h100", devices=64, days=5, fit=law, space=space)
    assert np.allclose(frame["c_model_flops"], problem.c_model, rtol=1e-12)
    # compute-optimal: every answer spends exactly the fixed C_model
    assert np.allclose(frame["compute_optimal_model_flops"], problem.c_model, rtol=1e-9)
    # cluster-optimal: the global optimum's row reports the plan's deliverable FLOPs
    best = frame.loc[frame["cluster_optimal_loss"].idxmin()]
    plan = solve(problem, top=1).cluster_optimal.predicted
    assert best["cluster_optimal_model_flops"] == pytest.approx(plan["deliverable_flops"], rel=1e-9)
    assert np.all(frame["cluster_optimal_model_flops"] > 0)

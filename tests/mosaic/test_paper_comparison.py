"""The paper's comparison: where each budget's optimum sits in a sweep, and why, from the law's terms."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mosaic.planner.law import sparsity_exponents
from mosaic.planner.sweep import optima, optima_line, sweep


def _frame(compute, cluster, in_budget=None, days=None):
    n = len(compute)
    return pd.DataFrame({"over": ["sparsity"] * n, "value": np.linspace(0.5, 0.99, n),
                         "compute_optimal_loss": compute, "cluster_optimal_loss": cluster,
                         "compute_optimal_loss_in_budget": in_budget if in_budget is not None else [np.nan] * n,
                         "compute_optimal_days_needed": days if days is not None else [np.nan] * n,
                         "compute_optimal_geometry": [f"g{i}" for i in range(n)],
                         "cluster_optimal_geometry": [f"h{i}" for i in range(n)], "cluster_optimal_mfu": [0.3] * n})


def test_optima_name_boundary_and_interior():
    frame = _frame([2.0, 1.9, 1.8, 1.7], [2.0, 1.8, 1.85, 1.9], in_budget=[2.0, 1.95, 1.9, np.nan],
                   days=[10.0, 20.0, 40.0, np.nan])
    rows = {r["budget"]: r for r in optima(frame)}
    assert rows["compute_optimal"]["where"] == "boundary" and rows["compute_optimal"]["value"] == pytest.approx(0.99)
    assert not rows["compute_optimal"]["feasible_here"] and rows["compute_optimal"]["days_needed"] is None
    assert rows["cluster_optimal"]["where"] == "interior" and rows["cluster_optimal"]["geometry"] == "h1"
    line = optima_line(frame)
    assert "boundary" in line and "interior" in line and "no layout fits here" in line


def test_sparsity_exponents_trace_the_fixed_flops_optimum(law):
    """The powers are the law's own exponents; under the bundled law all are positive, so the law
    falls monotonically in S at fixed N_act, D and G (checked against the law itself)."""
    from scaling_fits import load_fit

    p = law.params
    assert sparsity_exponents(law) == {"a_term": p["alpha"], "c_term": -p["lambda"], "j_term": p["gamma"] - p["delta"]}
    default = load_fit(None)
    powers = sparsity_exponents(default)
    assert all(v > 0 for v in powers.values())
    n_act, d, g = 5e9, 1e12, 4.0
    s = np.linspace(0.5, 0.999, 40)
    assert np.all(np.diff(default.predict(n_act / (1 - s), s, d, g)) < 0)


def test_the_compute_optimal_sparsity_is_the_sparsest_value_under_the_bundled_law(space):
    frame = sweep("h100", "sparsity", devices=64, days=5, space=space)
    rows = {r["budget"]: r for r in optima(frame)}
    finite = frame["value"][np.isfinite(frame["compute_optimal_loss"])]
    assert rows["compute_optimal"]["value"] == pytest.approx(float(finite.max()))
    assert rows["compute_optimal"]["where"] == "boundary"

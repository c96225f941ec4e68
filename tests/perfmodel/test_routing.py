"""The routing statistics (perfmodel.routing) against simulated uniform routing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perfmodel.routing import (
    busiest_load_factor,
    dropped_fraction,
    erf,
    expected_max_normal,
    expert_imbalance,
    ranks_hit_probability,
)


def _route(rng, tokens, n_experts, top_k):
    """Each token's top_k distinct experts, uniformly at random: (tokens, top_k) ids."""
    return np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k]


def test_special_functions():
    assert np.allclose(erf([-1.0, 0.0, 0.5, 2.0]), [math.erf(x) for x in (-1.0, 0.0, 0.5, 2.0)], atol=2e-7)
    # z_2 = 1/sqrt(pi), z_3 = 3/(2 sqrt(pi)) exactly; one variable: its mean
    assert expected_max_normal([1, 2, 3]) == pytest.approx([0.0, 1 / math.sqrt(math.pi), 1.5 / math.sqrt(math.pi)],
                                                           abs=1e-4)


@pytest.mark.parametrize(("E", "k", "groups", "tokens"), [(16, 2, 4, 512), (64, 8, 8, 1024), (32, 4, 32, 256)])
def test_busiest_group_matches_simulation(E, k, groups, tokens):
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(400):
        load = np.bincount(_route(rng, tokens, E, k).ravel(), minlength=E).reshape(groups, -1).sum(axis=1)
        ratios.append(load.max() / load.mean())
    assert float(busiest_load_factor(E, k, groups, tokens)) == pytest.approx(np.mean(ratios), rel=0.01)
    assert float(busiest_load_factor(E, k, 1, tokens)) == 1.0 and float(busiest_load_factor(0, 0, 4, tokens)) == 1.0
    if groups == E:
        assert float(expert_imbalance(E, k, tokens)) == float(busiest_load_factor(E, k, E, tokens))


def test_capacity_drops_and_rank_hits_match_simulation():
    rng = np.random.default_rng(1)
    E, k, T = 16, 2, 512
    drops = []
    for _ in range(400):
        counts = np.bincount(_route(rng, T, E, k).ravel(), minlength=E)
        drops.append(np.maximum(counts - T * k / E, 0).sum() / (T * k))
    assert float(dropped_fraction(E, k, T, 1.0)) == pytest.approx(np.mean(drops), rel=0.03)
    assert float(dropped_fraction(E, k, T, 0.0)) == 0.0 and float(dropped_fraction(E, k, T, 4.0)) < 1e-6
    ids = _route(rng, 20000, 256, 8)
    hit = np.mean(np.any(ids < 32, axis=1))  # a rank of 32 of the 256 experts (ep = 8)
    assert float(ranks_hit_probability(256, 8, 8)) == pytest.approx(hit, abs=0.01)

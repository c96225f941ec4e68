"""The geometry MINLP: integer width, depth, experts and top-k, counted by perfmodel's formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mosaic.planner import geometry_minlp as gm
from mosaic.planner.minlp import solver_available
from perfmodel.errors import InputError, SolverError
from perfmodel.specs.architecture import active_params, model_flops_per_token, total_params

C_MODEL = 2.0e23
BAND = (math.sqrt(C_MODEL / (6 * 2000)), math.sqrt(C_MODEL / (6 * 5)))


def _space(**changes):
    args = dict(heads_per_kv=(1, 8), depth=(4, 32), n_experts=(2, 64), top_k=(1, 4), active_params=BAND,
                n_dense_layers=(0, 1))
    args.update(changes)
    return gm.IntegerSpace(**args)


def test_the_counts_are_perfmodels_on_random_geometries():
    space = _space()
    rng = np.random.default_rng(1)
    for structure in space.structures():
        coef = gm.count_coefficients(space, structure)
        v, layers, experts = rng.integers(1, 9, 50), rng.integers(4, 33, 50), rng.integers(3, 65, 50)
        k = rng.integers(1, 3, 50)
        archs = space.archs(structure, v, layers, experts, k)
        basis = gm._basis(v, layers, experts, k)
        for name, fn in (("n_total", total_params), ("n_active", active_params), ("flops", model_flops_per_token)):
            np.testing.assert_allclose(basis @ coef[name], np.asarray(fn(archs), dtype=float), rtol=1e-12)


def test_a_count_outside_the_basis_is_refused(monkeypatch):
    space = _space()
    monkeypatch.setattr(gm, "total_params", lambda arch: total_params(arch) + np.sqrt(np.asarray(arch.d_model, float)))
    with pytest.raises(SolverError, match="not a polynomial"):
        gm.count_coefficients(space, space.structures()[0])


def test_only_the_mosaic4d_form_is_written(law):
    assert gm.law_parameters(law)["alpha"] == law.params["alpha"]

    class Chinchilla:
        name, params = "chinchilla", {"a": 1.0, "alpha": 0.3, "b": 1.0, "beta": 0.3, "e": 1.7}

    with pytest.raises(SolverError, match="not the mosaic4d form"):
        gm.law_parameters(Chinchilla())


def test_bad_ranges_name_the_key():
    with pytest.raises(InputError, match="depth"):
        _space(depth=(30, 10))
    with pytest.raises(InputError, match="granularity"):
        _space(granularity=(3.0,))


def test_the_minlp_proves_what_listing_every_geometry_finds():
    """Bundled fit: the integer model's optimum equals the exhaustive listing (perfmodel's counts,
    law.predict) over every (v, L, E, k) of every structure."""
    ok, why = solver_available("scip")
    if not ok:
        pytest.skip(f"scip unavailable: {why}")
    from scaling_fits import load_fit

    law = load_fit(None)
    space = _space()
    answer = gm.solve(space, law, C_MODEL, time_limit_s=120)
    loss, structure, point, passed = gm.enumerate_space(space, law, C_MODEL)
    assert passed > 10_000 and space.size() > passed
    assert answer.status == "optimal" and answer.gap <= 1e-6
    assert answer.loss == pytest.approx(loss, rel=1e-9)
    assert (answer.structure, (answer.heads_per_kv, answer.depth, answer.n_experts, answer.top_k)) == (structure, point)

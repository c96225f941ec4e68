"""Laws: fast log-sum-exp path equals the written formula; special cases reduce as stated."""

from __future__ import annotations

import numpy as np
import pytest

from scaling_fits.errors import FitDataError
from scaling_fits.laws import LAWS, Abnar2025Params, Krajewski2024Params, Mosaic4DParams, get_law

RNG = np.random.default_rng(7)
N = np.geomspace(1e7, 1e12, 9)[:, None]
S = np.array([0.0, 0.3, 0.9, 0.99])[None, :]
D = 3e11
G = np.array([1.0, 4.0, 16.0, 64.0])[None, :]

MOSAIC = Mosaic4DParams(a=18.0, alpha=0.12, b=400.0, beta=0.28, c=0.4, lambda_=-0.1, j=30.0, delta=0.5,
                        gamma=0.2, eta=0.58, e=1.2)


def random_params(law):
    values = {}
    for field in law.fields:
        lo, hi = law.params_type.START[field]
        values[field] = float(np.exp(RNG.uniform(np.log(lo), np.log(hi))) if law.is_coef(field) else RNG.uniform(lo, hi))
    return law.params_type(**values)


@pytest.mark.parametrize("name", sorted(LAWS))
def test_fast_path_equals_reference_formula(name):
    law = get_law(name)
    for _ in range(5):
        p = random_params(law)
        fast = law.predict(p, N, S, D, G)
        ref = law.reference(p, N, S, D, G)
        assert fast.shape == (9, 4)
        np.testing.assert_allclose(fast, ref, rtol=1e-12)


def test_mosaic4d_dense_reduces_to_chinchilla_form():
    law = get_law("mosaic4d")
    n, d = np.geomspace(1e7, 1e12, 20), np.geomspace(1e9, 1e13, 20)
    got = law.predict(MOSAIC, n, 0.0, d, 1.0)
    p = MOSAIC
    reduced = p.a / n ** p.alpha + p.j / n ** p.gamma + p.b / d ** p.beta + (p.c + p.e)
    np.testing.assert_allclose(got, reduced, rtol=1e-12)
    # with the interaction term removed it is exactly Chinchilla with E = c + e (N_act = N_tot at S = 0)
    no_j = p._replace(j=0.0)
    chin = get_law("chinchilla").params_type(E=p.c + p.e, A=p.a, B=p.b, alpha=p.alpha, beta=p.beta)
    np.testing.assert_allclose(get_law("mosaic4d").reference(no_j, n, 0.0, d, 1.0),
                               get_law("chinchilla").predict(chin, n, 0.0, d), rtol=1e-12)


def test_mosaic4d_dense_with_shared_n_exponent_is_krajewski():
    p = MOSAIC._replace(gamma=MOSAIC.alpha)
    k = Krajewski2024Params(c=p.c + p.e, g=p.j, gamma=p.eta, a=p.a, alpha=p.alpha, b=p.b, beta=p.beta)
    np.testing.assert_allclose(get_law("mosaic4d").predict(p, N, 0.0, D, G),
                               get_law("krajewski2024").predict(k, N, 0.0, D, G), rtol=1e-12)


def test_mosaic4d_at_g1_is_abnar():
    p = MOSAIC
    ab = Abnar2025Params(a=p.a, alpha=p.alpha, b=p.b, beta=p.beta, c=p.c, lambda_=p.lambda_, d=p.j,
                         delta=p.delta, gamma=p.gamma, e=p.e)
    np.testing.assert_allclose(get_law("mosaic4d").predict(p, N, S, D, 1.0),
                               get_law("abnar2025").predict(ab, N, S, D, 1.0), rtol=1e-12)


def test_granularity_lowers_mosaic_loss_and_theta_roundtrip():
    law = get_law("mosaic4d")
    loss = law.predict(MOSAIC, 1e9, 0.9, 1e11, np.array([1.0, 8.0, 64.0]))
    assert np.all(np.diff(loss) < 0)
    assert law.params_from_theta(law.theta_from_params(MOSAIC)) == pytest.approx(MOSAIC)
    assert law.param_names[5] == "lambda" and law.index("lambda") == 5


@pytest.mark.parametrize("kwargs, field", [
    ({"n_total": -1.0}, "n_total"), ({"sparsity": 1.0}, "sparsity"), ({"tokens": 0.0}, "tokens"),
    ({"granularity": np.nan}, "granularity"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    args = {"n_total": 1e9, "sparsity": 0.5, "tokens": 1e11, "granularity": 1.0, **kwargs}
    with pytest.raises(FitDataError, match=field):
        get_law("mosaic4d").predict(MOSAIC, **args)


def test_unknown_law_and_parameter():
    with pytest.raises(FitDataError, match="unknown law 'kaplan'"):
        get_law("kaplan")
    with pytest.raises(FitDataError, match="no parameter 'zeta'"):
        get_law("mosaic4d").index("zeta")

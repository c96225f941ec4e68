"""Identifiability: a planted 4-D law from 400 runs, what the fitter reports when the data cannot separate terms,
per-source irreducible losses, and the granularity-form choice."""

from __future__ import annotations

import numpy as np
import pytest

from scaling_fits.data import combine, from_arrays
from scaling_fits.fitter import FitOptions, describe_identifiability, fit, identifiability
from scaling_fits.laws import Mosaic4DLG2Params, Mosaic4DParams, get_law
from scaling_fits.pipeline import fit_law
from scaling_fits.select import choose_granularity_form

LAW = get_law("mosaic4d")
TRUTH = Mosaic4DParams(a=400.0, alpha=0.3, b=400.0, beta=0.28, c=0.3, lambda_=0.4, j=60.0, delta=0.5,
                       gamma=0.25, eta=0.5, e=1.5)
EXPONENTS = ("alpha", "beta", "lambda", "delta", "gamma", "eta")


def ladder(params, law=LAW, noise=0.005, seed=0, s=(0.0, 0.5, 0.875, 0.97), g=(1.0, 2.0, 4.0, 16.0)):
    """400 runs, one final loss each: 5 N x 4 S x 4 G x 5 D, log-normal noise."""
    rng = np.random.default_rng(seed)
    n, d = np.geomspace(3e7, 3e10, 5), np.geomspace(1e9, 1e12, 5)
    N, S, G, D = (x.ravel() for x in np.meshgrid(n, np.asarray(s), np.asarray(g), d, indexing="ij"))
    loss = law.predict(params, N, S, D, G) * np.exp(noise * rng.standard_normal(N.size))
    return from_arrays(N, D, loss, S, G)


def relative_errors(result, truth, names=EXPONENTS):
    got = dict(zip(result.law.param_names, result.law.natural(result.model.project(result.theta))))
    want = dict(zip(result.law.param_names, result.law.natural(result.law.theta_from_params(truth))))
    return {k: got[k] / want[k] - 1.0 for k in names}


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_4d_law_from_400_runs_every_exponent_within_5pct(seed):
    data = ladder(TRUTH, seed=seed)
    assert data.n_runs == 400
    res = fit(LAW, data, FitOptions(n_starts=32))
    errors = relative_errors(res, TRUTH)
    assert max(abs(v) for v in errors.values()) < 0.05, errors
    report = identifiability(res, data)
    assert not report["flagged"], report["flagged"]
    assert all(report["relative_se"][k] < 0.05 for k in EXPONENTS)


def test_reported_standard_errors_cover_the_actual_errors():
    # a harder law (weak sparsity term, N exponents close together): the errors are what the se says
    truth = Mosaic4DParams(a=33.6, alpha=0.30, b=2500.0, beta=0.375, c=0.19, lambda_=-0.43, j=80.0, delta=0.2,
                           gamma=0.26, eta=0.58, e=1.52)
    for seed in (0, 2):
        data = ladder(truth, seed=seed)
        res = fit(LAW, data, FitOptions(n_starts=32))
        se = identifiability(res, data)["relative_se"]
        errors = relative_errors(res, truth)
        assert all(abs(errors[k]) <= 3 * se[k] for k in EXPONENTS), (errors, se)


def test_dense_only_runs_flag_the_terms_they_cannot_see():
    data = ladder(TRUTH, s=(0.0,), g=(1.0,))
    res = fit(LAW, data, FitOptions(n_starts=16))
    report = identifiability(res, data)
    flagged = report["flagged"]
    for name in ("delta", "eta"):          # (1 - S) and G are constant: no information
        assert name in flagged and "no information" in flagged[name]["reason"]
    # with S = 0 the N-terms a/N^alpha and j/N^gamma are two power laws in N: only their sum is measured
    assert {"alpha", "gamma"} & set(flagged)
    partners = {p for name in ("alpha", "gamma") if name in flagged for p, _ in flagged[name]["trades_off_with"]}
    assert partners
    line = describe_identifiability(report)
    assert "delta" in line and "trades off with" in line


def test_per_source_irreducible_loss_recovered_with_shared_exponents():
    truth_b = TRUTH._replace(e=1.9)
    a = ladder(TRUTH, seed=3)
    b = ladder(truth_b, seed=4, s=(0.0,), g=(1.0,))
    data = combine([from_arrays(a.n_total, a.tokens, a.loss, a.sparsity, a.granularity, run_id=np.arange(a.n_points),
                                source_id="moe"),
                    from_arrays(b.n_total, b.tokens, b.loss, b.sparsity, b.granularity,
                                run_id=1000 + np.arange(b.n_points), source_id="dense")])
    assert data.source_names == ("dense", "moe")
    options = FitOptions(n_starts=16, per_source=("e",), reference_source="moe")
    res = fit(LAW, data, options)
    values = dict(zip(res.model.param_names, res.model.natural(res.theta)))
    assert values["e"] == pytest.approx(1.5, rel=0.02)
    assert values["e[dense]"] == pytest.approx(1.9, rel=0.02)
    assert max(abs(v) for v in relative_errors(res, TRUTH).values()) < 0.05
    fitted = fit_law(data, "mosaic4d", options, holdout_fraction=None, loo=False)
    assert fitted.params["e"] == pytest.approx(values["e"])          # the planner's law is the reference source's
    assert set(fitted.metrics["sources"]) == {"dense", "moe"}
    assert fitted.metrics["sources"]["dense"]["e"] == pytest.approx(values["e[dense]"])


def test_granularity_form_chosen_by_held_out_error_and_refused_without_g_variation():
    lg2 = get_law("mosaic4d_lg2")
    truth = Mosaic4DLG2Params(**TRUTH._asdict(), eta2=-0.12)   # optimum at G = exp(0.5 / 0.24) ~ 8
    data = ladder(truth, law=lg2, g=(1.0, 2.0, 4.0, 8.0, 32.0))
    report = choose_granularity_form(data, FitOptions(n_starts=16), loo=False)
    assert report["choice"] == "logquad", report
    forms = report["forms"]
    assert forms["logquad"]["mape_holdout"] < forms["power"]["mape_holdout"]
    flat = choose_granularity_form(ladder(TRUTH, g=(1.0,)), FitOptions(n_starts=8), loo=False)
    assert flat["choice"] is None and "not identifiable" in flat["reason"]


def test_a_parameter_on_a_bound_names_the_parameters_that_undo_it():
    """A bound parameter whose Jacobian column the others explain (R^2 >= 0.999) trades off with them
    (sign +1: they move together to keep the fit); an independent one names no partner."""
    from scaling_fits.fitter import IDENTIFIABILITY_LIMITS, _bound_partners

    rng = np.random.default_rng(3)
    cols = rng.standard_normal((200, 3))
    tied = 2.0 * cols[:, 0] - cols[:, 2] + 1e-4 * rng.standard_normal(200)
    free = rng.standard_normal(200)
    J = np.column_stack([cols, tied, free])
    inner = np.array([True, True, True, False, False])
    out = _bound_partners(J, inner, ["p", "q", "r", "tied", "free"], np.ones(200), IDENTIFIABILITY_LIMITS)
    assert out["tied"] == [["p", -1.0], ["r", 1.0]] and "free" not in out

"""Fit files: round trip, strict loading, the bundled default fit, the planner's API."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import numpy as np
import pytest
import yaml

import scaling_fits
from scaling_fits import FitDataError, FittedLaw, load_fit
from scaling_fits.data import file_sha256, from_arrays
from scaling_fits.fitfile import dump_fit, from_mapping, write_fit
from scaling_fits.granularity import KRAJEWSKI_2024, calibrate_eta
from scaling_fits.pipeline import fit_law

PKG = Path(scaling_fits.__file__).resolve().parent


@pytest.fixture(scope="module")
def small_fit():
    rng = np.random.default_rng(0)
    n, d = np.repeat(np.geomspace(1e8, 1e10, 6), 4), np.tile(np.geomspace(1e9, 1e11, 4), 6)
    loss = (1.7 + 400 / n ** 0.34 + 400 / d ** 0.28) * np.exp(0.005 * rng.standard_normal(n.size))
    data = from_arrays(n, d, loss, run_id=np.repeat(np.arange(6), 4))
    from scaling_fits.fitter import FitOptions

    return fit_law(data, "chinchilla", FitOptions(n_starts=6), n_boot=5, holdout_fraction=0.2, loo=True)


def test_round_trip_keeps_predictions_and_hash(small_fit, tmp_path):
    path = tmp_path / "fit.yaml"
    write_fit(small_fit, path)
    loaded = load_fit(path)
    assert loaded.name == "chinchilla" and loaded.params == small_fit.params
    assert loaded.content_hash() == small_fit.content_hash()
    n, s, d = np.geomspace(1e8, 1e12, 5), 0.0, 1e11
    np.testing.assert_array_equal(loaded.predict(n, s, d, 1.0), small_fit.predict(n, s, d, 1.0))
    np.testing.assert_allclose(loaded.bootstrap_params, small_fit.bootstrap_params, rtol=1e-15)
    assert set(loaded.ci) == {"E", "A", "B", "alpha", "beta"}
    assert loaded.metrics["mape_holdout"] is not None and loaded.metrics["mape_loo"] is not None


def test_hash_depends_on_parameters(small_fit):
    data = small_fit.to_mapping()
    data["params"]["alpha"] *= 1.001
    assert from_mapping(data).content_hash() != small_fit.content_hash()


def edit(fit: FittedLaw, fn):
    data = yaml.safe_load(dump_fit(fit))
    fn(data)
    return data


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(extra=1), "extra: unknown key"),
    (lambda d: d.pop("params"), "params: missing key"),
    (lambda d: d.update(version=2), "version: unsupported version 2"),
    (lambda d: d.update(law="kaplan"), "unknown law 'kaplan'"),
    (lambda d: d["params"].update(zeta=1.0), "params.zeta: not a parameter of chinchilla"),
    (lambda d: d["params"].pop("beta"), "params.beta: missing"),
    (lambda d: d["params"].update(alpha="fast"), "params.alpha: expected a number"),
    (lambda d: d["params"].update(A=-1.0), "params.A: coefficient is negative"),
    (lambda d: d["bootstrap"]["samples"].append([1.0, 2.0]), "bootstrap.samples"),
    (lambda d: d["bootstrap"].update(n=5), "bootstrap.n: unknown key"),
    (lambda d: d.update(fixed=["zeta"]), "fixed: expected a list of parameter names"),
    (lambda d: d.update(ci_level=1.5), "ci_level"),
])
def test_strict_loading_names_key(small_fit, tmp_path, change, match):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(edit(small_fit, change)))
    with pytest.raises(FitDataError, match=match):
        load_fit(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FitDataError, match="no such fit file"):
        load_fit(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    with pytest.raises(FitDataError, match="not valid YAML"):
        load_fit(bad)
    bad.write_text("- 1\n")
    with pytest.raises(FitDataError, match="expected a mapping"):
        load_fit(bad)


def test_bundled_default_fit_is_what_the_planner_gets():
    fit = load_fit(None)
    assert fit.name == "mosaic4d" and fit.fixed == ("eta",)
    # eta: calibrated to Krajewski et al. 2024's measured granularity effect (the runs all have G = 1)
    assert fit.params["eta"] == pytest.approx(calibrate_eta(fit.law, fit.params, KRAJEWSKI_2024["table1"]), rel=1e-6)
    assert set(fit.params) == {"a", "alpha", "b", "beta", "c", "lambda", "j", "delta", "gamma", "eta", "e"}
    prov = fit.provenance
    assert prov["priors"]["eta"]["value"] == fit.params["eta"] and "Krajewski" in prov["priors"]["eta"]["point"]
    parts = [file_sha256(PKG / "data" / name) for name in ("clark2022_runs.csv", "chinchilla2022_runs.csv")]
    assert prov["data"]["sha256"] == hashlib.sha256("\x00".join(parts).encode()).hexdigest()
    assert any("Clark et al. 2022" in s for s in prov["sources"])
    assert any("Hoffmann et al. 2022" in s for s in prov["sources"])
    assert prov["data"]["sources"] == ["chinchilla2022", "clark2022"]
    for key in ("fit_date", "fitter"):
        assert key in prov
    m = fit.metrics
    assert m["mape_in_sample"] < 0.02 and m["mape_holdout"] < 0.03
    # the irreducible loss is measured (not at a bound, not flagged), once per source
    assert "e" not in m["identifiability"]["flagged"]
    assert m["sources"]["clark2022"]["reference"] and m["sources"]["clark2022"]["e"] == fit.params["e"]
    lo, hi = m["sources"]["chinchilla2022"]["e_ci"]
    assert lo <= m["sources"]["chinchilla2022"]["e"] <= hi
    # vectorised, broadcasting prediction and bootstrap samples
    n = np.geomspace(1e9, 1e12, 7)[:, None]
    s = np.array([0.0, 0.5, 0.9, 0.97])[None, :]
    loss = fit.predict(n, s, 1e12, 8.0)
    assert loss.shape == (7, 4) and np.all(np.isfinite(loss)) and np.all(loss > 0)
    assert np.all(np.diff(loss[:, 0]) < 0)                        # bigger dense models: lower loss
    boot = fit.predict_bootstrap(n, s, 1e12, 8.0)
    assert boot.shape == (fit.bootstrap_params.shape[0], 7, 4)
    assert fit.bootstrap_params.shape[1] == len(fit.params)
    lo, hi = np.quantile(boot, [0.025, 0.975], axis=0)
    assert np.all(lo <= loss * 1.02) and np.all(hi >= loss * 0.98)
    assert len(fit.content_hash()) == 16


def test_predict_bootstrap_without_samples_is_a_named_error(small_fit):
    plain = from_mapping({**small_fit.to_mapping(), "bootstrap": None, "ci": {}, "ci_level": None})
    assert plain.bootstrap_params is None
    with pytest.raises(FitDataError, match="no bootstrap samples"):
        plain.predict_bootstrap(1e9, 0.0, 1e11, 1.0)


def test_scaling_fits_imports_nothing_else_of_ours():
    ours = {"mosaic", "perfmodel", "calibration"}
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ours for n in names), f"{path.name} imports {names}"

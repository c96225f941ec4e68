"""`mosaic fit`: JSON keys, written file, plot, one-line errors with exit 2."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from typer.testing import CliRunner

from mosaic.cli.app import app
from scaling_fits import load_fit


def runs_csv(tmp_path):
    rng = np.random.default_rng(1)
    n, d = np.repeat(np.geomspace(1e8, 1e10, 6), 4), np.tile(np.geomspace(1e9, 1e11, 4), 6)
    loss = (1.7 + 400 / n ** 0.34 + 400 / d ** 0.28) * np.exp(0.005 * rng.standard_normal(n.size))
    path = tmp_path / "runs.csv"
    pd.DataFrame({"run_id": np.repeat(np.arange(6), 4), "n_total": n, "tokens": d, "loss": loss}).to_csv(path, index=False)
    return path


def test_json_output_and_file(tmp_path):
    out = tmp_path / "fit.yaml"
    result = CliRunner().invoke(app, ["fit", str(runs_csv(tmp_path)), "--law", "chinchilla", "--starts", "6",
                                      "--bootstrap", "4", "--holdout-top", "0.2", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["law"] == "chinchilla"
    assert list(payload["params"]) == ["E", "A", "B", "alpha", "beta"]
    assert set(payload["ci"]) == {"E", "A", "B", "alpha", "beta"}
    assert 0 < payload["mape_in_sample"] < 0.02 and 0 < payload["mape_holdout"] < 0.05
    fit = load_fit(out)
    assert fit.content_hash() == payload["hash"]
    assert fit.bootstrap_params.shape == (4, 5)


def test_table_output_plot_and_fixed_prior(tmp_path):
    png = tmp_path / "fit.png"
    result = CliRunner().invoke(app, ["fit", str(runs_csv(tmp_path)), "--law", "krajewski2024", "--starts", "4",
                                      "--bootstrap", "0", "--no-loo", "--holdout-top", "0", "--fix", "gamma=0.58",
                                      "--fix", "g=2.1", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "fixed (prior)" in result.output and "MAPE in-sample" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mosaic4d_json_param_names(tmp_path):
    result = CliRunner().invoke(app, ["fit", str(runs_csv(tmp_path)), "--starts", "2", "--bootstrap", "0",
                                      "--no-loo", "--holdout-top", "0", "--fix", "eta=0.58", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert list(payload["params"]) == ["a", "alpha", "b", "beta", "c", "lambda", "j", "delta", "gamma", "eta", "e"]
    assert payload["mape_holdout"] is None


def one_line_error(result, start):
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith(start), result.output
    assert "Traceback" not in result.output


def test_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"n_total": [1e8, 1e9], "tokens": [1e9, 1e9], "loss": [2.0, 0.0]}).to_csv(bad, index=False)
    runner = CliRunner()
    one_line_error(runner.invoke(app, ["fit", str(bad)]), f"error: {bad}: column 'loss' row 2")
    one_line_error(runner.invoke(app, ["fit", str(tmp_path / "none.csv")]), "error:")
    good = runs_csv(tmp_path)
    one_line_error(runner.invoke(app, ["fit", str(good), "--law", "kaplan"]), "error: unknown law 'kaplan'")
    one_line_error(runner.invoke(app, ["fit", str(good), "--fix", "eta"]), "error: --fix 'eta'")
    one_line_error(runner.invoke(app, ["fit", str(good), "-o", str(tmp_path / "no" / "fit.yaml")]), "error: --output")


def test_per_source_irreducible_loss_and_not_identified_flags(tmp_path):
    rng = np.random.default_rng(2)
    n, d = np.repeat(np.geomspace(1e8, 1e10, 6), 4), np.tile(np.geomspace(1e9, 1e11, 4), 6)
    frames = []
    for source, e in (("corpus_a", 1.7), ("corpus_b", 2.1)):
        loss = (e + 400 / n ** 0.34 + 400 / d ** 0.28) * np.exp(0.003 * rng.standard_normal(n.size))
        frames.append(pd.DataFrame({"run_id": [f"{source}-{i}" for i in np.repeat(np.arange(6), 4)], "source": source,
                                    "n_total": n, "tokens": d, "loss": loss}))
    path = tmp_path / "two.csv"
    pd.concat(frames).to_csv(path, index=False)
    out = tmp_path / "fit.yaml"
    result = CliRunner().invoke(app, ["fit", str(path), "--law", "chinchilla", "--per-source", "E", "--reference-source",
                                      "corpus_b", "--starts", "8", "--bootstrap", "0", "--no-loo", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "source corpus_a" in result.output and "(reference)" in result.output
    fit = load_fit(out)
    assert abs(fit.params["E"] / 2.1 - 1) < 0.03                     # the reference source's irreducible loss
    assert abs(fit.metrics["sources"]["corpus_a"]["E"] / 1.7 - 1) < 0.03
    # mosaic4d on dense G = 1 runs: the terms they cannot see are flagged on the table
    result = CliRunner().invoke(app, ["fit", str(runs_csv(tmp_path)), "--starts", "4", "--bootstrap", "0", "--no-loo",
                                      "--holdout-top", "0"])
    assert result.exit_code == 0, result.output
    assert "NOT IDENTIFIED" in result.output and "not identified by these runs" in result.output

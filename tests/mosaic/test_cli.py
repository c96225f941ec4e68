"""`mosaic plan` and `mosaic sweep` end to end (in process, planted law unless the test says so)."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from mosaic.cli.app import app

runner = CliRunner()


def test_plan_json_and_plan_file(planted, space_file, tmp_path):
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "64", "--days", "5", "--space", space_file,
                              "--json", "--top", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert set(payload) >= {"model", "layout", "tokens", "predicted", "compute_optimal", "alternatives"}
    assert len(payload["alternatives"]) == 2
    plan = yaml.safe_load(out.read_text())
    assert plan["version"] == 1 and plan == payload  # --json prints the plan file's own mapping


def test_plan_tables_name_both_budgets_and_the_binding_constraint(planted, space_file):
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "64", "--hours", "48", "--space", space_file,
                              "--solver", "scip", "--no-progress"])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    for text in ("cluster-optimal", "compute-optimal", "binding constraint", "status optimal", "next best"):
        assert text in flat


def test_plan_bad_input_and_infeasible_exit_codes(planted, space_file, tmp_path):
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "4096", "--space", space_file])
    assert res.exit_code == 2 and "exceeds cluster 'h100' size 1024" in " ".join(res.output.split())
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--days", "5", "--hours", "3", "--space", space_file])
    assert res.exit_code == 2 and "give --days or --hours, not both" in res.output
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--solver", "gurobi", "--space", space_file])
    assert res.exit_code == 2 and "--solver 'gurobi' is unknown" in " ".join(res.output.split())
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--workers", "-1", "--space", space_file])
    flat = " ".join(res.output.split())
    assert res.exit_code == 2 and "Invalid value for '--workers'" in flat
    cluster = yaml.safe_load(open("perfmodel/clusters/h100.yaml").read())
    cluster["accelerator"]["hbm_usable_bytes"] = 3.5e9
    path = tmp_path / "small_hbm.yaml"
    path.write_text(yaml.safe_dump(cluster))
    res = runner.invoke(app, ["plan", "--cluster", str(path), "--devices", "64", "--space", space_file])
    assert res.exit_code == 1
    flat = " ".join(res.output.split())
    assert "memory binds" in flat and "nearest feasible relaxation" in flat


def test_sweep_writes_csv_and_png(planted, space_file, tmp_path):
    csv, png = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    res = runner.invoke(app, ["sweep", "--cluster", "h100", "--devices", "64", "--days", "5", "--space", space_file,
                              "--over", "granularity", "-o", str(csv), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("over,value") and len(lines) == 3  # G = 1 and 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    res = runner.invoke(app, ["sweep", "--cluster", "h100", "--over", "days", "--values", "a,b", "--space", space_file])
    assert res.exit_code == 2 and "--values" in res.output
    res = runner.invoke(app, ["sweep", "--cluster", "h100", "--over", "days", "--workers", "-2", "--space", space_file])
    flat = " ".join(res.output.split())
    assert res.exit_code == 2 and "Invalid value for '--workers'" in flat


def test_plan_with_the_bundled_fit_and_sensitivity(space_file):
    from scaling_fits import load_fit

    fit = load_fit(None)
    res = runner.invoke(app, ["plan", "--cluster", "ascend_superpod", "--devices", "128", "--space", space_file,
                              "--sensitivity", "--json", "--top", "2"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert payload["fit"] == {"name": fit.name, "hash": fit.content_hash()}
    changes = [r["change"] for r in payload["analysis"]["sensitivity"]]
    assert changes == ["budget x0.8", "budget x1.2", "bandwidth x0.8", "bandwidth x1.2", "hbm x0.8", "hbm x1.2"]
    boot = payload["analysis"]["bootstrap"]
    if fit.bootstrap_params is not None:
        assert 0.0 <= boot["p_beats_runner_up"] <= 1.0 and boot["samples"] == len(fit.bootstrap_params)
    else:
        assert boot["p_beats_runner_up"] is None


def test_the_default_output_states_the_decision_under_uncertainty(space_file):
    """The bundled fit (bootstrap) and the measured errors: the table and --json carry the decision."""
    args = ["plan", "--cluster", "b200", "--devices", "16", "--days", "2", "--space", space_file, "--top", "3"]
    res = runner.invoke(app, args + ["--no-progress"])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    for text in ("under uncertainty", "P best", "indistinguishable from the nominal best", "P(pick is best)", "rule:"):
        assert text in flat
    res = runner.invoke(app, args + ["--json"])
    payload = json.loads(res.stdout)
    d = payload["decision"]
    assert d["available"] and d["pick"] == "robust" and 0.0 <= d["p_chosen_is_best"] <= 1.0
    assert payload["predicted"]["decision"]["rank"] == d["chosen_rank"]
    assert all("p_best" in a["predicted"]["decision"] for a in payload["alternatives"])

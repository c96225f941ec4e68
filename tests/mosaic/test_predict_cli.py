"""`mosaic predict`: JSON contract, tables, plot, --layout best, errors and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mosaic.cli.app import app
from perfmodel import evaluate, load_cluster, parse_layout
from perfmodel.specs import MoEArchitecture
from perfmodel.specs.strict import load_spec

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"
MIXTRAL = str(MODELS / "mixtral_8x7b.yaml")
REQUIRED = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "tflops_per_device",
            "memory_per_device_bytes", "feasible", "reason", "breakdown")


def run(*args: str):
    return CliRunner().invoke(app, ["predict", *args])


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.glob("*.yaml")))
def test_example_models_load(name):
    arch = load_spec(MoEArchitecture, MODELS / name)
    assert arch.total_params() > 0


def test_json_has_the_contract_keys_and_matches_the_api():
    result = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "tp=2,ep=8,pp=4,mbs=1,gbs=1024,sp=true",
                 "--devices", "256", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    for key in REQUIRED:
        assert key in payload
    assert payload["feasible"] is True and payload["reason"] == "ok"
    assert payload["devices"] == 256 and payload["layout"]["dp"] == 32
    arch = load_spec(MoEArchitecture, MIXTRAL)
    expected = evaluate(arch, parse_layout("tp=2,ep=8,pp=4,mbs=1,gbs=1024,sp=true", devices=256),
                        load_cluster("h100")).row(0)
    assert payload["step_time_s"] == pytest.approx(expected["step_time_s"])
    assert payload["breakdown"]["bubble"] > 0


def test_table_and_plot(tmp_path):
    png = tmp_path / "breakdown.png"
    result = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "ep=8,pp=2,gbs=512", "--devices", "64",
                 "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert "where the step goes" in result.stdout and "expert_gemm" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name != "breakdown.png"]  # no temp files left


def test_dp_in_layout_sets_the_devices():
    result = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "ep=8,pp=4,dp=16,gbs=256", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["devices"] == 64
    clash = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "ep=8,pp=4,dp=16,gbs=256", "--devices", "32")
    assert clash.exit_code == 2 and "disagrees" in clash.output


def test_layout_best_prints_the_top_five(tmp_path):
    result = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "best", "--devices", "64", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    top = payload["top"]
    assert len(top) == 5
    speeds = [row["tokens_per_s"] for row in top]
    assert speeds == sorted(speeds, reverse=True)
    assert all(row["feasible"] for row in top)
    assert payload["search"]["candidates"] >= payload["search"]["feasible"] > 5
    table = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "best", "--devices", "64",
                "--plot", str(tmp_path / "best.png"))
    assert table.exit_code == 0 and "best layouts" in table.stdout
    assert (tmp_path / "best.png").exists()


def test_invalid_layout_exits_2_naming_the_rule():
    result = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "tp=1,ep=3,gbs=64", "--devices", "64")
    assert result.exit_code == 2
    assert "ep_divides_experts" in result.output and "error:" in result.output


def test_infeasible_layout_prints_then_exits_1():
    result = run("--cluster", "h100", "--model", MIXTRAL, "--layout", "mbs=8,gbs=64", "--devices", "8", "--json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["feasible"] is False and payload["reason"] == "memory"


@pytest.mark.parametrize("args, needle", [
    (("--layout", "tp=2", "--devices", "100000"), "exceeds cluster"),
    (("--layout", "tpp=2"), "unknown key 'tpp'"),
    (("--layout", "best", "--precision", "fp4"), "--precision"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    result = run("--cluster", "h100", "--model", MIXTRAL, *args)
    assert result.exit_code == 2
    assert needle in result.output


def test_model_file_errors(tmp_path):
    bad = tmp_path / "model.yaml"
    bad.write_text("version: 1\nn_layers: 2\n")
    result = run("--cluster", "h100", "--model", str(bad), "--layout", "tp=1")
    assert result.exit_code == 2 and "missing key" in result.output


@pytest.mark.parametrize("name", ["deepseek_v3_gb200_256", "qwen3_235b_b200_256", "kimi_k2_gb300_256",
                                  "olmoe2_large_h100_64"])
def test_frontier_plans_predict(name):
    """The example plans predict through --plan (their model, resolved layout, devices, cluster),
    feasibly, stating the resolved pipeline split."""
    import json

    result = run("--plan", f"examples/plans/{name}.yaml", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["feasible"] and data["devices"] in (64, 256)
    assert data["pipeline_split"].startswith("E") or data["layout"]["pp"] == 1
    params = data["model_card_params"]
    assert 0 < params["active"] < params["total"]
    if name == "deepseek_v3_gb200_256":  # "671B total, 37B activated" (arXiv 2412.19437)
        assert round(params["total"] / 1e9) == 671 and round(params["active"] / 1e9) == 37


def test_balanced_default_and_missing_dispatcher_in_the_cli():
    import json

    result = run("--cluster", "h100", "--model", "examples/models/deepseek_v3.yaml", "--layout", "pp=8,ep=8,recompute=full",
                 "--devices", "256", "--json")
    split = json.loads(result.stdout)["pipeline_split"]
    assert split == "Et*6|(t*8|)*6t*7mL (balanced: pp*vpp=8 does not divide n_layers=61)"
    bad = run("--cluster", "h100", "--model", "examples/models/deepseek_v3.yaml", "--layout", "ep=8,dispatcher=deepep",
              "--devices", "8")
    assert bad.exit_code == 2 and "dispatcher=deepep" in bad.output and len(bad.output.strip().splitlines()) == 1

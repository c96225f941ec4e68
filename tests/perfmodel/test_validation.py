"""`perfmodel.validation` and `mosaic validate`: strict runs CSV, measure conversion, APE."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

import perfmodel.validation as validation
from mosaic.cli.app import app
from perfmodel.clusters import bundled_cluster_paths, load_cluster
from perfmodel.errors import InputError
from perfmodel.specs.architecture import model_flops_per_token
from perfmodel.validation import (
    MEASURES,
    REQUIRED_COLUMNS,
    bundled_runs_path,
    compare,
    load_runs,
    measured_step_time_s,
    parse_cluster_map,
    resolve_clusters,
    summarize,
    validate_runs,
)

# A small MoE on 8 H100s: 2 layers, 8 experts top-2, ep 4 carved out of dp 4 (tp 2).
BASE_ROW = {
    "run_id": "tiny", "cluster": "h100", "devices": "8", "model": "tiny moe",
    "n_layers": "2", "d_model": "512", "n_heads": "8", "n_kv_heads": "4", "head_dim": "64", "vocab_size": "1000",
    "seq_len": "1024", "n_experts": "8", "top_k": "2", "n_shared_experts": "0", "d_expert": "256", "d_ff_dense": "0",
    "n_dense_layers": "0", "ffn_ratio": "4.0", "gated_ffn": "true", "tie_embeddings": "false",
    "tp": "2", "pp": "1", "vpp": "1", "ep": "4", "etp": "1", "cp": "1", "dp_flavor": "zero1", "mbs": "2", "gbs": "32",
    "recompute": "none", "sequence_parallel": "true", "precision": "bf16",
    "measure": "step_time_s", "value": "2.0", "source": "test", "notes": "synthetic",
}


def write_runs(path: Path, rows: list[dict[str, str]], columns: list[str] | None = None) -> Path:
    columns = columns or list(rows[0])
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return path


def row(**changes: str) -> dict[str, str]:
    return {**BASE_ROW, **changes}


class FakeResult(SimpleNamespace):
    pass


def fake_evaluate_factory(factor: float = 0.5, infeasible: dict[int, str] | None = None):
    """A stand-in for perfmodel.evaluate: step time = model FLOPs / (devices * factor * peak).

    `infeasible` maps a row index to the reason code (an index into perfmodel.evaluate.REASONS).
    """
    from perfmodel.evaluate import REASONS
    infeasible = infeasible or {}
    calls = []

    def evaluate(archs, layouts, cluster, devices=None):
        calls.append((len(archs), cluster.name))
        precision = ["fp32", "bf16", "fp16", "fp8", "mxfp8"]
        peak = np.asarray([cluster.accelerator.peak(precision[int(code)]) for code in layouts.precision])
        tokens = layouts.gbs * archs.seq_len
        step = tokens * model_flops_per_token(archs) / (devices * factor * peak)
        reason = np.zeros(len(archs), dtype=np.int64)
        for index, name in infeasible.items():
            reason[index] = REASONS.index(name)
        feasible = reason == 0
        tps = tokens / (step * devices)
        return FakeResult(step_time_s=step, tokens_per_s=tps * devices, tokens_per_s_per_device=tps,
                          mfu=np.full(len(archs), factor), feasible=feasible, reason=reason,
                          memory_per_device_bytes=np.full(len(archs), 1e9))

    evaluate.calls = calls
    return evaluate


# --- the bundled CSV -----------------------------------------------------------------------

def test_bundled_runs_load_with_sources_and_known_clusters():
    runs = load_runs(bundled_runs_path())
    assert len(runs) >= 10
    assert len({r.run_id for r in runs}) == len(runs)
    bundled = set(bundled_cluster_paths())
    assert {r.cluster for r in runs} <= bundled
    assert all(r.source.strip() for r in runs)
    assert any(r.arch.n_experts > 0 for r in runs) and any(r.arch.n_experts == 0 for r in runs)
    clusters = resolve_clusters(runs)
    for run in runs:
        step = measured_step_time_s(run, clusters[run.cluster])
        assert math.isfinite(step) and step > 0
        assert run.layout.world() == run.devices


def test_bundled_measured_mfu_is_physical():
    """A published run cannot exceed the accelerator's peak: measured MFU (our convention) in (0, 1)."""
    runs = load_runs(bundled_runs_path())
    clusters = resolve_clusters(runs)
    frame = compare(runs, clusters, evaluate=fake_evaluate_factory())
    assert frame["measured_mfu"].between(0.0, 1.0, inclusive="neither").all()


# --- measure conversion --------------------------------------------------------------------

@pytest.mark.parametrize("measure", MEASURES)
def test_every_measure_converts_back_to_the_same_step_time(tmp_path, measure):
    step_s = 2.0
    base = load_runs(write_runs(tmp_path / "base.csv", [row()]))[0]
    cluster = load_cluster("h100")
    tokens = 32 * 1024
    flops = float(model_flops_per_token(base.arch))
    value = {
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / 8,
        "tflops_per_device": tokens * flops / step_s / 8 / 1e12,
        "mfu": tokens * flops / step_s / 8 / cluster.accelerator.peak("bf16"),
    }[measure]
    run = load_runs(write_runs(tmp_path / "r.csv", [row(measure=measure, value=repr(value))]))[0]
    assert measured_step_time_s(run, cluster) == pytest.approx(step_s, rel=1e-12)


# --- comparison and summary ----------------------------------------------------------------

def test_ape_and_summary_follow_their_definitions(tmp_path):
    rows = [row(run_id="a", value="2.0"), row(run_id="b", value="5.0", gbs="64"), row(run_id="c", value="1.0"),
            row(run_id="d", value="3.0")]
    runs = load_runs(write_runs(tmp_path / "r.csv", rows))
    clusters = resolve_clusters(runs)
    evaluate = fake_evaluate_factory(infeasible={2: "memory", 3: "invalid_layout"})
    frame = compare(runs, clusters, evaluate=evaluate)
    assert evaluate.calls == [(4, "h100")]  # one vectorised call per cluster
    assert list(frame["run_id"]) == ["a", "b", "c", "d"]
    predicted = frame["predicted_step_time_s"].to_numpy()
    measured = np.array([2.0, 5.0, 1.0, 3.0])
    np.testing.assert_allclose(frame["measured_step_time_s"], measured)
    # a memory-infeasible run still has a step-time prediction and is scored; an invalid layout is not
    expected_ape = np.abs(predicted[:3] - measured[:3]) / measured[:3]
    np.testing.assert_allclose(frame["ape"].to_numpy()[:3], expected_ape)
    assert list(frame["reason"]) == ["", "", "memory", "invalid_layout"]
    assert math.isnan(frame["ape"][3]) and math.isnan(predicted[3])
    summary = summarize(frame)
    assert summary["compared"] == 3 and summary["runs"] == 4
    assert summary["predicted_infeasible"] == {"c": "memory", "d": "invalid_layout"}
    assert summary["unscored"] == ["d"]
    assert summary["mean_ape_pct"] == pytest.approx(100 * expected_ape.mean())
    assert summary["max_ape_pct"] == pytest.approx(100 * expected_ape.max())
    assert summary["worst_run_id"] == ["a", "b", "c"][int(np.argmax(expected_ape))]


def test_perfect_predictions_give_zero_error(tmp_path):
    runs = load_runs(write_runs(tmp_path / "r.csv", [row()]))
    clusters = resolve_clusters(runs)
    evaluate = fake_evaluate_factory()
    predicted = float(evaluate(*_batches(runs), clusters["h100"], devices=np.array([8])).step_time_s[0])
    write_runs(tmp_path / "r2.csv", [row(value=repr(predicted))])
    _, summary = validate_runs(tmp_path / "r2.csv", evaluate=evaluate)
    assert summary["mean_ape_pct"] == pytest.approx(0.0, abs=1e-9)
    assert summary["max_ape_pct"] == pytest.approx(0.0, abs=1e-9)


def _batches(runs):
    from perfmodel.specs.architecture import ArchBatch
    from perfmodel.specs.layout import LayoutBatch
    return ArchBatch.stack([r.arch for r in runs]), LayoutBatch.stack([r.layout for r in runs])


# --- strict loading: every bad input is one InputError naming line and column ---------------

BAD_ROWS = [
    ({"tp": "two"}, "line 2 (run_id 'tiny'), column 'tp': expected an integer"),
    ({"value": "nan"}, "column 'value': 'nan' is not a finite number"),
    ({"value": ""}, "column 'value': is empty"),
    ({"value": "-3"}, "column 'value': -3.0 must be > 0"),
    ({"measure": "mfu", "value": "1.5"}, "must be in (0, 1] for measure mfu"),
    ({"measure": "flops"}, "column 'measure': 'flops' is unknown"),
    ({"gated_ffn": "maybe"}, "column 'gated_ffn': expected true or false"),
    ({"cluster": "h1000"}, "column 'cluster': cluster 'h1000' is neither a file nor a bundled cluster"),
    ({"tp": "3"}, "layout: key 'dp': devices=8 is not a multiple of tp*cp*pp=3"),
    ({"n_heads": "6", "n_kv_heads": "3"}, "invalid layout: tp_divides_heads"),
    ({"ep": "3"}, "ep_divides_experts"),
    ({"top_k": "9"}, "model geometry: key 'top_k'"),
    ({"recompute": "some"}, "layout: key 'recompute'"),
    ({"precision": "fp8", "cluster": "a100_80gb"}, "column 'precision': accelerator"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_ROWS, ids=[m.split(":")[0][:40] for _, m in BAD_ROWS])
def test_bad_rows_raise_one_input_error_naming_the_place(tmp_path, changes, message):
    path = write_runs(tmp_path / "runs.csv", [row(**changes)])
    with pytest.raises(InputError) as info:
        runs = load_runs(path)
        resolve_clusters(runs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_and_unknown_columns_are_named(tmp_path):
    columns = [c for c in BASE_ROW if c != "head_dim"]
    with pytest.raises(InputError, match="missing column 'head_dim'"):
        load_runs(write_runs(tmp_path / "a.csv", [row()], columns))
    renamed = {("n_layer" if k == "n_layers" else k): v for k, v in BASE_ROW.items()}
    with pytest.raises(InputError, match="unknown column 'n_layer'; did you mean 'n_layers'"):
        load_runs(write_runs(tmp_path / "b.csv", [renamed]))


def test_duplicate_ids_extra_cells_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="run_id 'tiny' repeats line 2"):
        load_runs(write_runs(tmp_path / "a.csv", [row(), row()]))
    path = write_runs(tmp_path / "b.csv", [row()])
    path.write_text(path.read_text().rstrip("\n") + ",extra\n")
    with pytest.raises(InputError, match="more cells than the header"):
        load_runs(path)
    (tmp_path / "c.csv").write_text("")
    with pytest.raises(InputError, match="the file is empty"):
        load_runs(tmp_path / "c.csv")
    (tmp_path / "d.csv").write_text(",".join(BASE_ROW) + "\n")
    with pytest.raises(InputError, match="no runs"):
        load_runs(tmp_path / "d.csv")
    with pytest.raises(InputError, match="does not exist"):
        load_runs(tmp_path / "missing.csv")


def test_columns_cover_every_spec_field():
    """Core fields are required; the optional groups (MLA, MTP, split, dispatch) may be left out."""
    from perfmodel.specs.architecture import ARCH_FIELDS, CORE_ARCH_FIELDS
    from perfmodel.specs.layout import CORE_LAYOUT_FIELDS, LAYOUT_FIELDS
    from perfmodel.validation import KNOWN_COLUMNS
    assert set(CORE_ARCH_FIELDS) <= set(REQUIRED_COLUMNS)
    assert set(CORE_LAYOUT_FIELDS) - {"dp"} <= set(REQUIRED_COLUMNS)
    assert set(ARCH_FIELDS) | set(LAYOUT_FIELDS) <= set(KNOWN_COLUMNS)
    from perfmodel.specs.layout import OVERLAP_FIELDS
    from perfmodel.validation import OPTIONAL_COLUMNS
    assert set(OVERLAP_FIELDS) <= set(OPTIONAL_COLUMNS)  # the overlap switches default to off (Megatron-Core's)


def test_optional_dp_column_is_checked_against_devices(tmp_path):
    columns = list(BASE_ROW) + ["dp"]
    assert load_runs(write_runs(tmp_path / "a.csv", [row(dp="4")], columns))[0].layout.dp == 4
    with pytest.raises(InputError, match="world_matches"):
        load_runs(write_runs(tmp_path / "b.csv", [row(dp="2")], columns))


# --- cluster map -------------------------------------------------------------------------

def test_cluster_map_parsing():
    assert parse_cluster_map("h100=site.yaml, b200 = b200") == {"h100": "site.yaml", "b200": "b200"}
    assert parse_cluster_map(None) == {}
    for bad, message in (("h100", "not name=cluster"), ("h100=", "needs a name"), ("a=b,a=c", "mapped twice")):
        with pytest.raises(InputError, match=message):
            parse_cluster_map(bad)


def test_cluster_map_loads_the_mapped_file(tmp_path):
    site = tmp_path / "site_h100.yaml"
    text = bundled_cluster_paths()["h100"].read_text()
    site.write_text(text.replace("name: h100", "name: site_h100", 1))
    runs = load_runs(write_runs(tmp_path / "r.csv", [row()]))
    clusters = resolve_clusters(runs, {"h100": str(site)})
    assert clusters["h100"].name == "site_h100"
    with pytest.raises(InputError, match="'b200' is not a cluster of any run"):
        resolve_clusters(runs, {"b200": "b200"})
    with pytest.raises(InputError, match="line 2 \\(run_id 'tiny'\\), column 'cluster'"):
        resolve_clusters(runs, {"h100": str(tmp_path / "nope.yaml")})


# --- CLI ---------------------------------------------------------------------------------

@pytest.fixture
def fake_model(monkeypatch):
    monkeypatch.setattr(validation, "_default_evaluate", lambda: fake_evaluate_factory(infeasible={1: "invalid_layout"}))


def test_cli_prints_table_and_summary_line(tmp_path, fake_model):
    path = write_runs(tmp_path / "r.csv", [row(run_id="a"), row(run_id="b", value="4.0")])
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "mean APE:" in result.output and "max APE:" in result.output
    assert "predicted infeasible" in result.output and "unscored" in result.output


def test_cli_json_matches_library(tmp_path, fake_model):
    path = write_runs(tmp_path / "r.csv", [row(run_id="a"), row(run_id="b", value="4.0"), row(run_id="c", value="1.0")])
    result = CliRunner().invoke(app, ["validate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    _, summary = validate_runs(path, evaluate=fake_evaluate_factory(infeasible={1: "invalid_layout"}))
    assert payload["summary"] == summary
    assert [r["run_id"] for r in payload["rows"]] == ["a", "b", "c"]
    assert payload["rows"][1]["ape"] is None and payload["rows"][1]["feasible"] is False


def test_cli_bad_csv_exits_2_with_one_line(tmp_path, fake_model):
    path = write_runs(tmp_path / "r.csv", [row(value="nan")])
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "column 'value'" in lines[0]
    result = CliRunner().invoke(app, ["validate", str(path), "--cluster-map", "h100"])
    assert result.exit_code == 2 and "error:" in result.output


# --- the real model on the bundled runs ------------------------------------------------------

def test_real_model_scores_every_bundled_run():
    """Every published run gets a finite, positive step-time prediction from perfmodel.evaluate,
    except those whose fused dispatcher the cluster has no measured figures for (listed apart)."""
    from perfmodel.clusters import load_cluster
    from perfmodel.dispatch import dispatcher_problem

    runs = {run.run_id: run for run in load_runs(bundled_runs_path())}
    frame, summary = validate_runs(bundled_runs_path())
    unpriced = [r for r, run in runs.items() if dispatcher_problem(load_cluster(run.cluster), run.layout)]
    assert summary["unscored"] == unpriced
    assert set(frame.loc[frame["run_id"].isin(unpriced), "reason"]) <= {"dispatcher"}
    frame = frame[~frame["run_id"].isin(unpriced)]
    assert summary["compared"] == summary["runs"] - len(unpriced) == len(frame)
    assert (frame["predicted_step_time_s"] > 0).all() and np.isfinite(frame["predicted_step_time_s"]).all()
    assert 0 <= summary["median_ape_pct"] <= summary["max_ape_pct"]
    assert summary["mean_ape_pct"] == pytest.approx(100 * frame["ape"].mean())
    assert frame["predicted_mfu"].between(0.0, 1.0, inclusive="neither").all()

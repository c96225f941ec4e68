"""benchmarks/fidelity.py end to end on a reduced set: 2 single-rank configurations, 2 rounds of 3 steps.

Checks that the pipeline runs (predict, train, compare, refit) and writes its JSON, PNG and
last lines; the error figures themselves are the benchmark's business (docs/validation.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="the fidelity benchmark trains with the bundled trainer (extra `train`)")

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fidelity", REPO / "benchmarks" / "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)


def test_reduced_fidelity_run_writes_json_png_and_last_lines(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fidelity.py"), "--device", "cpu", "--configs", "smoke", "--steps", "6", "--rounds", "2", "--round-seconds", "0.3",
         "--cluster", "cpu_local", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"MAPE before refit: \d+(\.\d+)?%", lines[-2]), lines[-2:]
    assert re.fullmatch(r"MAPE after refit \(leave-one-out\): \d+(\.\d+)?%", lines[-1]), lines[-2:]

    result = json.loads((tmp_path / "fidelity_cpu.json").read_text())
    names = [row["name"] for row in result["configs"]]
    assert names == ["moe_1r_mbs2", "dense_1r_mbs2"]
    for row in result["configs"]:
        assert row["measured_step_time_s"] > 0 and row["predicted_s"] > 0
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_step_time_s"] - 1.0)
        assert row["steps_used"] >= 2
        assert row["predicted_loo_s"] is not None and row["predicted_loo_s"] > 0
    errors = [abs(row["error"]) for row in result["configs"]]
    assert result["mape_before"] == pytest.approx(sum(errors) / len(errors))
    assert result["max_abs_error_before"] == pytest.approx(max(errors))
    assert -1.0 <= result["kendall_tau_before"] <= 1.0
    # the printed figures are the JSON's
    assert lines[-2] == f"MAPE before refit: {result['mape_before'] * 100:.1f}%"
    assert lines[-1] == f"MAPE after refit (leave-one-out): {result['mape_after_loo'] * 100:.1f}%"
    # the host-bound figures were probed before each of the 2 x 2 runs and after the last, and used
    probes = result["drift_probes"]
    assert [p["before"] for p in probes] == ["moe_1r_mbs2", "dense_1r_mbs2"] * 2 + [None]
    for key in ("launch_latency_s", "dtensor_op_latency_s"):
        samples = [p[key] for p in probes]
        assert min(samples) > 0
        assert result["host_figures_s"][key]["used"] == pytest.approx(np.mean(samples), rel=1e-3)
    assert all(p["gemm_flops_per_s"] > 1e8 for p in probes)
    for row in result["configs"]:
        assert row["error_calibrated"] == pytest.approx(row["predicted_calibrated_s"] / row["measured_step_time_s"] - 1.0)
    assert result["mape_before_calibration_alone"] == pytest.approx(
        np.mean([abs(row["error_calibrated"]) for row in result["configs"]]))
    # two rounds pooled into one run folder: 3 steps, then steps for about 0.3 s at the first
    # round's median (at least 3), the second without its warm-up steps; steps numbered on
    for row in result["configs"]:
        metrics = [json.loads(line) for line in
                   (tmp_path / "fidelity_cpu" / "runs" / row["name"] / "metrics.jsonl").read_text().splitlines()]
        first = [m["step_time_s"] for m in metrics if "round" not in m]
        assert len(first) == 3
        second = fidelity.steps_for_seconds(float(np.median(first[1:])), 3, 0.3)  # first round less its warm-up
        kept = 3 + second - fidelity.ROUND_WARMUP_STEPS
        assert [m["step"] for m in metrics] == list(range(1, kept + 1))
        assert [m.get("round", 0) for m in metrics] == [0] * 3 + [1] * (kept - 3)
        assert row["steps_used"] == kept - 1  # the first process's first step is warm-up, the rest pooled
    assert not list((tmp_path / "fidelity_cpu" / "runs").glob("*.round*"))
    assert len(result["load_average_before"]) == 3
    # one mean per round (round 0 without its first step), and their disagreement; the measured
    # step time is the mean of both rounds pooled
    for row in result["configs"]:
        times = [json.loads(line)["step_time_s"] for line in
                 (tmp_path / "fidelity_cpu" / "runs" / row["name"] / "metrics.jsonl").read_text().splitlines()]
        assert row["round_means_s"] == pytest.approx([float(np.mean(times[1:3])), float(np.mean(times[3:]))])
        assert row["round_spread"] == pytest.approx(max(row["round_means_s"]) / min(row["round_means_s"]))
        assert row["measured_step_time_s"] == pytest.approx(float(np.mean(times[1:])))
    assert result["median_round_spread"] >= 1.0
    for row in result["configs"]:  # 2 rounds: a standard error, 0 only if both rounds had one mean
        assert row["measured_relative_se"] >= 0.0
    assert result["noise_floor_mape"] == pytest.approx(
        np.sqrt(2 / np.pi) * np.mean([row["measured_relative_se"] for row in result["configs"]]))

    png = tmp_path / "fidelity_cpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refit = tmp_path / "fidelity_cpu" / "refit.yaml"
    assert "from_runs" in refit.read_text()


def test_bootstrap_standard_error_of_the_pooled_mean_follows_the_rounds_disagreement() -> None:
    same = [[1.0, 1.0, 1.0]] * 4
    assert fidelity.bootstrap_relative_se(same) == 0.0
    assert np.isnan(fidelity.bootstrap_relative_se([[1.0, 2.0, 3.0]]))  # one round: no estimate
    close = [[1.00, 1.01, 0.99], [1.05, 1.04, 1.06], [0.97, 0.96, 0.98], [1.02, 1.01, 1.03]]
    apart = [[1.0, 1.01, 0.99], [1.5, 1.49, 1.51], [0.7, 0.71, 0.69], [1.2, 1.21, 1.19]]
    se_close, se_apart = fidelity.bootstrap_relative_se(close), fidelity.bootstrap_relative_se(apart)
    assert 0.0 < se_close < se_apart
    assert 0.005 < se_close < 0.05  # rounds about 3% apart: a pooled mean good to a few percent
    assert fidelity.bootstrap_relative_se(close) == se_close  # seeded: the report is reproducible


def test_rounds_step_for_the_seconds_asked_within_bounds() -> None:
    warm = fidelity.ROUND_WARMUP_STEPS
    assert fidelity.steps_for_seconds(0.02, 12, 2.0) == 100 + warm
    assert fidelity.steps_for_seconds(0.5, 12, 2.0) == 12  # slow steps: the --steps share is the floor
    assert fidelity.steps_for_seconds(1e-6, 12, 2.0) == fidelity.MAX_STEPS_PER_ROUND
    assert fidelity.steps_for_seconds(float("nan"), 12, 2.0) == 12
    assert fidelity.steps_for_seconds(0.02, 12, 0.0) == 12  # --round-seconds 0: the plain split


def test_drift_probes_replace_the_host_figures_and_scale_the_rest(tmp_path: Path) -> None:
    from perfmodel.clusters import load_cluster

    base = load_cluster("cpu_local").accelerator
    flops = 2.0 * fidelity.PROBE_GEMM_SIZE ** 3
    calibrated_rate = base.peak("fp32") * float(base.compute_curve("fp32")(flops))
    # the means: per-op costs twice the calibrated, GEMM rate half (the medians: 1.5x and 1/4)
    probes = [{"launch_latency_s": base.launch_latency_s * r, "dtensor_op_latency_s": 1e-4 * r,
               "gemm_flops_per_s": calibrated_rate * g} for r, g in ((1.0, 0.25), (1.5, 0.25), (3.5, 1.0))]
    used = load_cluster(str(fidelity.interleaved_cluster(Path("cpu_local"), probes, tmp_path))).accelerator
    assert used.launch_latency_s == pytest.approx(2 * base.launch_latency_s, rel=1e-3)
    assert used.dtensor_op_latency_s == pytest.approx(2e-4, rel=1e-3)
    assert used.checkpoint_region_latency_s == pytest.approx(2 * base.checkpoint_region_latency_s, rel=1e-3)
    assert used.checkpoint_saved_tensor_latency_s == pytest.approx(2 * base.checkpoint_saved_tensor_latency_s, rel=1e-3)
    assert used.compute_efficiency["fp32"].values == pytest.approx(
        [v / 2 for v in base.compute_efficiency["fp32"].values], rel=1e-3)
    assert used.compute_efficiency["bf16"].values == base.compute_efficiency["bf16"].values  # not probed
    assert "drift probes" in used.sources["dtensor_op_latency_s"]


def test_collective_probes_scale_the_fabric_latencies_to_what_they_timed(tmp_path: Path) -> None:
    """The probes' mean, k times the model's own time for the probed all-reduce, makes the model
    price that all-reduce at k times (latencies and sync scaled, bandwidth kept)."""
    from perfmodel.clusters import load_cluster
    from perfmodel.comm import collective_time

    base = load_cluster("cpu_local")
    size = fidelity.PROBE_COLLECTIVE_BYTES
    modelled = float(collective_time(base, "all_reduce", size, 2, 1))
    probes = (1.5 * modelled, 2.5 * modelled)  # mean: twice the modelled time
    host = [{"launch_latency_s": base.accelerator.launch_latency_s, "dtensor_op_latency_s": 1e-4,
             "gemm_flops_per_s": base.accelerator.peak("fp32")}]
    used = load_cluster(str(fidelity.interleaved_cluster(Path("cpu_local"), host, tmp_path, probes)))
    assert float(collective_time(used, "all_reduce", size, 2, 1)) == pytest.approx(2 * modelled, rel=2e-3)
    ratio = fidelity.collective_latency_ratio(base, 2 * modelled)
    for before, after in zip(base.levels, used.levels):
        assert after.latency_s == pytest.approx(before.latency_s * ratio, rel=1e-3)
        assert after.sync_latency_s == pytest.approx(before.sync_latency_s * ratio, rel=1e-3)
        assert after.bandwidth_bytes_per_s == before.bandwidth_bytes_per_s
        assert "collective probes" in after.source
    # a probe faster than the bytes alone allow is floored at the refit's lower bound, not negative
    assert fidelity.collective_latency_ratio(base, 1e-9) == pytest.approx(0.1)
    no_probe = load_cluster(str(fidelity.interleaved_cluster(Path("cpu_local"), host, tmp_path)))
    assert [lv.latency_s for lv in no_probe.levels] == [lv.latency_s for lv in base.levels]


def test_collective_probe_times_a_two_rank_all_reduce(tmp_path: Path) -> None:
    seconds = fidelity.collective_probe(tmp_path)
    assert seconds is not None and 1e-6 < seconds < 1.0
    rows = (tmp_path / "collectives.partial.csv").read_text().splitlines()
    assert len(rows) == 3  # header, back to back, after compute: one kind, one size
    assert all(f",{fidelity.PROBE_COLLECTIVE_BYTES}.0," in row for row in rows[1:])


def test_calibrations_before_and_after_the_runs_merge_by_geometric_mean(tmp_path: Path) -> None:
    import yaml

    from perfmodel.clusters import load_cluster, resolve_cluster_path

    merge = fidelity.geometric_mean_figures
    assert merge(2.0, 8.0) == 4.0 and merge(0.0, 2.0) == 1.0 and merge(3, 3) == 3
    assert merge([1.0, 4.0], [4.0, 1.0]) == [2.0, 2.0]
    assert merge("a", "b") == "a" and merge(True, False) is True
    curve = {"sizes": [1.0, 2.0], "values": [0.2, 0.8]}
    assert merge(curve, {"sizes": [1.0, 3.0], "values": [0.8, 0.2]}) == curve  # other knots: kept, not mixed
    before = yaml.safe_load(resolve_cluster_path("cpu_local").read_text())
    after = yaml.safe_load(resolve_cluster_path("cpu_local").read_text())
    after["accelerator"]["launch_latency_s"] = before["accelerator"]["launch_latency_s"] * 4
    after["levels"][0]["latency_s"] = before["levels"][0]["latency_s"] / 4
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(before))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(after))
    merged = load_cluster(str(fidelity.bracketed_cluster(tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path)))
    assert merged.accelerator.launch_latency_s == pytest.approx(2 * before["accelerator"]["launch_latency_s"], rel=1e-3)
    assert merged.levels[0].latency_s == pytest.approx(before["levels"][0]["latency_s"] / 2, rel=1e-3)
    assert merged.accelerator.compute_efficiency["fp32"].values == pytest.approx(
        before["accelerator"]["compute_efficiency"]["fp32"]["values"])
    assert "geometric mean" in merged.calibration["bracketed"]


@pytest.mark.parametrize("args, message", [
    (["--configs", "nope"], "unknown nope"),
    (["--recalibrate"], "drop --cluster"),  # a given cluster file cannot be calibrated twice
    (["--round-seconds", "nan"], "need a number >= 0"),
    (["--probe-collectives", "--no-interleave"], "drop one of them"),  # nothing to scale: refused, not ignored
])
def test_bad_arguments_are_refused_before_any_run(tmp_path: Path, args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fidelity.py"), *args,
                           "--cluster", "cpu_local", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr and args[0] in done.stderr
    assert not (tmp_path / "fidelity_cpu").exists()

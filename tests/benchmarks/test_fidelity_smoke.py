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


def test_an_accelerator_this_machine_lacks_is_refused_before_any_run(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fidelity.py"), "--device", "cuda",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--device cuda: torch sees no CUDA device" in done.stderr
    assert not list(tmp_path.iterdir())

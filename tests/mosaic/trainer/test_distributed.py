"""Multi-process runs under torchrun (cpu, gloo, fp32): parity, learning, kill -9 and resume.

Each launch costs seconds of interpreter start-up, so the runs are shared: one
single-process reference per router, one run per parallel layout, and the
kill/resume pair reuses the uninterrupted ep=2 run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")

pytestmark = pytest.mark.slow

STEPS = 8
PARITY_STEPS = 5
LAYOUTS = {
    # name: (layout, router)    world = dp; ep carved out of dp (parallel folding)
    "ref_softmax": ("dp=1,mbs=2,gbs=8", "softmax"),
    "ref_sigmoid": ("dp=1,mbs=2,gbs=8", "sigmoid"),
    "dp2_ddp": ("dp=2,mbs=2,gbs=8,dp_flavor=ddp", "softmax"),
    "ep2_zero1": ("dp=2,ep=2,mbs=2,gbs=8,dp_flavor=zero1", "softmax"),  # edp = 1
    "dp2xep2_fsdp": ("dp=4,ep=2,mbs=2,gbs=8,dp_flavor=fsdp", "sigmoid"),  # edp = 2
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cli, tiny_model_file):
    root = tmp_path_factory.mktemp("runs")
    outs = {}
    for name, (layout, router) in LAYOUTS.items():
        out = root / name
        cli("--model", str(tiny_model_file), "--layout", layout, "--router", router, "--steps", str(STEPS),
            "--checkpoint-every", "3", "--out", str(out))
        outs[name] = out
    return outs


@pytest.mark.parametrize("name,reference", [
    ("dp2_ddp", "ref_softmax"), ("ep2_zero1", "ref_softmax"), ("dp2xep2_fsdp", "ref_sigmoid"),
])
def test_parallel_layouts_match_the_single_process_run(runs, cli, name, reference):
    parallel = cli.losses(runs[name])[:PARITY_STEPS]
    single = cli.losses(runs[reference])[:PARITY_STEPS]
    assert len(parallel) == PARITY_STEPS
    np.testing.assert_allclose(parallel, single, rtol=1e-5, atol=0)


def test_loss_decreases_and_metrics_have_the_calibration_keys(runs, cli):
    losses = cli.losses(runs["ref_softmax"])
    assert losses[-1] < losses[0] - 0.3, losses
    rows = [json.loads(line) for line in (runs["dp2xep2_fsdp"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    keys = ["step", "loss", "aux_loss", "tokens_per_s", "step_time_s", "mfu", "mfu_palm", "tflops_per_device",
            "peak_memory_bytes", "expert_imbalance", "val_loss"]
    for row in rows:
        assert list(row) == keys
        assert row["tokens_per_s"] == pytest.approx(8 * 16 / row["step_time_s"])
        assert 0 < row["mfu"] < 1 and row["peak_memory_bytes"] > 0 and row["expert_imbalance"] >= 1


def test_run_yaml_records_the_resolved_run(runs):
    import yaml

    run = yaml.safe_load((runs["dp2xep2_fsdp"] / "run.yaml").read_text())
    assert run["version"] == 1 and run["world_size"] == 4 and run["device"] == "cpu" and run["cluster"] == "cpu_local"
    assert run["layout"]["ep"] == 2 and run["layout"]["dp"] == 4 and run["layout"]["dp_flavor"] == "fsdp"
    assert run["model"]["n_experts"] == 4 and set(run["versions"]) >= {"mosaic", "torch", "python"}


def test_kill_minus_nine_then_resume_continues_the_same_losses(runs, cli, tiny_model_file, tmp_path):
    layout, router = LAYOUTS["ep2_zero1"]
    out = tmp_path / "killed"
    args = ["--model", str(tiny_model_file), "--layout", layout, "--router", router, "--steps", str(STEPS),
            "--checkpoint-every", "3", "--out", str(out)]
    # rank 1 SIGKILLs itself as step 8 starts: checkpoint 6 is the newest complete one
    killed = cli(*args, env={"MOSAIC_TRAINER_FAULT": "1:8"}, check=False)
    assert killed.returncode == 1 and "training failed" in killed.stderr
    assert len(cli.losses(out)) == 7
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["step_00000003", "step_00000006"]
    cli(*args, "--resume")
    resumed = cli.losses(out)
    uninterrupted = cli.losses(runs["ep2_zero1"])
    assert len(resumed) == STEPS
    np.testing.assert_allclose(resumed, uninterrupted, rtol=0, atol=1e-6)

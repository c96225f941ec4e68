"""What a run on an accelerator needs of the training loop, checked on cpu: the step clock waits for
the device, the model is created on the run's device, a throughput run can save no checkpoint, and
a bf16-autocast run trains its routed experts in bf16."""

from __future__ import annotations

import math
import os
import time

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")

from typer.testing import CliRunner  # noqa: E402

from mosaic.cli.app import app  # noqa: E402
from mosaic.trainer.config import RunConfig, TrainOptions  # noqa: E402
from perfmodel.errors import InputError  # noqa: E402
from perfmodel.specs.layout import parse_layout  # noqa: E402


@pytest.fixture
def restored_environment():
    """`run` sets RANK/WORLD_SIZE/MASTER_* for a one-process group; later tests must not see them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _config(tiny_arch, out, **train) -> RunConfig:
    layout = parse_layout("dp=1,mbs=2,gbs=4,precision=fp32")
    return RunConfig(model=tiny_arch, layout=layout, cluster="cpu_local", device="cpu", world_size=1, precision="fp32",
                     out_dir=str(out), train=TrainOptions(progress=False, **train))


def test_the_step_clock_is_read_after_the_device_finished_the_step(tmp_path, monkeypatch, tiny_arch,
                                                                   restored_environment):
    """cuda and npu kernels run after the host returns: a step's time read before a synchronize
    leaves out its queued backward and optimizer. A stand-in synchronize that moves the trainer's
    clock on by 1000 s shows whether it ran inside each step's timed span."""
    import mosaic.trainer.train as train

    offset = [0.0]

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + offset[0]

    devices = []

    def synchronize(device: torch.device) -> None:
        devices.append(device.type)
        offset[0] += 1000.0

    monkeypatch.setattr(train, "time", Clock)
    monkeypatch.setattr(train, "synchronize", synchronize)
    rows = train.run(_config(tiny_arch, tmp_path / "run", steps=3, checkpoint=False))
    assert devices == ["cpu"] * 3  # once per step
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["step_time_s"] >= 1000.0 for row in rows)
    assert not (tmp_path / "run" / "checkpoints").exists()  # checkpoint=False: none, not even at the end
    assert (tmp_path / "run" / "summary.json").is_file()


def test_the_model_is_created_on_the_run_device(tiny_arch):
    """On the run's device, not on the host and copied (the host fills a few billion weights in minutes)."""
    from mosaic.trainer.train import build_model

    model = build_model(tiny_arch, TrainOptions(), torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert {moe.load_E.device.type for moe in model.moe_layers()} == {"meta"}
    host = build_model(tiny_arch, TrainOptions(), torch.device("cpu"))
    assert {p.device.type for p in host.parameters()} == {"cpu"}


def test_checkpoints_every_n_steps_cannot_be_asked_with_no_checkpoint(tmp_path, tiny_model_file):
    with pytest.raises(InputError, match="checkpoint_every.*--no-checkpoint"):
        TrainOptions(checkpoint=False, checkpoint_every=3)
    result = CliRunner().invoke(app, ["train", "--model", str(tiny_model_file), "--layout", "dp=1,mbs=1,gbs=1",
                                      "--no-checkpoint", "--checkpoint-every", "3", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "--no-checkpoint" in result.output, result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_bf16_autocast_run_trains_its_routed_experts_in_bf16(tmp_path, tiny_arch, restored_environment, recompute):
    """The loop a cuda bf16 run goes through (autocast around forward, fp32 master weights, loss in
    fp32), here on cpu's bf16 autocast: the routed experts' outputs are bf16, the weights stay fp32,
    the loss is finite; under full recompute the recomputed forward is in bf16 as well."""
    import mosaic.trainer.train as train
    from mosaic.trainer.model import GroupedExperts

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    original = GroupedExperts.forward

    def recording(self, x_NH, counts_E):
        y = original(self, x_NH, counts_E)
        seen.append((y.dtype, self.w1.dtype))
        return y

    layout = parse_layout(f"dp=1,mbs=2,gbs=4,precision=bf16,recompute={recompute}")
    config = RunConfig(model=tiny_arch, layout=layout, cluster="cpu_local", device="cpu", world_size=1,
                       precision="bf16", out_dir=str(tmp_path / "run"), train=TrainOptions(steps=2, progress=False,
                                                                                         checkpoint=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GroupedExperts, "forward", recording)
        rows = train.run(config)
    moe_layers = tiny_arch.n_layers - tiny_arch.n_dense_layers
    calls_per_step = 2 * moe_layers * (2 if recompute == "full" else 1)  # 2 micro-batches; recompute runs forward again
    assert len(seen) == 2 * calls_per_step
    assert set(seen) == {(torch.bfloat16, torch.float32)}
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 for row in rows)

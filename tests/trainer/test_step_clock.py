"""What a run on an accelerator needs of the training loop, checked on cpu: the step clock waits for
the device, the model is created on the run's device, and a throughput run can save no checkpoint."""

from __future__ import annotations

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

"""A rank that dies or hangs ends the run with a clear error and keeps the measurements; CLI input errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from calibration.collectives import FAULT_ENV, run_collectives_subprocess
from mosaic.cli.app import app
from perfmodel.errors import InputError

from .conftest import base_cluster


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_dying_rank_ends_the_cli_run_with_a_clear_error_and_keeps_measurements(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "die:1:10")  # rank 1 exits once two collectives (7 sizes each) are measured
    from calibration import kernels

    full_plan = kernels.kernel_plan  # the first two points of each kind: the failure comes after them

    def few_points(device, quick, precisions):
        points = full_plan(device, quick, precisions)
        return [p for i, p in enumerate(points) if [q.kind for q in points[:i]].count(p.kind) < 2]

    monkeypatch.setattr(kernels, "kernel_plan", few_points)
    output = tmp_path / "cal.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--nproc", "2", "--cluster", base_cluster(),
                                      "-o", str(output), "--timeout", "60"])
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "error:" in message and "rank" in message and "measurements kept" in message
    assert not output.exists()  # no profile from a broken run
    from calibration.tables import read_folder

    kept = read_folder(tmp_path / "cal.kernels")
    assert str(tmp_path / "cal.kernels") in message
    assert len(kept.rows("gemm")) and len(kept.rows("attention"))  # the kernels measured before the failure
    assert "all_reduce" in set(kept.rows("collectives")["collective"])  # and the collectives
    assert (tmp_path / "cal.collectives.log").exists()


def test_a_hanging_rank_is_killed_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:1:7")
    started = time.monotonic()
    result = run_collectives_subprocess(2, "cpu", True, ["host"], [8], tmp_path, stall_s=6.0, total_timeout_s=120)
    assert result.error is not None and "no progress" in result.error
    assert time.monotonic() - started < 90
    assert {r.kind for r in result.rows} == {"all_reduce"}  # the first collective's points were kept
    # every process of the run is gone (torchrun and its ranks share one process group)
    out = subprocess.run(["pgrep", "-f", f"calibration.collectives --out {tmp_path}"], capture_output=True, text=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(("args", "needle"), [
    (["--device", "tpu"], "--device 'tpu'"),
    (["--cluster", "nope"], "cluster 'nope'"),
    (["--cluster", "h100", "-o", "out.txt", "--nproc", "1"], ".yaml"),
    (["--cluster", "h100", "--nproc", "0"], "--nproc"),
    (["--cluster", "h100", "--measurements", "missing.csv"], "missing.csv"),
    (["--from-runs", "."], "--cluster"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["calibrate", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("*.yaml"))


def _fake_cuda(monkeypatch, name: str | None) -> None:
    """This process sees one CUDA device called `name` (none with None)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(name is not None))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize(("name", "needle"), [
    (None, "--device cuda: torch sees no CUDA device"),
    ("NVIDIA L4", "--cluster: not given, and no bundled cluster describes the cuda device 'NVIDIA L4'"),
    ("NVIDIA H100 PCIe", "a100_80gb, b200, b300, gb200_nvl72, gb300_nvl72, h100, h200, h800, mi300x"),
])
def test_cuda_without_cluster_is_refused_where_no_bundled_cluster_matches(name, needle, tmp_path, monkeypatch):
    _fake_cuda(monkeypatch, name)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["calibrate", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


def test_cuda_without_cluster_calibrates_on_the_bundled_cluster_of_the_gpu(tmp_path, monkeypatch):
    import calibration.run

    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3")
    asked = {}

    def record(base, **kwargs):
        asked.update(base=base, device=kwargs["device_kind"])
        raise InputError("recorded")  # stop before measuring

    monkeypatch.setattr(calibration.run, "calibrate", record)
    result = CliRunner().invoke(app, ["calibrate", "--device", "cuda", "-o", str(tmp_path / "out.yaml")])
    assert asked == {"base": "h100", "device": "cuda"}, result.output
    assert result.exit_code == 2 and "recorded" in result.output


def test_help_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from mosaic.cli.app import app; "
            "r = CliRunner().invoke(app, ['calibrate', '--help']); assert r.exit_code == 0, r.output; "
            "assert '--from-runs' in r.output; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_collective_worker_refuses_unknown_kinds_and_sizes(tmp_path, capsys):
    from calibration.collectives import main

    for argv, text in ((["--kinds", "all_reduce,broadcast"], "--kinds: unknown broadcast"),
                       (["--sizes", "4096,-1"], "--sizes: message sizes must be positive"),
                       (["--sizes", "4k"], "--sizes: message sizes must be positive")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--out", str(tmp_path / "x.csv"), *argv])
        assert exit_info.value.code == 2
        assert text in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()

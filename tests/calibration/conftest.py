"""Shared fixture: one `mosaic calibrate --quick` run on cpu with 2 gloo ranks (about 15 s), reused by the tests."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="calibration needs torch (extra `calibrate`)")


def base_cluster() -> str:
    """cpu_local when bundled (the cluster that describes this machine), else h100 as a structural base."""
    from perfmodel.clusters import bundled_cluster_paths

    return "cpu_local" if "cpu_local" in bundled_cluster_paths() else "h100"


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from typer.testing import CliRunner

    from mosaic.cli.app import app

    folder = tmp_path_factory.mktemp("calibrate")
    output = folder / "calibrated.yaml"
    report = folder / "report"
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--device", "cpu", "--nproc", "2", "--cluster",
                                      base_cluster(), "-o", str(output), "--report", str(report)])
    return {"result": result, "output": output, "tables": folder / "calibrated.kernels", "report": report,
            "folder": folder}


@pytest.fixture(scope="session")
def calibrated(quick_run: dict):
    from perfmodel.clusters import load_cluster

    assert quick_run["result"].exit_code == 0, quick_run["result"].output
    return load_cluster(str(quick_run["output"]))


@pytest.fixture(scope="session")
def measured(quick_run: dict):
    """The run's kernel tables, read back (calibration.tables.MeasuredTables)."""
    from calibration.tables import read_folder

    assert quick_run["result"].exit_code == 0, quick_run["result"].output
    return read_folder(quick_run["tables"])



"""The planner side imports and runs without torch; the CLI skeleton behaves."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from mosaic import __version__
from mosaic.cli.app import app

BLOCK_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['torch_npu'] = None; "


def test_core_packages_import_without_torch():
    code = BLOCK_TORCH + "import mosaic, perfmodel, scaling_fits, calibration, mosaic.cli.app; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_help_lists_commands_without_torch():
    code = BLOCK_TORCH + "from mosaic.cli.app import app; app(['--help'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "clusters" in result.stdout


def test_version_flag():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_unknown_cluster_is_one_line_error_exit_2():
    result = CliRunner().invoke(app, ["show-cluster", "no_such_cluster"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith("error: cluster 'no_such_cluster'")
    assert "Traceback" not in result.output

"""What a newcomer sees at 80 columns: no line wider than the terminal, no name cut or split mid-word.

A word is split when the 80-column output holds a token the same command's 400-column output
does not (rich wraps at spaces; a folded or ellipsised word leaves a fragment behind).
"""

from __future__ import annotations

import itertools
import re

import pytest
from typer.testing import CliRunner

from mosaic.cli.app import app

runner = CliRunner()
BOX = re.compile(r"[\u2500-\u257f]")  # table borders


def _words(text: str) -> set[str]:
    return set(BOX.sub(" ", text).split())


@pytest.fixture
def steady(monkeypatch, planted):
    """The planted law, and a clock that ticks one second per reading (the search line's rate is fixed)."""
    import mosaic.planner.plan as plan_mod

    ticks = itertools.count()
    monkeypatch.setattr(plan_mod.time, "perf_counter", lambda: float(next(ticks)))


def _at(width: int, args: list[str]) -> str:
    res = runner.invoke(app, args, env={"COLUMNS": str(width)})
    assert res.exit_code in (0, 1), res.output
    return res.output


COMMANDS = [
    ["clusters"],
    ["show-cluster", "h100"],
    ["show-cluster", "gb200_nvl72"],
    ["show-cluster", "ascend_superpod"],
    ["show-cluster", "cpu_local"],
    ["validate"],
    ["predict", "--cluster", "h100", "--model", "examples/models/mixtral_8x7b.yaml", "--layout", "best", "--devices", "64"],
    ["predict", "--cluster", "h100", "--model", "examples/models/mixtral_8x7b.yaml", "--layout",
     "tp=2,ep=8,pp=4,mbs=1,gbs=1024,sp=true", "--devices", "256"],
    *([name, "--help"] for name in ("train", "plan", "predict", "sweep", "fit", "calibrate", "export", "validate")),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_tables_fit_80_columns_without_splitting_a_word(args):
    narrow, wide = _at(80, args), _at(400, args)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "…" not in narrow
    assert _words(narrow) <= _words(wide), sorted(_words(narrow) - _words(wide))


@pytest.mark.parametrize("extra", [["--top", "3"], ["--top", "2", "--sensitivity"]])
def test_plan_tables_fit_80_columns(steady, space_file, extra):
    args = ["plan", "--cluster", "h100", "--devices", "64", "--days", "5", "--space", space_file, "--no-progress", *extra]
    narrow, wide = _at(80, args), _at(400, args)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "…" not in narrow and _words(narrow) <= _words(wide), sorted(_words(narrow) - _words(wide))
    assert "next best" in narrow


def test_sweep_table_fits_80_columns(steady, space_file):
    args = ["sweep", "--cluster", "h100", "--devices", "64", "--days", "5", "--space", space_file, "--over", "sparsity"]
    narrow, wide = _at(80, args), _at(400, args)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "…" not in narrow and _words(narrow) <= _words(wide)


def test_flags_show_no_value_type():
    for name in ("train", "plan", "predict", "clusters"):
        out = _at(80, [name, "--help"])
        assert "<bool>" not in out, name
    assert "<bool>" not in _at(80, ["--help"])
    assert "<int>" in _at(80, ["plan", "--help"])  # options that take a value still name its type


def test_clusters_is_compact_and_points_to_show_cluster():
    out = _at(80, ["clusters"])
    assert "mosaic show-cluster NAME" in out
    assert "[S-acc]" not in out  # sources live in show-cluster
    assert "[S-acc]" in _at(80, ["show-cluster", "h100"])

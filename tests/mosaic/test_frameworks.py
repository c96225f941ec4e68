"""What each framework runs (`mosaic.frameworks`): one table read by the exporters and by
`mosaic plan --framework`."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from mosaic import frameworks
from mosaic.cli.app import app
from mosaic.exports import render
from mosaic.planfile import read_plan
from mosaic.planner import build_problem

runner = CliRunner()


@pytest.mark.parametrize("name", sorted(frameworks.FRAMEWORKS))
def test_the_vectorised_rules_agree_with_the_scalar_check_and_read_the_layout_only(law, make_space, name):
    """Over a grid mixing every overlap switch, dispatcher, recompute and precision: each row's
    vectorised verdict equals the scalar check of that row as a ParallelLayout, and a grid taken in
    another order gets the same verdicts (no row reads another)."""
    space = make_space().replace_layout(vpp=(1, 2), precision=("bf16", "fp16", "fp32"))
    grid = build_problem("h100", devices=64, days=5.0, fit=law, space=space).evaluator.grid
    grid = dataclasses.replace(grid, gbs=np.asarray(grid.mbs) * np.asarray(grid.dp))  # gbs is set per geometry
    ok = frameworks.supported(name, grid)
    rows = np.random.default_rng(0).choice(len(grid), 300, replace=False)
    for i in rows:
        assert ok[i] == (not frameworks.refusals(name, grid.row(int(i)))), (name, grid.row(int(i)))
    assert 0 < ok.sum() < len(ok)  # the table refuses some rows of this space and runs others
    flip = np.arange(len(grid))[::-1]
    np.testing.assert_array_equal(frameworks.supported(name, grid.take(flip)), ok[flip])


@pytest.mark.parametrize("name", ["megatron", "torchtitan"])
def test_a_plan_searched_for_a_framework_exports_to_it(planted, space_file, tmp_path, name):
    """`--framework NAME`: the search leaves out what NAME cannot run (counted in the JSON), the plan
    and every alternative pass NAME's table, and `mosaic export --format NAME` writes it."""
    out = tmp_path / "plan.yaml"
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "64", "--days", "5", "--space", space_file,
                              "--framework", name, "--json", "-o", str(out)])
    assert res.exit_code == 0, res.output
    search = json.loads(res.stdout)["search"]
    assert search["framework"] == name and search["framework_excluded_layouts"] > 0
    plan = read_plan(str(out))
    assert frameworks.refusals(name, plan.layout) == []
    for alt in yaml.safe_load(out.read_text())["alternatives"]:
        assert frameworks.refusals(name, type(plan.layout)(**alt["layout"])) == []
    assert render(plan, name)


def test_the_plan_names_the_exports_that_refuse_it_and_bad_framework_names(planted, space_file, tmp_path):
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "64", "--days", "5", "--space", space_file,
                              "--no-progress", "--framework", "deepspeed"])
    assert res.exit_code == 2 and "--framework deepspeed: unknown; use one of megatron, mindspeed, torchtitan" in res.output
    assert len(res.output.strip().splitlines()) == 1
    space = yaml.safe_load(open(space_file))
    space["layout"]["ep_comm_overlap"] = [True]
    only_overlap = tmp_path / "overlap.yaml"
    only_overlap.write_text(yaml.safe_dump(space))
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "64", "--days", "5", "--space",
                              str(only_overlap), "--no-progress", "--framework", "torchtitan"])
    assert res.exit_code == 1 and "--framework torchtitan: runs none of the" in " ".join(res.output.split())
    res = runner.invoke(app, ["plan", "--cluster", "h100", "--devices", "64", "--days", "5", "--space",
                              str(only_overlap), "--no-progress"])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert "exports:" in flat and "torchtitan refuses layout.ep_comm_overlap" in flat

"""The exporters' plan reader: tolerant of extra sections, strict on model/layout/budget/tokens."""

from __future__ import annotations

import math

import pytest

from mosaic.planfile import plan_from_dict, read_plan
from perfmodel.errors import InputError
from tests.mosaic.exports._plans import EXAMPLE, example_dict, variant


def test_example_plan_reads_and_derives_steps():
    plan = read_plan(EXAMPLE)
    data = example_dict()
    assert plan.model.n_experts == data["model"]["n_experts"]
    assert plan.layout.to_string().startswith("tp=2,pp=4,vpp=2,ep=8")
    assert plan.devices == data["budget"]["devices"] == plan.layout.world()
    assert plan.cluster.name == data["cluster"]["name"] and plan.cluster.hash == data["cluster"].get("hash")
    tokens_per_step = data["layout"]["gbs"] * data["model"]["seq_len"]
    assert plan.train_iters == math.ceil(data["tokens"] / tokens_per_step)
    assert (plan.train_iters - 1) * tokens_per_step < data["tokens"] <= plan.train_iters * tokens_per_step
    assert plan.micro_batches == data["layout"]["gbs"] // (data["layout"]["mbs"] * data["layout"]["dp"])


def test_extra_top_level_sections_are_ignored():
    data = variant(predicted={"mfu": 0.4}, alternatives=[{"x": 1}], fit={"name": "law"}, tool_version="9",
                   derived={"anything": 1})
    assert plan_from_dict(data).model == read_plan(EXAMPLE).model


@pytest.mark.parametrize("change,key", [
    (lambda d: d["model"].update(n_expert=4), "model.n_expert"),
    (lambda d: d["model"].pop("d_model"), "model.d_model"),
    (lambda d: d["model"].update(n_layers="many"), "model.n_layers"),
    (lambda d: d["layout"].update(tpp=2), "layout.tpp"),
    (lambda d: d["layout"].pop("dp"), "layout.dp"),
    (lambda d: d["layout"].pop("gbs"), "layout.gbs"),
    (lambda d: d["layout"].update(recompute="some"), "layout.recompute"),
    (lambda d: d["layout"].update(ep=3), "layout"),  # 3 does not divide 8 experts
    (lambda d: d["budget"].update(devices=128), "layout"),  # tp*cp*pp*dp = 64 != 128
    (lambda d: d.pop("budget"), "budget"),
    (lambda d: d["budget"].pop("devices"), "budget.devices"),
    (lambda d: d.pop("tokens"), "tokens"),
    (lambda d: d.update(tokens=-1), "tokens"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(layout=None), "layout"),
    (lambda d: d.update(cluster="h100"), "cluster"),
])
def test_bad_plans_give_one_line_naming_the_key(change, key):
    data = example_dict()
    change(data)
    with pytest.raises(InputError) as info:
        plan_from_dict(data, source="p.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("p.yaml: ")
    assert f"'{key}" in message or f"key '{key}" in message, message

"""torchtitan export: valid TOML whose keys are torchtitan v0.2.2 JobConfig fields and whose values follow the plan."""

from __future__ import annotations

import ast
import math

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib is 3.11+
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 without tomli: no TOML parser to check the export")

from mosaic.exports import render
from mosaic.exports.torchtitan import flavor_module, flavor_name, job_tables
from mosaic.planfile import plan_from_dict, read_plan
from perfmodel.errors import InputError
from tests.mosaic.exports._plans import DEEPSEEK_LIKE, DENSE, EXAMPLE, variant
from tests.mosaic.exports.upstream_options import (
    MOE_ARGS,
    PIPELINE_SCHEDULES,
    QWEN3_MODEL_ARGS,
    TORCHTITAN_CHOICES,
    TORCHTITAN_CONVERTERS,
    TORCHTITAN_JOB_KEYS,
)


def flat(tables: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tables.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load(plan) -> dict:
    text = render(plan, "torchtitan")
    config = tomllib.loads(text)
    keys = flat(config)
    for key, value in keys.items():
        assert key in TORCHTITAN_JOB_KEYS, f"{key} is not a torchtitan v0.2.2 JobConfig field"
        if key in TORCHTITAN_CHOICES:
            assert value in TORCHTITAN_CHOICES[key], f"{key} = {value!r}"
    return config


def check_torchtitan_invariants(plan, config: dict) -> None:
    """What torchtitan's ParallelDims, pipeline and batch code require, and that it trains the plan's batch."""
    par, train = config["parallelism"], config["training"]
    dp_r, dp_s = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    tp, cp, pp = par["tensor_parallel_degree"], par["context_parallel_degree"], par.get("pipeline_parallel_degree", 1)
    ep, etp = par["expert_parallel_degree"], par["expert_tensor_parallel_degree"]
    assert dp_r * dp_s * cp * tp * pp == plan.devices
    assert dp_r * dp_s == plan.layout.dp
    if ep > 1:
        assert etp in (1, tp)
        assert (dp_s * cp * tp) % (etp * ep) == 0  # efsdp = dp_shard*cp*tp/(etp*ep) is whole
    batch_degree = dp_r * dp_s
    assert train["global_batch_size"] == plan.layout.gbs
    assert train["global_batch_size"] % (train["local_batch_size"] * batch_degree) == 0
    accumulation = train["global_batch_size"] // (train["local_batch_size"] * batch_degree)
    microbatch = par.get("pipeline_parallel_microbatch_size", train["local_batch_size"])
    assert microbatch == plan.layout.mbs
    pipeline_microbatches = train["local_batch_size"] // microbatch
    assert accumulation * pipeline_microbatches == plan.micro_batches
    if pp > 1:  # the performance model's pipeline runs all m micro-batches per step (bubble (pp-1)/(m*vpp))
        assert (accumulation, pipeline_microbatches) == (1, plan.micro_batches)
    assert train["seq_len"] == plan.model.seq_len
    assert train["steps"] == math.ceil(plan.tokens / (plan.layout.gbs * plan.model.seq_len))
    if pp > 1:
        assert par["pipeline_parallel_schedule"] in PIPELINE_SCHEDULES
        stages = plan.model.n_layers // par["pipeline_parallel_layers_per_stage"]
        assert stages == pp * plan.layout.vpp
        assert par["pipeline_parallel_first_stage_less_layers"] == par["pipeline_parallel_last_stage_less_layers"] == 0


def registered_model_args(plan) -> dict:
    """Parse the flavor module: Qwen3ModelArgs and MoEArgs keywords, checked against torchtitan's fields."""
    tree = ast.parse(flavor_module(plan))
    calls = {node.func.id: node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name)}
    qwen = {kw.arg: kw.value for kw in calls["Qwen3ModelArgs"].keywords}
    assert set(qwen) <= set(QWEN3_MODEL_ARGS)
    values = {k: ast.literal_eval(v) for k, v in qwen.items() if k != "moe_args"}
    if "MoEArgs" in calls:
        moe = {kw.arg: ast.literal_eval(kw.value) for kw in calls["MoEArgs"].keywords}
        assert set(moe) <= set(MOE_ARGS)
        values["moe_args"] = moe
    return values


def test_torchtitan_toml_for_the_example_plan():
    plan = read_plan(EXAMPLE)
    config = load(plan)
    check_torchtitan_invariants(plan, config)
    par = config["parallelism"]
    assert par["tensor_parallel_degree"] == plan.layout.tp
    assert par["pipeline_parallel_degree"] == plan.layout.pp
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"  # vpp = 2
    assert par["expert_parallel_degree"] == plan.layout.ep
    assert par["fsdp_reshard_after_forward"] == "never"  # zero1
    assert config["activation_checkpoint"]["mode"] == "selective"
    assert config["training"]["mixed_precision_param"] == "bfloat16"
    assert config["model"]["name"] == config["experimental"]["custom_import"] == flavor_name(plan)
    model = registered_model_args(plan)
    m = plan.model
    assert (model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"], model["head_dim"]) == \
        (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim)
    assert model["vocab_size"] == m.vocab_size and model["moe_inter_dim"] == m.d_expert
    assert model["moe_args"]["num_experts"] == m.n_experts and model["moe_args"]["top_k"] == m.top_k
    assert model["moe_args"]["num_shared_experts"] == m.n_shared_experts
    compile(flavor_module(plan), "flavor.py", "exec")


def test_torchtitan_header_carries_the_flavor_module():
    plan = read_plan(EXAMPLE)
    text = render(plan, "torchtitan")
    header = "\n".join(line[4:] for line in text.splitlines() if line.startswith("#   ") or line == "#")
    assert flavor_module(plan).strip() in header


def test_torchtitan_fsdp_fp8_cp_and_differences():
    plan = plan_from_dict(variant(**DEEPSEEK_LIKE))
    config = load(plan)
    check_torchtitan_invariants(plan, config)
    assert "fsdp_reshard_after_forward" not in config["parallelism"]
    assert config["parallelism"]["context_parallel_degree"] == 2
    assert config["activation_checkpoint"]["mode"] == "full"
    assert set(config["model"]["converters"]) <= set(TORCHTITAN_CONVERTERS)
    assert config["quantize"]["grouped_mm"]["float8"]["fqns"] == ["experts"]
    assert "WARNING: torchtitan's Qwen3 has no dense first layers" in render(plan, "torchtitan")
    assert registered_model_args(plan)["moe_args"]["num_shared_experts"] == plan.model.n_shared_experts


@pytest.mark.parametrize("layout", [
    {"dp_flavor": "ddp", "overlap_param_gather": False},  # ep=8 over tp*cp=2: needs a shard degree of 4 (HSDP)
    {"dp_flavor": "ddp", "ep": 2, "overlap_param_gather": False},  # ep fits inside tp: pure DDP
    {"pp": 1, "vpp": 1, "dp": 32, "gbs": 512},  # no pipeline: gradient accumulation
    {"etp": 2, "ep": 4},
    {"precision": "mxfp8"},
    {"recompute": "none", "precision": "fp32"},
])
def test_torchtitan_layouts_keep_the_invariants(layout):
    plan = plan_from_dict(variant(layout=layout))
    check_torchtitan_invariants(plan, load(plan))


def test_torchtitan_ddp_uses_the_smallest_shard_that_holds_ep():
    plan = plan_from_dict(variant(layout={"dp_flavor": "ddp", "overlap_param_gather": False}))
    par = load(plan)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (2, 4)
    assert "2 replicas x 4 shards (HSDP)" in render(plan, "torchtitan")


def test_torchtitan_dense_model():
    plan = plan_from_dict(variant(**DENSE))
    config = load(plan)
    check_torchtitan_invariants(plan, config)
    model = registered_model_args(plan)
    assert model["moe_enabled"] is False and model["hidden_dim"] == plan.model.d_ff_dense


@pytest.mark.parametrize("layout,key", [
    ({"precision": "fp16"}, "layout.precision"),
    ({"tp": 4, "dp": 4, "etp": 2, "ep": 4}, "layout.etp"),
])
def test_torchtitan_refuses_what_it_cannot_express(layout, key):
    with pytest.raises(InputError, match=key):
        render(plan_from_dict(variant(layout=layout)), "torchtitan")


def test_torchtitan_overlaps_tensor_parallel_by_compiled_async_tp_and_refuses_ep_overlap():
    plan = plan_from_dict(variant(layout={"tp_comm_overlap": True}), "plan.yaml")
    tables = job_tables(plan)
    assert tables["parallelism"]["enable_async_tensor_parallel"] is True and tables["compile"]["enable"] is True
    assert "compile" not in job_tables(plan_from_dict(variant(), "plan.yaml"))
    with pytest.raises(InputError, match=r"layout\.ep_comm_overlap"):
        job_tables(plan_from_dict(variant(layout={"ep_comm_overlap": True}), "plan.yaml"))


def test_torchtitan_frontier_plans_split_and_mla():
    """Stages of unequal depth as module_fqns_per_model_part (every layer once, in order); MLA plans
    register torchtitan's DeepSeek-V3 model args; MTP and hybridep are WARNING lines."""
    from tests.mosaic.exports.upstream_options import DEEPSEEK_V3_MODEL_ARGS

    plan = read_plan(EXAMPLE.parent / "deepseek_v3_gb200_256.yaml")
    tables = job_tables(plan)
    parts = tables["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == plan.layout.pp * plan.layout.vpp and "pipeline_parallel_layers_per_stage" not in tables["parallelism"]
    layers = [name for part in parts for name in part if name.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(plan.model.n_layers)]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"] and len(parts[-1]) == 3
    assert load(plan)["parallelism"]["module_fqns_per_model_part"] == parts  # every key a v0.2.2 JobConfig field
    tree = ast.parse(flavor_module(plan))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DeepSeekV3ModelArgs")
    args = {kw.arg: kw.value for kw in call.keywords}
    assert set(args) <= set(DEEPSEEK_V3_MODEL_ARGS)
    assert ast.literal_eval(args["kv_lora_rank"]) == 512 and ast.literal_eval(args["qk_nope_head_dim"]) == 128
    text = render(plan, "torchtitan")
    assert "WARNING: torchtitan has no multi-token prediction" in text and "no hybridep dispatcher" in text

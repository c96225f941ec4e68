"""Megatron-LM and MindSpeed-LLM exports: run the script with a recording torchrun, check every option."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from mosaic.exports import render
from mosaic.exports.megatron import megatron_argv
from mosaic.exports.mindspeed import mindspeed_argv
from mosaic.planfile import plan_from_dict, read_plan
from perfmodel.errors import InputError
from tests.mosaic.exports._plans import DEEPSEEK_LIKE, DENSE, EXAMPLE, run_script, variant
from tests.mosaic.exports.upstream_options import (
    MEGATRON_CORE_0_12_1_OPTIONS,
    MEGATRON_OPTIONS,
    MINDSPEED_EXTRA_CHOICES,
    MINDSPEED_OPTIONS,
    TORCHRUN_OPTIONS,
)


def parse(argv: list[str], table: dict, extra_choices: dict | None = None) -> dict[str, list[str]]:
    """Parse argv like argparse would from the upstream table; every option must be known and well formed."""
    extra_choices = extra_choices or {}
    values: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        name = argv[i]
        assert name in table, f"{name} is not an option of the upstream parser"
        arity, choices = table[name]
        if arity == 0:
            taken = []
        elif arity == 1:
            taken = [argv[i + 1]]
        else:  # '+': up to the next option
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            taken = argv[i + 1:j]
            assert taken, f"{name} needs at least one value"
        for value in taken:
            assert not value.startswith("--"), f"{name} is missing its value"
            allowed = tuple(choices or ()) + tuple(extra_choices.get(name, ()))
            assert not allowed or value in allowed, f"{name} {value!r} not in {allowed}"
        assert name not in values, f"{name} given twice"
        values[name] = taken
        i += 1 + len(taken)
    return values


def script_argv(tmp_path: Path, fake_bin: Path, text: str, env: dict[str, str] | None = None):
    """Write the script, check its syntax, run it; return (torchrun args, pretrain_gpt.py args)."""
    script = tmp_path / "launch.sh"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    result, argv_dir = run_script(script, fake_bin, env)
    assert result.returncode == 0, result.stderr
    argv = (argv_dir / "torchrun.argv").read_text().splitlines()
    entry = next(i for i, word in enumerate(argv) if word.endswith("pretrain_gpt.py"))
    return argv[:entry], argv[entry + 1:]


def as_int(values: dict[str, list[str]], name: str) -> int:
    return int(values[name][0])


def test_megatron_script_carries_the_plan(tmp_path, fake_bin):
    plan = read_plan(EXAMPLE)
    launcher, argv = script_argv(tmp_path, fake_bin, render(plan, "megatron"), {"MEGATRON_LM_DIR": "/mlm"})
    values = parse(argv, MEGATRON_OPTIONS)
    m, lay = plan.model, plan.layout
    assert as_int(values, "--num-layers") == m.n_layers
    assert as_int(values, "--hidden-size") == m.d_model
    assert as_int(values, "--num-attention-heads") == m.n_heads
    assert as_int(values, "--num-query-groups") == m.n_kv_heads and "--group-query-attention" in values
    assert as_int(values, "--kv-channels") == m.head_dim
    assert as_int(values, "--seq-length") == as_int(values, "--max-position-embeddings") == m.seq_len
    assert as_int(values, "--num-experts") == m.n_experts
    assert as_int(values, "--moe-router-topk") == m.top_k
    assert as_int(values, "--moe-ffn-hidden-size") == m.d_expert
    assert "--moe-shared-expert-intermediate-size" not in values and "--moe-layer-freq" not in values
    assert values["--moe-token-dispatcher-type"] == ["alltoall"] and "--moe-grouped-gemm" in values
    assert as_int(values, "--tensor-model-parallel-size") == lay.tp
    assert as_int(values, "--pipeline-model-parallel-size") == lay.pp
    assert as_int(values, "--num-layers-per-virtual-pipeline-stage") * lay.pp * lay.vpp == m.n_layers
    assert as_int(values, "--context-parallel-size") == lay.cp
    assert as_int(values, "--expert-model-parallel-size") == lay.ep
    assert as_int(values, "--expert-tensor-parallel-size") == lay.etp
    assert "--sequence-parallel" in values and "--use-distributed-optimizer" in values
    assert values["--recompute-granularity"] == ["selective"] and values["--recompute-modules"] == ["core_attn"]
    assert "--bf16" in values and "--fp8-format" not in values
    assert as_int(values, "--micro-batch-size") == lay.mbs
    assert as_int(values, "--global-batch-size") == lay.gbs
    assert as_int(values, "--train-iters") == math.ceil(plan.tokens / (lay.gbs * m.seq_len))
    assert "--swiglu" in values and "--untie-embeddings-and-output-weights" in values
    assert values["--normalization"] == ["RMSNorm"] and values["--position-embedding-type"] == ["rope"]
    assert values["--tokenizer-type"] == ["NullTokenizer"] and as_int(values, "--vocab-size") == m.vocab_size
    # torchrun: the plan's node shape (h100: 8 per node -> 8 nodes)
    assert set(w for w in launcher if w.startswith("-")) <= set(TORCHRUN_OPTIONS)
    assert launcher[launcher.index("--nproc_per_node") + 1] == "8"
    assert launcher[launcher.index("--nnodes") + 1] == "8"
    # the script-only arguments are the plan-derived ones plus data/optimizer/checkpoint groups
    derived = megatron_argv(plan)
    assert argv[:len(derived)] == derived


def test_megatron_script_with_data_uses_the_tokenizer(tmp_path, fake_bin):
    text = render(read_plan(EXAMPLE), "megatron")
    _, argv = script_argv(tmp_path, fake_bin, text, {"DATA_PATH": "/data/c4_text", "TOKENIZER_MODEL": "tok"})
    values = parse(argv, MEGATRON_OPTIONS)
    assert values["--data-path"] == ["/data/c4_text"] and values["--tokenizer-model"] == ["tok"]
    assert "--mock-data" not in values


def test_megatron_script_refuses_a_wrong_node_count(tmp_path, fake_bin):
    script = tmp_path / "launch.sh"
    script.write_text(render(read_plan(EXAMPLE), "megatron"))
    result, argv_dir = run_script(script, fake_bin, {"NNODES": "4"})
    assert result.returncode == 2 and "64 devices" in result.stderr
    assert not (argv_dir / "torchrun.argv").exists()


def test_megatron_dense_layers_shared_experts_fsdp_fp8(tmp_path, fake_bin):
    plan = plan_from_dict(variant(**DEEPSEEK_LIKE))
    text = render(plan, "megatron")
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in text  # Megatron-FSDP asserts it is not 1
    _, argv = script_argv(tmp_path, fake_bin, text)
    values = parse(argv, MEGATRON_OPTIONS)
    m = plan.model
    # Megatron's moe_freq_type evaluates the list expression; do the same
    pattern = eval(values["--moe-layer-freq"][0], {"__builtins__": {}})
    assert pattern == [0] * m.n_dense_layers + [1] * (m.n_layers - m.n_dense_layers)
    assert as_int(values, "--moe-shared-expert-intermediate-size") == m.n_shared_experts * m.d_expert
    assert as_int(values, "--ffn-hidden-size") == m.d_ff_dense
    assert "--use-megatron-fsdp" in values and values["--data-parallel-sharding-strategy"] == ["optim_grads_params"]
    assert values["--ckpt-format"] == ["fsdp_dtensor"]
    assert values["--recompute-granularity"] == ["full"] and values["--recompute-method"] == ["uniform"]
    assert values["--fp8-format"] == ["hybrid"] and "--bf16" in values
    assert as_int(values, "--context-parallel-size") == 2
    assert "--sequence-parallel" not in values


def test_megatron_dense_model_has_no_moe_flags():
    plan = plan_from_dict(variant(**DENSE))
    values = parse(megatron_argv(plan), MEGATRON_OPTIONS)
    assert not any(name.startswith("--moe") or "expert" in name for name in values)
    assert as_int(values, "--ffn-hidden-size") == plan.model.d_ff_dense
    assert "--use-distributed-optimizer" not in values  # ddp


def test_mindspeed_script_carries_the_plan(tmp_path, fake_bin):
    plan = read_plan(EXAMPLE)
    text = render(plan, "mindspeed", gpus_per_node=16)
    launcher, argv = script_argv(tmp_path, fake_bin, text, {"DATA_PATH": "/d", "TOKENIZER_PATH": "/t"})
    table = {**MEGATRON_CORE_0_12_1_OPTIONS, **MINDSPEED_OPTIONS}
    values = parse(argv, table, MINDSPEED_EXTRA_CHOICES)
    assert as_int(values, "--num-experts") == plan.model.n_experts
    assert as_int(values, "--expert-model-parallel-size") == plan.layout.ep
    for flag in ("--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn",
                 "--moe-grouped-gemm", "--overlap-grad-reduce", "--overlap-param-gather"):
        assert flag in values
    assert "--moe-alltoall-overlap-comm" not in values and not plan.layout.ep_comm_overlap
    assert as_int(values, "--padded-vocab-size") == plan.model.vocab_size
    assert launcher[launcher.index("--nproc_per_node") + 1] == "16"
    assert launcher[launcher.index("--nnodes") + 1] == "4"
    derived = mindspeed_argv(plan)
    assert argv[:len(derived)] == derived


def test_mindspeed_needs_data_and_tokenizer(tmp_path, fake_bin):
    script = tmp_path / "launch.sh"
    script.write_text(render(read_plan(EXAMPLE), "mindspeed"))
    result, argv_dir = run_script(script, fake_bin)
    assert result.returncode != 0 and "DATA_PATH" in result.stderr
    assert not (argv_dir / "torchrun.argv").exists()


def test_mindspeed_dense_first_layers_use_first_k_dense_replace():
    data = variant(**DEEPSEEK_LIKE)
    data["layout"].update(dp_flavor="zero1", precision="bf16")
    plan = plan_from_dict(data)
    values = parse(mindspeed_argv(plan), {**MEGATRON_CORE_0_12_1_OPTIONS, **MINDSPEED_OPTIONS},
                   MINDSPEED_EXTRA_CHOICES)
    assert as_int(values, "--first-k-dense-replace") == plan.model.n_dense_layers
    assert values["--moe-layer-freq"] == ["1"]


def test_mindspeed_fsdp_uses_custom_fsdp_without_alltoall_overlap():
    data = variant(**DEEPSEEK_LIKE)
    data["layout"].update(precision="bf16")
    plan = plan_from_dict(data)
    values = parse(mindspeed_argv(plan), {**MEGATRON_CORE_0_12_1_OPTIONS, **MINDSPEED_OPTIONS},
                   MINDSPEED_EXTRA_CHOICES)
    assert "--use-custom-fsdp" in values and "--use-distributed-optimizer" in values
    assert values["--data-parallel-sharding-strategy"] == ["optim_grads_params"]
    assert "--no-gradient-accumulation-fusion" in values
    assert "--moe-alltoall-overlap-comm" not in values
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in render(plan, "mindspeed")


@pytest.mark.parametrize("layout,key", [
    ({"precision": "fp8"}, "layout.precision"),
    ({"precision": "mxfp8"}, "layout.precision"),
])
def test_mindspeed_refuses_what_it_cannot_run(layout, key):
    with pytest.raises(InputError, match=key):
        render(plan_from_dict(variant(layout=layout)), "mindspeed")


ALL_OVERLAPS = {"overlap_grad_reduce": True, "overlap_param_gather": True, "tp_comm_overlap": True,
                "ep_comm_overlap": True}


@pytest.mark.parametrize("switches", [
    ALL_OVERLAPS, {k: False for k in ALL_OVERLAPS}, {"overlap_grad_reduce": True, "ep_comm_overlap": True},
], ids=["all", "none", "grad-and-ep"])
def test_every_overlap_switch_sets_its_megatron_flag(switches):
    plan = plan_from_dict(variant(layout={**{k: False for k in ALL_OVERLAPS}, **switches}), "plan.yaml")
    values = parse(megatron_argv(plan), MEGATRON_OPTIONS)
    flags = {"overlap_grad_reduce": "--overlap-grad-reduce", "overlap_param_gather": "--overlap-param-gather",
             "tp_comm_overlap": "--tp-comm-overlap", "ep_comm_overlap": "--overlap-moe-expert-parallel-comm"}
    for key, flag in flags.items():
        assert (flag in values) == bool(switches.get(key, False)), key


def test_mindspeed_overlaps_tp_by_coc_and_ep_by_its_alltoall_overlap():
    plan = plan_from_dict(variant(layout=ALL_OVERLAPS), "plan.yaml")
    values = parse(mindspeed_argv(plan), {**MEGATRON_CORE_0_12_1_OPTIONS, **MINDSPEED_OPTIONS}, MINDSPEED_EXTRA_CHOICES)
    for flag in ("--overlap-grad-reduce", "--overlap-param-gather", "--use-ascend-coc", "--moe-alltoall-overlap-comm"):
        assert flag in values
    assert "--tp-comm-overlap" not in values
    # MindSpeed's documented preconditions of --moe-alltoall-overlap-comm
    assert values["--moe-token-dispatcher-type"] == ["alltoall"] and plan.layout.ep > 1


@pytest.mark.parametrize("layout, render_to, key", [
    ({"tp_comm_overlap": True, "sequence_parallel": False}, "megatron", "layout.tp_comm_overlap"),
    ({"overlap_param_gather": True, "overlap_grad_reduce": False}, "mindspeed", "layout.overlap_param_gather"),
    ({"recompute": "selective", "recompute_modules": "op"}, "megatron", "layout.recompute_modules"),
])
def test_an_overlap_the_framework_cannot_run_is_refused_by_name(layout, render_to, key):
    """(and a recompute module list it has no form for)"""
    plan = plan_from_dict(variant(layout=layout), "plan.yaml")
    with pytest.raises(InputError, match=key.replace(".", r"\.")) as refused:
        render(plan, render_to, gpus_per_node=8)
    assert "\n" not in str(refused.value)


FRONTIER = EXAMPLE.parent
FRONTIER_PLANS = ("deepseek_v3_gb200_256", "qwen3_235b_b200_256", "kimi_k2_gb300_256", "olmoe2_large_h100_64")


@pytest.mark.parametrize("name", FRONTIER_PLANS)
def test_megatron_carries_frontier_plans(tmp_path, fake_bin, name):
    """Split, MLA, MTP, dispatcher and capacity options are Megatron's own (the d98e8a6 parser's
    table), and they say what the plan says."""
    from perfmodel.specs.stages import parse_pp_layout

    plan = read_plan(FRONTIER / f"{name}.yaml")
    _, argv = script_argv(tmp_path, fake_bin, render(plan, "megatron"), {"MEGATRON_LM_DIR": "/mlm"})
    values = parse(argv, MEGATRON_OPTIONS)
    m, lay = plan.model, plan.layout
    if lay.pp_layout:
        stages = parse_pp_layout(values["--pipeline-model-parallel-layout"][0])
        assert len(stages) == lay.pp * lay.vpp and sum(s.count("t") for s in stages) == m.n_layers
        assert sum(s.count("m") for s in stages) == m.n_mtp_layers == int(values.get("--mtp-num-layers", ["0"])[0])
        assert "--num-layers-per-virtual-pipeline-stage" not in values  # vpp follows from the string
    if lay.account_embedding:
        assert "--account-for-embedding-in-pipeline-split" in values and "--account-for-loss-in-pipeline-split" in values
    if m.kv_lora_rank:
        assert "--multi-latent-attention" in values and as_int(values, "--kv-lora-rank") == m.kv_lora_rank
        assert as_int(values, "--qk-head-dim") + as_int(values, "--qk-pos-emb-head-dim") == m.head_dim
        assert as_int(values, "--v-head-dim") == m.v_head_dim and as_int(values, "--q-lora-rank") == m.q_lora_rank
    if lay.recompute == "selective":
        assert values["--recompute-modules"] == (lay.recompute_modules or "core_attn").split("+")
    if lay.dispatcher == "hybridep":
        assert values["--moe-token-dispatcher-type"] == ["flex"]
        assert values["--moe-flex-dispatcher-backend"] == ["hybridep"]
    if lay.capacity_factor:
        assert float(values["--moe-expert-capacity-factor"][0]) == lay.capacity_factor


def test_megatron_and_mindspeed_split_options():
    """first/last rank counts (+ virtual stages per rank), the balanced default as a layout string;
    MindSpeed-LLM (core_v0.12.1 has no layout string) takes a per-rank --num-layer-list."""
    data = variant(model={"n_layers": 30}, layout={"pp": 4, "vpp": 1, "dp": 2, "ep": 2, "tp": 8})
    balanced = parse(megatron_argv(plan_from_dict(data)), MEGATRON_OPTIONS)
    assert balanced["--pipeline-model-parallel-layout"] == ["Et*7|(t*8|)*2t*7L"]
    mind = parse(mindspeed_argv(plan_from_dict(data)), {**MEGATRON_CORE_0_12_1_OPTIONS, **MINDSPEED_OPTIONS},
                 MINDSPEED_EXTRA_CHOICES)
    assert mind["--num-layer-list"] == ["7,8,8,7"]
    data["layout"].update(vpp=2, first_stage_layers=6, last_stage_layers=8)
    for table, argv in ((MEGATRON_OPTIONS, megatron_argv(plan_from_dict(data))),
                        ({**MEGATRON_CORE_0_12_1_OPTIONS, **MINDSPEED_OPTIONS}, mindspeed_argv(plan_from_dict(data)))):
        values = parse(argv, table, MINDSPEED_EXTRA_CHOICES)
        assert values["--decoder-first-pipeline-num-layers"] == ["6"] and values["--decoder-last-pipeline-num-layers"] == ["8"]
        assert values["--num-virtual-stages-per-pipeline-rank"] == ["2"]
    data["layout"].update(first_stage_layers=None, last_stage_layers=None, pp_layout="Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*3L")
    with pytest.raises(InputError, match="layout.pp_layout"):
        mindspeed_argv(plan_from_dict(data))
    with pytest.raises(InputError, match="layout.dispatcher"):
        mindspeed_argv(plan_from_dict(variant(layout={"dispatcher": "deepep"})))

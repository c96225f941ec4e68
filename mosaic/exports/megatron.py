"""Megatron-LM `pretrain_gpt.py` arguments and launch script for a plan.

Option names, arities and choices were checked against Megatron-LM's own
argument parser: NVIDIA/Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(2026-08-22, megatron-core 0.20.0), `megatron/training/arguments.py`, built
with `add_megatron_arguments(argparse.ArgumentParser())` and listed (878
options); the options used here are stored with that provenance in
tests/mosaic/exports/upstream_options.py. MindSpeed-LLM (mindspeed.py) reuses these
groups on Megatron core_v0.12.1, checked the same way.

Mapping from the plan (MOSAIC symbol -> Megatron option):
  tp, pp, cp, ep, etp   --tensor-/--pipeline-/--context-/--expert-model-/--expert-tensor-parallel-size
  vpp > 1               --num-layers-per-virtual-pipeline-stage L/(pp*vpp) (even split)
  pipeline split        first/last_stage_layers: --decoder-first/last-pipeline-num-layers (vpp > 1:
                        --num-virtual-stages-per-pipeline-rank vpp); account_embedding/_loss:
                        --account-for-embedding/loss-in-pipeline-split (same vpp option); a layout
                        string, balanced_split or the balanced default (pp*vpp does not divide L):
                        --pipeline-model-parallel-layout with the resolved stages (vpp follows from it)
  MLA                   --multi-latent-attention --q-lora-rank (when > 0) --kv-lora-rank
                        --qk-head-dim head_dim - qk_rope_head_dim --qk-pos-emb-head-dim --v-head-dim
  n_mtp_layers          --mtp-num-layers
  dispatcher            alltoall / allgather: --moe-token-dispatcher-type; deepep / hybridep:
                        flex --moe-flex-dispatcher-backend deepep|hybridep
  capacity_factor       --moe-expert-capacity-factor (+ --moe-pad-expert-input-to-capacity)
  sequence_parallel     --sequence-parallel (only with tp > 1; Megatron ignores it at tp = 1)
  dp_flavor             ddp: (none); zero1: --use-distributed-optimizer;
                        fsdp: --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
                        --use-distributed-optimizer --ckpt-format fsdp_dtensor (both required by
                        Megatron-FSDP v1 in validate_args)
  dp                    not an option: Megatron derives it as world / (tp*cp*pp)
  E, k, d_expert        --num-experts, --moe-router-topk, --moe-ffn-hidden-size
  E_s                   --moe-shared-expert-intermediate-size E_s*d_expert (Megatron's total
                        shared width: "num_shared_experts * ffn_size_of_each_shared_expert")
  n_dense_layers        --moe-layer-freq "([0]*n+[1]*(L-n))" (a per-layer 0/1 pattern)
  recompute             selective: --recompute-granularity selective --recompute-modules <the layout's
                        recompute_modules, '+' -> ' '; core_attn when not given, Megatron's default>;
                        full: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  precision             bf16: --bf16; fp16: --fp16; fp8: --bf16 --fp8-format hybrid --fp8-recipe delayed;
                        mxfp8: --bf16 --fp8-format e4m3 --fp8-recipe mxfp8; fp32: (none)
  overlap switches      overlap_grad_reduce: --overlap-grad-reduce; overlap_param_gather:
                        --overlap-param-gather (zero1/fsdp, validate_args); tp_comm_overlap:
                        --tp-comm-overlap (needs --sequence-parallel, validate_args); ep_comm_overlap:
                        --overlap-moe-expert-parallel-comm (ModelParallelConfig fields, flags built by
                        ArgumentGroupFactory; TransformerConfig checks ep > 1, no full recompute, vpp
                        under pp > 1)
  train iterations      --train-iters ceil(tokens / (gbs * seq_len))
The model flags describe the bundled trainer's model: RMSNorm, RoPE (base
10000, Megatron's default), GQA, no linear biases, SwiGLU (or GeLU MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mosaic import frameworks
from mosaic.exports.common import bash_array, header, node_shape
from mosaic.planfile import Plan
from perfmodel.specs.stages import format_pp_layout, virtual_stage_layers

MEGATRON_MATCHED = ("NVIDIA/Megatron-LM commit d98e8a64ddf3 (2026-08-22, megatron-core 0.20.0), "
                    "megatron/training/arguments.py")


@dataclass(frozen=True)
class ArgGroup:
    """A named group of command-line words (becomes one bash array)."""

    name: str
    comment: str
    args: tuple[str, ...]


def moe_layer_pattern(n_layers: int, n_dense_layers: int) -> str:
    """Megatron's --moe-layer-freq list form: 0 = dense FFN layer, 1 = MoE layer."""
    return f"([0]*{n_dense_layers}+[1]*{n_layers - n_dense_layers})"


def model_args(plan: Plan) -> list[str]:
    m = plan.model
    args = ["--num-layers", str(m.n_layers), "--hidden-size", str(m.d_model),
            "--num-attention-heads", str(m.n_heads), "--kv-channels", str(m.head_dim)]
    if m.n_kv_heads != m.n_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.n_kv_heads)]
    if m.kv_lora_rank > 0:
        args.append("--multi-latent-attention")
        if m.q_lora_rank > 0:
            args += ["--q-lora-rank", str(m.q_lora_rank)]
        args += ["--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim", str(m.head_dim - m.qk_rope_head_dim),
                 "--qk-pos-emb-head-dim", str(m.qk_rope_head_dim), "--v-head-dim", str(m.v_head_dim)]
    if m.n_mtp_layers > 0:
        args += ["--mtp-num-layers", str(m.n_mtp_layers)]
    if m.d_ff_dense > 0:
        args += ["--ffn-hidden-size", str(m.d_ff_dense)]
    args += ["--seq-length", str(m.seq_len), "--max-position-embeddings", str(m.seq_len),
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear"]
    if m.gated_ffn:
        args.append("--swiglu")
    if not m.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    return args


def expert_args(plan: Plan) -> list[str]:
    """Expert count, top-k and widths: the MoE flags Megatron and MindSpeed-LLM share."""
    m = plan.model
    args = ["--num-experts", str(m.n_experts), "--moe-router-topk", str(m.top_k),
            "--moe-ffn-hidden-size", str(m.d_expert)]
    if m.n_shared_experts > 0:
        args += ["--moe-shared-expert-intermediate-size", str(m.n_shared_experts * m.d_expert)]
    return args


def capacity_args(plan: Plan) -> list[str]:
    """Capacity-factor routing (Megatron-Core options MindSpeed-LLM's core_v0.12.1 has too)."""
    lay = plan.layout
    if lay.capacity_factor is None:
        return []
    return ["--moe-expert-capacity-factor", f"{lay.capacity_factor:g}"] + (
        ["--moe-pad-expert-input-to-capacity"] if lay.pad_to_capacity else [])


def moe_args(plan: Plan) -> list[str]:
    m, lay = plan.model, plan.layout
    if m.n_experts == 0:
        return []
    args = expert_args(plan)
    if m.n_dense_layers > 0:
        args += ["--moe-layer-freq", moe_layer_pattern(m.n_layers, m.n_dense_layers)]
    if lay.dispatcher in ("deepep", "hybridep"):
        dispatch = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", lay.dispatcher]
    else:
        dispatch = ["--moe-token-dispatcher-type", lay.dispatcher]
    return args + ["--moe-grouped-gemm", *dispatch, *capacity_args(plan)]


def megatron_split_args(plan: Plan) -> list[str]:
    """The pipeline split and virtual stages as Megatron's options (module doc)."""
    lay, m = plan.layout, plan.model
    if lay.pp == 1:
        return []
    vstages = ["--num-virtual-stages-per-pipeline-rank", str(lay.vpp)] if lay.vpp > 1 else []
    if lay.first_stage_layers is not None or lay.last_stage_layers is not None:
        args = ["--decoder-first-pipeline-num-layers", str(lay.first_stage_layers)] \
            if lay.first_stage_layers is not None else []
        if lay.last_stage_layers is not None:
            args += ["--decoder-last-pipeline-num-layers", str(lay.last_stage_layers)]
        return args + vstages
    if lay.account_embedding or lay.account_loss:
        return (["--account-for-embedding-in-pipeline-split"] if lay.account_embedding else []) + (
            ["--account-for-loss-in-pipeline-split"] if lay.account_loss else []) + vstages
    if lay.pp_layout or lay.balanced_split or m.n_layers % (lay.pp * lay.vpp):
        return ["--pipeline-model-parallel-layout",
                format_pp_layout(virtual_stage_layers(m.n_layers, lay), m.n_mtp_layers)]
    return ["--num-layers-per-virtual-pipeline-stage", str(m.n_layers // (lay.pp * lay.vpp))] if lay.vpp > 1 else []


def parallel_args(plan: Plan, fsdp_args: tuple[str, ...], split_args: list[str]) -> list[str]:
    lay, m = plan.layout, plan.model
    args = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)]
    args += split_args
    args += ["--context-parallel-size", str(lay.cp)]
    if m.n_experts > 0:
        args += ["--expert-model-parallel-size", str(lay.ep), "--expert-tensor-parallel-size", str(lay.etp)]
    if lay.sequence_parallel and lay.tp > 1:
        args.append("--sequence-parallel")
    if lay.dp_flavor == "zero1":
        args.append("--use-distributed-optimizer")
    elif lay.dp_flavor == "fsdp":
        args += list(fsdp_args)
    return args


def recompute_args(plan: Plan) -> list[str]:
    mode = plan.layout.recompute
    if mode == "selective":
        modules = (plan.layout.recompute_modules or "core_attn").split("+")  # 'op': refused by frameworks
        return ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    if mode == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return []


def overlap_args(plan: Plan, tp_flag: str = "--tp-comm-overlap",
                 ep_flag: str = "--overlap-moe-expert-parallel-comm") -> list[str]:
    """The layout's overlap switches as flags (`tp_flag` / `ep_flag`: the framework's names; what
    each framework refuses is checked before, `mosaic.frameworks`)."""
    lay = plan.layout
    args = []
    if lay.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
    if lay.overlap_param_gather:
        args.append("--overlap-param-gather")
    if lay.tp_comm_overlap:
        args.append(tp_flag)
    if lay.ep_comm_overlap and plan.model.n_experts > 0:
        args.append(ep_flag)
    return args


def precision_args(plan: Plan) -> list[str]:
    return {
        "fp32": [],
        "bf16": ["--bf16"],
        "fp16": ["--fp16"],
        "fp8": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
        "mxfp8": ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    }[plan.layout.precision]


def batch_args(plan: Plan) -> list[str]:
    lay = plan.layout
    return ["--micro-batch-size", str(lay.mbs), "--global-batch-size", str(lay.gbs),
            "--train-iters", str(plan.train_iters)]


MEGATRON_FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor")
"""Megatron-FSDP v1 needs the distributed optimizer and the fsdp_dtensor checkpoint format (validate_args)."""


def pretrain_gpt_groups(plan: Plan, moe: list[str], fsdp: Any, split: list[str],
                        overlap: Optional[list[str]] = None) -> list[ArgGroup]:
    """The plan-derived groups of a Megatron `pretrain_gpt.py` (also MindSpeed-LLM's), given the MoE
    and pipeline-split flags (and the overlap flags; default Megatron's, `overlap_args`)."""
    lay = plan.layout
    switches = [name for name in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap")
                if getattr(lay, name)]
    return [
        ArgGroup("MODEL_ARGS", "model geometry (plan: model)", tuple(model_args(plan))),
        ArgGroup("MOE_ARGS", "routed/shared experts (plan: model)", tuple(moe)),
        ArgGroup("PARALLEL_ARGS", "parallel layout (plan: layout); dp = world / (tp*cp*pp) is derived",
                 tuple(parallel_args(plan, fsdp, split))),
        ArgGroup("OVERLAP_ARGS", f"communication overlap (plan: {', '.join(switches) or 'none'})",
                 tuple(overlap_args(plan) if overlap is None else overlap)),
        ArgGroup("RECOMPUTE_ARGS", f"activation recompute: {plan.layout.recompute}", tuple(recompute_args(plan))),
        ArgGroup("PRECISION_ARGS", f"precision: {plan.layout.precision}", tuple(precision_args(plan))),
        ArgGroup("BATCH_ARGS", f"batch and length: train-iters = ceil(tokens / (gbs * seq_len)) = "
                 f"ceil({plan.tokens:.6g} / ({plan.layout.gbs} * {plan.model.seq_len}))", tuple(batch_args(plan))),
    ]


def megatron_groups(plan: Plan) -> list[ArgGroup]:
    """The plan-derived argument groups (everything the plan decides), once `mosaic.frameworks`
    finds nothing Megatron-LM refuses."""
    frameworks.check("megatron", plan.layout, plan.source)
    return [g for g in pretrain_gpt_groups(plan, moe_args(plan), MEGATRON_FSDP, megatron_split_args(plan)) if g.args]


def megatron_argv(plan: Plan) -> list[str]:
    """Flat list of the plan-derived `pretrain_gpt.py` arguments."""
    return [word for group in megatron_groups(plan) for word in group.args]


def launch_script(plan: Plan, *, title: str, matched: tuple[str, ...], groups: list[ArgGroup],
                   env_lines: list[str], fixed_groups: str, entry: str, per_node_var: str,
                   gpus_per_node: Optional[int]) -> str:
    shape = node_shape(plan, gpus_per_node)
    parts = ["#!/usr/bin/env bash\n", header(plan, title, matched),
             f"# Devices per node: {shape.per_node} ({shape.note}); nodes: {shape.nodes}.\n",
             "# Run it on every node (NODE_RANK 0..NNODES-1), or under Slurm with one task per node.\n",
             "set -euo pipefail\n\n",
             "# Launch settings: the environment overrides these defaults.\n"]
    parts += [line + "\n" for line in env_lines]
    parts.append(
        f'NNODES=${{NNODES:-${{SLURM_NNODES:-{shape.nodes}}}}}\n'
        'NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}\n'
        'MASTER_ADDR=${MASTER_ADDR:-localhost}\n'
        'MASTER_PORT=${MASTER_PORT:-29500}\n'
        'CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints}\n'
        '# Optimizer settings are not part of the plan (AdamW as in the bundled trainer; set your own).\n'
        'LR=${LR:-3.0e-4}\n'
        'MIN_LR=${MIN_LR:-3.0e-5}\n'
        f'if (( NNODES * {per_node_var} != {plan.devices} )); then\n'
        f'    echo "error: the plan needs {plan.devices} devices; NNODES*{per_node_var}=$((NNODES * {per_node_var}))" >&2\n'
        '    exit 2\n'
        'fi\n\n'
    )
    parts.append(bash_array("DISTRIBUTED_ARGS", [
        "--nproc_per_node", f"${{{per_node_var}}}", "--nnodes", "${NNODES}", "--node_rank", "${NODE_RANK}",
        "--master_addr", "${MASTER_ADDR}", "--master_port", "${MASTER_PORT}"], "torchrun"))
    for group in groups:
        parts.append(bash_array(group.name, list(group.args), group.comment))
    parts.append(bash_array("OPTIMIZER_ARGS", [
        "--lr", "${LR}", "--min-lr", "${MIN_LR}", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0"], "not from the plan"))
    parts.append(fixed_groups)
    names = ["DISTRIBUTED_ARGS"]  # torchrun's own, before the script
    args_names = [g.name for g in groups] + ["OPTIMIZER_ARGS", "DATA_ARGS", "CHECKPOINT_ARGS"]
    launch = f'exec torchrun "${{{names[0]}[@]}}" {entry} \\\n'
    launch += " \\\n".join(f'    "${{{name}[@]}}"' for name in args_names) + ' \\\n    "$@"\n'
    parts.append("\n" + launch)
    return "".join(parts)


def cuda_connections_line(plan: Plan) -> str:
    """Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tp/cp > 1 (Hopper), and != 1 with FSDP."""
    if plan.layout.dp_flavor == "fsdp":
        return "unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron-FSDP requires it unset or > 1"
    return "export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron requires 1 with tp or cp > 1 (before Blackwell)"


def render_megatron(plan: Plan, gpus_per_node: Optional[int] = None) -> str:
    """A bash launch script for Megatron-LM's pretrain_gpt.py with the plan's arguments."""
    shape = node_shape(plan, gpus_per_node)
    env = [
        "MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$PWD}  # a Megatron-LM checkout (holds pretrain_gpt.py)",
        f"GPUS_PER_NODE=${{GPUS_PER_NODE:-{shape.per_node}}}",
        "DATA_PATH=${DATA_PATH:-}  # Megatron indexed-dataset prefix; empty: --mock-data (smoke run)",
        "TOKENIZER_MODEL=${TOKENIZER_MODEL:-}  # Hugging Face tokenizer (name or path) for DATA_PATH",
        cuda_connections_line(plan),
    ]
    fixed = (
        f'# data: the plan fixes the vocabulary (V = {plan.model.vocab_size}); the tokenizer must produce it\n'
        'if [[ -n "${DATA_PATH}" ]]; then\n'
        '    DATA_ARGS=(--data-path "${DATA_PATH}" --tokenizer-type HuggingFaceTokenizer '
        '--tokenizer-model "${TOKENIZER_MODEL}" --split 99,1,0)\n'
        'else\n'
        f'    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size {plan.model.vocab_size})\n'
        'fi\n'
    )
    fixed += bash_array("CHECKPOINT_ARGS", [
        "--save", "${CHECKPOINT_DIR}", "--load", "${CHECKPOINT_DIR}", "--save-interval", "1000",
        "--log-interval", "10", "--eval-interval", "1000", "--eval-iters", "10"], "checkpoints and logging")
    return launch_script(plan, title="Megatron-LM pretrain_gpt.py launch for a MOSAIC plan",
                          matched=(MEGATRON_MATCHED,), groups=megatron_groups(plan), env_lines=env,
                          fixed_groups=fixed, entry='"${MEGATRON_LM_DIR}/pretrain_gpt.py"',
                          per_node_var="GPUS_PER_NODE", gpus_per_node=gpus_per_node)


__all__ = ["ArgGroup", "MEGATRON_MATCHED", "launch_script", "megatron_argv", "megatron_groups", "moe_layer_pattern",
           "render_megatron"]

"""MindSpeed-LLM (Ascend NPU) launch script for a plan: Megatron arguments plus MindSpeed's own.

MindSpeed-LLM runs on Megatron-LM core_v0.12.1 (its install guide,
docs/en/pytorch/training/install_guide.md: `git checkout core_v0.12.1`), so the
Megatron option names here were checked against that tag's parser
(NVIDIA/Megatron-LM a845aa7e12b3, `megatron/training/arguments.py`, built and
listed as for megatron.py). MindSpeed's own options were checked against their
definitions and documentation:
  Ascend/MindSpeed commit 028de58ca629 (2026-07-21):
    --use-fused-rmsnorm, --use-fused-swiglu   mindspeed/features_manager/megatron_basic/megatron_basic.py,
                                              docs/zh/features/rms_norm.md, swiglu.md
    --use-fused-rotary-pos-emb                mindspeed/features_manager/fusions/fused_rope.py,
                                              docs/zh/features/rotary-embedding.md
    --use-flash-attn                          (a Megatron option) docs/zh/features/flash-attention.md
    --moe-alltoall-overlap-comm               mindspeed/features_manager/moe/moe_alltoall_overlap.py,
                                              docs/zh/features/megatron_moe/megatron-moe-alltoall-overlap-comm.md
                                              (needs --moe-token-dispatcher-type alltoall, --moe-grouped-gemm, ep > 1)
  Ascend/MindSpeed-LLM commit c77308a14bfc (2026-08-21):
    --first-k-dense-replace                   mindspeed_llm/features_manager/transformer/transformer_block.py
                                              (dense first layers; MoE layers where layer >= k and
                                              layer % --moe-layer-freq == 0, so --moe-layer-freq 1)
    --tokenizer-type PretrainedFromHF, --tokenizer-name-or-path, --padded-vocab-size
                                              mindspeed_llm/features_manager/tokenizer/build_tokenizer.py
    --num-layer-list                          mindspeed_llm/features_manager/pipeline_parallel/num_layer_list.py
                                              (layers per pipeline rank, comma separated; not with
                                              virtual pipeline stages)
The launch layout (torchrun, --use-mcore-models, --transformer-impl local,
--no-gradient-accumulation-fusion, --distributed-backend nccl, PYTORCH_NPU_ALLOC_CONF)
follows MindSpeed-LLM's examples/mcore/qwen3_moe/pretrain_qwen3_30b_a3b_4K_ptd.sh.

dp_flavor fsdp uses Megatron core_v0.12.1's custom FSDP as MindSpeed documents it
(docs/zh/features/custom_fsdp.md: --use-custom-fsdp --data-parallel-sharding-strategy
optim_grads_params --no-gradient-accumulation-fusion --use-distributed-optimizer, with
CUDA_DEVICE_MAX_CONNECTIONS unset), without --moe-alltoall-overlap-comm (MindSpeed's own
custom-FSDP test, tests_extend/system_tests/feature_tests/custom_fsdp.sh, does not combine them).
Overlap switches: overlap_grad_reduce / overlap_param_gather -> Megatron's flags; tp_comm_overlap
-> --use-ascend-coc (mindspeed/features_manager/tensor_parallel/locl_coc.py, CoC: communication
over computation); ep_comm_overlap -> --moe-alltoall-overlap-comm.
The pipeline split: `mindspeed_split_args`. Multi-head latent attention, MTP and capacity factors use
core_v0.12.1's own options (as megatron.py; MindSpeed-LLM's --multi-head-latent-attention,
--qk-rope-head-dim and --qk-nope-head-dim are deprecated aliases of them, deprecated_args.py).
Refused (InputError): fp8/mxfp8 precision; the deepep/hybridep dispatchers.
"""

from __future__ import annotations

from typing import Optional

from mosaic import frameworks
from mosaic.exports.common import bash_array
from mosaic.exports.megatron import (
    ArgGroup,
    capacity_args,
    expert_args,
    launch_script,
    megatron_split_args,
    overlap_args,
    pretrain_gpt_groups,
)
from mosaic.planfile import Plan
from perfmodel.errors import InputError
from perfmodel.specs.stages import format_pp_layout, virtual_stage_layers

MINDSPEED_MATCHED = (
    "NVIDIA/Megatron-LM tag core_v0.12.1 (a845aa7e12b3), megatron/training/arguments.py (MindSpeed-LLM's Megatron)",
    "Ascend/MindSpeed commit 028de58ca629 (2026-07-21) and Ascend/MindSpeed-LLM commit c77308a14bfc (2026-08-21)",
)


MINDSPEED_FSDP = ("--use-custom-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                  "--use-distributed-optimizer")
"""MindSpeed's documented custom-FSDP flags (--no-gradient-accumulation-fusion is always in MINDSPEED_ARGS)."""


def _check_supported(plan: Plan) -> None:
    lay, m = plan.layout, plan.model
    frameworks.check("mindspeed", lay, plan.source)  # the layout rules; those reading the model below
    if m.n_experts > 0 and m.n_dense_layers > 0 and lay.pp > 1 and m.n_dense_layers >= m.n_layers // lay.pp:
        raise InputError(f"{plan.source}: key 'model.n_dense_layers': MindSpeed-LLM refuses a pipeline stage made only "
                         f"of dense layers ({m.n_dense_layers} >= n_layers/pp = {m.n_layers // lay.pp}); lower pp")


def mindspeed_moe_args(plan: Plan) -> list[str]:
    m, lay = plan.model, plan.layout
    if m.n_experts == 0:
        return []
    args = expert_args(plan)
    if m.n_dense_layers > 0:
        args += ["--first-k-dense-replace", str(m.n_dense_layers), "--moe-layer-freq", "1"]
    args += ["--moe-grouped-gemm", "--moe-token-dispatcher-type", lay.dispatcher, *capacity_args(plan)]
    return args


def mindspeed_split_args(plan: Plan) -> list[str]:
    """The pipeline split in core_v0.12.1 / MindSpeed-LLM options: Megatron's first/last and
    account-for options as they are; any other uneven split as MindSpeed-LLM's --num-layer-list
    (layers per pipeline rank; vpp = 1 only), or as first/last counts when it is one (core_v0.12.1
    has no --pipeline-model-parallel-layout)."""
    lay, m = plan.layout, plan.model
    split = megatron_split_args(plan)
    if not split or split[0] != "--pipeline-model-parallel-layout":
        return split
    counts = virtual_stage_layers(m.n_layers, lay)
    ranks = [sum(counts[j] for j in range(r, len(counts), lay.pp)) for r in range(lay.pp)]
    if lay.vpp == 1:
        return ["--num-layer-list", ",".join(str(c) for c in ranks)]
    chunks_equal = all(len({counts[c * lay.pp + r] for c in range(lay.vpp)}) == 1 for r in range(lay.pp))
    if chunks_equal and len(set(ranks[1:-1])) <= 1:
        return ["--decoder-first-pipeline-num-layers", str(ranks[0]), "--decoder-last-pipeline-num-layers",
                str(ranks[-1]), "--num-virtual-stages-per-pipeline-rank", str(lay.vpp)]
    raise InputError(f"{plan.source}: key 'layout.pp_layout': MindSpeed-LLM (Megatron core_v0.12.1) has no layout "
                     f"string and no uneven interleaved split for {format_pp_layout(counts, m.n_mtp_layers)}; "
                     "use vpp=1 (--num-layer-list) or first/last_stage_layers")


def mindspeed_overlap_args(plan: Plan) -> list[str]:
    """Megatron's data-parallel overlap flags (core_v0.12.1: --overlap-param-gather needs
    --overlap-grad-reduce), MindSpeed's CoC for tensor-parallel overlap (--use-ascend-coc) and
    its all-to-all overlap for expert parallel (--moe-alltoall-overlap-comm)."""
    return overlap_args(plan, tp_flag="--use-ascend-coc", ep_flag="--moe-alltoall-overlap-comm")


def mindspeed_fused_args(plan: Plan) -> list[str]:
    args = ["--use-mcore-models", "--transformer-impl", "local", "--use-flash-attn", "--use-fused-rmsnorm",
            "--use-fused-rotary-pos-emb"]
    if plan.model.gated_ffn:
        args.append("--use-fused-swiglu")
    args += ["--no-gradient-accumulation-fusion", "--distributed-backend", "nccl"]
    return args


def mindspeed_groups(plan: Plan) -> list[ArgGroup]:
    """Plan-derived groups for MindSpeed-LLM's pretrain_gpt.py."""
    _check_supported(plan)
    groups = pretrain_gpt_groups(plan, mindspeed_moe_args(plan), MINDSPEED_FSDP, mindspeed_split_args(plan),
                                 mindspeed_overlap_args(plan))
    groups.append(ArgGroup("MINDSPEED_ARGS", "MindSpeed fused kernels and launch options", tuple(mindspeed_fused_args(plan))))
    return [g for g in groups if g.args]


def mindspeed_argv(plan: Plan) -> list[str]:
    return [word for group in mindspeed_groups(plan) for word in group.args]


def render_mindspeed(plan: Plan, gpus_per_node: Optional[int] = None) -> str:
    """A bash launch script for MindSpeed-LLM's pretrain_gpt.py with the plan's arguments."""
    from mosaic.exports.common import node_shape

    groups = mindspeed_groups(plan)
    shape = node_shape(plan, gpus_per_node)
    env = [
        "MINDSPEED_LLM_DIR=${MINDSPEED_LLM_DIR:-$PWD}  # a MindSpeed-LLM checkout with Megatron core_v0.12.1 copied in",
        f"NPUS_PER_NODE=${{NPUS_PER_NODE:-{shape.per_node}}}",
        "DATA_PATH=${DATA_PATH:-}  # preprocessed dataset prefix (MindSpeed-LLM preprocess_data.py)",
        "TOKENIZER_PATH=${TOKENIZER_PATH:-}  # Hugging Face tokenizer folder",
        ("unset CUDA_DEVICE_MAX_CONNECTIONS  # custom FSDP needs it unset (MindSpeed docs)"
         if plan.layout.dp_flavor == "fsdp" else "export CUDA_DEVICE_MAX_CONNECTIONS=1"),
        "export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True",
    ]
    fixed = (
        ': "${DATA_PATH:?set DATA_PATH to the preprocessed dataset prefix}"\n'
        ': "${TOKENIZER_PATH:?set TOKENIZER_PATH to the tokenizer folder}"\n'
        f'# data: the plan fixes the vocabulary (V = {plan.model.vocab_size})\n'
    )
    fixed += bash_array("DATA_ARGS", [
        "--data-path", "${DATA_PATH}", "--split", "100,0,0", "--tokenizer-type", "PretrainedFromHF",
        "--tokenizer-name-or-path", "${TOKENIZER_PATH}", "--make-vocab-size-divisible-by", "1",
        "--padded-vocab-size", str(plan.model.vocab_size)])
    fixed += bash_array("CHECKPOINT_ARGS", [
        "--save", "${CHECKPOINT_DIR}", "--save-interval", "1000", "--log-interval", "10",
        "--eval-interval", "1000", "--eval-iters", "0"], "checkpoints and logging")
    return launch_script(plan, title="MindSpeed-LLM pretrain_gpt.py launch (Ascend NPU) for a MOSAIC plan",
                          matched=MINDSPEED_MATCHED, groups=groups, env_lines=env, fixed_groups=fixed,
                          entry='"${MINDSPEED_LLM_DIR}/pretrain_gpt.py"', per_node_var="NPUS_PER_NODE",
                          gpus_per_node=gpus_per_node)


__all__ = ["MINDSPEED_MATCHED", "mindspeed_argv", "mindspeed_groups", "render_mindspeed"]

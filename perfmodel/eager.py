"""Host-side op counts of an eager PyTorch implementation (the bundled trainer).

On CPU clusters (`ClusterSpec.host_cores` set) every rank is an eager PyTorch process
(`mosaic train`, one thread per rank) whose core both dispatches and runs each aten op.
At the sizes a CPU trains, the time per op is dominated by dispatch (Python module call,
autograd recording, the dispatcher, the autograd engine in backward), so the model needs
the number of ops the trainer really issues, not the fused-kernel counts of Megatron /
Transformer Engine that `perfmodel.operators` states for GPUs (where the host enqueues
ahead of the device and only the excess shows).

An op is an aten op that reaches a backend kernel (views included: they are dispatched
too). Source of every count: `mosaic.trainer.op_count.count_trainer_ops` (one training step of
`mosaic.trainer.model.Transformer` under a `TorchDispatchMode`), on the tiny MoE of
examples/tiny_moe.yaml and its variants; the counts do not depend on mbs or widths. The
measured counts behind each constant are in docs/eager_counts.md, and
tests/calibration/test_eager_ops.py recounts them against the trainer. The per-op time they
multiply is `Accelerator.launch_latency_s`, calibrated the same way
(`calibration.eager_ops.eager_op_seconds`: an eager block's forward + backward time divided by
its op count).

Collectives are one launch each (`perfmodel.host`); DTensor ops (tensor parallel) are counted
apart (`EAGER_DTENSOR_*`, priced at `dtensor_op_latency_s`). The trainer's own per-step
collectives (`eager_step_collectives`: token count, statistics, gradient-norm reductions)
are small all-reduces that cost their latency; `perfmodel.host.EagerHost` prices them on
the cluster's fabric with the step's optimizer time.
"""

from __future__ import annotations

import numpy as np

from perfmodel.specs.protocols import ArchLike, LayoutLike, Values

EAGER_OPS = {
    # block: (forward, backward) ops per micro-batch (per layer for layer blocks)
    "embedding": (5.0, 2.0),      # arange/expand positions, lookup; embedding_dense_backward
    "attention": (78.0, 81.0),    # RMSNorm, q/k/v/o linears, RoPE (recomputes cos/sin each call), SDPA, residual
    "dense_ffn": (24.0, 50.0),    # RMSNorm, SwiGLU w1/w3/w2 linears, residual
    "moe": (47.0, 72.0),          # RMSNorm, router (softmax, top-k, aux loss, counts), sort/gather, grouped GEMMs, index_add
    "head": (19.0, 34.0),         # final RMSNorm, LM head, fp32 cross-entropy, loss normalisation
}
"""Counts of the tiny MoE with multi-head attention (n_kv_heads = n_heads), gated FFNs and no
shared expert; the corrections below give the other variants."""
EAGER_EP_OPS = (36.0, 8.0)
"""Per MoE layer with ep > 1 (expert-parallel dispatch of `mosaic.trainer.parallelize`): the
count exchange, split sizes, the expert-major permutation, dispatch and combine all-to-alls
and their autograd records (`count_trainer_ops(arch, ep=2)`; independent of ep)."""
EAGER_GQA_OPS = (8.0, 8.0)
"""Grouped-query attention: repeat_interleave of K and V."""
EAGER_SHARED_EXPERT_OPS = (9.0, 26.0)
"""A (gated) shared expert MLP on the MoE layer's input."""
EAGER_UNGATED_OPS = {"dense_ffn": (-5.0, -12.0), "moe": (-5.0, -18.0)}
"""Plain GeLU MLPs instead of SwiGLU: one projection and one product fewer."""
EAGER_FULL_RECOMPUTE_OPS = 64.0
"""Per layer, beyond re-running its forward: torch.utils.checkpoint (non-reentrant) saved-tensor
hooks and detaches."""
EAGER_SELECTIVE_RECOMPUTE_OPS = 15.0
"""Per layer: the checkpointed attention core again (K/V repeat, SDPA) plus checkpoint hooks."""
EAGER_OPS_PER_PARAM_TENSOR = 13.0
"""AdamW with foreach=False (the trainer's optimizer: DTensor and plain expert tensors share a
group): 10 ops per parameter tensor (2 add_, 2 mul_, lerp_, addcmul_, sqrt, div, addcdiv_, the
step-count item); the global gradient norm: pow, sum, add_ per tensor."""
EAGER_STEP_OPS = 42.0
"""Once per step: loss-normalisation all-reduce, loss and load statistics, router-bias update,
metrics, optimizer record_function."""
EAGER_STEP_OPS_PER_MOE_LAYER = 17.0
"""Once per step per MoE layer: reset and gather its expert-load counters."""
EAGER_OPS_PER_MICRO_BATCH = 13.0
"""Per micro-batch outside the model: batch to device, loss and aux accumulation."""


def eager_block_ops(arch: ArchLike) -> dict[str, tuple[Values, Values]]:
    """(forward, backward) eager ops per micro-batch of each block (per layer for layer blocks)."""
    f = np.asarray
    gqa = f(arch.n_kv_heads, dtype=float) < f(arch.n_heads, dtype=float)
    ungated = ~f(arch.gated_ffn, dtype=bool)
    shared = f(arch.n_shared_experts, dtype=float) > 0
    out: dict[str, tuple[Values, Values]] = {}
    for block, (fwd_count, bwd_count) in EAGER_OPS.items():
        fwd, bwd = f(fwd_count), f(bwd_count)
        if block == "attention":
            fwd, bwd = fwd + gqa * EAGER_GQA_OPS[0], bwd + gqa * EAGER_GQA_OPS[1]
        if block == "moe":
            fwd, bwd = fwd + shared * EAGER_SHARED_EXPERT_OPS[0], bwd + shared * EAGER_SHARED_EXPERT_OPS[1]
        if block in EAGER_UNGATED_OPS:
            d_fwd, d_bwd = EAGER_UNGATED_OPS[block]
            fwd, bwd = fwd + ungated * d_fwd, bwd + ungated * d_bwd
        out[block] = (fwd * 1.0, bwd * 1.0)
    return out


def eager_param_tensors(arch: ArchLike) -> dict[str, Values]:
    """Parameter tensors per block (per layer for layer blocks) of the bundled model: separate
    q/k/v/o projections and an RMSNorm weight per norm."""
    f = np.asarray
    ffn = np.where(f(arch.gated_ffn, dtype=bool), 3.0, 2.0)
    shared = np.where(f(arch.n_shared_experts, dtype=float) > 0, ffn, 0.0)
    return {"embedding": f(1.0), "attention": f(5.0), "dense_ffn": 1.0 + ffn, "moe": 2.0 + ffn + shared,
            "head": np.where(f(arch.tie_embeddings, dtype=bool), 1.0, 2.0)}


def eager_step_ops(arch: ArchLike, counts: dict[str, Values], micro_batches: Values) -> Values:
    """Ops once per step on a stage holding counts[block] blocks: optimizer, gradient norm and
    the trainer's bookkeeping (micro_batches per step)."""
    tensors = eager_param_tensors(arch)
    total: Values = 0.0
    for block, n in tensors.items():
        total = total + counts[block] * n
    return (EAGER_OPS_PER_PARAM_TENSOR * total + EAGER_STEP_OPS + EAGER_STEP_OPS_PER_MOE_LAYER * counts["moe"]
            + EAGER_OPS_PER_MICRO_BATCH * np.asarray(micro_batches, dtype=float))


EAGER_STEP_COLLECTIVE_BYTES = 256.0
"""Size of each bookkeeping all-reduce: a few scalars up to (2 + MoE layers x experts) float64
statistics; latency-bound at any of these sizes."""


def eager_step_collectives(lay: LayoutLike) -> dict[str, Values]:
    """Small all-reduces the bundled trainer issues once per step, by process group
    (`perfmodel.comm.group_geometry` names; a group of one costs nothing). Source:
    mosaic/trainer/train.py and parallelize.clip_grad_norm --
    dp: the step's global target-token count (normalises the loss exactly);
    world: loss, auxiliary loss and per-expert load statistics;
    tp: the gradient norm's square sums of DTensor gradients, one per sharded placement
    (column-wise Shard(0) and row-wise Shard(1) weights; replicated ones need none);
    ep / etp: the expert gradients' square sum; pp_all: the norm's total over stages."""
    one = np.ones_like(np.asarray(lay.tp, dtype=float))
    return {"dp": one, "world": one, "tp": 2.0 * one, "ep": one, "etp": one, "pp_all": one}


EAGER_DTENSOR_OPS = {
    # block: (forward, backward) ops on DTensors per micro-batch (per layer for layer blocks) under tp > 1
    "embedding": (1.0, 2.0),      # vocabulary-parallel lookup (RowwiseParallel)
    "attention": (16.0, 36.0),    # column-wise q/k/v, row-wise o and their reshapes (GQA and MHA alike)
    "dense_ffn": (12.0, 27.0),    # column-wise w1/w3, row-wise w2 (SwiGLU)
    "moe": (2.0, 7.0),            # the replicated router weight (experts see a sequence shard, plain tensors)
    "head": (4.0, 9.0),           # column-wise LM head, logits gathered
}
"""Counted with `mosaic.trainer.op_count.count_trainer_ops(arch, tp=2)` (fake 2-rank world) on the
tiny MoE without its shared expert (router only) and the dense variant; they do not depend on
the tp degree, mbs or widths."""
EAGER_DTENSOR_SHARED_EXPERT_OPS = (6.0, 21.0)
"""A gated shared expert (column-wise w1/w3, row-wise w2) in the MoE layer."""
EAGER_DTENSOR_UNGATED_OPS = {"dense_ffn": (-4.0, -9.0), "moe": (-2.0, -7.0)}
"""GeLU MLPs (no w3)."""
EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR = 2.0
"""Full recompute adds about twice the layers' forward DTensor ops: the checkpointed forward
re-runs and re-wraps."""
EAGER_DTENSOR_OPS_PER_PARAM_TENSOR = 11.0
"""Per DTensor parameter: AdamW foreach=False runs 8 of its ops on the DTensor, the gradient
norm 3 (pow, sum, accumulate; clip_grad_norm)."""
EAGER_DTENSOR_STEP_OPS = 2.0
"""Per step: the gradient norm's full_tensor, once per sharded placement (Shard(0), Shard(1))."""


def eager_dtensor_block_ops(arch: ArchLike) -> dict[str, tuple[Values, Values]]:
    """(forward, backward) DTensor ops per micro-batch of each block under tp > 1 (per layer)."""
    f = np.asarray
    ungated = ~f(arch.gated_ffn, dtype=bool)
    shared = f(arch.n_shared_experts, dtype=float) > 0
    out: dict[str, tuple[Values, Values]] = {}
    for block, (fwd_count, bwd_count) in EAGER_DTENSOR_OPS.items():
        fwd, bwd = f(fwd_count), f(bwd_count)
        if block == "moe":
            fwd = fwd + shared * EAGER_DTENSOR_SHARED_EXPERT_OPS[0]
            bwd = bwd + shared * EAGER_DTENSOR_SHARED_EXPERT_OPS[1]
            d_fwd, d_bwd = EAGER_DTENSOR_UNGATED_OPS["moe"]
            fwd, bwd = fwd + (ungated & shared) * d_fwd, bwd + (ungated & shared) * d_bwd
        if block == "dense_ffn":
            d_fwd, d_bwd = EAGER_DTENSOR_UNGATED_OPS["dense_ffn"]
            fwd, bwd = fwd + ungated * d_fwd, bwd + ungated * d_bwd
        out[block] = (fwd * 1.0, bwd * 1.0)
    return out


def eager_dtensor_param_tensors(arch: ArchLike) -> dict[str, Values]:
    """DTensor parameters per block under tp > 1: the tensor-parallel linears and the router
    weight; norms and routed experts stay plain tensors."""
    f = np.asarray
    ffn = np.where(f(arch.gated_ffn, dtype=bool), 3.0, 2.0)
    shared = np.where(f(arch.n_shared_experts, dtype=float) > 0, ffn, 0.0)
    return {"embedding": f(1.0), "attention": f(4.0), "dense_ffn": ffn, "moe": 1.0 + shared,
            "head": np.where(f(arch.tie_embeddings, dtype=bool), 0.0, 1.0)}


EAGER_SAVED_TENSORS = {"attention": 23.0, "dense_ffn": 15.0, "moe": 30.0}
"""Tensors autograd saves per layer block in one micro-batch's forward (what a checkpointed layer
packs and recomputes): attention with its norm, projections, RoPE and core; the SwiGLU dense FFN
with its norm; the MoE layer (router, dispatch, grouped experts) without a shared expert.
Counted with `mosaic.trainer.op_count.count_saved_tensors`; they do not depend on widths, mbs or
GQA vs MHA."""
EAGER_SAVED_CORE = 5.0
"""Saved by the attention core alone (selective recompute's region: SDPA's inputs and outputs)."""
EAGER_SAVED_SHARED_EXPERT = 9.0
"""A gated shared expert in the MoE layer."""
EAGER_SAVED_UNGATED = {"dense_ffn": -4.0, "moe": -9.0}
"""GeLU MLPs (no w3)."""


def eager_saved_tensors(arch: ArchLike) -> dict[str, Values]:
    """Saved tensors per layer block of one micro-batch's forward (see EAGER_SAVED_TENSORS)."""
    f = np.asarray
    ungated = ~f(arch.gated_ffn, dtype=bool)
    shared = f(arch.n_shared_experts, dtype=float) > 0
    return {"attention": f(EAGER_SAVED_TENSORS["attention"]),
            "dense_ffn": EAGER_SAVED_TENSORS["dense_ffn"] + ungated * EAGER_SAVED_UNGATED["dense_ffn"],
            "moe": EAGER_SAVED_TENSORS["moe"] + shared * EAGER_SAVED_SHARED_EXPERT
            + (ungated & shared) * EAGER_SAVED_UNGATED["moe"]}

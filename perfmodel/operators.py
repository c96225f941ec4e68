"""The operators of one transformer layer, per phase, for one micro-batch on one device.

A layer is a list of `Op`s (DESIGN.md "Performance model"): each states, for the
forward pass, the input-gradient (dgrad) and the weight-gradient (wgrad) pass,
the FLOPs it executes, the HBM bytes it moves, the kernels it launches and the
FLOPs of one kernel call (the size its efficiency is looked up at), and whether
communication can run beside it. Collectives are `Comm`s (group, kind, bytes).
Everything is numpy arithmetic, so one definition serves one configuration
(`MoEArchitecture` + `ParallelLayout`, floats out) and a batch (arrays out).

Conventions and sources
- GEMM (M x K)·(K x N): 2MKN FLOPs forward, the same again for dgrad and for
  wgrad (PaLM, Chowdhery et al. 2022, app. B). Bytes: both operands read and
  the output written once (tiles re-read from cache are not HBM traffic);
  wgrad accumulates into fp32 main gradients (read + write 4 B each, Megatron
  `main_grad`).
- Tensor parallel (Megatron, Shoeybi et al. 2019): QKV/up projections split
  their output dimension, out/down projections their input dimension, by tp.
  Context parallel splits the sequence (tokens per rank / cp).
- Attention core = FlashAttention (Dao 2023, FlashAttention-2): causal, so it
  executes half of the 4·s·h_q score/value FLOPs per token that the model-FLOP
  convention counts; its backward executes 5 matmuls to the forward's 2
  (2.5x). It never stores the s x s score matrix. It runs in bf16 even when the
  GEMMs run in fp8 (Transformer Engine's default; FP8 attention is opt-in).
- MoE (Megatron-Core token dispatchers, the layout's `dispatcher`): tokens are split
  over tp before routing (Megatron-Core requires sequence parallel for MoE with tp > 1),
  each rank routes its T/tp tokens to top_k experts and
    alltoall   permutes the copies, sends them over the ep group, runs E/ep local
               experts as one grouped GEMM (etp splits d_expert, tokens all-gathered
               over etp), returns and un-permutes them;
    allgather  all-gathers the tokens and their routing (bool map + fp32 probabilities,
               5 bytes per token and expert) over the etp*ep group, selects (permutes)
               its local experts' copies, and reduce-scatters the scatter-added output;
    deepep /   sends each token once per destination rank (fused dispatch/combine
    hybridep   kernels priced from measurements, `perfmodel.dispatch`); deepep permutes
               the received rows into expert order on the rank, hybridep fuses that.
  The busiest expert-parallel rank receives f times the mean copies, f the expected
  maximum of the uniform-routing model (`perfmodel.routing.busiest_load_factor`, of E,
  top_k, ep and the etp*ep*T/tp tokens of one micro-batch in the group). A capacity
  factor c caps each expert at c times its mean (rows min(f, c)), or pads every expert
  to it (rows c); the tokens it drops are `routing.dropped_fraction`.
- Multi-head latent attention (`mla_attention_ops`, Megatron-Core `MLASelfAttention`): the
  down projections (replicated weights) run on the rank's sequence shard, the compressed
  latents are gathered over tp (sequence parallel) and normed, the up projections split
  heads over tp, the core runs with query/key heads of head_dim and value heads of
  v_head_dim. Selective recompute of an MLA layer also recomputes the up projections
  (Megatron's `mla_up_proj`, with `core_attn`): their outputs Q, K, V are not stored.
- Multi-token prediction (`mtp_ops`, one block per module on the last stage): two norms and
  the 2h -> h projection; its layer, second LM head and embedding lookup are the
  attention / FFN / head / embedding blocks again (`perfmodel.tables` sums them).
- Shared experts and the dense FFN are tp-split like a Megatron MLP.
- Dropout is not modelled (LLaMA/Mixtral/DeepSeek pre-training uses none).
- Element sizes: activations 2 B (4 B for fp32 training); GEMM operands 1 B
  under fp8/mxfp8 (Transformer Engine casts GEMM inputs, outputs stay bf16).
- FP8 scope: only the transformer layers' linear GEMMs run at the fp8 peak. The
  router is a plain (bf16/fp32) linear in Megatron-Core (`TopKRouter`), and the LM
  head stays bf16: Megatron's `output_layer` is a `tensor_parallel.ColumnParallelLinear`,
  not a Transformer Engine module, and torchtitan's float8 converter skips `output`
  by default (`filter_fqns`). Both are `gemm_hp` (priced like attention: bf16).
- FP8 casts (`fp8_cast_ops`): every fp8 GEMM quantises its activation input in
  the forward pass and its output gradient in the backward pass, as separate
  memory-bound kernels, except where Transformer Engine fuses the cast into the
  producing kernel (LayerNormLinear / LayerNormMLP: the QKV and dense-FFN up
  inputs come out of the norm in fp8, the FFN down input out of the activation,
  and the up projection's gradient out of the activation's backward). `fp8` is
  tensor-wise CURRENT scaling (Megatron-Bridge "FP8-CS", torchtitan float8
  tensorwise): the amax of the tensor must be known before the cast, one extra
  read (TE docs, "FP8 Current Scaling"); and Hopper FP8 GEMMs take only the TN
  layout, so each tensor is written rowwise and columnwise (TE docs,
  "Performance considerations: handling transposes"): per element 2b read + 2 B
  written, 2 kernels. `mxfp8` computes its per-32-element scales inside the
  cast (one read) and writes rowwise and columnwise data with their E8M0 scales:
  b + 2·(1 + 1/32) B, 1 kernel (TE docs, "MXFP8"). Weights are cast once per
  step (TE caches them across micro-batches, `is_first_microbatch`): not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Union

import numpy as np

from perfmodel.memo import memoised, memoised_last
from perfmodel.routing import busiest_load_factor, dropped_fraction
from perfmodel.specs.architecture import uses_mla
from perfmodel.specs.layout import (
    DEFAULT_RECOMPUTE_MASK,
    DISPATCHERS,
    DP_FLAVORS,
    PRECISIONS,
    RECOMPUTE_MODES,
    RECOMPUTE_MODULES,
    recompute_module_mask,
)
from perfmodel.specs.protocols import ArchLike, LayoutLike, Values

PHASES = ("fwd", "dgrad", "wgrad")
"""Forward, input-gradient, weight-gradient."""

KINDS = ("gemm", "gemm_hp", "attention", "expert_gemm", "memory")
"""gemm: a dense matmul at the layout's precision; gemm_hp: a matmul that stays in
bf16 under fp8/mxfp8 (router, LM head); attention: the flash-attention core (bf16);
expert_gemm: routed experts' grouped GEMM; memory: bandwidth-bound
elementwise/permutation kernels (norms, activations, residuals, softmax, fp8 casts)."""

BLOCKS = ("attention", "dense_ffn", "moe", "embedding", "head")

FUSED_CALLS = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd")
"""The fused dispatcher's calls per MoE layer and micro-batch (`perfmodel.dispatch`)."""
ROUTING_BYTES_PER_EXPERT = 5.0
"""The allgather dispatcher gathers each token's routing map (1 byte per expert, bool) and
probabilities (4 bytes per expert, fp32) with its hidden state (Megatron-Core
`MoEAllGatherTokenDispatcher`)."""
MLA_UP_OPS = ("q_norm", "q_up", "kv_norm", "kv_up", "mla_rope")
"""The MLA ops Megatron's `mla_up_proj` recompute module repeats (up projections, their norms, rope)."""
RECOMPUTE_MODULE_OPS = {
    "core_attn": ("core_attention",),
    "mla_up_proj": MLA_UP_OPS,
    "layernorm": ("attn_norm", "ffn_norm", "moe_norm"),
    "moe_act": ("expert_act",),
    "mlp": ("ffn_up", "ffn_act", "ffn_down"),
    "op": (),
}
"""The ops each selective recompute module runs again in the backward pass (Megatron-Core
`TransformerConfig.recompute_modules`: core_attn the attention core, mla_up_proj MLA's up
projections and rope, layernorm the input and pre-MLP norms, moe_act the routed experts'
activation function, mlp the dense MLP); `op` (torchtitan's per-op policy) repeats a share of
every op (`op_sac`)."""
assert tuple(RECOMPUTE_MODULE_OPS) == RECOMPUTE_MODULES

FLASH_BWD_FACTOR = 2.5
"""FlashAttention-2 backward executes 5 matmuls to the forward's 2 (Dao 2023, sec. 3.1)."""

CAUSAL_FRACTION = 0.5
"""Causal attention kernels skip the masked upper triangle: about half the scores."""

FP32_GRAD_BYTES = 4
"""Main gradients are fp32 (Megatron sets accumulate_allreduce_grads_in_fp32 for bf16)."""


# ---------------------------------------------------------------------------
# Categorical layout fields as integer codes (ParallelLayout holds strings,
# LayoutBatch holds codes).

def _code(value: Union[str, np.ndarray], names: tuple[str, ...]) -> Union[int, np.ndarray]:
    if isinstance(value, str):
        return names.index(value)
    return np.asarray(value)


def precision_code(lay: LayoutLike) -> Union[int, np.ndarray]:
    return _code(lay.precision, PRECISIONS)


def recompute_code(lay: LayoutLike) -> Union[int, np.ndarray]:
    return _code(lay.recompute, RECOMPUTE_MODES)


def recompute_modules_code(lay: LayoutLike) -> Union[int, np.ndarray]:
    """Bit mask of the selective recompute modules (bit i: RECOMPUTE_MODULES[i])."""
    value = lay.recompute_modules
    if value is None:
        return DEFAULT_RECOMPUTE_MASK
    if isinstance(value, str):
        return recompute_module_mask(value)
    return np.asarray(value)


def recomputes(lay: LayoutLike, module: str) -> Union[bool, np.ndarray]:
    """Whether selective recompute checkpoints `module` (False under none and full)."""
    bit = 1 << RECOMPUTE_MODULES.index(module)
    mask = np.asarray(recompute_modules_code(lay)).astype(np.int64)
    return (np.asarray(recompute_code(lay)) == SELECTIVE) & ((mask & bit) != 0)


OpSacEntry = tuple[str, Values, Values, Values, Values]
"""(our op, its share of the op's FLOPs, output elements, present, an aten.mm) of one matmul call."""


def _op_sac_entries(arch: ArchLike, lay: LayoutLike, block: str) -> list[OpSacEntry]:
    """The matmul calls of one transformer block in torchtitan's order (Llama 3 / Qwen3 /
    DeepSeek-V3 modules: wq, wk, wv | wq_a, wq_b or wq, wkv_a, wkv_b; wo; then w1, w3, w2, or the
    router gate and the shared expert's w1, w3, w2), each mapped to the op that prices it here."""
    sh = shapes(arch, lay)
    w = mla_widths(arch, lay)
    T, T_sp, T_moe, h, h_q, h_kv, tp = sh["T"], sh["T_sp"], sh["T_moe"], sh["h"], sh["h_q"], sh["h_kv"], sh["tp"]
    lowp = np.asarray(precision_code(lay)) < FP8  # torchao float8 linears call aten._scaled_mm, not aten.mm
    gated = sh["gated"]
    one, yes = np.ones_like(np.asarray(T, dtype=float)), np.ones(np.shape(T), dtype=bool)
    up = np.where(gated, 0.5, 1.0)
    if block == "attention":
        mla = np.asarray(uses_mla(arch), dtype=bool)
        has_q = mla & np.asarray(w["has_q"], dtype=bool)
        H, d_q, d_r, d_v = w["H"], w["d_q"], w["d_r"], w["d_v"]
        qkv = h_q + 2.0 * h_kv
        return [("qkv_proj", h_q / qkv, T * h_q / tp, ~mla, lowp), ("qkv_proj", h_kv / qkv, T * h_kv / tp, ~mla, lowp),
                ("qkv_proj", h_kv / qkv, T * h_kv / tp, ~mla, lowp),
                ("q_down", one, T_sp * w["r_q"], has_q, lowp), ("q_up", one, T * H * d_q / tp, has_q, lowp),
                ("q_proj", one, T * H * d_q / tp, mla & ~has_q, lowp),
                ("kv_down", one, T_sp * (w["r_kv"] + d_r), mla, lowp),
                ("kv_up", one, T * H * (d_q - d_r + d_v) / tp, mla, lowp),
                ("out_proj", one, T * h, yes, lowp)]
    if block == "dense_ffn":
        width = np.asarray(arch.d_ff_dense, dtype=float) / tp
        return [("ffn_up", up, T * width, yes, lowp), ("ffn_up", 0.5 * one, T * width, gated, lowp),
                ("ffn_down", one, T * h, yes, lowp)]
    if block == "moe":
        shared = np.asarray(arch.n_shared_experts, dtype=float) * np.asarray(arch.d_expert, dtype=float) / tp
        return [("router", one, T_moe * np.asarray(arch.n_experts, dtype=float), yes, yes),  # the gate stays bf16
                ("shared_up", up, T * shared, shared > 0, lowp), ("shared_up", 0.5 * one, T * shared, (shared > 0) & gated, lowp),
                ("shared_down", one, T * h, shared > 0, lowp)]
    return []


def op_sac(arch: ArchLike, lay: LayoutLike, block: str, start: Values = 0.0) -> tuple[dict[str, Values], Values, Values]:
    """torchtitan's per-op selective activation checkpointing (`selective_ac_option = "op"`,
    torchtitan 2025-06 `_apply_ac_to_transformer_block`): inside each transformer block the
    outputs of aten.mm, flash SDPA, reduce-scatter and max are saved except every second aten.mm
    (a counter per block); every other op is recomputed in the backward pass. Per op of `block`,
    the share of its forward recomputed (memory-bound ops and grouped expert GEMMs, which call
    aten._grouped_mm: 1; the attention core and OP_SAC_TRAILING: 0; a matmul: its calls' FLOP
    shares at even counts),
    the elements of the saved matmul outputs, and the counter after the block (`start`: before)."""
    count = np.asarray(start, dtype=float)
    recomputed: dict[str, Values] = {}
    present_any: dict[str, Values] = {}
    saved_elems: Values = 0.0
    for name, share, elems, present, is_mm in _op_sac_entries(arch, lay, block):
        here = np.asarray(present, dtype=bool)
        mm = here & np.asarray(is_mm, dtype=bool)
        count = count + mm
        keep = mm & (np.mod(count, 2.0) == 1.0)
        recomputed[name] = recomputed.get(name, 0.0) + np.where(here & ~keep, share, 0.0)
        present_any[name] = present_any.get(name, False) | here
        saved_elems = saved_elems + np.where(keep, elems, 0.0)
    # an op none of whose calls is made (no shared experts) recomputes its (zero) work as any other op
    shares = {n: np.where(present_any[n], v, 1.0) for n, v in recomputed.items()}
    shares.update({n: 0.0 for n in OP_SAC_TRAILING})
    return shares, saved_elems, count


OP_SAC_TRAILING = ("ffn_down", "shared_down", "ffn_residual", "moe_residual")
"""Ops torch.utils.checkpoint does not run again (early stop, its default): recomputation ends
once every tensor the backward needs is rebuilt, and the block's last down projection and its
residual add feed only additions (the trainer's op count checks it)."""


def op_sac_share(op: Op, recomputed: dict[str, Values]) -> Values:
    """The share of `op`'s forward torchtitan's per-op policy recomputes (`op_sac`)."""
    if op.name in recomputed:
        return recomputed[op.name]
    return 0.0 if op.kind == "attention" else 1.0


def dp_flavor_code(lay: LayoutLike) -> Union[int, np.ndarray]:
    return _code(lay.dp_flavor, DP_FLAVORS)


def dispatcher_code(lay: LayoutLike) -> Union[int, np.ndarray]:
    return _code(lay.dispatcher, DISPATCHERS)


FP32, BF16, FP16, FP8, MXFP8 = (PRECISIONS.index(p) for p in ("fp32", "bf16", "fp16", "fp8", "mxfp8"))
NONE, SELECTIVE, FULL = (RECOMPUTE_MODES.index(r) for r in ("none", "selective", "full"))
DDP, ZERO1, FSDP = (DP_FLAVORS.index(f) for f in ("ddp", "zero1", "fsdp"))
ALLTOALL, ALLGATHER, DEEPEP, HYBRIDEP = (DISPATCHERS.index(d) for d in ("alltoall", "allgather", "deepep", "hybridep"))


@memoised
def activation_bytes(lay: LayoutLike) -> Values:
    """Bytes per activation element: 4 for fp32 training, else 2 (bf16)."""
    return np.where(precision_code(lay) == FP32, 4.0, 2.0)


@memoised
def fp8_cast_bytes_per_element(lay: LayoutLike) -> tuple[Values, Values]:
    """(HBM bytes, kernels) per quantised element under fp8 (current scaling) and mxfp8;
    0 for other precisions (see the module doc, "FP8 casts")."""
    code = precision_code(lay)
    b = activation_bytes(lay)
    nbytes = np.where(code == FP8, 2.0 * b + 2.0, np.where(code == MXFP8, b + 2.0 * (1.0 + 1.0 / 32.0), 0.0))
    return nbytes, np.where(code == FP8, 2.0, np.where(code == MXFP8, 1.0, 0.0))


@memoised
def gemm_operand_bytes(lay: LayoutLike) -> Values:
    """Bytes per GEMM operand element: 1 under fp8/mxfp8, else the activation size."""
    return np.where(precision_code(lay) >= FP8, 1.0, activation_bytes(lay))


@memoised
def weight_bytes(lay: LayoutLike) -> Values:
    """Bytes per parameter of the model weights: fp32 4; bf16/fp16 2; fp8 keeps the
    bf16 weight plus a 1-byte fp8 copy (Transformer Engine) = 3."""
    code = precision_code(lay)
    return np.where(code == FP32, 4.0, np.where(code >= FP8, 3.0, 2.0))


# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """One operator for one micro-batch on one device (values per phase fwd/dgrad/wgrad)."""

    name: str
    block: str
    kind: str
    flops: tuple[Values, Values, Values]
    bytes: tuple[Values, Values, Values]
    kernels: tuple[Values, Values, Values]
    shape: tuple[Values, Values, Values]
    """What its efficiency is read at: a GEMM's forward (m, n, k) of one group (m rows, n
    outputs, k the reduction; each phase's own dims follow, `kernels.forms.phase_dims`); the
    attention core's (sequence length, head dim, 0); a memory-bound kernel's (0, 0, 0)."""
    overlappable: bool
    size_phase: int = 0
    """A memory-bound op's phase whose bytes per kernel set its efficiency (the forward,
    unless the op has no forward work, like a cast that only exists backward)."""
    memory_class: str = "copy"
    """The kernel class of a memory-bound op (`kernels.forms.MEMORY_CLASSES`); a GEMM's
    operand streams are priced as copies."""

    def row(self, i: int | None = None) -> dict[str, Any]:
        """Plain numbers (of candidate i for a batch) for tables and JSON."""
        def pick(x: Values) -> float:
            arr = np.asarray(x, dtype=float)
            return float(arr if arr.ndim == 0 else arr[i or 0])
        out: dict[str, Any] = {"name": self.name, "block": self.block, "kind": self.kind,
                               "overlappable": self.overlappable}
        for j, phase in enumerate(PHASES):
            out[f"{phase}_flops"] = pick(self.flops[j])
            out[f"{phase}_bytes"] = pick(self.bytes[j])
            out[f"{phase}_kernels"] = pick(self.kernels[j])
        return out


@dataclass(frozen=True)
class Comm:
    """One collective per micro-batch (per layer of its block) on one device.

    `group` names the process group (tp, cp, ep, etp, pp); `phase` is fwd or bwd;
    `bytes` is the buffer size S in nccl-tests' sense (the full buffer for
    all-reduce/all-gather/reduce-scatter, the per-rank send buffer for
    all-to-all, the message for p2p).
    """

    name: str
    block: str
    group: str
    kind: str
    phase: str
    bytes: Values


def _gemm(name: str, block: str, kind: str, m: Values, k: Values, n: Values, b_in: Values, b_out: Values,
          groups: Values = 1.0) -> Op:
    """A (possibly grouped) GEMM of m x k by k x n in total, split into `groups` equal
    sub-problems (local experts). Transformer Engine's grouped GEMM (Megatron-Core
    `TEGroupedMLP` -> `GroupedLinear` -> `te_general_grouped_gemm`) issues one cuBLAS GEMM
    per group, round-robin over its compute streams (`nvte_multi_stream_cublas_gemm`):
    `groups` kernel launches per phase, each of 2mkn/groups FLOPs (the efficiency size)."""
    flops = 2.0 * m * k * n
    weights = k * n
    fwd_bytes = b_in * (m * k + weights) + b_out * m * n
    dgrad_bytes = b_in * (m * n + weights) + b_out * m * k
    wgrad_bytes = b_in * (m * k + m * n) + 2 * FP32_GRAD_BYTES * weights
    return Op(name, block, kind, (flops, flops, flops), (fwd_bytes, dgrad_bytes, wgrad_bytes),
              (groups, groups, groups), (m / groups, n, k), True)


MEMORY_CLASS_OF = {
    "attn_norm": "norm", "ffn_norm": "norm", "moe_norm": "norm", "final_norm": "norm",
    "ffn_act": "activation", "expert_act": "activation", "shared_act": "activation",
    "permute": "permute", "unpermute_combine": "permute", "embedding": "permute",
    "cross_entropy": "cross_entropy", "fp8_cast": "cast",
}
"""Memory-bound op -> its kernel class (the rest: elementwise: residual adds, RoPE, router softmax,
top-k and load-balancing loss)."""


def _memory(name: str, block: str, fwd_bytes: Values, bwd_bytes: Values, kernels_fwd: Values = 1.0,
            kernels_bwd: Values = 1.0, size_phase: int = 0, memory_class: str | None = None) -> Op:
    """A bandwidth-bound kernel (its few FLOPs per element are not the limit) of `memory_class`
    (default: MEMORY_CLASS_OF[name], else elementwise)."""
    cls = memory_class or MEMORY_CLASS_OF.get(name, "elementwise")
    return Op(name, block, "memory", (0.0, 0.0, 0.0), (fwd_bytes, bwd_bytes, 0.0),
              (kernels_fwd, kernels_bwd, 0.0), (0.0, 0.0, 0.0), False, size_phase, cls)


def _fp8_cast(block: str, lay: LayoutLike, fwd_elements: Values, bwd_elements: Values, casts_fwd: Values,
              casts_bwd: Values) -> Op:
    """The separate fp8 quantisation kernels of a block's fp8 GEMMs (zero unless fp8/mxfp8)."""
    per_element, kernels = fp8_cast_bytes_per_element(lay)
    return _memory("fp8_cast", block, per_element * fwd_elements, per_element * bwd_elements,
                   kernels * casts_fwd, kernels * casts_bwd,
                   size_phase=1 if np.ndim(casts_fwd) == 0 and casts_fwd == 0 else 0)


@memoised_last
def shapes(arch: ArchLike, lay: LayoutLike) -> dict[str, Values]:
    """Token counts and widths (see `_shapes`), once per (arch, lay) in an evaluation and for the last
    pair outside one (`perfmodel.memo`)."""
    return _shapes(arch, lay)


def _shapes(arch: ArchLike, lay: LayoutLike) -> dict[str, Values]:
    """Token counts and widths of one micro-batch on one device (all as floats/arrays).

    T      tokens of the micro-batch on this rank: mbs * s / cp
    T_sp   tokens a norm/residual sees: T / tp with sequence parallel, else T
    T_moe  tokens this rank routes: T / tp (MoE layers are sequence-parallel)
    M_mean rows an expert-parallel rank receives on average: etp * T_moe * top_k
           (what its stored activations add up to over many layers, see memory.py)
    load   f, the busiest rank's rows over the mean (`routing.busiest_load_factor` of E, k,
           ep and etp * ep * T_moe tokens)
    rows   rows of the busiest rank over the mean: f dropless; min(f, c) with capacity factor
           c; c when padded to capacity
    M_exp  rows of the grouped expert GEMM on the busiest rank: M_mean * rows
    M_kept rows a rank stores on average: M_mean, times (1 - dropped) with a capacity, c padded
    drop   fraction of the copies a capacity factor drops (`routing.dropped_fraction`)
    """
    f = np.asarray
    tp, cp, etp, ep = (f(getattr(lay, n), dtype=float) for n in ("tp", "cp", "etp", "ep"))
    sp = f(lay.sequence_parallel, dtype=bool)
    tokens = f(lay.mbs, dtype=float) * f(arch.seq_len, dtype=float) / cp
    h_q = f(arch.n_heads, dtype=float) * f(arch.head_dim, dtype=float)
    h_kv = f(arch.n_kv_heads, dtype=float) * f(arch.head_dim, dtype=float)
    t_moe = tokens / tp
    n_experts = f(arch.n_experts, dtype=float)
    b = activation_bytes(lay)
    t_sp = np.where(sp, tokens / tp, tokens)
    h = f(arch.d_model, dtype=float)
    k = f(arch.top_k, dtype=float)
    capacity = f(lay.capacity_factor if lay.capacity_factor is not None else 0.0, dtype=float)
    pad = f(lay.pad_to_capacity, dtype=bool)
    load = busiest_load_factor(n_experts, k, ep, etp * ep * t_moe)
    drop = dropped_fraction(n_experts, k, t_moe, capacity)
    capped = capacity > 0
    rows = np.where(capped, np.where(pad, capacity, np.minimum(load, capacity)), load)
    m_mean = etp * t_moe * k
    return {
        "b": b,
        "norm_fwd_bytes": 2.0 * b * t_sp * h,
        "norm_bwd_bytes": 3.0 * b * t_sp * h,
        "T": tokens,
        "T_sp": t_sp,
        "T_moe": t_moe,
        "M_exp": m_mean * rows,
        "M_mean": m_mean,
        "M_kept": m_mean * np.where(capped, np.where(pad, capacity, 1.0 - drop), 1.0),
        "load": load,
        "rows": rows,
        "drop": drop,
        "E_local": np.maximum(n_experts / ep, 1.0),
        "h": h,
        "h_q": h_q,
        "h_kv": h_kv,
        "V": f(arch.vocab_size, dtype=float),
        "s": f(arch.seq_len, dtype=float),
        "heads": f(arch.n_heads, dtype=float),
        "gated": f(arch.gated_ffn, dtype=bool),
        "tp": tp, "cp": cp, "ep": ep, "etp": etp, "sp": sp,
    }


def _act_bytes(gated: Values, rows: Values, width: Values, b: Values) -> tuple[Values, Values]:
    """SwiGLU reads gate+up and writes one (3 tensors), backward reads 3 writes 2;
    GeLU reads 1 writes 1, backward reads 2 writes 1."""
    fwd = np.where(gated, 3.0, 2.0) * rows * width * b
    bwd = np.where(gated, 5.0, 3.0) * rows * width * b
    return fwd, bwd


def only_where(ops: list[Op], on: Values) -> list[Op]:
    """The ops with every phase's work scaled by `on` (1 where the candidate runs them, 0 where
    not): one op list serves a batch that mixes, e.g., standard and latent attention."""
    def scale(values: tuple[Values, Values, Values]) -> tuple[Values, Values, Values]:
        return tuple(v * on for v in values)  # type: ignore[return-value]
    return [replace(op, flops=scale(op.flops), bytes=scale(op.bytes), kernels=scale(op.kernels)) for op in ops]


def attention_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Input norm, QKV projection, RoPE, flash-attention core, output projection, residual
    (`mha_attention_ops`), or multi-head latent attention's (`mla_attention_ops`)."""
    mla = np.asarray(uses_mla(arch))
    if not mla.any():
        return mha_attention_ops(arch, lay)
    if mla.all():
        return mla_attention_ops(arch, lay)
    on = mla.astype(float)
    return only_where(mha_attention_ops(arch, lay), 1.0 - on) + only_where(mla_attention_ops(arch, lay), on)


def mla_widths(arch: ArchLike, lay: LayoutLike) -> dict[str, Values]:
    """MLA widths per token on one rank: heads H, query/key head d_q, rope d_r, value d_v, ranks
    r_q, r_kv; has_q (r_q > 0); latent = what the up projections read and tp gathers
    ((r_q or h) + r_kv + d_r); col = the up projections' input width whose gradient tp reduces."""
    f = np.asarray
    h = f(arch.d_model, dtype=float)
    r_q = f(arch.q_lora_rank, dtype=float)
    r_kv = f(arch.kv_lora_rank, dtype=float)
    d_r = f(arch.qk_rope_head_dim, dtype=float)
    has_q = r_q > 0
    q_in = np.where(has_q, r_q, h)
    return {"H": f(arch.n_heads, dtype=float), "d_q": f(arch.head_dim, dtype=float), "d_r": d_r,
            "d_v": f(arch.v_head_dim, dtype=float), "r_q": r_q, "r_kv": r_kv, "has_q": has_q,
            "latent": q_in + r_kv + d_r, "col": q_in + r_kv + d_r}


def mla_attention_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Multi-head latent attention (module doc): norm, q down (r_q > 0; replicated weight, on
    the T_sp shard) + latent norm + q up, or the direct q projection; kv down, latent norm, kv
    up; RoPE on the rope parts; the flash core (scores over d_q, values over d_v); output
    projection; fp8 casts; residual."""
    sh = shapes(arch, lay)
    w = mla_widths(arch, lay)
    b, b_in = activation_bytes(lay), gemm_operand_bytes(lay)
    T, T_sp, h, tp = sh["T"], sh["T_sp"], sh["h"], sh["tp"]
    H, d_q, d_r, d_v, r_q, r_kv = w["H"], w["d_q"], w["d_r"], w["d_v"], w["r_q"], w["r_kv"]
    q_lora = w["has_q"].astype(float)
    q_heads = H * d_q / tp
    core_fwd = 2.0 * CAUSAL_FRACTION * T * sh["s"] * H * (d_q + d_v) / tp
    core_fwd_bytes = b * T * H * (2.0 * d_q + 2.0 * d_v) / tp + 4.0 * T * H / tp
    core_bwd_bytes = b * T * H * (4.0 * d_q + 4.0 * d_v) / tp + 4.0 * T * H / tp
    # the flash-attention kernel runs at the query/key head dim (d_q, rope part included)
    core = Op("core_attention", "attention", "attention", (core_fwd, FLASH_BWD_FACTOR * core_fwd, 0.0),
              (core_fwd_bytes, core_bwd_bytes, 0.0), (1.0, 2.0, 0.0), (sh["s"] / sh["cp"], d_q, 0.0), True)
    rope_bytes = 2.0 * b * T * (H * d_r / tp + d_r)
    q_ops = only_where([_gemm("q_down", "attention", "gemm", T_sp, h, r_q, b_in, b),
                        _memory("q_norm", "attention", 2.0 * b * T * r_q, 3.0 * b * T * r_q),
                        _gemm("q_up", "attention", "gemm", T, r_q, q_heads, b_in, b)], q_lora)
    q_ops += only_where([_gemm("q_proj", "attention", "gemm", T, h, q_heads, b_in, b)], 1.0 - q_lora)
    # fp8 casts: forward the inputs of the GEMMs without a fused norm (both down projections or
    # the direct q projection, the output projection); backward every projection's output gradient
    fwd_cast = np.where(w["has_q"], 2.0 * T_sp * h, T * h + T_sp * h) + T * H * d_v / tp
    bwd_cast = (np.where(w["has_q"], T_sp * r_q, 0.0) + T_sp * (r_kv + d_r) + T * q_heads
                + T * H * (d_q - d_r + d_v) / tp + T * h)
    return [
        _memory("attn_norm", "attention", sh["norm_fwd_bytes"], sh["norm_bwd_bytes"]),
        *q_ops,
        _gemm("kv_down", "attention", "gemm", T_sp, h, r_kv + d_r, b_in, b),
        _memory("kv_norm", "attention", 2.0 * b * T * r_kv, 3.0 * b * T * r_kv),
        _gemm("kv_up", "attention", "gemm", T, r_kv, H * (d_q - d_r + d_v) / tp, b_in, b),
        _memory("mla_rope", "attention", rope_bytes, rope_bytes),
        core,
        _gemm("out_proj", "attention", "gemm", T, H * d_v / tp, h, b_in, b),
        _fp8_cast("attention", lay, fwd_cast, bwd_cast, 3.0, 4.0 + q_lora),
        _memory("attn_residual", "attention", sh["norm_bwd_bytes"], sh["norm_bwd_bytes"]),
    ]


def mha_attention_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Input norm, QKV projection, RoPE, flash-attention core, output projection, residual."""
    sh = shapes(arch, lay)
    b, b_in = activation_bytes(lay), gemm_operand_bytes(lay)
    T, h, h_q, h_kv, tp = sh["T"], sh["h"], sh["h_q"], sh["h_kv"], sh["tp"]
    rope_bytes = 2.0 * b * T * (h_q + h_kv) / tp
    core_fwd = 4.0 * CAUSAL_FRACTION * T * sh["s"] * h_q / tp
    core_fwd_bytes = b * T * (2.0 * h_q + 2.0 * h_kv) / tp + 4.0 * T * sh["heads"] / tp
    core_bwd_bytes = b * T * (4.0 * h_q + 4.0 * h_kv) / tp + 4.0 * T * sh["heads"] / tp
    head_dim = np.asarray(arch.head_dim, dtype=float)
    core = Op("core_attention", "attention", "attention", (core_fwd, FLASH_BWD_FACTOR * core_fwd, 0.0),
              (core_fwd_bytes, core_bwd_bytes, 0.0), (1.0, 2.0, 0.0), (sh["s"] / sh["cp"], head_dim, 0.0), True)
    return [
        _memory("attn_norm", "attention", sh["norm_fwd_bytes"], sh["norm_bwd_bytes"]),
        _gemm("qkv_proj", "attention", "gemm", T, h, (h_q + 2.0 * h_kv) / tp, b_in, b),
        _memory("rope", "attention", rope_bytes, rope_bytes),
        core,
        _gemm("out_proj", "attention", "gemm", T, h_q / tp, h, b_in, b),
        # fwd: out_proj input (QKV input comes from the fused norm); bwd: both output gradients
        _fp8_cast("attention", lay, T * h_q / tp, T * (h + (h_q + 2.0 * h_kv) / tp), 1.0, 2.0),
        _memory("attn_residual", "attention", sh["norm_bwd_bytes"], sh["norm_bwd_bytes"]),
    ]


def _mlp_ops(prefix: str, block: str, sh: dict[str, Values], width: Values, b: Values, b_in: Values) -> list[Op]:
    """Megatron MLP split over tp: up (gate+up fused when gated), activation, down."""
    T, h, tp, gated = sh["T"], sh["h"], sh["tp"], sh["gated"]
    act_f, act_b = _act_bytes(gated, T, width / tp, b)
    up = _gemm(f"{prefix}_up", block, "gemm", T, h, np.where(gated, 2.0, 1.0) * width / tp, b_in, b)
    down = _gemm(f"{prefix}_down", block, "gemm", T, width / tp, h, b_in, b)
    launched = np.where(width > 0, 1.0, 0.0)  # no shared experts: no kernels at all
    return [
        replace(up, kernels=(launched,) * 3),
        _memory(f"{prefix}_act", block, act_f, act_b, launched, launched),
        replace(down, kernels=(launched,) * 3),
    ]


def dense_ffn_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Norm, dense MLP of width d_ff_dense, residual."""
    sh = shapes(arch, lay)
    b, b_in = activation_bytes(lay), gemm_operand_bytes(lay)
    width = np.asarray(arch.d_ff_dense, dtype=float)
    return [
        _memory("ffn_norm", "dense_ffn", sh["norm_fwd_bytes"], sh["norm_bwd_bytes"]),
        *_mlp_ops("ffn", "dense_ffn", sh, width, b, b_in),
        # LayerNormMLP fuses the up input and down input casts and the up gradient's;
        # the down projection's output gradient is cast on its own
        _fp8_cast("dense_ffn", lay, 0.0, sh["T"] * sh["h"], 0.0, 1.0),
        _memory("ffn_residual", "dense_ffn", sh["norm_bwd_bytes"], sh["norm_bwd_bytes"]),
    ]


def moe_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Norm, router (+softmax/top-k, load-balancing loss), permute, grouped expert GEMMs, un-permute and
    combine, shared experts, residual."""
    sh = shapes(arch, lay)
    b, b_in = activation_bytes(lay), gemm_operand_bytes(lay)
    T_moe, M, h, etp = sh["T_moe"], sh["M_exp"], sh["h"], sh["etp"]
    E = np.asarray(arch.n_experts, dtype=float)
    k = np.asarray(arch.top_k, dtype=float)
    d_local = np.asarray(arch.d_expert, dtype=float) / etp
    gated = sh["gated"]
    act_f, act_b = _act_bytes(gated, M, d_local, b)
    copies = T_moe * k
    permute_bytes = 2.0 * b * copies * h
    unpermute_fwd, unpermute_bwd = b * (2.0 * copies + T_moe) * h, b * (3.0 * copies + T_moe) * h
    permute_kernels, unpermute_kernels = (2.0, 2.0), (2.0, 3.0)
    code = np.asarray(dispatcher_code(lay))
    if np.any(code != ALLTOALL):
        # allgather: select the local experts' copies from the gathered tokens and scatter-add them
        # back; deepep: put the received rows into expert order and combine the copies into them;
        # hybridep: both fused into its kernels (module doc)
        gathered = sh["etp"] * sh["ep"] * T_moe
        received = np.asarray(fused_received_rows(arch, lay), dtype=float)
        permute_bytes = np.where(code == ALLTOALL, permute_bytes, np.where(code == HYBRIDEP, 0.0, 2.0 * b * M * h))
        rows_back = np.where(code == ALLGATHER, gathered, received)
        unpermute_fwd = np.where(code == ALLTOALL, unpermute_fwd,
                                 np.where(code == HYBRIDEP, 0.0, b * (2.0 * M + rows_back) * h))
        unpermute_bwd = np.where(code == ALLTOALL, unpermute_bwd,
                                 np.where(code == HYBRIDEP, 0.0, b * (3.0 * M + rows_back) * h))
        fused_permute = np.where(code == HYBRIDEP, 0.0, 1.0)
        permute_kernels = (2.0 * fused_permute, 2.0 * fused_permute)
        unpermute_kernels = (2.0 * fused_permute, 3.0 * fused_permute)
    ops = [
        _memory("moe_norm", "moe", sh["norm_fwd_bytes"], sh["norm_bwd_bytes"]),
        _gemm("router", "moe", "gemm_hp", T_moe, h, E, b, 4.0),
        _memory("router_topk", "moe", 4.0 * T_moe * E * 2.0, 4.0 * T_moe * E * 3.0, 3.0, 3.0),
        # load-balancing loss (Switch; Megatron-Core `TopKRouter._apply_aux_loss` ->
        # `switch_load_balancing_loss_func`): fp32 scores softmax again (read + write T·E·4),
        # tokens per expert from the routing map (T·E·1), sum of scores over tokens (T·E·4);
        # backward: broadcast the gradient (write 4) and the softmax backward (read 8, write 4)
        _memory("router_aux_loss", "moe", 13.0 * T_moe * E, 16.0 * T_moe * E, 4.0, 2.0),
        _memory("permute", "moe", permute_bytes, permute_bytes, *permute_kernels),
        _gemm("expert_up", "moe", "expert_gemm", M, h, np.where(gated, 2.0, 1.0) * d_local, b_in, b,
              groups=sh["E_local"]),
        _memory("expert_act", "moe", act_f, act_b),
        _gemm("expert_down", "moe", "expert_gemm", M, d_local, h, b_in, b, groups=sh["E_local"]),
        _memory("unpermute_combine", "moe", unpermute_fwd, unpermute_bwd, *unpermute_kernels),
    ]
    shared_width = np.asarray(arch.n_shared_experts, dtype=float) * np.asarray(arch.d_expert, dtype=float)
    ops += _mlp_ops("shared", "moe", sh, shared_width, b, b_in)
    # grouped experts (TE GroupedLinear, no norm/activation fusion): both inputs forward,
    # both output gradients backward; shared experts (plain TE linears on the normed
    # input): up and down inputs forward, down and up gradients backward
    up = np.where(gated, 2.0, 1.0)
    shared_w = shared_width / sh["tp"]
    has_shared = np.where(shared_width > 0, 1.0, 0.0)
    ops.append(_fp8_cast("moe", lay, M * (h + d_local) + sh["T"] * (h + shared_w) * has_shared,
                         M * (h + up * d_local) + sh["T"] * (h + up * shared_w) * has_shared,
                         2.0 + 2.0 * has_shared, 2.0 + 2.0 * has_shared))
    ops.append(_memory("moe_residual", "moe", sh["norm_bwd_bytes"], sh["norm_bwd_bytes"]))
    return ops


def embedding_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Vocab-parallel embedding lookup (first stage); backward scatter-adds into the
    fp32 gradient of the table."""
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    return [_memory("embedding", "embedding", 2.0 * b * sh["T"] * sh["h"],
                    (b + 2.0 * FP32_GRAD_BYTES) * sh["T"] * sh["h"], 2.0, 2.0)]


def head_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """Final norm, vocab-parallel LM head (bf16 even under fp8, see the module doc), fp32
    softmax cross-entropy (last stage)."""
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    T, h, V, tp = sh["T"], sh["h"], sh["V"], sh["tp"]
    logits = T * V / tp
    return [
        _memory("final_norm", "head", sh["norm_fwd_bytes"], sh["norm_bwd_bytes"]),
        _gemm("lm_head", "head", "gemm_hp", T, h, V / tp, b, b),
        # forward reads bf16 logits, writes and re-reads fp32 (max, exp-sum, loss);
        # backward writes the fp32 softmax gradient and the bf16 logit gradient.
        _memory("cross_entropy", "head", (b + 8.0) * logits, (4.0 + b) * logits, 4.0, 2.0),
    ]


def fused_received_rows(arch: ArchLike, lay: LayoutLike) -> Values:
    """Token rows the busiest rank receives from a deduplicating dispatch (each token once per
    destination rank holding one of its experts): ep T_moe p_rank(E, k, ep) rows
    (`perfmodel.routing.ranks_hit_probability`)."""
    from perfmodel.routing import ranks_hit_probability

    sh = shapes(arch, lay)
    return (sh["ep"] * sh["T_moe"] * ranks_hit_probability(np.asarray(arch.n_experts, dtype=float),
                                                           np.asarray(arch.top_k, dtype=float), sh["ep"]) * sh["rows"])


def mtp_ops(arch: ArchLike, lay: LayoutLike) -> list[Op]:
    """The MTP module's own ops (DeepSeek-V3 sec. 2.2; Megatron-Core `MultiTokenPredictionLayer`):
    norms of the shifted tokens' embeddings and of the hidden states, the 2h -> h projection
    (column-parallel over tp). Its layer, LM head and embedding lookup are priced as those
    blocks (`perfmodel.tables`)."""
    sh = shapes(arch, lay)
    b, b_in = activation_bytes(lay), gemm_operand_bytes(lay)
    T, h, tp = sh["T"], sh["h"], sh["tp"]
    return [
        _memory("mtp_norms", "mtp", 2.0 * sh["norm_fwd_bytes"], 2.0 * sh["norm_bwd_bytes"], 2.0, 2.0),
        _gemm("mtp_proj", "mtp", "gemm", T, 2.0 * h, h / tp, b_in, b),
        _fp8_cast("mtp", lay, T * 2.0 * h, T * h / tp, 1.0, 1.0),
    ]


def layer_ops(arch: ArchLike, lay: LayoutLike) -> dict[str, list[Op]]:
    """Every operator per block, for one micro-batch on one device: the explanation table.

    Blocks: attention (every layer), dense_ffn (dense layers), moe (routed layers),
    embedding (first pipeline stage), head (last stage), mtp (the MTP modules' own ops, when
    the model has them). Counts per stage are in `perfmodel.schedule.pipeline_stages`.
    """
    out = {
        "attention": attention_ops(arch, lay),
        "dense_ffn": dense_ffn_ops(arch, lay),
        "moe": moe_ops(arch, lay),
        "embedding": embedding_ops(arch, lay),
        "head": head_ops(arch, lay),
    }
    if np.any(np.asarray(arch.n_mtp_layers) > 0):
        out["mtp"] = mtp_ops(arch, lay)
    return out


def layer_comms(arch: ArchLike, lay: LayoutLike) -> dict[str, list[Comm]]:
    """Collectives of each block per micro-batch on one device (before placement/pricing).

    - attention / dense FFN: one tp all-reduce of T*h forward (after the row-parallel
      projection) and one backward (Megatron); with sequence parallel it is a
      reduce-scatter + all-gather of the same bytes, priced as one all-reduce.
    - moe: all-to-all dispatch and combine forward, the same two backward, each
      sending T_moe*top_k*h elements times the busiest rank's rows factor (`shapes`);
      with etp > 1 an all-gather before and a reduce-scatter after the experts over
      etp; shared experts gather/scatter their tokens over tp like an MLP. The
      allgather and fused dispatchers' collectives instead (module doc).
    - attention with MLA: tp gathers the latents (q, kv, rope) and reduce-scatters the
      output with sequence parallel; without it all-reduces the output forward and the
      latents' gradient backward; cp exchanges K (head_dim) and V (v_head_dim) of every head.
    - attention with cp > 1: ring exchange of K and V (all-gather of cp chunks)
      forward, K/V again plus their gradients (reduce-scatter) backward.
    - embedding: without sequence parallel an all-reduce of the looked-up rows, with
      it a reduce-scatter (Megatron VocabParallelEmbedding).
    - head: with sequence parallel, all-gather the hidden states forward and
      reduce-scatter their gradient backward; without, all-reduce the gradient
      backward; vocab-parallel cross-entropy: 3 all-reduces of T fp32 values
      (max, sum of exponentials, target logit).
    """
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    T, h, tp = sh["T"], sh["h"], sh["tp"]
    hidden = b * T * h
    k = np.asarray(arch.top_k, dtype=float)
    a2a = b * sh["T_moe"] * k * h * sh["rows"]
    etp_buf = b * sh["M_exp"] * h
    code = np.asarray(dispatcher_code(lay))
    dispatch_comms: list[Comm] = []
    if np.any(code != ALLTOALL):
        # allgather: tokens + routing gathered over etp*ep, the scatter-added output reduce-scattered
        # back (and the reverse in backward); fused: the 4 calls, priced from measured figures by
        # `perfmodel.tables` (`perfmodel.dispatch`), their bytes a 0/1 marker here
        a2a = np.where(code == ALLTOALL, a2a, 0.0)
        etp_buf = np.where(code == ALLGATHER, 0.0, etp_buf)
        gathered = sh["etp"] * sh["ep"] * sh["T_moe"]
        ag = np.where(code == ALLGATHER, 1.0, 0.0)
        tokens_ag = ag * b * gathered * h
        routing_ag = ag * ROUTING_BYTES_PER_EXPERT * gathered * np.asarray(arch.n_experts, dtype=float)
        fused = np.where((code == DEEPEP) | (code == HYBRIDEP), 1.0, 0.0) * np.where(sh["ep"] > 1, 1.0, 0.0)
        dispatch_comms = [Comm("ep_gather_fwd", "moe", "ep_etp", "all_gather", "fwd", tokens_ag + routing_ag),
                          Comm("ep_scatter_fwd", "moe", "ep_etp", "reduce_scatter", "fwd", tokens_ag),
                          Comm("ep_gather_bwd", "moe", "ep_etp", "all_gather", "bwd", tokens_ag),
                          Comm("ep_scatter_bwd", "moe", "ep_etp", "reduce_scatter", "bwd", tokens_ag),
                          *(Comm(f"ep_fused_{name}", "moe", "ep", "fused", name.rsplit("_", 1)[1], fused)
                            for name in FUSED_CALLS)]
    kv = b * sh["cp"] * T * 2.0 * sh["h_kv"] / tp
    shared = np.where(np.asarray(arch.n_shared_experts) > 0, hidden, 0.0)
    mla = np.asarray(uses_mla(arch))
    attn_hidden = hidden
    mla_comms: list[Comm] = []
    if mla.any():
        # MLA: K and V of every head cross the cp ring; tp gathers the latents (sequence
        # parallel) or reduces their gradients (not), and reduces the output projection's output
        w = mla_widths(arch, lay)
        kv = np.where(mla, b * sh["cp"] * T * w["H"] * (w["d_q"] + w["d_v"]) / tp, kv)
        attn_hidden = np.where(mla, 0.0, hidden)
        on_sp = np.where(mla & sh["sp"], 1.0, 0.0)
        off_sp = np.where(mla & ~sh["sp"], 1.0, 0.0)
        latent, out = on_sp * b * T * w["latent"], on_sp * hidden
        mla_comms = [Comm("tp_mla_latent_fwd", "attention", "tp", "all_gather", "fwd", latent),
                     Comm("tp_mla_out_fwd", "attention", "tp", "reduce_scatter", "fwd", out),
                     Comm("tp_mla_latent_bwd", "attention", "tp", "reduce_scatter", "bwd", latent),
                     Comm("tp_mla_out_bwd", "attention", "tp", "all_gather", "bwd", out),
                     Comm("tp_mla_fwd", "attention", "tp", "all_reduce", "fwd", off_sp * hidden),
                     Comm("tp_mla_bwd", "attention", "tp", "all_reduce", "bwd", off_sp * b * T * w["col"])]
    attn = [Comm("tp_attn_fwd", "attention", "tp", "all_reduce", "fwd", attn_hidden),
            Comm("tp_attn_bwd", "attention", "tp", "all_reduce", "bwd", attn_hidden),
            Comm("cp_kv_fwd", "attention", "cp", "all_gather", "fwd", kv),
            Comm("cp_kv_bwd", "attention", "cp", "all_gather", "bwd", kv),
            Comm("cp_dkv_bwd", "attention", "cp", "reduce_scatter", "bwd", kv)] + mla_comms
    dense = [Comm("tp_ffn_fwd", "dense_ffn", "tp", "all_reduce", "fwd", hidden),
             Comm("tp_ffn_bwd", "dense_ffn", "tp", "all_reduce", "bwd", hidden)]
    moe = [Comm("ep_dispatch_fwd", "moe", "ep", "all_to_all", "fwd", a2a),
           Comm("ep_combine_fwd", "moe", "ep", "all_to_all", "fwd", a2a),
           Comm("ep_dispatch_bwd", "moe", "ep", "all_to_all", "bwd", a2a),
           Comm("ep_combine_bwd", "moe", "ep", "all_to_all", "bwd", a2a),
           Comm("etp_gather_fwd", "moe", "etp", "all_gather", "fwd", etp_buf),
           Comm("etp_scatter_fwd", "moe", "etp", "reduce_scatter", "fwd", etp_buf),
           Comm("etp_gather_bwd", "moe", "etp", "all_gather", "bwd", etp_buf),
           Comm("etp_scatter_bwd", "moe", "etp", "reduce_scatter", "bwd", etp_buf),
           Comm("tp_shared_fwd", "moe", "tp", "all_reduce", "fwd", shared),
           Comm("tp_shared_bwd", "moe", "tp", "all_reduce", "bwd", shared)] + dispatch_comms
    sp_hidden = np.where(sh["sp"], hidden, 0.0)
    no_sp_hidden = np.where(sh["sp"], 0.0, hidden)
    embedding = [Comm("tp_embedding_fwd", "embedding", "tp", "all_reduce", "fwd", no_sp_hidden),
                 Comm("tp_embedding_sp_fwd", "embedding", "tp", "reduce_scatter", "fwd", sp_hidden)]
    head = [Comm("tp_head_gather_fwd", "head", "tp", "all_gather", "fwd", sp_hidden),
            Comm("tp_head_scatter_bwd", "head", "tp", "reduce_scatter", "bwd", sp_hidden),
            Comm("tp_head_reduce_bwd", "head", "tp", "all_reduce", "bwd", no_sp_hidden),
            *(Comm(f"tp_cross_entropy_{i}_fwd", "head", "tp", "all_reduce", "fwd", 4.0 * T) for i in range(3))]
    out = {"attention": attn, "dense_ffn": dense, "moe": moe, "embedding": embedding, "head": head}
    if np.any(np.asarray(arch.n_mtp_layers) > 0):  # the MTP projection's tp reduction, as an MLP's
        out["mtp"] = [Comm("tp_mtp_fwd", "mtp", "tp", "all_reduce", "fwd", hidden),
                      Comm("tp_mtp_bwd", "mtp", "tp", "all_reduce", "bwd", hidden)]
    return out


def eager_trainer_comms(arch: ArchLike, lay: LayoutLike) -> dict[str, list[Comm]]:
    """`layer_comms` with the bundled trainer's tensor-parallel collectives in place of
    Megatron's where it runs without sequence parallel (CPU clusters: their ranks run it).

    The trainer keeps q/k/v and w1/w3 as separate DTensor linears (torch ColwiseParallel), so
    each adds its own input-gradient all-reduce; MoE layers route a sequence shard per tp rank
    and gather the output; the LM head gathers full logits (no vocab-parallel loss). Counted
    per micro-batch with `calibration.eager_ops.fake_world` and torch.profiler
    (docs/eager_counts.md): attention fwd 1 / bwd 3 all-reduces of T*h; dense FFN 1 / 2
    (1 ungated); MoE layer: fwd the router's load statistics (E fp32 values) and the output
    all-gather, bwd the input gradient's all-gather; a gated shared expert fwd all-gather +
    reduce-scatter, bwd 2 all-reduces + 1 all-gather (1 all-reduce ungated); embedding fwd 1
    all-reduce; head fwd an all-gather of T*V logits, bwd 1 all-reduce. With sequence parallel (not counted) the
    Megatron list stays. Expert parallel adds the exchange of per-expert token counts (E int64)
    before each dispatch.
    """
    base = layer_comms(arch, lay)
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    plain = ~np.asarray(sh["sp"], dtype=bool)
    hidden = np.where(plain, b * sh["T"] * sh["h"], 0.0)
    gated = np.asarray(arch.gated_ffn, dtype=bool)
    shared = np.asarray(arch.n_shared_experts, dtype=float) > 0
    logits = np.where(plain, b * sh["T"] * np.asarray(arch.vocab_size, dtype=float), 0.0)
    router_stats = np.where(plain, 4.0 * np.asarray(arch.n_experts, dtype=float), 0.0)

    def tp(name: str, block: str, kind: str, phase: str, size: Values) -> Comm:
        return Comm(name, block, "tp", kind, phase, size)

    def megatron(block: str) -> list[Comm]:
        """The block's comms, tp ones kept only where sequence parallel is on."""
        return [c if c.group != "tp" else Comm(c.name, c.block, c.group, c.kind, c.phase, np.where(plain, 0.0, c.bytes))
                for c in base[block]]

    shared_hidden = np.where(shared, hidden, 0.0)
    return {
        "attention": megatron("attention") + [tp("eager_tp_attn_fwd", "attention", "all_reduce", "fwd", hidden)]
        + [tp(f"eager_tp_qkv_{i}_bwd", "attention", "all_reduce", "bwd", hidden) for i in range(3)],
        "dense_ffn": megatron("dense_ffn") + [tp("eager_tp_ffn_fwd", "dense_ffn", "all_reduce", "fwd", hidden),
                                              tp("eager_tp_w1_bwd", "dense_ffn", "all_reduce", "bwd", hidden),
                                              tp("eager_tp_w3_bwd", "dense_ffn", "all_reduce", "bwd",
                                                 np.where(gated, hidden, 0.0))],
        "moe": megatron("moe") + [
            Comm("eager_ep_counts_fwd", "moe", "ep", "all_to_all", "fwd", 8.0 * np.asarray(arch.n_experts, dtype=float)),
            tp("eager_tp_router_stats_fwd", "moe", "all_reduce", "fwd", router_stats),
            tp("eager_tp_moe_out_fwd", "moe", "all_gather", "fwd", hidden),
            tp("eager_tp_moe_in_bwd", "moe", "all_gather", "bwd", hidden),
            tp("eager_tp_shared_in_fwd", "moe", "all_gather", "fwd", shared_hidden),
            tp("eager_tp_shared_out_fwd", "moe", "reduce_scatter", "fwd", shared_hidden),
            tp("eager_tp_shared_w1_bwd", "moe", "all_reduce", "bwd", shared_hidden),
            tp("eager_tp_shared_w3_bwd", "moe", "all_reduce", "bwd", np.where(gated, shared_hidden, 0.0)),
            tp("eager_tp_shared_out_bwd", "moe", "all_gather", "bwd", shared_hidden)],
        "embedding": megatron("embedding") + [tp("eager_tp_embedding_fwd", "embedding", "all_reduce", "fwd", hidden)],
        "head": megatron("head") + [tp("eager_tp_logits_fwd", "head", "all_gather", "fwd", logits),
                                    tp("eager_tp_head_bwd", "head", "all_reduce", "bwd", hidden)],
        **({"mtp": megatron("mtp")} if "mtp" in base else {}),
    }

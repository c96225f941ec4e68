"""Memory per device: parameters, gradients, optimizer, activations, buffers.

Sources
- Mixed-precision Adam (Megatron-LM `theoretical_memory_usage.py`): bf16
  weights 2 B, fp32 main gradients 4 B, fp32 master weights + two moments
  12 B = 18 B/param; the distributed optimizer (ZeRO-1) shards the 12 B over
  the data-parallel group, FSDP (ZeRO-3) shards all three. fp32 training keeps
  no master copy: 4 + 4 + 8 B. fp8 adds a 1-byte fp8 weight copy (Transformer
  Engine). Dense parameters shard over dp*cp, routed experts over edp.
- Activations (Korthikanti et al. 2022, arXiv 2205.05198, sec. 4 and Table 2), listed per
  stored tensor and generalised to GQA, gated FFNs and MoE, without dropout
  masks (none in LLaMA-style pre-training) and with flash attention (no s x s
  score matrix is ever stored). Per layer and token, b bytes per element:
    attention  norm input h·r + QKV input h·r + Q,K,V (h_q + 2h_kv)/t + output h_q/t
               + fp32 log-sum-exp 4·heads/t      (r = 1/t with sequence parallel, else 1)
    dense FFN  norm input h·r + up input h·r + gate/up (1|2)·d/t + activation d/t
    MoE        norm + router input 2h·r + fp32 router probabilities 4E/t
               + per token copy the rank receives (M_mean rows): the dispatched input h
               (kept by fc1), gate/up output (1|2)·d_e/etp, the probability-weighted
               activation d_e/etp (kept by fc2) and its fp32 routing probability (4 B);
               Megatron-Core multiplies the probabilities inside the experts'
               activation (`GroupedMLP`/`TEGroupedMLP.activation_func_with_probs`), so
               the combine is a plain sum that keeps no expert output
               + shared experts as an MLP reading the router's input
  For a non-gated MHA 4h MLP this is 32·h bytes: Megatron-LM's
  `theoretical_memory_usage.compute_activation_memory` per-layer term
  s·b·h·(18 + 4·ffn/h) = 34·s·b·h minus the two 1-byte dropout masks
  (`tests/perfmodel/test_fidelity.py` checks it against that formula). Under fp8 the
  tensors kept only as GEMM inputs are the 1-byte fp8 copies Transformer Engine saves
  (`layer_activation_bytes`).
- Selective recompute (Megatron-Core's default module `core_attn`): the core attention
  runs inside `tensor_parallel.checkpoint`, so its internal tensors are recomputed, but
  its output is the input `linear_proj` saves for the weight gradient and stays stored
  (Korthikanti et al. Table 2: selective removes only the 5·a·s²·b terms; the 34·s·b·h
  remain). With flash attention the only internal tensor is the fp32 log-sum-exp, so
  selective saves that, and flash's own bf16 copy of the output under fp8. Full
  recompute keeps only each layer's input plus one layer's working set.
- The other selective modules (`--recompute-modules`; Megatron-Core's output-discarding
  checkpoints for layernorm, moe_act and mla_up_proj, a plain checkpoint for mlp) drop what
  their module's output was kept as: layernorm each norm's output (the QKV / MLP input, g,
  the router input, b), moe_act the routed experts' activation output (fc2's input, g per
  row and d_e/etp), mla_up_proj MLA's Q, K, V, mlp the dense MLP's gate/up output and
  activation (its input stays).
- MoE stored activations use the MEAN tokens per expert-parallel rank (M_mean), not the
  busiest rank's (M_exp = load x mean, `perfmodel.routing.busiest_load_factor`): a rank's peak is the sum over all its
  layers and in-flight micro-batches, and the rank that is busiest differs from layer to
  layer (routing is balanced by the auxiliary loss only on average), so the sum
  concentrates at the mean (law of large numbers over L x in-flight terms). The
  transient dispatch buffers of the one layer being computed keep the busiest rank's
  M_exp, as do the expert GEMM times (every all-to-all waits for the busiest rank).
- In-flight micro-batches: `schedule.in_flight` (1F1B / interleaved).
- Logits: bf16 logits plus the fp32 copy the vocab-parallel cross-entropy
  keeps for the backward pass ((b + 4)·T·V/t on the last stage).
- MoE buffers: all-to-all send and receive buffers of one layer in flight
  (2·b·M_exp·h) plus the permutation workspace (b·T_moe·k·h).
- FSDP: the gathered weights of the current and the prefetched layer
  (2 layers, bf16) plus one layer's unsharded fp32 gradient.
- Framework overhead (CUDA context, communicator buffers, fragmentation):
  `cluster.framework_overhead_bytes`.
- MoE stored rows: M_mean dropless; with a capacity factor the kept (not dropped) rows, or
  the padded capacity (`operators.shapes` M_kept).
- MLA (`mla_activation_bytes`): latents, Q/K/V and the core output; recomputing the up
  projections (mla_up_proj) and the core (core_attn) keeps the latents and the output projection's input.
- MTP modules on the last stage: their layer, projection input and a second set of logits.
- Per device (`memory_per_device`): the largest of the priced pipeline stages
  (`schedule.pipeline_stages`); what `evaluate` reports and the planner prunes with.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import numpy as np

from perfmodel import choice, memo
from perfmodel.choice import Rows
from perfmodel.memo import memoised, memoised_last
from perfmodel.operators import (
    FP8,
    FP32,
    FP32_GRAD_BYTES,
    FSDP,
    FULL,
    ZERO1,
    activation_bytes,
    dp_flavor_code,
    gemm_operand_bytes,
    mla_widths,
    op_sac,
    precision_code,
    recompute_code,
    recomputes,
    shapes,
    weight_bytes,
)
from perfmodel.schedule import Stage, in_flight, pipeline_stages
from perfmodel.specs.architecture import (
    attention_params_per_layer,
    dense_ffn_params,
    expert_params,
    n_moe_layers,
    router_params,
    uses_mla,
)
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.protocols import ArchLike, LayoutLike, Values

MEMORY_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "moe_buffers",
                     "fsdp_buffers", "framework")
STATIC_COMPONENTS = ("weights", "gradients", "optimizer", "fsdp_buffers", "framework")
"""The components that depend on the geometry, the stage and the sharding only (`stage_static_memory`):
not on mbs, recompute, sequence parallel, gbs, the overlap switches or the dispatcher."""


def stage_params(arch: ArchLike, lay: LayoutLike, counts: dict[str, Values]) -> tuple[Values, Values]:
    """(dense, expert) parameters one device of a stage holds (before dp sharding).

    Dense: attention/tp + 2 norms per layer, dense FFN/tp, router (replicated) and
    shared experts/tp per MoE layer, vocab-parallel embedding/LM head (V*h/tp each;
    tied embeddings on one stage are counted once), final norm on the head stage.
    Expert: E/ep routed experts per MoE layer, each split over etp.
    MTP modules (counts["mtp"]): their layer (of the last layer's type) as above, 3 norms and
    the 2h x h projection / tp; they share the LM head and need the embedding on their stage
    (Megatron keeps a copy there, kept equal to the first stage's like a tied embedding).
    """
    tp = np.asarray(lay.tp, dtype=float)
    h = np.asarray(arch.d_model, dtype=float)
    vocab = np.asarray(arch.vocab_size, dtype=float) * h / tp
    tied_here = np.asarray(arch.tie_embeddings, dtype=bool) & (counts["embedding"] > 0) & (counts["head"] > 0)
    dense = (counts["attention"] * (attention_params_per_layer(arch) / tp + 2.0 * h)
             + counts["dense_ffn"] * dense_ffn_params(arch) / tp
             + counts["moe"] * (router_params(arch) + np.asarray(arch.n_shared_experts) * expert_params(arch) / tp)
             + counts["embedding"] * vocab + counts["head"] * (np.where(tied_here, 0.0, vocab) + h))
    experts = (counts["moe"] * np.asarray(arch.n_experts, dtype=float) / np.asarray(lay.ep, dtype=float)
               * expert_params(arch) / np.asarray(lay.etp, dtype=float))
    mtp = counts.get("mtp", 0.0)
    if np.ndim(mtp) or mtp:
        moe = np.asarray(n_moe_layers(arch)) > 0
        ffn = np.where(moe, router_params(arch) + np.asarray(arch.n_shared_experts) * expert_params(arch) / tp,
                       dense_ffn_params(arch) / tp)
        mtp_embedding = np.where((mtp > 0) & (counts["embedding"] == 0), vocab, 0.0)
        dense = dense + mtp * (attention_params_per_layer(arch) / tp + 2.0 * h + ffn + 3.0 * h + 2.0 * h * h / tp) \
            + mtp_embedding
        experts = experts + mtp * np.where(moe, np.asarray(arch.n_experts, dtype=float) / np.asarray(lay.ep, dtype=float)
                                           * expert_params(arch) / np.asarray(lay.etp, dtype=float), 0.0)
    return dense, experts


@memoised
def shard_sizes(lay: LayoutLike) -> tuple[Values, Values]:
    """Data-parallel shard counts: dense over dp*cp, experts over edp = tp*cp*dp/(etp*ep)."""
    tp, cp, dp = (np.asarray(getattr(lay, n), dtype=float) for n in ("tp", "cp", "dp"))
    edp = np.maximum(tp * cp * dp / (np.asarray(lay.etp, dtype=float) * lay.ep), 1.0)
    return dp * cp, edp


@memoised
def optimizer_bytes_per_param(lay: LayoutLike) -> Values:
    """Adam state: fp32 master + 2 moments = 12 B (mixed precision), 2 moments = 8 B (fp32)."""
    return np.where(precision_code(lay) == FP32, 8.0, 12.0)


@memoised_last
def layer_activation_bytes(arch: ArchLike, lay: LayoutLike) -> dict[str, Values]:
    """Stored activation bytes of one layer's blocks for one micro-batch (recompute none/selective).

    b = activation bytes, g = GEMM-input bytes: under fp8/mxfp8 Transformer Engine saves the
    fp8-cast input of each fp8 GEMM for its weight gradient (1 B), so tensors kept only as
    GEMM inputs cost g; tensors other kernels need (norm inputs, Q/K/V, activation-function
    inputs, expert outputs) stay at b. Without recompute the attention output is kept at
    b for the flash backward plus a g copy for the output projection under fp8, and the
    fp32 log-sum-exp; selective recompute of core_attn keeps only the projection's input
    (g) (module doc). Routed-expert tensors count the mean rows per rank (M_mean).
    """
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    g = gemm_operand_bytes(lay)
    fp8 = precision_code(lay) >= FP8
    T, T_sp, T_moe, M = sh["T"], sh["T_sp"], sh["T_moe"], sh["M_kept"]
    h, h_q, h_kv, tp, etp = sh["h"], sh["h_q"], sh["h_kv"], sh["tp"], sh["etp"]
    up = np.where(sh["gated"], 2.0, 1.0)
    core = recomputes(lay, "core_attn")
    # layernorm recompute discards each norm's output (the next GEMM's input, or the router's)
    norm_out = np.where(recomputes(lay, "layernorm"), 0.0, 1.0)
    kept_without_recompute = np.where(fp8, b + g, b) * T * h_q / tp + 4.0 * T * sh["heads"] / tp
    attention = ((b + norm_out * g) * T_sp * h + b * T * (h_q + 2.0 * h_kv) / tp
                 + np.where(core, g * T * h_q / tp, kept_without_recompute))
    mla = np.asarray(uses_mla(arch))
    if mla.any():
        attention = np.where(mla, mla_activation_bytes(arch, lay), attention)
    d_ff = np.asarray(arch.d_ff_dense, dtype=float)
    # mlp recompute checkpoints the dense MLP: only its input stays
    dense = (b + norm_out * g) * T_sp * h + np.where(recomputes(lay, "mlp"), 0.0, (b * up + g) * T * d_ff / tp)
    d_loc = np.asarray(arch.d_expert, dtype=float) / etp
    shared = np.asarray(arch.n_shared_experts, dtype=float) * np.asarray(arch.d_expert, dtype=float)
    act_out = np.where(recomputes(lay, "moe_act"), 0.0, g)  # moe_act discards fc2's input
    moe = ((1.0 + norm_out) * b * T_sp * h + 4.0 * T_moe * np.asarray(arch.n_experts, dtype=float)
           + M * (g * h + (b * up + act_out) * d_loc + 4.0)
           + np.where(shared > 0, np.where(fp8, g * T_sp * h, 0.0) + (b * up + g) * T * shared / tp, 0.0))
    op = recomputes(lay, "op")
    if np.any(op):  # torchtitan's per-op policy: the block input and the saved outputs only
        _, att_elems, count = op_sac(arch, lay, "attention")
        wm = mla_widths(arch, lay)
        core_out = np.where(mla, T * wm["H"] * wm["d_v"] / tp, T * h_q / tp)
        heads = np.asarray(arch.n_heads, dtype=float)
        attention = np.where(op, b * T_sp * h + b * (att_elems + core_out) + 4.0 * T * heads / tp, attention)
        dense = np.where(op, b * op_sac(arch, lay, "dense_ffn", count)[1], dense)
        moe = np.where(op, b * op_sac(arch, lay, "moe", count)[1], moe)
    return {"attention": attention, "dense_ffn": dense, "moe": moe, "layer_input": b * T_sp * h}


def mla_activation_bytes(arch: ArchLike, lay: LayoutLike) -> Values:
    """Stored bytes of one MLA attention block per micro-batch: the norm input (b) and the down
    projections' input (g; one copy, as for the QKV input), the latents the up projections keep
    (their norms' inputs and the rope key: b T (r_q + r_kv + d_r), T rows: gathered over tp), and
    without recompute Q, K, V (b T H (2 d_q + d_v) / tp), the core output (b, + g under fp8) and
    its fp32 log-sum-exp; recomputing core_attn keeps only the output projection's input (g) of
    the core, mla_up_proj drops Q, K, V (rebuilt from the latents), layernorm the norm output."""
    sh = shapes(arch, lay)
    w = mla_widths(arch, lay)
    b, g = activation_bytes(lay), gemm_operand_bytes(lay)
    fp8 = precision_code(lay) >= FP8
    T, T_sp, h, tp = sh["T"], sh["T_sp"], sh["h"], sh["tp"]
    H, d_q, d_v = w["H"], w["d_q"], w["d_v"]
    latents = b * T * (w["r_q"] + w["r_kv"] + w["d_r"])
    out = T * H * d_v / tp
    qkv = np.where(recomputes(lay, "mla_up_proj"), 0.0, b * T * H * (2.0 * d_q + d_v) / tp)
    core = np.where(recomputes(lay, "core_attn"), g * out, np.where(fp8, b + g, b) * out + 4.0 * T * H / tp)
    norm_out = np.where(recomputes(lay, "layernorm"), 0.0, 1.0)
    return (b + norm_out * g) * T_sp * h + latents + qkv + core


def stage_memory(arch: ArchLike, lay: LayoutLike, cluster: ClusterSpec, stage: Union[str, Stage],
                 counts: Optional[dict[str, Values]] = None, params: Optional[tuple[Values, Values]] = None,
                 activations: Optional[dict[str, Values]] = None) -> dict[str, Values]:
    """Memory components (bytes) of one device of a pipeline stage: a `Stage` of
    `schedule.pipeline_stages`, or `first` / `last` (rank 0 / pp - 1).

    `counts` (the stage's), `params` (stage_params(...)) and `activations`
    (layer_activation_bytes(...)) may be passed when already computed.
    """
    if isinstance(stage, str):
        stages = pipeline_stages(arch, lay)
        stage = stages[0] if stage == "first" else stages[1]
    counts = stage.counts if counts is None else counts
    static = stage_static_memory(arch, lay, cluster, counts, params)

    act = layer_activation_bytes(arch, lay) if activations is None else activations
    per_mb = (counts["attention"] * act["attention"] + counts["dense_ffn"] * act["dense_ffn"]
              + counts["moe"] * act["moe"])
    ffn_max = np.maximum(np.where(counts["moe"] > 0, act["moe"], 0.0),
                         np.where(counts["dense_ffn"] > 0, act["dense_ffn"], 0.0))
    one_layer = act["attention"] + ffn_max
    full = recompute_code(lay) == FULL
    per_mb = np.where(full, counts["attention"] * act["layer_input"], per_mb)
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    mtp = counts.get("mtp", 0.0)
    mtp_logits: Values = 0.0
    if np.ndim(mtp) or mtp:
        # an MTP module stores its layer, its two normed inputs (concatenated: the projection's
        # input) and its own logits (a second LM head); full recompute leaves it out
        moe_model = np.asarray(n_moe_layers(arch)) > 0
        mtp_layer = act["attention"] + np.where(moe_model, act["moe"], act["dense_ffn"]) + 4.0 * b * sh["T"] * sh["h"]
        per_mb = per_mb + mtp * mtp_layer
        mtp_logits = mtp * (b + 4.0) * sh["T"] * sh["V"] / sh["tp"]
    activations_bytes = in_flight(lay, stage.rank) * per_mb + np.where(full, one_layer, 0.0)

    logits = counts["head"] * (b + 4.0) * sh["T"] * sh["V"] / sh["tp"] + mtp_logits
    copies = sh["T_moe"] * np.asarray(arch.top_k, dtype=float)
    moe_buffers = np.where(counts["moe"] > 0, 2.0 * b * sh["M_exp"] * sh["h"] + b * copies * sh["h"], 0.0)

    out = {"activations": activations_bytes, "logits": logits, "moe_buffers": moe_buffers,
           **{k: np.zeros_like(activations_bytes) + v for k, v in static.items()}}
    return {k: out[k] for k in MEMORY_COMPONENTS}


def stage_static_memory(arch: ArchLike, lay: LayoutLike, cluster: ClusterSpec, counts: dict[str, Values],
                        params: Optional[tuple[Values, Values]] = None) -> dict[str, Values]:
    """The STATIC_COMPONENTS of `stage_memory` (bytes) of a stage holding `counts`: weights and fp32
    gradients of the parameters a device holds (its dp shard under FSDP), optimizer state of those
    it updates (its shard under ZeRO-1 and FSDP), FSDP's gathered-layer buffers (one mean layer's
    parameters x (2 x gather bytes + fp32 gradient)), the framework's fixed overhead."""
    dense, experts = stage_params(arch, lay, counts) if params is None else params
    shard_dense, shard_expert = shard_sizes(lay)
    flavor = dp_flavor_code(lay)
    fsdp = flavor == FSDP
    sharded_opt = (flavor == ZERO1) | fsdp
    held = np.where(fsdp, dense / shard_dense + experts / shard_expert, dense + experts)
    updated = np.where(sharded_opt, dense / shard_dense + experts / shard_expert, dense + experts)
    layers = np.maximum(counts["attention"], 1.0)
    layer_params = (dense + experts) / layers
    gather_bytes = np.where(precision_code(lay) == FP32, 4.0, 2.0)
    return {
        "weights": weight_bytes(lay) * held,
        "gradients": FP32_GRAD_BYTES * held,
        "optimizer": optimizer_bytes_per_param(lay) * updated,
        "fsdp_buffers": np.where(fsdp, layer_params * (2.0 * gather_bytes + FP32_GRAD_BYTES), 0.0),
        "framework": np.zeros_like(held) + cluster.framework_overhead_bytes,
    }


class DeviceMemory(NamedTuple):
    """Memory per device of the largest priced pipeline stage."""

    total_bytes: np.ndarray
    breakdown: dict[str, np.ndarray]
    """Bytes per MEMORY_COMPONENTS entry, of the largest stage."""
    stage: np.ndarray
    """Index into `schedule.pipeline_stages` of the largest stage (0: the first, 1: the last)."""


def memory_per_device(arch: ArchLike, lay: LayoutLike, cluster: ClusterSpec,
                      stages: Optional[list[Stage]] = None,
                      params: Optional[list[tuple[Values, Values]]] = None) -> DeviceMemory:
    """Bytes per device of the largest pipeline stage (of `schedule.pipeline_stages`; the others
    hold no more), with that stage's components; ties go to the earlier stage.

    `stages` and `params` ([stage_params(...) per stage]) may be passed when already computed."""
    with memo.scope():  # the stages share their batch's formulas (`perfmodel.memo`)
        stages = pipeline_stages(arch, lay) if stages is None else stages
        activations = layer_activation_bytes(arch, lay)
        return largest_stage([stage_memory(arch, lay, cluster, st, st.counts, None if params is None else params[i],
                                           activations) for i, st in enumerate(stages)])


def largest_stage(mem: list[dict[str, Values]], rows: Optional[list[Rows]] = None) -> DeviceMemory:
    """`DeviceMemory` of the largest of the stages' `stage_memory` components (ties: the earlier);
    `rows`: the candidates each stage's components are given for (`perfmodel.choice`; None: all)."""
    rows = [None] * len(mem) if rows is None else rows
    totals = [sum(m[k] for k in MEMORY_COMPONENTS) for m in mem]
    index, best = choice.largest(totals, rows)
    total = np.asarray(best, dtype=float)
    largest_stage = choice.Chosen(index, rows)
    breakdown = {k: np.broadcast_to(largest_stage.of([m[k] for m in mem]), total.shape).astype(float)
                 for k in MEMORY_COMPONENTS}
    return DeviceMemory(total, breakdown, np.asarray(index))

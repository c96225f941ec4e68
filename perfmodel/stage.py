"""Times of one pipeline stage: per micro-batch, and once per step.

Per micro-batch (sums over the stage's blocks, `tables.StageBlocks`):
- compute per category, fwd + bwd; recompute repeats the layers' forward (full)
  or the attention core's (selective; with MLA also the up projections) in the backward pass.
- Communication per class: tp, cp, ep from the block tables (full recompute
  repeats the layers' forward collectives); pp: vpp p2p sends of one
  micro-batch's boundary activations, b x T x h (/ tp with sequence parallel),
  per phase; FSDP: the parameter all-gather forward and backward plus the fp32
  gradient reduce-scatter backward, dense over dp*cp, experts over edp.
- Overlap (`hide`): within each phase, communication hides behind that phase's
  overlappable compute, at most the fraction `overlap_fractions` gives it (the layout's
  switches x what the runtime can hide, `Overlap`), in the order cp (behind attention only),
  tp, ep, pp, FSDP; the rest is exposed. Hidden seconds h cost compute_slowdown x h: the
  compute beside them runs slower (`Overlap.compute_slowdown`, measured).
- Fused dispatchers (`perfmodel.dispatch`): while their calls hide under compute, that compute
  runs on 1 - sm_fraction of the compute units, i.e. hidden x sm_fraction / (1 - sm_fraction)
  longer (in place of the generic compute_slowdown for those calls).
- Host: `HostDispatch` adds its dispatch time to the device time of both phases.

Once per step (after the last micro-batch):
- DDP all-reduces fp32 gradients; ZeRO-1 reduce-scatters them and all-gathers
  the updated parameters. Both hide behind the backward (gradients) or forward
  (parameters) window left over when `overlap_grad_reduce` / `overlap_param_gather` are on,
  except the last DDP_BUCKET_PARAMS bucket; off, they run after the backward / before the
  forward.
- Optimizer: optimizer_step_bytes_per_param x the parameters this rank updates
  (all under DDP, its dp shard under ZeRO-1/FSDP) through HBM, priced by the host.
"""

from __future__ import annotations

import numpy as np

from perfmodel.choice import select
from perfmodel.comm import CollectivePricer
from perfmodel.hardware import HardwareView
from perfmodel.host import HostDispatch
from perfmodel.memo import memoised
from perfmodel.memory import shard_sizes, stage_params
from perfmodel.operators import (
    DDP,
    FP32,
    FP32_GRAD_BYTES,
    FSDP,
    ZERO1,
    activation_bytes,
    dp_flavor_code,
    precision_code,
    shapes,
)
from perfmodel.specs.cluster import Overlap
from perfmodel.specs.protocols import LayoutLike, Values
from perfmodel.tables import CATEGORIES, LAYER_BLOCKS, StageBlocks

DDP_BUCKET_PARAMS = 40e6
"""Megatron-Core DDP bucket size (parameters): the last bucket's reduction cannot
hide behind the backward pass (`DistributedDataParallelConfig.bucket_size`)."""

HIDE_ORDER = ("cp", "tp", "ep", "pp", "fsdp")
"""Classes in the order they take the overlap window (cp behind attention only)."""

StageTimes = dict[str, Values]
"""Seconds of one stage by key (see `stage_times`)."""
StageParams = tuple[Values, Values]
"""(dense, expert) parameters one device of a stage holds before dp sharding (`memory.stage_params`)."""


@memoised
def optimizer_step_bytes_per_param(lay: LayoutLike) -> Values:
    """HBM bytes per updated parameter in the Adam step: read master, m, v, grad
    (16) + the gradient-norm read (4) + write master, m, v (12) + the bf16 weight
    (2) = 34; fp32 training has no separate weight copy: 32."""
    return np.where(precision_code(lay) == FP32, 32.0, 34.0)


def hide(comm_s: Values, fraction: float, window_s: Values) -> tuple[Values, Values]:
    """(hidden seconds, window seconds left): at most `fraction` of `comm_s`, at most the window."""
    hidden_s = np.minimum(fraction * comm_s, np.maximum(window_s, 0.0))
    return hidden_s, window_s - hidden_s


def hidden_ep_cost(sm_fraction: Values, overlap: Overlap) -> Values:
    """Seconds of compute slowdown per hidden EP second: sm / (1 - sm) for a fused dispatcher
    holding the share sm > 0 of the compute units (module doc), else `Overlap.compute_slowdown`."""
    sm = np.asarray(sm_fraction, dtype=float)
    return np.where(sm > 0, sm / (1.0 - np.minimum(sm, 0.99)), overlap.compute_slowdown)


def stage_times(stage: StageBlocks, overlap: Overlap, hw: HardwareView, pricer: CollectivePricer,
                host: HostDispatch) -> tuple[StageTimes, StageParams]:
    """Per-micro-batch and per-step seconds of one pipeline stage (keys: the categories,
    recompute, dispatch, micro_batch, {cls}_exposed / {cls}_hidden for tp cp ep pp fsdp,
    dp_step_exposed / dp_step_hidden, optimizer) and its parameters (dense, expert)."""
    arch, lay, counts, total = stage.arch, stage.lay, stage.counts, stage.total
    full, selective = stage.full, stage.selective
    launch_latency_s = hw.launch_latency_s

    out: StageTimes = {}
    for cat in CATEGORIES:
        out[cat] = total(f"fwd_{cat}") + total(f"bwd_{cat}")
    layer_fwd_s = sum(total(f"fwd_{cat}", LAYER_BLOCKS) for cat in CATEGORIES)
    layer_fwd_overlap_s = total("fwd_overlap", LAYER_BLOCKS)
    core_fwd_s = counts["attention"] * stage.tables["attention"]["core_fwd"]
    # selective recompute repeats the ops of the modules it checkpoints (tables.py)
    selective_fwd_s = stage.recomputed("fwd")
    selective_overlap_s = stage.recomputed("fwd_overlap")
    recompute_s = select(full, layer_fwd_s, select(selective, selective_fwd_s, 0.0))
    out["recompute"] = recompute_s

    fwd_compute_s = sum(total(f"fwd_{cat}") for cat in CATEGORIES)
    bwd_compute_s = sum(total(f"bwd_{cat}") for cat in CATEGORIES) + recompute_s
    fwd_window_s = total("fwd_overlap")
    bwd_window_s = total("bwd_overlap") + select(full, layer_fwd_overlap_s, select(selective, selective_overlap_s,
                                                                                          0.0))
    fwd_attn_s = total("fwd_attention")
    bwd_attn_s = total("bwd_attention") + select(full | stage.modules["core_attn"], core_fwd_s, 0.0)

    dense_params, expert_params = stage_params(arch, lay, counts)
    comm_s, param_gather_s, grad_scatter_s = _micro_batch_comm(stage, pricer, dense_params, expert_params)

    fraction = overlap_fractions(lay, overlap)
    exposed_s, hidden_s, left_s = {}, {}, {}
    for phase, window_s, attn_s in (("fwd", fwd_window_s, fwd_attn_s), ("bwd", bwd_window_s, bwd_attn_s)):
        phase_hidden, phase_exposed, left_s[phase] = _overlap_phase(comm_s, phase, window_s, attn_s, fraction)
        hidden_s.update(phase_hidden)
        exposed_s.update(phase_exposed)

    fwd_kernels, bwd_kernels = host.phase_kernels(stage)
    # compute beside hidden communication runs slower (`Overlap.compute_slowdown`); a fused
    # dispatcher's kernels instead hold sm_fraction of the compute units while hidden under
    # compute: that compute runs 1 / (1 - sm_fraction) longer
    stretch = hidden_ep_cost(stage.tables["moe"].get("ep_sm_fraction", 0.0), overlap)
    fwd_slowdown_s = overlap.compute_slowdown * sum(hidden_s[f"fwd_{c}"] for c in HIDE_ORDER if c != "ep") \
        + stretch * hidden_s["fwd_ep"]
    bwd_slowdown_s = overlap.compute_slowdown * sum(hidden_s[f"bwd_{c}"] for c in HIDE_ORDER if c != "ep") \
        + stretch * hidden_s["bwd_ep"]
    out["overlap_slowdown"] = fwd_slowdown_s + bwd_slowdown_s
    fwd_device_s = fwd_compute_s + sum(exposed_s[f"fwd_{c}"] for c in HIDE_ORDER) + fwd_slowdown_s
    bwd_device_s = bwd_compute_s + sum(exposed_s[f"bwd_{c}"] for c in HIDE_ORDER) + bwd_slowdown_s
    dispatch_s = host.dispatch_s(stage, fwd_kernels, bwd_kernels, fwd_device_s, bwd_device_s, launch_latency_s,
                                 hw.share)
    out["dispatch"] = dispatch_s
    out["micro_batch"] = fwd_device_s + bwd_device_s + dispatch_s
    for cls in ("tp", "cp", "ep", "pp", "fsdp"):
        out[f"{cls}_exposed"] = exposed_s[f"fwd_{cls}"] + exposed_s[f"bwd_{cls}"]
        out[f"{cls}_hidden"] = hidden_s[f"fwd_{cls}"] + hidden_s[f"bwd_{cls}"]

    out["dp_step_exposed"], out["dp_step_hidden"] = _dp_step_sync(
        lay, pricer, fraction, dense_params, expert_params, param_gather_s, grad_scatter_s, left_s)
    out["dp_step_slowdown"] = overlap.compute_slowdown * out["dp_step_hidden"]
    out["optimizer"] = _optimizer_s(stage, hw, pricer, host, dense_params, expert_params)
    return out, (dense_params, expert_params)


def _micro_batch_comm(stage: StageBlocks, pricer: CollectivePricer, dense_params: Values, expert_params: Values
                      ) -> tuple[dict[str, Values], Values, Values]:
    """(seconds per class and phase of one micro-batch, the parameter all-gather seconds,
    the gradient reduce-scatter seconds): full recompute repeats the forward collectives."""
    arch, lay, total, full = stage.arch, stage.lay, stage.total, stage.full
    comm_s: dict[str, Values] = {}
    for cls in ("tp", "cp", "ep"):
        comm_s[f"fwd_{cls}"] = total(f"fwd_{cls}")
        comm_s[f"bwd_{cls}"] = total(f"bwd_{cls}") + select(full, total(f"fwd_{cls}", LAYER_BLOCKS), 0.0)
    shape = shapes(arch, lay)
    p2p_bytes = activation_bytes(lay) * shape["T"] * shape["h"] / np.where(shape["sp"], shape["tp"], 1.0)
    p2p_s = np.asarray(lay.vpp, dtype=float) * pricer.time("pp", "p2p", p2p_bytes)
    comm_s["fwd_pp"] = p2p_s
    comm_s["bwd_pp"] = p2p_s
    fsdp = np.asarray(dp_flavor_code(lay)) == FSDP
    gather_bytes_per_param = np.where(precision_code(lay) == FP32, 4.0, 2.0)
    param_gather_s = (pricer.time("dp", "all_gather", gather_bytes_per_param * dense_params)
                      + pricer.time("edp", "all_gather", gather_bytes_per_param * expert_params))
    grad_scatter_s = (pricer.time("dp", "reduce_scatter", FP32_GRAD_BYTES * dense_params)
                      + pricer.time("edp", "reduce_scatter", FP32_GRAD_BYTES * expert_params))
    comm_s["fwd_fsdp"] = select(fsdp, param_gather_s, 0.0)
    comm_s["bwd_fsdp"] = select(fsdp, param_gather_s + grad_scatter_s, 0.0)
    return comm_s, param_gather_s, grad_scatter_s


def overlap_fractions(lay: LayoutLike, overlap: Overlap) -> dict[str, Values]:
    """The hideable fraction of each class for each candidate: the runtime's (`Overlap`) where the
    layout overlaps it. cp: always (the ring exchange overlaps the attention of the chunk before);
    tp: `tp_comm_overlap`; ep: `ep_comm_overlap`; pp: interleaved schedules (Megatron-Core overlaps
    their p2p, `--overlap-p2p-communication`, on by default; plain 1F1B waits for its sends);
    fsdp: FSDP prefetches the next layer's parameters and reduce-scatters behind the backward;
    grad / param: DDP and ZeRO-1's once-per-step sync, `overlap_grad_reduce` / `overlap_param_gather`."""
    flag = lambda name: np.asarray(getattr(lay, name), dtype=float)  # noqa: E731
    return {
        "cp": overlap.cp,
        "tp": overlap.tp * flag("tp_comm_overlap"),
        "ep": overlap.ep * flag("ep_comm_overlap"),
        "pp": overlap.pp * (np.asarray(lay.vpp, dtype=float) > 1),
        "fsdp": overlap.dp,
        "grad": overlap.dp * flag("overlap_grad_reduce"),
        "param": overlap.dp * flag("overlap_param_gather"),
    }


def _overlap_phase(comm_s: dict[str, Values], phase: str, window_s: Values, attn_s: Values,
                   fraction: dict[str, Values]) -> tuple[dict[str, Values], dict[str, Values], Values]:
    """(hidden, exposed seconds per class, window left) of one phase: cp hides behind the
    attention time only (and uses up the window), then tp, ep, pp, FSDP in turn."""
    cp_hidden_s, _ = hide(comm_s[f"{phase}_cp"], fraction["cp"], attn_s)
    window_s = window_s - cp_hidden_s
    tp_hidden_s, window_s = hide(comm_s[f"{phase}_tp"], fraction["tp"], window_s)
    ep_hidden_s, window_s = hide(comm_s[f"{phase}_ep"], fraction["ep"], window_s)
    pp_hidden_s, window_s = hide(comm_s[f"{phase}_pp"], fraction["pp"], window_s)
    fsdp_hidden_s, window_s = hide(comm_s[f"{phase}_fsdp"], fraction["fsdp"], window_s)
    hidden_s, exposed_s = {}, {}
    for cls, cls_hidden_s in (("cp", cp_hidden_s), ("tp", tp_hidden_s), ("ep", ep_hidden_s), ("pp", pp_hidden_s),
                              ("fsdp", fsdp_hidden_s)):
        hidden_s[f"{phase}_{cls}"] = cls_hidden_s
        exposed_s[f"{phase}_{cls}"] = comm_s[f"{phase}_{cls}"] - cls_hidden_s
    return hidden_s, exposed_s, np.maximum(window_s, 0.0)


def _dp_step_sync(lay: LayoutLike, pricer: CollectivePricer, fraction: dict[str, Values], dense_params: Values,
                  expert_params: Values, param_gather_s: Values, grad_scatter_s: Values,
                  left_s: dict[str, Values]) -> tuple[Values, Values]:
    """(exposed, hidden) seconds of the once-per-step DDP / ZeRO-1 synchronisation."""
    flavor = np.asarray(dp_flavor_code(lay))
    ddp = flavor == DDP
    zero1 = flavor == ZERO1
    grad_sync_s = select(
        ddp,
        pricer.time("dp", "all_reduce", FP32_GRAD_BYTES * dense_params)
        + pricer.time("edp", "all_reduce", FP32_GRAD_BYTES * expert_params),
        select(zero1, grad_scatter_s, 0.0))
    zero1_gather_s = select(zero1, param_gather_s, 0.0)
    local_params = np.maximum(dense_params + expert_params, 1.0)
    last_bucket = np.minimum(1.0, DDP_BUCKET_PARAMS / local_params)
    grad_hidden_s = np.minimum(np.minimum(fraction["grad"] * grad_sync_s, left_s["bwd"]),
                               grad_sync_s * (1.0 - last_bucket))
    gather_hidden_s = np.minimum(np.minimum(fraction["param"] * zero1_gather_s, left_s["fwd"]),
                                 zero1_gather_s * (1.0 - last_bucket))
    return grad_sync_s + zero1_gather_s - grad_hidden_s - gather_hidden_s, grad_hidden_s + gather_hidden_s


def _optimizer_s(stage: StageBlocks, hw: HardwareView, pricer: CollectivePricer, host: HostDispatch,
                 dense_params: Values, expert_params: Values) -> Values:
    """Seconds of the optimizer step over the parameters this rank updates."""
    lay = stage.lay
    shard_dense, shard_expert = shard_sizes(lay)
    sharded = np.asarray(dp_flavor_code(lay)) != DDP
    updated_params = np.where(sharded, dense_params / shard_dense + expert_params / shard_expert,
                              dense_params + expert_params)
    optimizer_bytes = optimizer_step_bytes_per_param(lay) * updated_params
    kernels = host.step_kernels(stage)
    memory_s = hw.memory_seconds(optimizer_bytes, kernels, "optimizer")
    return host.step_s(stage, memory_s, kernels, hw.launch_latency_s, hw.share, pricer)

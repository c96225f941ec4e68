"""`evaluate(archs, layouts, cluster)`: step time, throughput, MFU, memory, feasibility.

One vectorised code path over numpy arrays of candidates (a single
configuration is a batch of one, `perfmodel.inputs`). For each candidate:

1. Hardware (`perfmodel.hardware`): peaks of the layout's precision and the
   cluster's efficiency curves; each rank's share of a core from the cluster's
   host policy (`perfmodel.host`: 1 off-CPU).
2. Block tables (`perfmodel.tables`): operators (`perfmodel.operators`) per
   block for one micro-batch on one device, time of an op and phase =
   max(FLOPs / (peak x eff_compute(kernel FLOPs)), bytes / (HBM bandwidth x
   eff_memory(bytes per kernel))); collectives (`perfmodel.comm`) priced on the
   fabric levels their groups span.
3. Stages (`perfmodel.stage`): per micro-batch, each phase's communication
   hides behind that phase's overlappable compute (at most the cluster's
   `overlap` fraction), the host adds its dispatch time (`perfmodel.host`);
   once per step the DDP/ZeRO-1 synchronisation and the optimizer.
4. The slowest priced pipeline stage (`perfmodel.schedule.pipeline_stages`: the
   first, the last and the middle ranks no earlier rank dominates) sets the step:
   (m + (pp-1)/vpp) micro-batch slots, plus the exposed DP synchronisation, plus
   the optimizer step, times the straggler factor of the node count.
5. Memory (`perfmodel.memory.memory_per_device`) of the largest stage against
   usable HBM.

Breakdown (seconds per step): the STEP_COMPONENTS add up to step_time_s; the
*_hidden entries are communication that ran under compute (not added).
MFU = model_flops_per_token (DESIGN.md convention) x tokens/s / (devices x
peak of the layout's precision, times the core share on CPU clusters).

Infeasible candidates never raise: `feasible` is False and `reason` names the
first failed check (invalid_layout, devices, precision, dispatcher, memory); their
numbers are still computed (meaningless for invalid_layout) so a search can
report how far off they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from numpy.typing import ArrayLike

from perfmodel import choice, memo
from perfmodel.choice import Rows
from perfmodel.comm import CollectivePricer
from perfmodel.hardware import HardwareView
from perfmodel.host import HostDispatch, host_dispatch
from perfmodel.inputs import as_float, broadcast_inputs
from perfmodel.memory import largest_stage, layer_activation_bytes, stage_memory
from perfmodel.memory import stage_params as memory_stage_params
from perfmodel.operators import shapes
from perfmodel.result import BREAKDOWN_KEYS, HIDDEN_COMPONENTS, REASONS, STEP_COMPONENTS, EvalResult
from perfmodel.schedule import Stage, bubble_slots, micro_batches, pipeline_stages, straggler_factor
from perfmodel.specs.architecture import (
    ArchBatch,
    MoEArchitecture,
    model_flops_per_token,
    model_flops_per_token_palm,
    n_moe_layers,
)
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import LayoutBatch, ParallelLayout
from perfmodel.specs.protocols import Values
from perfmodel.stage import StageTimes, stage_times
from perfmodel.tables import StageBlocks, Tables, shared_block_tables
from perfmodel.validity import valid_mask

__all__ = ["BREAKDOWN_KEYS", "CHUNK", "HIDDEN_COMPONENTS", "REASONS", "STEP_COMPONENTS", "EvalResult", "evaluate"]

CHUNK = 32768
"""Candidates per vectorised pass: small enough that its arrays (256 KiB each) stay in cache, large
enough that the per-call overhead (~10 ms a pass) stays a few per cent (fastest of 8k-128k on
benchmarks/perfmodel_speed.py)."""


def evaluate(archs: Union[MoEArchitecture, ArchBatch], layouts: Union[ParallelLayout, LayoutBatch],
             cluster: ClusterSpec, devices: Optional[ArrayLike] = None) -> EvalResult:
    """Predict every candidate (see module doc). `devices` defaults to each layout's world size."""
    arch_b, lay_b, dev = broadcast_inputs(archs, layouts, devices)
    host = host_dispatch(cluster)
    n = len(dev)
    if n <= CHUNK:
        return _evaluate_chunk(arch_b, lay_b, cluster, host, dev)
    parts = []
    for start in range(0, n, CHUNK):
        idx = slice(start, min(start + CHUNK, n))
        parts.append(_evaluate_chunk(arch_b.take(idx), lay_b.take(idx), cluster, host, dev[idx]))
    return EvalResult.concat(parts)


def _evaluate_chunk(arch: ArchBatch, lay: LayoutBatch, cluster: ClusterSpec, host: HostDispatch,
                    devices: np.ndarray) -> EvalResult:
    with memo.scope():  # each formula of this chunk's batches once (`perfmodel.memo`)
        return _evaluate_batch(arch, lay, cluster, host, devices)


def _evaluate_batch(arch: ArchBatch, lay: LayoutBatch, cluster: ClusterSpec, host: HostDispatch,
                    devices: np.ndarray) -> EvalResult:
    valid = valid_mask(arch, lay, devices)  # on the given columns: integer remainders where they are integers
    arch, lay = as_float(arch), as_float(lay)
    pipeline = pipeline_stages(arch, lay)
    hw = HardwareView(cluster, lay, host.core_share(devices))
    pricer = CollectivePricer(cluster, lay, hw.share)
    tables = shared_block_tables(arch, lay, cluster, host.block_comms, pricer, hw)
    activations = layer_activation_bytes(arch, lay)
    m = micro_batches(lay)
    slots = bubble_slots(lay)
    stages: list[StageTimes] = []  # timed stages: times of every candidate, or of `timed_rows`
    timed_rows: list[Rows] = []
    timed_ranks: list[Values] = []
    memories: list[dict[str, Values]] = []  # every stage: memory of every candidate, or of `memory_rows`
    memory_rows: list[Rows] = []
    for i, stage in enumerate(pipeline):
        # The first and last stages are priced for every candidate. A further stage is padded with
        # the first where a candidate has fewer (`pipeline_stages`): a timed one is priced only for
        # the candidates where it differs from the first, the others keep the first's numbers (the
        # same counts and rank, the same numbers; `perfmodel.choice`), so a few uneven candidates
        # cost a few rows; a memory-only one (a few formulas) costs less on every candidate.
        rows = None if i < 2 else _rows_apart(stage, pipeline[0])
        if rows is not None and len(rows) == 0:
            continue  # the first stage again for every candidate: never slower or larger
        if not stage.timed:
            rows = None
        if rows is None:
            part = _StagePart(arch, lay, tables, stage, hw, pricer, activations, m, slots)
        else:
            part = _StagePart.of_rows(rows, arch, lay, tables, stage, hw, pricer, activations, m, slots)
        if stage.timed:
            st, memory_params = stage_times(StageBlocks(part.arch, part.lay, part.tables, part.stage.counts),
                                            cluster.overlap, part.hw, part.pricer, host)
            st["step"] = ((part.m + part.slots) * st["micro_batch"] + st["dp_step_exposed"] + st["dp_step_slowdown"]
                          + st["optimizer"])
            stages.append(st)
            timed_rows.append(rows)
            timed_ranks.append(stage.rank)
        else:  # a middle rank a later one outweighs: memory only
            memory_params = memory_stage_params(part.arch, part.lay, part.stage.counts)
        memories.append(stage_memory(part.arch, part.lay, cluster, part.stage, part.stage.counts, memory_params,
                                     part.activations))
        memory_rows.append(rows)
    slowest, _ = choice.largest([st["step"] for st in stages], timed_rows)  # ties go to the earlier stage
    slowest_stage = choice.Chosen(slowest, timed_rows)

    def pick(key: str) -> np.ndarray:
        return slowest_stage.of([st[key] for st in stages])

    factor = straggler_factor(cluster, devices)
    base_step_s = pick("step")
    step_s = base_step_s * factor
    breakdown = {
        "compute": m * pick("compute"),
        "attention": m * pick("attention"),
        "expert_gemm": m * pick("expert_gemm"),
        "recompute": m * pick("recompute"),
        "tp_exposed": m * pick("tp_exposed"),
        "cp_exposed": m * pick("cp_exposed"),
        "ep_exposed": m * pick("ep_exposed"),
        "pp_exposed": m * pick("pp_exposed"),
        "dp_exposed": m * pick("fsdp_exposed") + pick("dp_step_exposed"),
        "dispatch": m * pick("dispatch"),
        "overlap_slowdown": m * pick("overlap_slowdown") + pick("dp_step_slowdown"),
        "bubble": slots * pick("micro_batch"),
        "optimizer": pick("optimizer"),
        "straggler": base_step_s * (factor - 1.0),
        "tp_hidden": m * pick("tp_hidden"),
        "cp_hidden": m * pick("cp_hidden"),
        "ep_hidden": m * pick("ep_hidden"),
        "pp_hidden": m * pick("pp_hidden"),
        "dp_hidden": m * pick("fsdp_hidden") + pick("dp_step_hidden"),
    }
    breakdown = {k: np.broadcast_to(np.asarray(v, dtype=float), step_s.shape).copy() for k, v in breakdown.items()}

    memory = largest_stage(memories, memory_rows)

    tokens = np.asarray(lay.gbs, dtype=float) * np.asarray(arch.seq_len, dtype=float)
    tokens_per_s = tokens / step_s
    model_flops_per_s = np.asarray(model_flops_per_token(arch), dtype=float) * tokens_per_s
    mfu = model_flops_per_s / (devices * hw.gemm_peak)
    mfu_palm = np.asarray(model_flops_per_token_palm(arch), dtype=float) * tokens_per_s / (devices * hw.gemm_peak)

    reason = np.zeros(len(devices), dtype=np.int64)
    dispatch_missing = np.broadcast_to(tables["moe"].get("dispatch_missing", False), (len(devices),)) & (
        np.asarray(n_moe_layers(arch)) > 0)
    checks = (
        ("memory", memory.total_bytes > cluster.accelerator.usable_hbm_bytes),
        ("dispatcher", dispatch_missing),
        ("precision", hw.precision_missing),
        ("devices", devices > cluster.devices),
        ("invalid_layout", ~valid),
    )
    for name, failed in checks:  # the last assignment wins: most fundamental first in REASONS
        reason = np.where(failed, REASONS.index(name), reason)
    return EvalResult(
        step_time_s=step_s,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=tokens_per_s / devices,
        mfu=mfu,
        mfu_palm=mfu_palm,
        tflops_per_device=model_flops_per_s / devices / 1e12,
        memory_per_device_bytes=memory.total_bytes,
        feasible=reason == 0,
        reason=reason,
        breakdown=breakdown,
        memory_breakdown=memory.breakdown,
        devices=np.asarray(devices, dtype=float).astype(np.int64),
        micro_batches=np.asarray(m, dtype=float),
        bottleneck_stage=np.minimum(slowest, 2),
        bottleneck_rank=_choose(timed_ranks, slowest).astype(np.int64),
        dropped_fraction=np.broadcast_to(np.asarray(shapes(arch, lay)["drop"], dtype=float), (len(devices),)).copy(),
    )


@dataclass(frozen=True)
class _StagePart:
    """What pricing one stage for some candidates needs: their rows of the batch, its tables,
    hardware view and pricer, the stage, and the per-candidate inputs already computed."""

    arch: ArchBatch
    lay: LayoutBatch
    tables: Tables
    stage: Stage
    hw: HardwareView
    pricer: CollectivePricer
    activations: dict[str, Values]
    m: Values
    slots: Values

    @staticmethod
    def of_rows(rows: np.ndarray, arch: ArchBatch, lay: LayoutBatch, tables: Tables, stage: Stage,
                hw: HardwareView, pricer: CollectivePricer, activations: dict[str, Values], m: Values,
                slots: Values) -> _StagePart:
        sub_arch, sub_lay = arch.take(rows), lay.take(rows)
        sub_hw = hw.take(rows)
        take = lambda v: np.asarray(v)[rows] if np.ndim(v) else v  # noqa: E731
        return _StagePart(sub_arch, sub_lay, {b: {k: take(v) for k, v in t.items()} for b, t in tables.items()},
                          Stage(take(stage.rank), {b: take(v) for b, v in stage.counts.items()}, stage.timed),
                          sub_hw, pricer.take(rows, sub_hw.share),
                          {k: take(v) for k, v in activations.items()}, take(m), take(slots))


def _rows_apart(stage: Stage, first: Stage) -> np.ndarray:
    """The candidates whose `stage` differs from the first stage (another rank or other counts)."""
    apart = np.asarray(stage.rank) != np.asarray(first.rank)
    for block, count in stage.counts.items():
        apart = apart | (np.asarray(count) != np.asarray(first.counts[block]))
    return np.flatnonzero(apart)


def _choose(values: list, index: np.ndarray) -> np.ndarray:
    out = np.asarray(values[0], dtype=float) + 0.0 * index
    for i in range(1, len(values)):
        out = np.where(index == i, values[i], out)
    return out

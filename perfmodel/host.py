"""How the host issues a stage's work: one `HostDispatch` policy per cluster (`host_dispatch`).

- `AsyncHost` (accelerators): the host enqueues kernels ahead of the device, so
  a phase of a micro-batch takes max(device time, kernels x launch latency) and
  only the excess shows as dispatch; the kernels are the fused ones of
  Megatron-Core / Transformer Engine (`perfmodel.operators`), the collectives
  Megatron's (`operators.layer_comms`). A synchronisation stops the host running
  ahead: each routed MoE layer's forward (and its recomputed forward) reads the
  split sizes back to the host (MOE_HOST_SYNCS_PER_LAYER), so the device drains,
  waits the round trip and then the first launch: + syncs x (host_sync_latency_s
  + launch latency) per micro-batch, serial, never hidden. The optimizer step takes
  max(HBM time, OPTIMIZER_KERNELS_PER_LAYER x layers x launch latency).
- `EagerHost` (CPU clusters, `ClusterSpec.host_cores` set): every rank is an
  eager PyTorch process running the bundled trainer on its own core, which both
  launches and runs each op, so launch time adds to device time. The kernels
  are the trainer's aten ops (`perfmodel.eager`), the collectives its own
  (`operators.eager_trainer_comms`); tensor-parallel DTensor ops cost
  `dtensor_op_latency_s` each, activation checkpointing a cost per region and
  per saved tensor; the optimizer step adds its ops, the trainer's per-step
  bookkeeping ops and small all-reduces. Ranks beyond `host_cores` share the
  cores: each gets min(1, host_cores / devices) of one (`core_share`), which
  scales its peaks and divides its launch, DTensor, checkpoint and collective
  times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union

import numpy as np

from perfmodel.choice import select
from perfmodel.comm import CollectivePricer
from perfmodel.eager import (
    EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR,
    EAGER_DTENSOR_OPS_PER_PARAM_TENSOR,
    EAGER_DTENSOR_STEP_OPS,
    EAGER_EP_OPS,
    EAGER_FULL_RECOMPUTE_OPS,
    EAGER_SAVED_CORE,
    EAGER_SELECTIVE_RECOMPUTE_OPS,
    EAGER_STEP_COLLECTIVE_BYTES,
    eager_block_ops,
    eager_dtensor_block_ops,
    eager_dtensor_param_tensors,
    eager_saved_tensors,
    eager_step_collectives,
    eager_step_ops,
)
from perfmodel.operators import Comm, eager_trainer_comms, layer_comms
from perfmodel.schedule import micro_batches
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.protocols import ArchLike, LayoutLike, Values
from perfmodel.tables import LAYER_BLOCKS, StageBlocks

OPTIMIZER_KERNELS_PER_LAYER = 3.0
"""Fused multi-tensor launches per layer for the step: gradient norm, unscale/clip,
Adam (apex/Transformer Engine multi_tensor_apply); an estimate, small either way."""


MOE_HOST_SYNCS_PER_LAYER = 1.0
"""Device-to-host reads per routed MoE layer forward that the host waits on: the dropless
token dispatchers learn how many tokens each expert receives on the host, to size the
permuted buffers and the grouped GEMM's m_splits: Megatron-Core's alltoall dispatcher
(`tokens_per_expert` to host before the all-to-all, `cuda_sync_point`), DeepEP normal
dispatch (waits on the host for the received counts, 'timeout (dispatch CPU)'), HybridEP
('1x host sync', NVIDIA-NeMo/Megatron-Bridge#1842, and the stream drain NVIDIA-NeMo/Automodel
#3931 removes in its capacity mode). The backward reuses the forward's sizes."""


class HostDispatch(Protocol):
    """The host side of a step: what the ranks launch and what launching costs."""

    def core_share(self, devices: np.ndarray) -> np.ndarray:
        """Fraction of one core (and of the device's peak) each rank of a job of `devices` gets."""
        ...

    def block_comms(self, arch: ArchLike, lay: LayoutLike) -> dict[str, list[Comm]]:
        """Collectives of each block per micro-batch (before pricing)."""
        ...

    def phase_kernels(self, stage: StageBlocks) -> tuple[Values, Values]:
        """(forward, backward) launches of one micro-batch on a stage, recompute included."""
        ...

    def dispatch_s(self, stage: StageBlocks, fwd_kernels: Values, bwd_kernels: Values, fwd_device_s: Values,
                   bwd_device_s: Values, launch_latency_s: Values, share: np.ndarray) -> Values:
        """Seconds per micro-batch the host adds to the device time of both phases."""
        ...

    def step_kernels(self, stage: StageBlocks) -> Values:
        """Launches of the optimizer step (and per-step bookkeeping) on a stage."""
        ...

    def step_s(self, stage: StageBlocks, memory_s: Values, kernels: Values, launch_latency_s: Values,
               share: np.ndarray, pricer: CollectivePricer) -> Values:
        """Seconds of the optimizer step, from its HBM time `memory_s` and its launches."""
        ...


@dataclass(frozen=True)
class AsyncHost:
    """An accelerator's host: launches run ahead of the device; only their excess shows,
    except at the MoE layers' host synchronisations, which serialise."""

    host_sync_latency_s: Optional[float] = None
    """`Accelerator.host_sync_latency_s` (None: synchronisations not priced)."""

    def core_share(self, devices: np.ndarray) -> np.ndarray:
        return np.ones_like(devices)

    def block_comms(self, arch: ArchLike, lay: LayoutLike) -> dict[str, list[Comm]]:
        return layer_comms(arch, lay)

    def phase_kernels(self, stage: StageBlocks) -> tuple[Values, Values]:
        """Fused kernels and collective launches; full recompute launches the layers' forward
        kernels again, selective those of the modules it checkpoints (`operators.RECOMPUTE_MODULE_OPS`)."""
        total, full, selective = stage.total, stage.full, stage.selective
        fwd = total("fwd_kernels") + total("fwd_comm_kernels")
        bwd = (total("bwd_kernels") + total("bwd_comm_kernels")
               + select(full, total("fwd_kernels", LAYER_BLOCKS), select(selective, stage.recomputed("kernels"), 0.0)))
        return fwd, bwd

    def dispatch_s(self, stage: StageBlocks, fwd_kernels: Values, bwd_kernels: Values, fwd_device_s: Values,
                   bwd_device_s: Values, launch_latency_s: Values, share: np.ndarray) -> Values:
        """Per phase max(kernels x launch latency - device time, 0), plus the MoE layers'
        synchronisations x (host_sync_latency_s + launch latency)."""
        ahead_s = (np.maximum(fwd_kernels * launch_latency_s - fwd_device_s, 0.0)
                   + np.maximum(bwd_kernels * launch_latency_s - bwd_device_s, 0.0))
        if self.host_sync_latency_s is None:
            return ahead_s
        return ahead_s + self.host_syncs(stage) * (self.host_sync_latency_s + launch_latency_s)

    @staticmethod
    def host_syncs(stage: StageBlocks) -> Values:
        """Host synchronisations of one micro-batch on a stage: MOE_HOST_SYNCS_PER_LAYER per routed
        MoE layer forward, again for its recomputed forward (`StageBlocks.reruns_layers`)."""
        moe = stage.counts["moe"] * np.where(np.asarray(stage.arch.n_experts, dtype=float) > 0, 1.0, 0.0)
        return MOE_HOST_SYNCS_PER_LAYER * moe * np.where(stage.reruns_layers, 2.0, 1.0)

    def step_kernels(self, stage: StageBlocks) -> Values:
        return OPTIMIZER_KERNELS_PER_LAYER * np.maximum(stage.counts["attention"], 1.0)

    def step_s(self, stage: StageBlocks, memory_s: Values, kernels: Values, launch_latency_s: Values,
               share: np.ndarray, pricer: CollectivePricer) -> Values:
        """max(HBM time, kernels x launch latency)."""
        return np.maximum(memory_s, kernels * launch_latency_s)


@dataclass(frozen=True)
class EagerHost:
    """CPU ranks running the bundled trainer in eager PyTorch: each rank's core launches and
    runs its own ops, so launch time adds (see the module doc)."""

    host_cores: int
    """Physical cores all ranks share (`ClusterSpec.host_cores`)."""
    dtensor_op_latency_s: float
    """Host seconds one DTensor op adds (`Accelerator.dtensor_op_latency_s`; 0: not priced)."""
    checkpoint_region_latency_s: float
    """Host seconds per checkpointed region and micro-batch (`Accelerator.checkpoint_region_latency_s`)."""
    checkpoint_saved_tensor_latency_s: float
    """Host seconds per tensor a checkpointed region saves (`Accelerator.checkpoint_saved_tensor_latency_s`)."""

    def core_share(self, devices: np.ndarray) -> np.ndarray:
        """min(1, host_cores / devices)."""
        return np.minimum(1.0, self.host_cores / np.maximum(devices, 1.0))

    def block_comms(self, arch: ArchLike, lay: LayoutLike) -> dict[str, list[Comm]]:
        return eager_trainer_comms(arch, lay)

    def phase_kernels(self, stage: StageBlocks) -> tuple[Values, Values]:
        """The trainer's eager ops per block (`eager.eager_block_ops`), expert-parallel dispatch
        ops per MoE layer under ep > 1, collective launches; full recompute repeats the layers'
        forward ops plus checkpoint hooks, selective the attention core's."""
        total, counts, selective = stage.total, stage.counts, stage.selective
        ops = eager_block_ops(stage.arch)
        ep_moe = np.where(np.asarray(stage.lay.ep, dtype=float) > 1, counts["moe"], 0.0)  # expert-parallel dispatch
        fwd = total("fwd_comm_kernels") + sum(counts[b] * ops[b][0] for b in ops) + ep_moe * EAGER_EP_OPS[0]
        layer_fwd_ops = sum(counts[b] * ops[b][0] for b in LAYER_BLOCKS) + ep_moe * EAGER_EP_OPS[0]
        bwd = (total("bwd_comm_kernels") + sum(counts[b] * ops[b][1] for b in ops) + ep_moe * EAGER_EP_OPS[1]
               + np.where(stage.reruns_layers, layer_fwd_ops + EAGER_FULL_RECOMPUTE_OPS * counts["attention"],
                          np.where(selective, EAGER_SELECTIVE_RECOMPUTE_OPS * counts["attention"], 0.0)))
        return fwd, bwd

    def dispatch_s(self, stage: StageBlocks, fwd_kernels: Values, bwd_kernels: Values, fwd_device_s: Values,
                   bwd_device_s: Values, launch_latency_s: Values, share: np.ndarray) -> Values:
        """(forward + backward ops) x launch latency + DTensor ops x their latency + checkpointing."""
        dispatch_s = (fwd_kernels + bwd_kernels) * launch_latency_s + 0.0 * fwd_device_s
        dispatch_s = dispatch_s + self._dtensor_mb_ops(stage) * (self.dtensor_op_latency_s / share)
        return dispatch_s + self._checkpoint_s(stage, share)

    def step_kernels(self, stage: StageBlocks) -> Values:
        """AdamW and gradient-norm ops per parameter tensor plus the trainer's per-step ops."""
        return eager_step_ops(stage.arch, stage.counts, micro_batches(stage.lay))

    def step_s(self, stage: StageBlocks, memory_s: Values, kernels: Values, launch_latency_s: Values,
               share: np.ndarray, pricer: CollectivePricer) -> Values:
        """HBM time + ops x launch latency + the bookkeeping all-reduces + DTensor ops x their latency."""
        bookkeeping_s = sum(count * pricer.time(group, "all_reduce", EAGER_STEP_COLLECTIVE_BYTES)
                            for group, count in eager_step_collectives(stage.lay).items())
        return (memory_s + kernels * launch_latency_s + bookkeeping_s
                + self._dtensor_step_ops(stage) * (self.dtensor_op_latency_s / share))

    def _checkpoint_s(self, stage: StageBlocks, share: np.ndarray) -> Values:
        """Host time activation checkpointing adds per micro-batch beyond its ops: per region (a
        layer under full recompute, the attention core under selective) a fixed cost plus one per
        tensor it saves (`perfmodel.eager.eager_saved_tensors`)."""
        region_s, per_saved_s = self.checkpoint_region_latency_s, self.checkpoint_saved_tensor_latency_s
        counts = stage.counts
        saved = eager_saved_tensors(stage.arch)
        layers = counts["attention"]
        full_s = layers * region_s + per_saved_s * sum(counts[b] * saved[b] for b in LAYER_BLOCKS)
        selective_s = layers * (region_s + per_saved_s * EAGER_SAVED_CORE)
        return np.where(stage.reruns_layers, full_s, np.where(stage.selective, selective_s, 0.0)) / share

    @staticmethod
    def _dtensor_mb_ops(stage: StageBlocks) -> Values:
        """DTensor ops of one micro-batch on a stage under tp > 1 (`perfmodel.eager`), 0 without tp."""
        counts = stage.counts
        ops = eager_dtensor_block_ops(stage.arch)
        per_mb = sum(counts[b] * (ops[b][0] + ops[b][1]) for b in ops)
        layer_fwd = sum(counts[b] * ops[b][0] for b in LAYER_BLOCKS)
        per_mb = per_mb + np.where(stage.reruns_layers, EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR * layer_fwd, 0.0)
        return np.where(np.asarray(stage.lay.tp, dtype=float) > 1, per_mb, 0.0)

    @staticmethod
    def _dtensor_step_ops(stage: StageBlocks) -> Values:
        """DTensor ops once per step on a stage under tp > 1: optimizer and gradient norm."""
        tensors = eager_dtensor_param_tensors(stage.arch)
        per_step = (EAGER_DTENSOR_OPS_PER_PARAM_TENSOR * sum(stage.counts[b] * tensors[b] for b in tensors)
                    + EAGER_DTENSOR_STEP_OPS)
        return np.where(np.asarray(stage.lay.tp, dtype=float) > 1, per_step, 0.0)


def host_dispatch(cluster: ClusterSpec) -> Union[AsyncHost, EagerHost]:
    """The cluster's host policy: `EagerHost` where `host_cores` is set (CPU ranks), else `AsyncHost`."""
    if cluster.host_cores is None:
        return AsyncHost(host_sync_latency_s=cluster.accelerator.host_sync_latency_s)
    acc = cluster.accelerator
    return EagerHost(host_cores=cluster.host_cores,
                     dtensor_op_latency_s=acc.dtensor_op_latency_s or 0.0,
                     checkpoint_region_latency_s=acc.checkpoint_region_latency_s or 0.0,
                     checkpoint_saved_tensor_latency_s=acc.checkpoint_saved_tensor_latency_s or 0.0)

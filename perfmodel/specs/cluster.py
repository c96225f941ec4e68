"""Where a model trains: `Accelerator` (with its fitted kernel figures), `FabricLevel`, `ClusterSpec`.

A cluster file describes hardware (device, node size, fabric levels), not a
job: the device count is the default job size and its upper bound. Every
figure carries its source next to it; `mosaic calibrate` replaces datasheet
figures by measured ones and records that in `calibration:`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import yaml
from numpy.typing import ArrayLike

from perfmodel.errors import InputError
from perfmodel.specs.dispatch import FUSED_DISPATCHERS, EpDispatcherFigures
from perfmodel.specs.kernels import KernelFigures, provenance
from perfmodel.specs.strict import check, spec_to_dict

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class Accelerator:
    """One device as a rank sees it (for Ascend 910C: one die, as torch_npu shows it)."""

    name: str
    """Marketing name and variant."""
    peak_flops_per_s: dict[str, float]
    """Dense peak per precision (fp32, bf16, fp16, fp8, mxfp8 where the part has it)."""
    hbm_bytes: float
    """Device memory (vendor label)."""
    hbm_bandwidth_bytes_per_s: float
    """Peak memory bandwidth."""
    kernels: KernelFigures
    """Fitted kernel figures (GEMM and grouped GEMM by shape, attention, memory-bound kernel
    classes) with their rows, errors, sources and derivation (`perfmodel.specs.kernels`)."""
    launch_latency_s: float
    """Host time to dispatch one kernel (bounds small micro-batches)."""
    sources: dict[str, str]
    """Source of each figure above, by key."""
    hbm_usable_bytes: Optional[float] = None
    """Memory a job may allocate (None: hbm_bytes)."""
    checkpoint_region_latency_s: Optional[float] = None
    """Host time torch.utils.checkpoint adds per checkpointed region and micro-batch beyond its
    ops (non-reentrant: hooks, RNG state, recompute set-up); priced on CPU clusters for
    recompute (None: not priced). Measured by `mosaic calibrate` on cpu."""
    checkpoint_saved_tensor_latency_s: Optional[float] = None
    """Host time per tensor a checkpointed region saves (pack, recompute, unpack hooks)."""
    host_sync_latency_s: Optional[float] = None
    """Host time of a device-to-host read the host must wait for (the stream drains, a small
    copy comes back), as MoE token dispatchers do once per layer to learn the split sizes
    (`perfmodel.host.MOE_HOST_SYNCS_PER_LAYER`); the device idles meanwhile (None: not priced)."""
    dtensor_op_latency_s: Optional[float] = None
    """Host time one DTensor op adds beyond the single-device ops (tensor parallel in eager
    PyTorch: sharding propagation, wrapping); priced on CPU clusters, whose ranks run the
    bundled trainer (None: not priced). Measured by `mosaic calibrate` on cpu."""

    def __post_init__(self) -> None:
        check(len(self.peak_flops_per_s) > 0, "peak_flops_per_s", "is empty", "give at least bf16 or fp32")
        for precision, value in self.peak_flops_per_s.items():
            check(precision in ("fp32", "bf16", "fp16", "fp8", "mxfp8"), f"peak_flops_per_s.{precision}",
                  "unknown precision", "use fp32, bf16, fp16, fp8 or mxfp8")
            check(math.isfinite(value) and value > 0, f"peak_flops_per_s.{precision}",
                  f"must be a positive FLOP/s figure, got {value}", "write e.g. 989.0e12")
        check(self.hbm_bytes > 0, "hbm_bytes", f"must be > 0, got {self.hbm_bytes}", "write e.g. 80.0e9")
        check(self.hbm_usable_bytes is None or 0 < self.hbm_usable_bytes <= self.hbm_bytes, "hbm_usable_bytes",
              "must be in (0, hbm_bytes]", "lower it or leave it out")
        check(self.hbm_bandwidth_bytes_per_s > 0, "hbm_bandwidth_bytes_per_s", "must be > 0", "write e.g. 3.35e12")
        check(self.launch_latency_s >= 0, "launch_latency_s", "must be >= 0", "write seconds, e.g. 5.0e-6")
        for key in ("dtensor_op_latency_s", "checkpoint_region_latency_s", "checkpoint_saved_tensor_latency_s",
                    "host_sync_latency_s"):
            value = getattr(self, key)
            check(value is None or (math.isfinite(value) and value >= 0), key, "must be >= 0 seconds",
                  "write seconds, e.g. 6.0e-5, or leave it out")
            check(value is None or key in self.sources, "sources", f"no source for {key}", "cite the measurement")
        missing = [k for k in ("peak_flops_per_s", "hbm_bytes", "hbm_bandwidth_bytes_per_s", "launch_latency_s")
                   if k not in self.sources]
        check(not missing, "sources", f"no source for {', '.join(missing)}", "cite a datasheet, paper or measurement")

    @property
    def usable_hbm_bytes(self) -> float:
        return self.hbm_usable_bytes if self.hbm_usable_bytes is not None else self.hbm_bytes

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s of `precision`; mxfp8 falls back to fp8, fp16 to bf16."""
        for name in (precision, {"mxfp8": "fp8", "fp16": "bf16", "bf16": "fp16"}.get(precision, "")):
            if name in self.peak_flops_per_s:
                return self.peak_flops_per_s[name]
        raise InputError(f"accelerator '{self.name}' has no {precision} peak; choose one of "
                         f"{', '.join(self.peak_flops_per_s)}")

    def max_gemm_efficiency(self, precisions: Sequence[str]) -> float:
        """The largest e_max of any dense or grouped GEMM figure serving `precisions` (a bound
        on achieved FLOP/s over peak, used by the planner's loss bound)."""
        k = self.kernels
        values = []
        for p in precisions:
            values.append(k.gemm[k.precision("gemm", p)].e_max)
            grouped = k.grouped_gemm[k.precision("grouped_gemm", p)]
            values += [grouped.fwd.e_max, grouped.dgrad.e_max, grouped.wgrad.e_max]
        return max(values)

    def max_attention_efficiency(self, precisions: Sequence[str]) -> float:
        """The largest attention e_max serving `precisions` (the core runs bf16 under fp8)."""
        k = self.kernels
        names = {k.precision("attention", "bf16" if p in ("fp8", "mxfp8") else p) for p in precisions}
        return max(max(k.attention[n].fwd_e_max, k.attention[n].bwd_e_max) for n in names)


@dataclass(frozen=True)
class CollectiveFit:
    """Provenance of a fabric level's collective figures."""

    source: str
    rows: int = 0
    median_abs_error: Optional[float] = None
    derived: str = ""

    def __post_init__(self) -> None:
        provenance(self.rows, self.median_abs_error, self.source, self.derived)


@dataclass(frozen=True)
class FabricLevel:
    """One level of the interconnect: groups of `devices` joined at this bandwidth."""

    name: str
    """e.g. node (NVLink/HCCS), supernode (UB, NVL72), scale_out (IB/RoCE/EFA)."""
    devices: int
    """Devices in one group at this level (8 for an HGX node, 72 for NVL72)."""
    bandwidth_bytes_per_s: float
    """Per-device bandwidth, one direction."""
    latency_s: float
    """Alpha: fixed cost of one collective step at this level."""
    efficiency: float
    """Large-message achieved fraction of bandwidth (busbw / wire), used for every collective ..."""
    source: str
    """Where the figures come from."""
    collective_efficiency: dict[str, float] = field(default_factory=dict)
    """... unless overridden here per collective (all_reduce, all_gather, reduce_scatter, all_to_all, p2p)."""
    collective_latency_s: dict[str, float] = field(default_factory=dict)
    """... and per collective, where measured (NCCL's algorithms differ: a tree all-reduce takes
    more steps' latency than a ring all-gather); the rest take latency_s."""
    ll_collective_latency_s: dict[str, float] = field(default_factory=dict)
    """Low-latency protocol (NCCL LL/LL128) step latency per collective, where measured; a
    collective without it has one protocol (`perfmodel.comm`)."""
    ll_collective_efficiency: dict[str, float] = field(default_factory=dict)
    """Low-latency protocol efficiency per collective (a fraction of the link's bandwidth)."""
    collective_fit: Optional[CollectiveFit] = None
    """How latency_s and the efficiencies were obtained: fitted table rows, or carried over
    (`perfmodel.kernels.build`); None for a hand-written level."""
    sync_latency_s: float = 0.0
    """Fixed cost per blocking collective call issued between computations, beyond latency_s
    per step: the peers' waiting threads wake up and the ranks arrive apart. 0 where collectives
    queue on device streams (NCCL, HCCL); measured by `mosaic calibrate` on cpu (gloo)."""

    def __post_init__(self) -> None:
        check(self.devices >= 1, "devices", f"must be >= 1, got {self.devices}", "give the group size")
        check(math.isfinite(self.sync_latency_s) and self.sync_latency_s >= 0, "sync_latency_s", "must be >= 0",
              "write seconds, e.g. 5.0e-4, or leave it out (0)")
        check(self.bandwidth_bytes_per_s > 0, "bandwidth_bytes_per_s", "must be > 0", "write bytes/s, e.g. 450.0e9")
        check(self.latency_s >= 0, "latency_s", "must be >= 0", "write seconds, e.g. 5.0e-6")
        check(0 < self.efficiency <= 2, "efficiency", f"must be in (0, 2], got {self.efficiency}",
              "use busbw / link bandwidth (above 1 only for in-switch reduction, NVLS)")
        check(set(self.ll_collective_latency_s) == set(self.ll_collective_efficiency), "ll_collective_latency_s",
              "low-latency figures come in pairs", "give ll_collective_latency_s and ll_collective_efficiency for "
              "the same collectives")
        for name, value in {**self.collective_latency_s, **self.ll_collective_latency_s}.items():
            check(name in COLLECTIVES, f"collective_latency_s.{name}", "unknown collective",
                  f"use one of {', '.join(COLLECTIVES)}")
            check(math.isfinite(value) and value >= 0, f"collective_latency_s.{name}", "must be >= 0 seconds",
                  "write seconds, e.g. 5.0e-6")
        for name, value in {**self.collective_efficiency, **self.ll_collective_efficiency}.items():
            check(name in COLLECTIVES, f"collective_efficiency.{name}", "unknown collective",
                  f"use one of {', '.join(COLLECTIVES)}")
            check(0 < value <= 2, f"collective_efficiency.{name}", f"must be in (0, 2], got {value}",
                  "use busbw / link bandwidth (above 1 only for in-switch reduction, NVLS)")

    def efficiency_of(self, collective: str) -> float:
        return self.collective_efficiency.get(collective, self.efficiency)

    def latency_of(self, collective: str) -> float:
        return self.collective_latency_s.get(collective, self.latency_s)

    def has_low_latency(self, collective: str) -> bool:
        return collective in self.ll_collective_latency_s

    def ll_latency_of(self, collective: str) -> float:
        return self.ll_collective_latency_s.get(collective, self.latency_of(collective))

    def ll_efficiency_of(self, collective: str) -> float:
        return self.ll_collective_efficiency.get(collective, self.efficiency_of(collective))


@dataclass(frozen=True)
class Goodput:
    """Fraction of wall time that trains: `eta`, or modelled from failures (Young/Daly)."""

    eta: Optional[float] = None
    """Fixed goodput in (0, 1]; exclusive with node_mtbf_hours."""
    node_mtbf_hours: Optional[float] = None
    """Mean time between job-interrupting failures of one node."""
    checkpoint_s: float = 0.0
    """Blocking time of one checkpoint save."""
    restart_s: float = 0.0
    """Time from a failure to training again (detect, reschedule, load)."""
    source: str = ""

    def __post_init__(self) -> None:
        check((self.eta is None) != (self.node_mtbf_hours is None), "eta",
              "give exactly one of eta and node_mtbf_hours", "set eta (e.g. 0.9) or node_mtbf_hours")
        check(self.eta is None or 0 < self.eta <= 1, "eta", f"must be in (0, 1], got {self.eta}", "use a fraction")
        check(self.node_mtbf_hours is None or self.node_mtbf_hours > 0, "node_mtbf_hours", "must be > 0", "give hours")
        check(self.checkpoint_s >= 0 and self.restart_s >= 0, "checkpoint_s", "must be >= 0", "give seconds")


@dataclass(frozen=True)
class Overlap:
    """What the runtime lets each communication class hide behind compute, and what it costs.

    Whether a class overlaps is the layout's choice (`ParallelLayout` overlap switches, FSDP's
    prefetch, the interleaved schedule's p2p, context parallel's ring); these fractions are the
    most of it the runtime can hide (1 where collectives run on their own device streams, NCCL
    and HCCL; 0 where they block the rank's thread, gloo on CPU)."""

    tp: float = 1.0
    ep: float = 1.0
    dp: float = 1.0
    pp: float = 1.0
    source: str = ""
    cp: float = 1.0
    """Context parallel K/V ring exchange hidden behind the attention kernels it feeds
    (Megatron-Core context parallel overlaps each ring step with the attention of the
    previous chunk); 1.0 = fully hideable up to the attention time."""
    compute_slowdown: float = 0.0
    """Fraction by which compute slows while a collective runs beside it (they share the SMs /
    AI cores and HBM): hiding c seconds of communication costs compute_slowdown x c."""

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp", "pp", "cp", "compute_slowdown"):
            value = getattr(self, name)
            check(0 <= value <= 1, name, f"must be in [0, 1], got {value}", "use a fraction")


@dataclass(frozen=True)
class Straggler:
    """Slowdown from the slowest of n nodes: 1 + cv * sqrt(2 ln n) (max of n Gaussians)."""

    cv: float = 0.0
    """Coefficient of variation of one node's step time."""
    source: str = ""

    def __post_init__(self) -> None:
        check(0 <= self.cv < 1, "cv", f"must be in [0, 1), got {self.cv}", "use a small fraction, e.g. 0.01")

    def factor(self, nodes: ArrayLike) -> np.ndarray:
        return 1.0 + self.cv * np.sqrt(2.0 * np.log(np.maximum(np.asarray(nodes, dtype=float), 1.0)))


@dataclass(frozen=True)
class ClusterSpec:
    """A described cluster: accelerator, fabric levels (innermost first), size, policies."""

    name: str
    description: str
    accelerator: Accelerator
    levels: tuple[FabricLevel, ...]
    """Innermost first; each level's group size is a multiple of the previous one."""
    devices: int
    """Default job size and its upper bound."""
    goodput: Goodput
    overlap: Overlap = field(default_factory=Overlap)
    straggler: Straggler = field(default_factory=Straggler)
    framework_overhead_bytes: float = 0.0
    """Per-device memory the framework takes before the model (CUDA context, allocator, buffers)."""
    framework_overhead_source: str = ""
    size_from_host: bool = False
    """cpu_local: take devices and cores from the machine at load time."""
    host_cores: Optional[int] = None
    """Physical cores shared by all ranks (cpu): ranks beyond it share peak."""
    calibration: Optional[dict[str, Any]] = None
    """Filled by `mosaic calibrate`: provenance and fit quality."""
    ep_dispatch: dict[str, dict[str, EpDispatcherFigures]] = field(default_factory=dict)
    """Measured figures of the fused MoE dispatchers (FUSED_DISPATCHERS) by fabric level name
    (`perfmodel.specs.dispatch`); absent: the cluster prices alltoall and allgather only."""

    def __post_init__(self) -> None:
        check(self.devices >= 1, "devices", f"must be >= 1, got {self.devices}", "give the device count")
        check(len(self.levels) >= 1, "levels", "is empty", "describe at least the node level")
        for i, (inner, outer) in enumerate(zip(self.levels, self.levels[1:])):
            check(outer.devices % inner.devices == 0, f"levels[{i + 1}].devices",
                  f"{outer.devices} is not a multiple of the inner level's {inner.devices}",
                  "order levels innermost first with nested group sizes")
        check(self.framework_overhead_bytes >= 0, "framework_overhead_bytes", "must be >= 0", "give bytes")
        check(self.host_cores is None or self.host_cores >= 1, "host_cores", "must be >= 1", "give the core count")
        names = [lvl.name for lvl in self.levels]
        for dispatcher, by_level in self.ep_dispatch.items():
            check(dispatcher in FUSED_DISPATCHERS, f"ep_dispatch.{dispatcher}", "is not a fused dispatcher",
                  f"use one of {', '.join(FUSED_DISPATCHERS)}")
            for level in by_level:
                check(level in names, f"ep_dispatch.{dispatcher}.{level}", "is not a fabric level of this cluster",
                      f"use one of {', '.join(names)}")

    @property
    def node_devices(self) -> int:
        """Devices per node: the innermost level's group."""
        return self.levels[0].devices

    def level_for_span(self, span_devices: ArrayLike) -> np.ndarray:
        """Index of the innermost level whose group holds `span_devices` consecutive ranks."""
        sizes = np.asarray([lvl.devices for lvl in self.levels])
        index = np.searchsorted(sizes, np.asarray(span_devices), side="left")
        return np.minimum(index, len(self.levels) - 1)

    def content_hash(self) -> str:
        """sha256 of the canonical YAML (what plans record); an empty `ep_dispatch` section is left
        out, so clusters without one keep the hash they had before the section existed."""
        data = spec_to_dict(self)
        if not data.get("ep_dispatch"):
            data.pop("ep_dispatch", None)
        text = yaml.safe_dump(data, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def with_devices(self, devices: int) -> ClusterSpec:
        if devices > self.devices:
            raise InputError(f"devices={devices} exceeds cluster '{self.name}' size {self.devices}; "
                             "use at most the cluster's count or edit its 'devices' key")
        return dataclasses.replace(self, devices=devices)


def host_memory_bytes() -> Optional[float]:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def size_from_host(spec: ClusterSpec) -> ClusterSpec:
    """Fill a `size_from_host` spec (cpu_local) from this machine.

    Devices (ranks) at the node level: at least the file's count, at least the
    cores; `host_cores` = usable cores; memory per rank = host RAM / ranks,
    since all ranks share it (the file's `hbm_bytes` is the fallback where
    the OS does not report its memory).
    """
    if not spec.size_from_host:
        return spec
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    node = dataclasses.replace(spec.levels[0], devices=max(spec.levels[0].devices, cores))
    acc = spec.accelerator
    memory = host_memory_bytes()
    if memory:
        per_rank = memory / node.devices
        sources = {**acc.sources, "hbm_bytes": f"host RAM {memory / 1e9:.1f} GB shared by {node.devices} ranks "
                                               "(size_from_host, at load time)"}
        acc = dataclasses.replace(acc, hbm_bytes=per_rank, hbm_usable_bytes=None, sources=sources)
    return dataclasses.replace(spec, devices=node.devices, host_cores=cores, accelerator=acc,
                               levels=(node, *spec.levels[1:]))

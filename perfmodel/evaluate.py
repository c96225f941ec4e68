"""`evaluate(archs, layouts, cluster)`: step time, throughput, MFU, memory, feasibility.

One vectorised code path over numpy arrays of candidates (a single
configuration is a batch of one). For each candidate:

1. Operators (`perfmodel.operators`) per block for one micro-batch on one
   device; time of an op and phase = max(FLOPs / (peak * eff_compute(kernel
   FLOPs)), bytes / (HBM bandwidth * eff_memory(bytes per kernel))), with the
   efficiency curves of the cluster file per precision (GEMMs at the layout's
   precision; the flash-attention core, router and LM head at bf16 under
   fp8/mxfp8), read at the op's forward size for all three phases.
2. Collectives (`perfmodel.comm`) priced on the fabric levels their groups
   span. Each phase's communication hides behind that phase's overlappable
   compute (GEMMs, attention), at most the cluster's `overlap` fraction of it,
   in the order cp (behind attention only), tp, ep, pp, FSDP; the rest is
   exposed.
3. CPU dispatch: a phase takes max(device time, kernels x launch latency)
   (the host enqueues asynchronously, so only the excess shows); on CPU
   clusters (`host_cores` set) the rank's own core launches and runs each
   kernel, so kernels x launch latency adds to the device time, and the
   kernels are the ops of an eager PyTorch step (`perfmodel.eager`, counted
   on the bundled trainer), optimizer and per-step bookkeeping included.
4. The slower of the first and last pipeline stage sets the step
   (`perfmodel.schedule`): (m + (pp-1)/vpp) micro-batch slots, plus the exposed
   DDP/ZeRO-1 gradient (and parameter) synchronisation, plus the optimizer
   step, times the straggler factor of the node count.
5. Memory (`perfmodel.memory`) of the larger stage against usable HBM.

Breakdown (seconds per step): the STEP_COMPONENTS add up to step_time_s;
the *_hidden entries are communication that ran under compute (not added).
MFU = model_flops_per_token (DESIGN.md convention) x tokens/s / (devices x
peak of the layout's precision); on host-sized CPU clusters ranks beyond
`host_cores` share the cores, so each rank's peak is scaled by
min(1, host_cores / devices) for both time and MFU, and its launch latency
and collective times divided by it (a rank gets that share of a core's time
to dispatch, and gloo moves and reduces its messages on the same cores).

Infeasible candidates never raise: `feasible` is False and `reason` names the
first failed check (invalid_layout, devices, precision, memory); their
numbers are still computed (meaningless for invalid_layout) so a search can
report how far off they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from perfmodel.comm import collective_coefficients, collective_time, group_geometry, group_levels
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
from perfmodel.errors import InputError
from perfmodel.memory import MEMORY_COMPONENTS, layer_activation_bytes, shard_sizes, stage_memory, stage_params
from perfmodel.operators import (
    BF16,
    DDP,
    FP8,
    FP32,
    FP32_GRAD_BYTES,
    FSDP,
    FULL,
    SELECTIVE,
    ZERO1,
    activation_bytes,
    attention_ops,
    dense_ffn_ops,
    dp_flavor_code,
    eager_trainer_comms,
    embedding_ops,
    head_ops,
    layer_comms,
    moe_ops,
    precision_code,
    recompute_code,
    shapes,
)
from perfmodel.schedule import bubble_slots, micro_batches, stage_layer_counts, straggler_factor
from perfmodel.specs.architecture import ARCH_FIELDS, ArchBatch, MoEArchitecture, model_flops_per_token
from perfmodel.specs.layout import PRECISIONS, LayoutBatch, ParallelLayout
from perfmodel.validity import valid_mask

REASONS = ("ok", "invalid_layout", "devices", "precision", "memory")
"""Reason code -> name. invalid_layout: a `perfmodel.validity` rule fails (see
`validity.violations`); devices: more than the cluster has; precision: the
accelerator has no peak for it; memory: above usable HBM."""

STEP_COMPONENTS = ("compute", "attention", "expert_gemm", "recompute", "tp_exposed", "cp_exposed",
                   "ep_exposed", "pp_exposed", "dp_exposed", "dispatch", "bubble", "optimizer", "straggler")
"""Seconds per step that add up to step_time_s. compute: dense GEMMs and
bandwidth-bound kernels (norms, activations, permutes, embedding, LM head,
cross-entropy); attention: the flash-attention core; expert_gemm: routed
experts' grouped GEMMs; recompute: forward work repeated in the backward pass;
*_exposed: communication not hidden (ep includes etp); dispatch: host launch
time beyond device time; bubble: pipeline fill/drain; optimizer: Adam step;
straggler: slowdown from the slowest node."""

HIDDEN_COMPONENTS = ("tp_hidden", "cp_hidden", "ep_hidden", "pp_hidden", "dp_hidden")
BREAKDOWN_KEYS = STEP_COMPONENTS + HIDDEN_COMPONENTS

DDP_BUCKET_PARAMS = 40e6
"""Megatron-Core DDP bucket size (parameters): the last bucket's reduction cannot
hide behind the backward pass (`DistributedDataParallelConfig.bucket_size`)."""

OPTIMIZER_KERNELS_PER_LAYER = 3.0
"""Fused multi-tensor launches per layer for the step: gradient norm, unscale/clip,
Adam (apex/Transformer Engine multi_tensor_apply); an estimate, small either way."""

CHUNK = 65536
"""Candidates per vectorised pass (keeps the working set in cache)."""

_BLOCK_BUILDERS = (("attention", attention_ops), ("dense_ffn", dense_ffn_ops), ("moe", moe_ops),
                   ("embedding", embedding_ops), ("head", head_ops))
_LAYER_BLOCKS = ("attention", "dense_ffn", "moe")
_CATS = ("compute", "attention", "expert_gemm")
_KIND_CAT = {"gemm": "compute", "gemm_hp": "compute", "memory": "compute", "attention": "attention",
             "expert_gemm": "expert_gemm"}
_COMM_CLASS = {"tp": "tp", "cp": "cp", "ep": "ep", "etp": "ep"}


def optimizer_step_bytes_per_param(lay: Any) -> Any:
    """HBM bytes per updated parameter in the Adam step: read master, m, v, grad
    (16) + the gradient-norm read (4) + write master, m, v (12) + the bf16 weight
    (2) = 34; fp32 training has no separate weight copy: 32."""
    return np.where(precision_code(lay) == FP32, 32.0, 34.0)


@dataclass(frozen=True)
class EvalResult:
    """Predictions for n candidates (numpy arrays of length n)."""

    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    tokens_per_s_per_device: np.ndarray
    mfu: np.ndarray
    tflops_per_device: np.ndarray
    """Achieved model TFLOP/s per device (model FLOPs, no recompute)."""
    memory_per_device_bytes: np.ndarray
    feasible: np.ndarray
    reason: np.ndarray
    """Codes into REASONS."""
    breakdown: dict[str, np.ndarray] = field(default_factory=dict)
    """Seconds per step per component (BREAKDOWN_KEYS)."""
    memory_breakdown: dict[str, np.ndarray] = field(default_factory=dict)
    """Bytes per device per component (memory.MEMORY_COMPONENTS)."""
    devices: np.ndarray = field(default_factory=lambda: np.zeros(0))
    micro_batches: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """m = gbs / (mbs * dp)."""
    bottleneck_stage: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """0: the first pipeline stage sets the step, 1: the last."""

    def __len__(self) -> int:
        return int(np.size(self.step_time_s))

    @property
    def reason_names(self) -> list[str]:
        return [REASONS[int(c)] for c in self.reason]

    def row(self, i: int) -> dict[str, Any]:
        """One candidate as plain JSON-ready values (reason as its name, reason_code as int)."""
        def num(x: Any) -> Optional[float]:
            v = float(x)
            return v if math.isfinite(v) else None
        return {
            "step_time_s": num(self.step_time_s[i]),
            "tokens_per_s": num(self.tokens_per_s[i]),
            "tokens_per_s_per_device": num(self.tokens_per_s_per_device[i]),
            "mfu": num(self.mfu[i]),
            "tflops_per_device": num(self.tflops_per_device[i]),
            "memory_per_device_bytes": num(self.memory_per_device_bytes[i]),
            "feasible": bool(self.feasible[i]),
            "reason": REASONS[int(self.reason[i])],
            "reason_code": int(self.reason[i]),
            "devices": int(self.devices[i]),
            "micro_batches": num(self.micro_batches[i]),
            "bottleneck_stage": "first" if int(self.bottleneck_stage[i]) == 0 else "last",
            "breakdown": {k: num(v[i]) for k, v in self.breakdown.items()},
            "memory_breakdown": {k: num(v[i]) for k, v in self.memory_breakdown.items()},
        }

    def take(self, index: Any) -> EvalResult:
        """The candidates at `index` (an integer array, slice or boolean mask)."""
        values: dict[str, Any] = {}
        for name in EvalResult.__dataclass_fields__:
            value = getattr(self, name)
            values[name] = {k: v[index] for k, v in value.items()} if isinstance(value, dict) else value[index]
        return EvalResult(**values)

    @staticmethod
    def concat(parts: list[EvalResult]) -> EvalResult:
        if len(parts) == 1:
            return parts[0]
        values: dict[str, Any] = {}
        for name in EvalResult.__dataclass_fields__:
            first = getattr(parts[0], name)
            if isinstance(first, dict):
                values[name] = {k: np.concatenate([getattr(p, name)[k] for p in parts]) for k in first}
            else:
                values[name] = np.concatenate([getattr(p, name) for p in parts])
        return EvalResult(**values)


# ---------------------------------------------------------------------------
# Inputs

def _as_batches(archs: Any, layouts: Any, devices: Any) -> tuple[ArchBatch, LayoutBatch, np.ndarray]:
    if isinstance(archs, MoEArchitecture):
        archs = ArchBatch.stack([archs])
    if isinstance(layouts, ParallelLayout):
        if layouts.dp is None or layouts.gbs is None:
            if devices is None or np.ndim(devices) != 0:
                raise InputError("layout: dp/gbs are not resolved; call layout.resolve(devices) or pass devices=N")
            layouts = layouts.resolve(int(devices))
        layouts = LayoutBatch.stack([layouts])
    if not isinstance(archs, ArchBatch) or not isinstance(layouts, LayoutBatch):
        raise InputError("evaluate: archs must be MoEArchitecture/ArchBatch and layouts ParallelLayout/LayoutBatch")
    n_a, n_l = len(archs), len(layouts)
    if n_a != n_l and 1 not in (n_a, n_l):
        raise InputError(f"evaluate: {n_a} architectures and {n_l} layouts; give equal lengths or one of either")
    n = n_l if n_a == 1 else n_a
    if n_a != n:
        archs = archs.take(np.zeros(n, dtype=np.int64))
    if n_l != n:
        layouts = layouts.take(np.zeros(n, dtype=np.int64))
    world = (np.asarray(layouts.tp) * layouts.cp * layouts.pp * layouts.dp).astype(float)
    dev = world if devices is None else np.broadcast_to(np.asarray(devices, dtype=float), (n,)).copy()
    return archs, layouts, dev


def evaluate(archs: Union[MoEArchitecture, ArchBatch], layouts: Union[ParallelLayout, LayoutBatch],
             cluster: Any, devices: Any = None) -> EvalResult:
    """Predict every candidate (see module doc). `devices` defaults to each layout's world size."""
    arch_b, lay_b, dev = _as_batches(archs, layouts, devices)
    n = len(dev)
    if n <= CHUNK:
        return _evaluate_chunk(arch_b, lay_b, cluster, dev)
    parts = []
    for start in range(0, n, CHUNK):
        idx = slice(start, min(start + CHUNK, n))
        parts.append(_evaluate_chunk(arch_b.take(idx), lay_b.take(idx), cluster, dev[idx]))
    return EvalResult.concat(parts)


# ---------------------------------------------------------------------------
# Hardware view of a chunk

class _Curve:
    """An `EfficiencyCurve` with its knots pre-logged: linear in log10(size) between the
    knots, flat beyond the ends (the same function as `EfficiencyCurve.__call__`).

    Evaluated without np.interp: its per-element binary search mispredicts on the
    random sizes of a batch (~14 ns per element); counting the knots at or below
    each size (one comparison pass per knot) and gathering that segment's slope
    costs a third of it. The arithmetic is np.interp's, slope * (x - x_j) + y_j with
    slope = (y_{j+1} - y_j) / (x_{j+1} - x_j), so the values are bit-identical."""

    def __init__(self, curve: Any) -> None:
        self.log_sizes = np.log10(np.asarray(curve.sizes, dtype=float))
        self.values = np.asarray(curve.values, dtype=float)
        # slope of the segment that starts at each knot; 0 after the last (flat)
        self.slopes = np.append(np.diff(self.values) / np.diff(self.log_sizes), 0.0)
        # knots are counted in bytes (2.5x faster passes than intp) unless there are too many
        self._count_dtype = np.uint8 if len(self.log_sizes) < 256 else np.intp

    def segment(self, log_size: Any) -> tuple[Any, Any]:
        """(index j of the knot at or below each log size, 0 below the first; the log
        size minus that knot's, after clipping to the knots' range)."""
        j = np.zeros(np.shape(log_size), dtype=self._count_dtype)
        for knot in self.log_sizes[1:]:
            j += log_size >= knot
        j = j.astype(np.intp)
        offset = np.clip(log_size, self.log_sizes[0], self.log_sizes[-1])
        offset -= self.log_sizes.take(j)  # take: a faster gather than [j]
        return j, offset

    def __call__(self, size: Any) -> Any:
        with np.errstate(divide="ignore"):
            j, offset = self.segment(np.log10(size))
        offset *= self.slopes.take(j)
        offset += self.values.take(j)
        return offset


class _Hardware:
    """Peaks and efficiency curves per candidate (precision codes index PRECISIONS)."""

    def __init__(self, cluster: Any, lay: LayoutBatch, devices: np.ndarray) -> None:
        acc = cluster.accelerator
        self.acc = acc
        table = np.full(len(PRECISIONS), np.nan)
        for i, name in enumerate(PRECISIONS):
            try:
                table[i] = acc.peak(name)
            except InputError:
                pass
        code = np.asarray(precision_code(lay))
        attn_code = np.where(code >= FP8, BF16, code)
        gemm_peak, attn_peak = table[code], table[attn_code]
        self.precision_missing = ~np.isfinite(gemm_peak) | ~np.isfinite(attn_peak)
        fallback = np.nanmax(table)
        share = np.ones_like(devices)
        if cluster.host_cores is not None:
            share = np.minimum(1.0, cluster.host_cores / np.maximum(devices, 1.0))
        self.share = share
        self.gemm_peak = np.where(np.isfinite(gemm_peak), gemm_peak, fallback) * share
        self.attn_peak = np.where(np.isfinite(attn_peak), attn_peak, fallback) * share
        self.attn_ratio = acc.attention_efficiency_vs_gemm or 1.0  # the core's rate over a GEMM's (calibrated)
        self.curves = [_Curve(acc.compute_curve(name)) for name in PRECISIONS]
        self.gemm_code, self.attn_code = code, attn_code
        self.gemm_present = np.flatnonzero(np.bincount(code, minlength=len(PRECISIONS)))
        self.attn_present = np.flatnonzero(np.bincount(attn_code, minlength=len(PRECISIONS)))
        # Mixed precisions. When the present curves share their knots (the bundled clusters
        # do), each row's segment on the common knots is found once and a gather of its own
        # curve's slope and value there finishes the interpolation. Otherwise every
        # precision's curve is laid side by side on one axis (curve c shifted by 100 c
        # decades), each row clipped to its own curve's ends, so one np.interp prices all
        # rows exactly as their own curve would.
        self._stacked: dict[str, Any] = {}
        self._shared: dict[str, Any] = {}
        for name, codes, present in (("gemm", code, self.gemm_present), ("attention", attn_code, self.attn_present)):
            knots = {tuple(self.curves[c].log_sizes) for c in present}
            if len(present) > 1 and len(knots) == 1 and len(self.curves[present[0]].log_sizes) > 1:
                k = len(self.curves[present[0]].log_sizes)
                values, slopes = np.zeros((len(PRECISIONS), k)), np.zeros((len(PRECISIONS), k))
                for c in present:
                    values[c], slopes[c] = self.curves[c].values, self.curves[c].slopes
                self._shared[name] = (self.curves[present[0]], values.ravel(), slopes.ravel(), codes * k)
            elif len(present) > 1:
                xs = np.concatenate([self.curves[c].log_sizes + 100.0 * c for c in present])
                ys = np.concatenate([self.curves[c].values for c in present])
                lo = np.array([self.curves[c].log_sizes[0] for c in range(len(PRECISIONS))])
                hi = np.array([self.curves[c].log_sizes[-1] for c in range(len(PRECISIONS))])
                self._stacked[name] = (xs, ys, lo[codes], hi[codes], 100.0 * codes)
        self.bw = acc.hbm_bandwidth_bytes_per_s
        self.mem_curve = _Curve(acc.memory_efficiency)
        self._mem_cache: dict[Any, Any] = {}

    def _eff(self, which: str, present: np.ndarray, size: Any) -> Any:
        if len(present) <= 1:
            return self.curves[present[0] if len(present) else BF16](size)
        if which in self._shared:
            curve, values, slopes, row_start = self._shared[which]
            with np.errstate(divide="ignore"):
                j, offset = curve.segment(np.log10(size))
            j += row_start
            offset *= slopes.take(j)
            offset += values.take(j)
            return offset
        xs, ys, lo, hi, shift = self._stacked[which]
        with np.errstate(divide="ignore"):
            return np.interp(np.clip(np.log10(size), lo, hi) + shift, xs, ys)

    def compute_rate(self, kind: str, kernel_flops: Any) -> Any:
        """Achieved FLOP/s: peak x eff_compute(FLOPs of one kernel call). Attention and the
        bf16 GEMMs (gemm_hp: router, LM head) run at bf16 under fp8/mxfp8."""
        if kind in ("attention", "gemm_hp"):
            ratio = self.attn_ratio if kind == "attention" else 1.0  # the flash core's measured fraction
            return self.attn_peak * ratio * self._eff("attention", self.attn_present, kernel_flops)
        return self.gemm_peak * self._eff("gemm", self.gemm_present, kernel_flops)

    def memory_efficiency(self, nbytes: Any, kernels: Any) -> Any:
        """eff_memory(bytes per kernel); repeated operands (the same array object, e.g.
        every norm's bytes) are looked up once."""
        key = (id(nbytes), kernels if np.ndim(kernels) == 0 else id(kernels))
        hit = self._mem_cache.get(key)
        if hit is not None and hit[0] is nbytes:
            return hit[1]
        eff = self.mem_curve(nbytes / np.maximum(kernels, 1.0))
        self._mem_cache[key] = (nbytes, eff)
        return eff

    def memory_time(self, nbytes: Any, kernels: Any) -> Any:
        """bytes / (HBM bandwidth x eff_memory(bytes per kernel))."""
        return nbytes / (self.bw * self.memory_efficiency(nbytes, kernels))


class _Collectives:
    """Collective pricing for a chunk, walking each (group, kind) geometry once; a
    repeated message (the same array object, e.g. the forward and backward all-to-alls
    of one buffer) is priced once."""

    def __init__(self, cluster: Any, lay: Any, share: Any = 1.0) -> None:
        self.cluster, self.lay = cluster, lay
        self.slowdown = 1.0 / np.asarray(share, dtype=float)  # CPU ranks beyond the cores (1 elsewhere)
        self._coef: dict[tuple[str, str], Any] = {}
        self._levels: dict[str, Any] = {}
        self._times: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def time(self, group: str, kind: str, size_bytes: Any) -> Any:
        hit = self._times.get((group, kind, id(size_bytes)))
        if hit is not None and hit[0] is size_bytes:
            return hit[1]
        key = (group, kind)
        if key not in self._coef:
            n, stride = group_geometry(self.lay, group)
            if group not in self._levels:
                self._levels[group] = group_levels(self.cluster, n, stride) if np.any(n > 1.0) else None
            self._coef[key] = collective_coefficients(self.cluster, kind, n, stride, self._levels[group])
        seconds = collective_time(self.cluster, kind, size_bytes, None, None, coefficients=self._coef[key]) * self.slowdown
        self._times[(group, kind, id(size_bytes))] = (size_bytes, seconds)  # holds the array: its id stays unique
        return seconds


def op_times(op: Any, hw: _Hardware) -> tuple[Any, Any, Any]:
    """Seconds of one op per phase (fwd, dgrad, wgrad): max(FLOPs / (peak x eff_compute),
    bytes / (HBM bw x eff_memory)). The efficiencies are looked up once, at the op's forward
    size (FLOPs of one kernel call; bytes per kernel; `op.size_phase` for an op without
    forward work), and hold for all three phases: the input- and weight-gradient kernels
    work on the same matrices."""
    j0 = op.size_phase
    seconds_per_byte = 1.0 / (hw.bw * hw.memory_efficiency(op.bytes[j0], op.kernels[j0]))
    seconds_per_flop = None if op.kind == "memory" else 1.0 / hw.compute_rate(op.kind, op.kernel_flops[0])
    out = []
    compute_of: dict[int, Any] = {}  # a GEMM's three phases share one FLOPs array: one product
    for j in range(3):
        nbytes, flops = op.bytes[j], op.flops[j]
        if np.ndim(nbytes) == 0 and nbytes == 0 and np.ndim(flops) == 0 and flops == 0:
            out.append(0.0)  # nothing in this phase (e.g. no weight gradient)
            continue
        memory = nbytes * seconds_per_byte
        if seconds_per_flop is None:
            out.append(memory)
            continue
        if id(flops) not in compute_of:
            compute_of[id(flops)] = flops * seconds_per_flop
        out.append(np.maximum(compute_of[id(flops)], memory))
    return out[0], out[1], out[2]


# ---------------------------------------------------------------------------
# One chunk

def _block_tables(arch: Any, lay: Any, comm_cost: _Collectives, hw: _Hardware) -> dict[str, dict[str, Any]]:
    """Per block, per micro-batch: time per category and phase, overlappable time,
    kernels, the forward totals (for full recompute) and the attention core's
    forward (for selective recompute); and communication per class and phase."""
    tables: dict[str, dict[str, Any]] = {}
    eager = comm_cost.cluster.host_cores is not None  # CPU ranks run the bundled trainer
    comms = eager_trainer_comms(arch, lay) if eager else layer_comms(arch, lay)
    for block, builder in _BLOCK_BUILDERS:
        t: dict[str, Any] = {f"{ph}_{cat}": 0.0 for ph in ("fwd", "bwd") for cat in _CATS}
        t.update(fwd_overlap=0.0, bwd_overlap=0.0, fwd_kernels=0.0, bwd_kernels=0.0, core_fwd=0.0)
        for op in builder(arch, lay):
            f, dg, wg = op_times(op, hw)
            cat = _KIND_CAT[op.kind]
            t[f"fwd_{cat}"] = t[f"fwd_{cat}"] + f
            t[f"bwd_{cat}"] = t[f"bwd_{cat}"] + dg + wg
            if op.overlappable:
                t["fwd_overlap"] = t["fwd_overlap"] + f
                t["bwd_overlap"] = t["bwd_overlap"] + dg + wg
            t["fwd_kernels"] = t["fwd_kernels"] + op.kernels[0]
            t["bwd_kernels"] = t["bwd_kernels"] + op.kernels[1] + op.kernels[2]
            if op.name == "core_attention":
                t["core_fwd"] = f
        for cls in ("tp", "cp", "ep"):
            t[f"fwd_{cls}"] = 0.0
            t[f"bwd_{cls}"] = 0.0
        t["fwd_comm_kernels"] = 0.0
        t["bwd_comm_kernels"] = 0.0
        for comm in comms[block]:
            seconds = comm_cost.time(comm.group, comm.kind, comm.bytes)
            key = f"{comm.phase}_{_COMM_CLASS[comm.group]}"
            t[key] = t[key] + seconds
            t[f"{comm.phase}_comm_kernels"] = t[f"{comm.phase}_comm_kernels"] + (seconds > 0)
        tables[block] = t
    return tables


def _hide(comm: Any, fraction: float, window: Any) -> tuple[Any, Any]:
    """(hidden, window left): at most `fraction` of `comm`, at most the window."""
    hidden = np.minimum(fraction * comm, np.maximum(window, 0.0))
    return hidden, window - hidden


def _stage(arch: Any, lay: Any, cluster: Any, hw: _Hardware, comm_cost: _Collectives,
           tables: dict[str, dict[str, Any]], counts: dict[str, Any]) -> dict[str, Any]:
    """Per-micro-batch and per-step times of one pipeline stage."""
    ov = cluster.overlap
    lat = hw.acc.launch_latency_s / hw.share  # CPU ranks beyond the cores dispatch in turns (share 1 elsewhere)
    rc = np.asarray(recompute_code(lay))
    full = rc == FULL
    selective = rc == SELECTIVE

    memo: dict[tuple[str, tuple[str, ...]], Any] = {}

    def total(key: str, blocks: tuple[str, ...] = tuple(tables)) -> Any:
        """Sum over blocks of (blocks on this stage) x (per-block value); zero entries skipped."""
        if (key, blocks) not in memo:
            acc: Any = 0.0
            for b in blocks:
                value = tables[b][key]
                if np.ndim(value) == 0 and value == 0:
                    continue
                acc = acc + counts[b] * value
            memo[(key, blocks)] = acc
        return memo[(key, blocks)]

    out: dict[str, Any] = {}
    for cat in _CATS:
        out[cat] = total(f"fwd_{cat}") + total(f"bwd_{cat}")
    layer_fwd = sum(total(f"fwd_{cat}", _LAYER_BLOCKS) for cat in _CATS)
    layer_fwd_overlap = total("fwd_overlap", _LAYER_BLOCKS)
    core_fwd = counts["attention"] * tables["attention"]["core_fwd"]
    recompute = np.where(full, layer_fwd, np.where(selective, core_fwd, 0.0))
    out["recompute"] = recompute

    fwd_compute = sum(total(f"fwd_{cat}") for cat in _CATS)
    bwd_compute = sum(total(f"bwd_{cat}") for cat in _CATS) + recompute
    fwd_window = total("fwd_overlap")
    bwd_window = total("bwd_overlap") + np.where(full, layer_fwd_overlap, np.where(selective, core_fwd, 0.0))
    fwd_attn = total("fwd_attention")
    bwd_attn = total("bwd_attention") + np.where(full | selective, core_fwd, 0.0)

    # communication per micro-batch (full recompute repeats the forward collectives)
    comm: dict[str, Any] = {}
    for cls in ("tp", "cp", "ep"):
        comm[f"fwd_{cls}"] = total(f"fwd_{cls}")
        comm[f"bwd_{cls}"] = total(f"bwd_{cls}") + np.where(full, total(f"fwd_{cls}", _LAYER_BLOCKS), 0.0)
    sh = shapes(arch, lay)
    p2p_bytes = activation_bytes(lay) * sh["T"] * sh["h"] / np.where(sh["sp"], sh["tp"], 1.0)
    p2p = np.asarray(lay.vpp, dtype=float) * comm_cost.time("pp", "p2p", p2p_bytes)
    comm["fwd_pp"] = p2p
    comm["bwd_pp"] = p2p
    dense_params, expert_params = stage_params(arch, lay, counts)
    out["params"] = (dense_params, expert_params)
    flavor = np.asarray(dp_flavor_code(lay))
    fsdp = flavor == FSDP
    gather_bytes = np.where(precision_code(lay) == FP32, 4.0, 2.0)
    gather = (comm_cost.time("dp", "all_gather", gather_bytes * dense_params)
              + comm_cost.time("edp", "all_gather", gather_bytes * expert_params))
    grad_rs = (comm_cost.time("dp", "reduce_scatter", FP32_GRAD_BYTES * dense_params)
               + comm_cost.time("edp", "reduce_scatter", FP32_GRAD_BYTES * expert_params))
    comm["fwd_fsdp"] = np.where(fsdp, gather, 0.0)
    comm["bwd_fsdp"] = np.where(fsdp, gather + grad_rs, 0.0)

    # overlap inside each phase of one micro-batch
    exposed: dict[str, Any] = {}
    hidden: dict[str, Any] = {}
    left: dict[str, Any] = {}
    for phase, window, attn in (("fwd", fwd_window, fwd_attn), ("bwd", bwd_window, bwd_attn)):
        h_cp, _ = _hide(comm[f"{phase}_cp"], ov.cp, attn)
        window = window - h_cp
        h_tp, window = _hide(comm[f"{phase}_tp"], ov.tp, window)
        h_ep, window = _hide(comm[f"{phase}_ep"], ov.ep, window)
        h_pp, window = _hide(comm[f"{phase}_pp"], ov.pp, window)
        h_fsdp, window = _hide(comm[f"{phase}_fsdp"], ov.dp, window)
        for cls, h in (("cp", h_cp), ("tp", h_tp), ("ep", h_ep), ("pp", h_pp), ("fsdp", h_fsdp)):
            hidden[f"{phase}_{cls}"] = h
            exposed[f"{phase}_{cls}"] = comm[f"{phase}_{cls}"] - h
        left[phase] = np.maximum(window, 0.0)

    # host dispatch bound per phase
    fwd_kernels = total("fwd_kernels") + total("fwd_comm_kernels")
    bwd_kernels = (total("bwd_kernels") + total("bwd_comm_kernels")
                   + np.where(full, total("fwd_kernels", _LAYER_BLOCKS), np.where(selective, counts["attention"], 0.0)))
    if cluster.host_cores is not None:  # eager PyTorch ranks (the bundled trainer): its op counts
        eager = eager_block_ops(arch)
        ep_moe = np.where(np.asarray(lay.ep, dtype=float) > 1, counts["moe"], 0.0)  # expert-parallel dispatch
        fwd_kernels = total("fwd_comm_kernels") + sum(counts[b] * eager[b][0] for b in eager) + ep_moe * EAGER_EP_OPS[0]
        layer_fwd_ops = sum(counts[b] * eager[b][0] for b in _LAYER_BLOCKS) + ep_moe * EAGER_EP_OPS[0]
        bwd_kernels = (total("bwd_comm_kernels") + sum(counts[b] * eager[b][1] for b in eager) + ep_moe * EAGER_EP_OPS[1]
                       + np.where(full, layer_fwd_ops + EAGER_FULL_RECOMPUTE_OPS * counts["attention"],
                                  np.where(selective, EAGER_SELECTIVE_RECOMPUTE_OPS * counts["attention"], 0.0)))
    fwd_device = fwd_compute + sum(exposed[f"fwd_{c}"] for c in ("cp", "tp", "ep", "pp", "fsdp"))
    bwd_device = bwd_compute + sum(exposed[f"bwd_{c}"] for c in ("cp", "tp", "ep", "pp", "fsdp"))
    if cluster.host_cores is not None:  # CPU ranks run their own kernels: launch time adds
        dispatch = (fwd_kernels + bwd_kernels) * lat + 0.0 * fwd_device
        dispatch = dispatch + _dtensor_mb_ops(arch, lay, counts, full) * _dtensor_latency(hw)
        dispatch = dispatch + _checkpoint_seconds(arch, counts, full, selective, hw)
    else:  # the host enqueues ahead of the device: only launch time beyond device time shows
        dispatch = np.maximum(fwd_kernels * lat - fwd_device, 0.0) + np.maximum(bwd_kernels * lat - bwd_device, 0.0)
    t_mb = fwd_device + bwd_device + dispatch
    out["dispatch"] = dispatch
    out["t_mb"] = t_mb
    for cls in ("tp", "cp", "ep", "pp"):
        out[f"{cls}_exposed"] = exposed[f"fwd_{cls}"] + exposed[f"bwd_{cls}"]
        out[f"{cls}_hidden"] = hidden[f"fwd_{cls}"] + hidden[f"bwd_{cls}"]
    out["fsdp_exposed"] = exposed["fwd_fsdp"] + exposed["bwd_fsdp"]
    out["fsdp_hidden"] = hidden["fwd_fsdp"] + hidden["bwd_fsdp"]

    # once per step: DDP / ZeRO-1 synchronisation after the last micro-batch
    ddp = flavor == DDP
    zero1 = flavor == ZERO1
    grads = np.where(
        ddp,
        comm_cost.time("dp", "all_reduce", FP32_GRAD_BYTES * dense_params)
        + comm_cost.time("edp", "all_reduce", FP32_GRAD_BYTES * expert_params),
        np.where(zero1, grad_rs, 0.0))
    params_ag = np.where(zero1, gather, 0.0)
    local = np.maximum(dense_params + expert_params, 1.0)
    last_bucket = np.minimum(1.0, DDP_BUCKET_PARAMS / local)
    h_grads = np.minimum(np.minimum(ov.dp * grads, left["bwd"]), grads * (1.0 - last_bucket))
    h_params = np.minimum(np.minimum(ov.dp * params_ag, left["fwd"]), params_ag * (1.0 - last_bucket))
    out["dp_step_exposed"] = grads + params_ag - h_grads - h_params
    out["dp_step_hidden"] = h_grads + h_params

    # optimizer step over the parameters this rank updates
    shard_dense, shard_expert = shard_sizes(lay)
    sharded = flavor != DDP
    updated = np.where(sharded, dense_params / shard_dense + expert_params / shard_expert, dense_params + expert_params)
    opt_bytes = optimizer_step_bytes_per_param(lay) * updated
    opt_kernels = OPTIMIZER_KERNELS_PER_LAYER * np.maximum(counts["attention"], 1.0)
    if cluster.host_cores is not None:  # eager: the optimizer's and the trainer's per-step ops, run in turn
        opt_kernels = eager_step_ops(arch, counts, micro_batches(lay))
        bookkeeping = sum(count * comm_cost.time(group, "all_reduce", EAGER_STEP_COLLECTIVE_BYTES)
                          for group, count in eager_step_collectives(lay).items())
        out["optimizer"] = (hw.memory_time(opt_bytes, opt_kernels) + opt_kernels * lat + bookkeeping
                            + _dtensor_step_ops(arch, lay, counts) * _dtensor_latency(hw))
    else:
        out["optimizer"] = np.maximum(hw.memory_time(opt_bytes, opt_kernels), opt_kernels * lat)
    return out


def _dtensor_latency(hw: _Hardware) -> Any:
    """Seconds a DTensor op adds on an eager CPU rank (0 where the cluster has no figure)."""
    return (hw.acc.dtensor_op_latency_s or 0.0) / hw.share


def _checkpoint_seconds(arch: Any, counts: dict[str, Any], full: Any, selective: Any, hw: _Hardware) -> Any:
    """Host time activation checkpointing adds per micro-batch on an eager CPU rank beyond its
    ops: per region (a layer under full recompute, the attention core under selective) a fixed
    cost plus one per tensor it saves (`perfmodel.eager.eager_saved_tensors`)."""
    region = hw.acc.checkpoint_region_latency_s or 0.0
    per_saved = hw.acc.checkpoint_saved_tensor_latency_s or 0.0
    saved = eager_saved_tensors(arch)
    layers = counts["attention"]
    full_cost = layers * region + per_saved * sum(counts[b] * saved[b] for b in _LAYER_BLOCKS)
    selective_cost = layers * (region + per_saved * EAGER_SAVED_CORE)
    return np.where(full, full_cost, np.where(selective, selective_cost, 0.0)) / hw.share


def _dtensor_mb_ops(arch: Any, lay: Any, counts: dict[str, Any], full: Any) -> Any:
    """DTensor ops of one micro-batch on a stage under tp > 1 (`perfmodel.eager`), 0 without tp."""
    ops = eager_dtensor_block_ops(arch)
    per_mb = sum(counts[b] * (ops[b][0] + ops[b][1]) for b in ops)
    layer_fwd = sum(counts[b] * ops[b][0] for b in _LAYER_BLOCKS)
    per_mb = per_mb + np.where(full, EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR * layer_fwd, 0.0)
    return np.where(np.asarray(lay.tp, dtype=float) > 1, per_mb, 0.0)


def _dtensor_step_ops(arch: Any, lay: Any, counts: dict[str, Any]) -> Any:
    """DTensor ops once per step on a stage under tp > 1: optimizer and gradient norm."""
    tensors = eager_dtensor_param_tensors(arch)
    per_step = EAGER_DTENSOR_OPS_PER_PARAM_TENSOR * sum(counts[b] * tensors[b] for b in tensors) + EAGER_DTENSOR_STEP_OPS
    return np.where(np.asarray(lay.tp, dtype=float) > 1, per_step, 0.0)


TABLE_ARCH_FIELDS = tuple(f for f in ARCH_FIELDS if f != "ffn_ratio")
TABLE_LAYOUT_FIELDS = ("tp", "cp", "ep", "etp", "mbs", "sequence_parallel", "precision")
"""What the per-block operator and collective tables depend on (not pp, vpp, dp, the dp
flavour, gbs or recompute): candidates equal in these share one table row."""

_HASH_MULTIPLIERS = np.random.default_rng(20250101).integers(1, 2**62, size=32, dtype=np.int64) | 1


def _table_groups(arch: ArchBatch, lay: LayoutBatch, devices: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(representatives, inverse) when at most half the candidates have distinct block
    tables (a planner grid: geometries x layouts), else None. Grouping is exact: a
    multiplicative hash proposes groups and every key column is then compared."""
    n = len(devices)
    if n < 256:
        return None
    columns = [np.asarray(getattr(arch, f)).astype(np.int64, copy=False) for f in TABLE_ARCH_FIELDS]
    columns += [np.asarray(getattr(lay, f)).astype(np.int64, copy=False) for f in TABLE_LAYOUT_FIELDS]
    columns.append(np.asarray(devices).astype(np.int64))

    def hashed(rows: Any) -> np.ndarray:
        with np.errstate(over="ignore"):
            key = np.zeros(len(columns[0][rows]), dtype=np.int64)
            for col, mult in zip(columns, _HASH_MULTIPLIERS):
                key = (key ^ (col[rows] * mult)) * np.int64(1099511628211)
        return key

    if 4 * len(np.unique(hashed(slice(0, 1024)))) > 3 * min(n, 1024):  # a sample says most rows differ
        return None
    key = hashed(slice(None))
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    if 2 * len(uniq) > n:
        return None
    inverse = inverse.ravel()
    rep_of_row = first[inverse]
    for col in columns:
        if not np.array_equal(col[rep_of_row], col):  # a hash collision: price every row
            return None
    return first, inverse


def _shared_block_tables(arch: ArchBatch, lay: LayoutBatch, cluster: Any, devices: np.ndarray,
                         comm_cost: _Collectives, hw: _Hardware) -> dict[str, dict[str, Any]]:
    """Block tables, computed once per distinct (geometry, table-relevant layout fields)."""
    groups = _table_groups(arch, lay, devices)
    if groups is None:
        return _block_tables(arch, lay, comm_cost, hw)
    first, inverse = groups
    sub_lay = lay.take(first)
    sub_hw = _Hardware(cluster, sub_lay, devices[first])
    sub = _block_tables(arch.take(first), sub_lay, _Collectives(cluster, sub_lay, sub_hw.share), sub_hw)
    return {block: {k: (v[inverse] if np.ndim(v) else v) for k, v in t.items()} for block, t in sub.items()}


_CODE_FIELDS = ("dp_flavor", "recompute", "precision", "sequence_parallel", "gated_ffn", "tie_embeddings")


def _as_float(batch: Any) -> Any:
    """The batch with its integer sizes as float64 once (the formulas work in floats;
    categorical codes and flags keep their types)."""
    values = {name: (value if name in _CODE_FIELDS else np.asarray(value, dtype=float))
              for name, value in vars(batch).items()}
    return type(batch)(**values)


def _evaluate_chunk(arch: ArchBatch, lay: LayoutBatch, cluster: Any, devices: np.ndarray) -> EvalResult:
    arch, lay = _as_float(arch), _as_float(lay)
    hw = _Hardware(cluster, lay, devices)
    comm_cost = _Collectives(cluster, lay, hw.share)
    tables = _shared_block_tables(arch, lay, cluster, devices, comm_cost, hw)
    counts = stage_layer_counts(arch, lay)
    m = micro_batches(lay)
    slots = bubble_slots(lay)
    stages = {}
    for name in ("first", "last"):
        st = _stage(arch, lay, cluster, hw, comm_cost, tables, counts[name])
        st["base"] = (m + slots) * st["t_mb"] + st["dp_step_exposed"] + st["optimizer"]
        stages[name] = st
    last_slower = stages["last"]["base"] > stages["first"]["base"]

    def pick(key: str) -> Any:
        return np.where(last_slower, stages["last"][key], stages["first"][key])

    factor = straggler_factor(cluster, devices)
    base = pick("base")
    step = base * factor
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
        "bubble": slots * pick("t_mb"),
        "optimizer": pick("optimizer"),
        "straggler": base * (factor - 1.0),
        "tp_hidden": m * pick("tp_hidden"),
        "cp_hidden": m * pick("cp_hidden"),
        "ep_hidden": m * pick("ep_hidden"),
        "pp_hidden": m * pick("pp_hidden"),
        "dp_hidden": m * pick("fsdp_hidden") + pick("dp_step_hidden"),
    }
    breakdown = {k: np.broadcast_to(np.asarray(v, dtype=float), step.shape).copy() for k, v in breakdown.items()}

    activations = layer_activation_bytes(arch, lay)
    mem_first = stage_memory(arch, lay, cluster, "first", counts["first"], stages["first"]["params"], activations)
    mem_last = stage_memory(arch, lay, cluster, "last", counts["last"], stages["last"]["params"], activations)
    total_first = sum(mem_first[k] for k in MEMORY_COMPONENTS)
    total_last = sum(mem_last[k] for k in MEMORY_COMPONENTS)
    last_bigger = total_last > total_first
    memory = np.where(last_bigger, total_last, total_first)
    memory_breakdown = {k: np.broadcast_to(np.where(last_bigger, mem_last[k], mem_first[k]), step.shape).astype(float)
                        for k in MEMORY_COMPONENTS}

    tokens = np.asarray(lay.gbs, dtype=float) * np.asarray(arch.seq_len, dtype=float)
    tokens_per_s = tokens / step
    model_flops_per_s = np.asarray(model_flops_per_token(arch), dtype=float) * tokens_per_s
    mfu = model_flops_per_s / (devices * hw.gemm_peak)

    reason = np.zeros(len(devices), dtype=np.int64)
    checks = (
        ("memory", memory > cluster.accelerator.usable_hbm_bytes),
        ("precision", hw.precision_missing),
        ("devices", devices > cluster.devices),
        ("invalid_layout", ~valid_mask(arch, lay, devices)),
    )
    for name, failed in checks:  # the last assignment wins: most fundamental first in REASONS
        reason = np.where(failed, REASONS.index(name), reason)
    return EvalResult(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=tokens_per_s / devices,
        mfu=mfu,
        tflops_per_device=model_flops_per_s / devices / 1e12,
        memory_per_device_bytes=np.asarray(memory, dtype=float),
        feasible=reason == 0,
        reason=reason,
        breakdown=breakdown,
        memory_breakdown=memory_breakdown,
        devices=np.asarray(devices, dtype=float).astype(np.int64),
        micro_batches=np.asarray(m, dtype=float),
        bottleneck_stage=last_slower.astype(np.int64),
    )

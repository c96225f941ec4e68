"""Kernel microbenchmarks: dense GEMM, grouped expert GEMM, causal SDPA, memory, launch.

Each benchmark is a `KernelPoint` (kind, precision, shape); `kernel_plan`
lists the grid for a device (smaller with `quick`), `run_point` times one
point and returns a `Measurement`. FLOP conventions match perfmodel: a GEMM
(M x K)(K x N) is 2MNK; a causal attention forward is half of the
4 * b * heads * s^2 * head_dim of the full score and value products.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from calibration.measurements import Measurement
from calibration.stats import summarize
from calibration.timing import Budget, synchronize, time_call, time_samples

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LAUNCH_BATCH = 100
"""Tiny kernels issued back to back per launch-latency sample."""
COLD_SPAN_BYTES = 64 * 2**20
"""CPU GEMMs read operands last touched this many bytes of writes ago: more than an L2 (0.5-2 MiB
per core) and the per-complex L3 (32 MiB on AMD Zen 3/4; `getconf LEVEL3_CACHE_SIZE` reports the
socket), as in a training step, where a weight comes back one full step later. Small GEMMs run
markedly slower cold than warm, and the bundled trainer's small matmuls ran at the cold rate
(docs/validation.md, "Measurements behind the calibration's settings")."""
COLD_MAX_COPIES = 256
"""Operand copies cycled per GEMM point: more than the calls one point gets (warm-up + 2 per round),
so no timed call reuses a copy."""


@dataclass(frozen=True)
class KernelPoint:
    kind: str
    precision: str
    shape: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.precision} " + " ".join(f"{k}={v:g}" for k, v in self.shape.items())


# --------------------------------------------------------------------------- precisions

def _fp8_matmul(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """FP8 (e4m3) GEMM through torch._scaled_mm, unit scales, bf16 output."""
    one = torch.ones((), device=a_MK.device, dtype=torch.float32)
    return torch._scaled_mm(a_MK, b_KN, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _make_fp8(M: int, N: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(M, K, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device=device).to(torch.float8_e4m3fn).t()  # column-major (K, N) as _scaled_mm wants
    return a, b


def supported_precisions(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """Precisions whose GEMM runs on `device`, and why each other one was skipped."""
    ok: list[str] = []
    skipped: dict[str, str] = {}
    candidates = ["fp32", "bf16"] if device.type == "cpu" else ["fp32", "bf16", "fp16", "fp8"]
    if device.type == "cpu":
        skipped["fp16"] = "not measured on cpu (no fp16 GEMM units the planner would use)"
        skipped["fp8"] = "no fp8 GEMM on cpu"
    for precision in candidates:
        try:
            if precision == "fp8":
                if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
                    raise RuntimeError("this torch build has no torch._scaled_mm")
                _fp8_matmul(*_make_fp8(32, 32, 32, device))
            else:
                a = torch.ones(16, 16, device=device, dtype=DTYPES[precision])
                a @ a
            synchronize(device)
            ok.append(precision)
        except Exception as exc:  # the device or build lacks it: say why, keep going
            skipped[precision] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return ok, skipped


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 CPUs with bf16 dot-product units (AVX-512 BF16: Zen 4, Cooper
Lake and later; AMX: Sapphire Rapids and later). Without them torch runs bf16 GEMMs through an
emulated path, tens of times slower than fp32 and not monotone in size, so a curve over size
alone does not describe it (docs/validation.md, "Measurements behind the calibration's settings")."""


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this x86 CPU has bf16 GEMM units (NATIVE_BF16_CPU_FLAGS in /proc/cpuinfo's
    flags); None where that cannot be told (no /proc/cpuinfo, or a CPU that lists no x86 flags)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    if "sse2" not in flags:  # not an x86 flag list (ARM lists "Features"): cannot tell
        return None
    return any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS)


def main_precision(precisions: list[str]) -> str:
    """The training precision to use for grouped GEMM and attention: bf16 when present."""
    return "bf16" if "bf16" in precisions else precisions[0]


# --------------------------------------------------------------------------- grids

def gemm_shapes(device: torch.device, quick: bool) -> list[tuple[int, int, int]]:
    """(M, N, K): squares over the device's useful range plus skinny/rectangular shapes."""
    if device.type == "cpu":
        squares = [16, 32, 64, 128, 256, 512, 768, 1024] + ([] if quick else [1536, 2048])
        rect = [(32, 512, 512), (2048, 128, 128), (128, 1024, 256), (512, 256, 1024)]
        if not quick:
            rect += [(8, 1024, 1024), (4096, 256, 512), (256, 2048, 512), (1024, 512, 2048)]
    else:
        squares = [256, 512, 1024, 2048, 4096, 8192] + ([] if quick else [128, 3072, 6144, 12288, 16384])
        rect = [(64, 8192, 8192), (16384, 1024, 1024), (4096, 14336, 4096), (8192, 4096, 14336)]
        if not quick:
            rect += [(16, 8192, 8192), (512, 8192, 8192), (2048, 28672, 8192), (32768, 2048, 2048)]
    return sorted({(s, s, s) for s in squares} | set(rect), key=lambda mnk: mnk[0] * mnk[1] * mnk[2])


def kernel_plan(device: torch.device, quick: bool, precisions: list[str]) -> list[KernelPoint]:
    """Every kernel point to time on `device`, cheapest first within each kind."""
    points: list[KernelPoint] = []
    cpu = device.type == "cpu"
    main = "fp32" if cpu else main_precision(precisions)  # the bundled trainer computes in fp32 on cpu
    for precision in precisions:
        for M, N, K in gemm_shapes(device, quick):
            if precision == "fp8" and (M % 16 or N % 16 or K % 16):
                continue
            points.append(KernelPoint("gemm", precision, {"M": M, "N": N, "K": K}))
    experts = [4, 8] if cpu else ([8, 64] if quick else [8, 32, 128])
    tokens = [32, 128, 512] if cpu else ([128, 1024] if quick else [64, 256, 1024, 4096])
    hidden, width = (256, 256) if cpu else (2048, 1408)
    for e in experts:
        for t in tokens:
            for imbalance in (1.0, 2.0):
                points.append(KernelPoint("grouped_gemm", main, {"E": e, "T": t, "K": hidden, "N": width, "imbalance": imbalance}))
    if cpu:  # (B, H, S, D) from the tiny models the bundled trainer runs on cpu up to S=512
        attention = [(2, 4, 32, 16), (2, 4, 64, 32), (1, 4, 128, 64), (1, 4, 256, 64), (1, 4, 512, 64)]
    else:
        seqs = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192]
        attention = [(1, h, s, d) for s in seqs for h in (16, 32) for d in ([128] if quick else [64, 128])]
    for b, h, s, d in attention:
        points.append(KernelPoint("sdpa", main, {"B": b, "H": h, "S": s, "D": d}))
    buffers = [2**k for k in range(14, 27, 2)] if cpu else [2**k for k in range(16, 31, 2)]
    if quick:
        buffers = buffers[::2] + ([buffers[-1]] if len(buffers) % 2 == 0 else [])
    for kind in ("mem_copy", "mem_add"):
        for nbytes in buffers:
            points.append(KernelPoint(kind, "fp32", {"bytes": nbytes}))
    points.append(KernelPoint("launch", "fp32", {"batch": LAUNCH_BATCH}))
    if cpu and not torch.distributed.is_initialized():  # needs a fake process group of its own
        points.append(KernelPoint("dtensor_op", "fp32", {"ranks": 2}))
    if cpu:  # what the bundled trainer's recompute adds on a CPU rank
        points.append(KernelPoint("checkpoint_region", "fp32", {"regions": 4}))
        points.append(KernelPoint("checkpoint_saved_tensor", "fp32", {"regions": 4}))
    return points


# --------------------------------------------------------------------------- grouped GEMM

def expert_token_counts(experts: int, tokens_per_expert: int, imbalance: float, align: int = 1) -> list[int]:
    """Tokens per expert with one hot expert: it gets imbalance x mean, the rest share the remainder.

    `imbalance` = max / mean load (1 = balanced, at most `experts`); counts are
    rounded to multiples of `align` and sum to experts * tokens_per_expert
    (rounded the same way).
    """
    assert 1.0 <= imbalance <= experts, "imbalance must be in [1, experts]"
    total = experts * tokens_per_expert
    hot = imbalance * tokens_per_expert
    rest = (total - hot) / (experts - 1) if experts > 1 else 0.0
    raw = np.array([hot] + [rest] * (experts - 1))
    counts = (np.floor(raw / align) * align).astype(int)
    shortfall = (total // align) * align - counts.sum()
    counts[0] += int(shortfall)  # the hot expert absorbs the rounding
    return counts.tolist()


def grouped_mm_reference(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Readable reference: one matmul per expert over its contiguous slice of tokens."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x_TK[start:start + n] @ w_EKN[e])
        start += n
    return torch.cat(outs)


def grouped_mm_bmm(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Fallback: pad every expert to the largest count and run one batched matmul."""
    E, K, _ = w_EKN.shape
    longest = max(counts)
    padded_ETK = x_TK.new_zeros(E, longest, K)
    start = 0
    for e, n in enumerate(counts):
        padded_ETK[e, :n] = x_TK[start:start + n]
        start += n
    out_ETN = torch.bmm(padded_ETK, w_EKN)
    return torch.cat([out_ETN[e, :n] for e, n in enumerate(counts)])


def grouped_mm_fast(x_TK: torch.Tensor, w_EKN: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul: (T, K) x (E, K, N) with int32 end offsets per expert -> (T, N)."""
    return F.grouped_mm(x_TK, w_EKN, offs=offsets)  # type: ignore[attr-defined]


def grouped_impl(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """Which grouped GEMM this build runs on `device`: ('grouped_mm', '') or ('bmm', why not)."""
    if not hasattr(F, "grouped_mm"):
        return "bmm", f"torch {torch.__version__} has no torch.nn.functional.grouped_mm; padded bmm fallback"
    try:
        x = torch.ones(32, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        grouped_mm_fast(x, w, torch.tensor([16, 32], device=device, dtype=torch.int32))
        synchronize(device)
        return "grouped_mm", ""
    except Exception as exc:
        return "bmm", f"torch.nn.functional.grouped_mm failed on {device.type}/{dtype} ({type(exc).__name__}); padded bmm fallback"


# --------------------------------------------------------------------------- runners

def _cold_operand_copies(M: int, N: int, K: int, dtype: torch.dtype,
                         device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(a, b, out) views into one buffer, spread over COLD_SPAN_BYTES: cycling them, every call
    finds its operands out of cache (see COLD_SPAN_BYTES)."""
    set_elements = M * K + K * N + M * N
    copies = min(COLD_MAX_COPIES, max(2, math.ceil(COLD_SPAN_BYTES / (set_elements * dtype.itemsize))))
    stride = max(set_elements, COLD_SPAN_BYTES // dtype.itemsize // copies)
    buffer = torch.randn(stride * copies, device=device, dtype=dtype)
    views = []
    for i in range(copies):
        base = i * stride
        a = buffer[base:base + M * K].view(M, K)
        b = buffer[base + M * K:base + M * K + K * N].view(K, N)
        out = buffer[base + M * K + K * N:base + set_elements].view(M, N)
        views.append((a, b, out))
    return views


def _gemm_fn(point: KernelPoint, device: torch.device) -> Callable[[], Any]:
    M, N, K = (int(point.shape[k]) for k in ("M", "N", "K"))
    if point.precision == "fp8":
        a, b = _make_fp8(M, N, K, device)
        return lambda: _fp8_matmul(a, b)
    dtype = DTYPES[point.precision]
    if device.type == "cpu":
        operands = itertools.cycle(_cold_operand_copies(M, N, K, dtype, device))

        def cold_mm() -> torch.Tensor:
            a, b, out = next(operands)
            return torch.mm(a, b, out=out)

        return cold_mm
    # Accelerators keep the warm loop: their GEMMs in training are large enough to stream
    # from HBM either way, and the last-level cache is not what this calibration measures.
    a = torch.randn(M, K, device=device, dtype=dtype)
    b = torch.randn(K, N, device=device, dtype=dtype)
    out = torch.empty(M, N, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


@dataclass(frozen=True)
class Prepared:
    """A kernel point ready to time: the call, its useful FLOPs / bytes, and how it ran."""

    point: KernelPoint
    fn: Callable[[], Any]
    flops: float
    nbytes: float
    impl: str = ""


def prepare_point(point: KernelPoint, device: torch.device) -> Prepared:
    """Allocate the operands of `point` on `device` and return the call to time."""
    shape = dict(point.shape)
    kind = point.kind
    if kind == "gemm":
        return Prepared(point, _gemm_fn(point, device), 2.0 * shape["M"] * shape["N"] * shape["K"], 0.0)
    if kind == "grouped_gemm":
        dtype = DTYPES[point.precision]
        E, T, K, N = (int(shape[k]) for k in ("E", "T", "K", "N"))
        counts = expert_token_counts(E, T, shape["imbalance"], align=1 if device.type == "cpu" else 16)
        x = torch.randn(sum(counts), K, device=device, dtype=dtype)
        w = torch.randn(E, K, N, device=device, dtype=dtype)
        impl, _ = grouped_impl(device, dtype)
        if impl == "grouped_mm":
            offsets = torch.tensor(np.cumsum(counts), device=device, dtype=torch.int32)
            fn = lambda: grouped_mm_fast(x, w, offsets)  # noqa: E731
        else:
            fn = lambda: grouped_mm_bmm(x, w, counts)  # noqa: E731
        return Prepared(point, fn, 2.0 * sum(counts) * K * N, 0.0, impl)
    if kind == "sdpa":
        dtype = DTYPES[point.precision]
        B, H, S, D = (int(shape[k]) for k in ("B", "H", "S", "D"))
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        return Prepared(point, fn, 4.0 * B * H * S * S * D / 2.0, 0.0)  # causal forward: half of QK^T and PV
    if kind in ("mem_copy", "mem_add"):
        n = int(shape["bytes"]) // 4
        a = torch.rand(n, device=device)
        b = torch.rand(n, device=device)
        c = torch.empty(n, device=device)
        if kind == "mem_copy":
            return Prepared(point, lambda: c.copy_(a), 0.0, 2.0 * n * 4)
        return Prepared(point, lambda: torch.add(a, b, out=c), 0.0, 3.0 * n * 4)
    raise AssertionError(f"unknown kernel kind {kind}")


def _measurement(prepared: Prepared, device: torch.device, stats: Any) -> Measurement:
    p = prepared.point
    return Measurement.from_stats(p.kind, device.type, p.precision, dict(p.shape), prepared.flops, prepared.nbytes,
                                  stats, impl=prepared.impl)


def _launch_samples(point: KernelPoint, device: torch.device, budget: Budget) -> tuple[list[float], dict[str, float]]:
    """(seconds per launch of each repeat, the point's shape as measured) of the launch point."""
    if device.type == "cpu":
        # The CPU model multiplies the eager ops of a training step by this figure
        # (perfmodel.eager): time an eager block forward + backward with autograd, per op.
        from calibration.eager_ops import eager_op_step

        step, ops = eager_op_step()
        return [s / ops for s in time_samples(step, device, budget)], {"batch": ops}
    x = torch.zeros(1, device=device)
    batch = int(point.shape["batch"])

    def launches() -> None:
        for _ in range(batch):
            x.add_(1.0)
        synchronize(device)

    # Host clock on purpose: dispatch cost is host time (kernels this small are not the bound).
    return [s / batch for s in time_samples(launches, torch.device("cpu"), budget)], dict(point.shape)


def _launch_row(point: KernelPoint, device: torch.device, samples: list[float], shape: dict[str, float]) -> Measurement:
    """The launch point's row from its per-launch samples."""
    return Measurement.from_stats(point.kind, device.type, point.precision, shape, 0.0, 0.0, summarize(samples))


def _launch_point(point: KernelPoint, device: torch.device, budget: Budget) -> Measurement:
    return _launch_row(point, device, *_launch_samples(point, device, budget))


LAUNCH_SLICE_MIN_REPEATS = 3
"""Repeats of each slice of the launch point that `run_points` spreads over the whole grid."""


def _dtensor_point(point: KernelPoint, budget: Budget) -> Measurement:
    """Host time a DTensor op adds on cpu (calibration.eager_ops.dtensor_op_samples): the CPU
    model prices the bundled trainer's tensor-parallel DTensor ops with it (perfmodel.eager)."""
    from calibration.eager_ops import dtensor_op_samples

    samples, ops = dtensor_op_samples(max(budget.min_repeats, 9))
    stats = summarize([max(s, 1e-9) for s in samples])
    return Measurement.from_stats(point.kind, "cpu", point.precision, {"ranks": int(point.shape["ranks"]), "ops": ops},
                                  0.0, 0.0, stats)


_CHECKPOINT_COSTS: dict[int, tuple[list[float], list[float], dict]] = {}


def _checkpoint_point(point: KernelPoint, budget: Budget) -> Measurement:
    """One of the two activation-checkpoint costs (calibration.eager_ops.checkpoint_costs, solved
    from two stacks at once; the second point reuses the first's solution)."""
    from calibration.eager_ops import checkpoint_costs

    key = id(budget)
    if key not in _CHECKPOINT_COSTS:
        _CHECKPOINT_COSTS.clear()
        _CHECKPOINT_COSTS[key] = checkpoint_costs(max(budget.min_repeats, 9))
    regions, per_saved, details = _CHECKPOINT_COSTS[key]
    values = regions if point.kind == "checkpoint_region" else per_saved
    stats = summarize([max(v, 1e-12) for v in values])
    return Measurement.from_stats(point.kind, "cpu", point.precision,
                                  {"regions": int(point.shape["regions"]), **{f"saved_{k}": v for k, v in details["saved"].items()}},
                                  0.0, 0.0, stats)


def run_point(point: KernelPoint, device: torch.device, budget: Budget) -> Measurement:
    """Time one kernel point on `device` and return its measurement."""
    if point.kind == "launch":
        return _launch_point(point, device, budget)
    if point.kind == "dtensor_op":
        return _dtensor_point(point, budget)
    if point.kind in ("checkpoint_region", "checkpoint_saved_tensor"):
        return _checkpoint_point(point, budget)
    prepared = prepare_point(point, device)
    return _measurement(prepared, device, time_call(prepared.fn, device, budget))


def run_points(points: list[KernelPoint], device: torch.device, budget: Budget,
               progress: Optional[Callable[[int], None]] = None) -> list[Measurement]:
    """Time many points; the points of one (kind, precision) in interleaved rounds.

    Round r times one repeat (after one untimed call) of every point of the group, so a burst of load
    from other jobs lands on many points a little rather than on one point
    entirely (the curve keeps its shape on a busy host). A group stops adding
    rounds once min_repeats are done and it has used max_seconds per point.
    Launch points are timed in slices before every other group and after the last.
    """
    groups: dict[tuple[str, str], list[KernelPoint]] = {}
    for point in points:
        groups.setdefault((point.kind, point.precision), []).append(point)
    results: dict[int, Measurement] = {}
    index = {id(p): i for i, p in enumerate(points)}
    # The launch latency is a host cost that moves with the host's load within seconds (on a
    # shared VM by half again from one 0.2 s sample to the next, docs/validation.md): it is
    # sampled in short slices before every other group and after the last, and summarized over
    # all of them, so it stands for the whole calibration rather than one moment.
    launch = [p for p in points if p.kind == "launch"]
    spread: dict[int, list[float]] = {id(p): [] for p in launch}
    shapes: dict[int, dict[str, float]] = {}
    slices = len([key for key in groups if key[0] != "launch"]) + 1
    slice_budget = Budget(warmup=1, min_repeats=max(LAUNCH_SLICE_MIN_REPEATS, -(-budget.min_repeats // slices)),
                          max_repeats=max(LAUNCH_SLICE_MIN_REPEATS, -(-budget.max_repeats // slices)),
                          max_seconds=budget.max_seconds / slices)

    def sample_launch() -> None:
        for point in launch:
            samples, shapes[id(point)] = _launch_samples(point, device, slice_budget)
            spread[id(point)].extend(samples)

    for (kind, _), group in groups.items():
        if kind == "launch":
            continue
        sample_launch()
        if kind in ("dtensor_op", "checkpoint_region", "checkpoint_saved_tensor"):
            for point in group:
                results[index[id(point)]] = run_point(point, device, budget)
                if progress:
                    progress(1)
            continue
        prepared = [prepare_point(p, device) for p in group]
        for item in prepared:
            for _ in range(budget.warmup):
                item.fn()
        synchronize(device)
        samples: list[list[float]] = [[] for _ in prepared]
        started = time.perf_counter()
        for round_index in range(budget.max_repeats):
            for item, store in zip(prepared, samples):
                # One untimed call first: the previous point left other operands in cache and
                # other kernels selected; the timed call then sees the warm state a loop would.
                store.extend(time_samples(item.fn, device, Budget(warmup=1, min_repeats=1, max_repeats=1)))
            if round_index + 1 >= budget.min_repeats and time.perf_counter() - started > budget.max_seconds * len(group):
                break
        for point, item, store in zip(group, prepared, samples):
            results[index[id(point)]] = _measurement(item, device, summarize(store))
        del prepared
        if progress:
            progress(len(group))
    sample_launch()
    for point in launch:
        results[index[id(point)]] = _launch_row(point, device, spread[id(point)], shapes[id(point)])
        if progress:
            progress(1)
    return [results[i] for i in range(len(points))]


__all__ = [
    "KernelPoint", "Prepared", "prepare_point", "run_points", "expert_token_counts", "gemm_shapes", "grouped_impl", "grouped_mm_bmm", "grouped_mm_fast",
    "grouped_mm_reference", "kernel_plan", "main_precision", "run_point", "supported_precisions",
]

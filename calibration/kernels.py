"""Kernel microbenchmarks: what the kernel forms of `perfmodel.kernels.forms` are fitted to.

Each benchmark is a `KernelPoint` (kind, precision, shape, phase); `kernel_plan` lists the grid
for a device (smaller with `quick`), `run_point` times one point and returns a `Measurement`:

- dense GEMM over a factorial grid of (M, N, K) (`gemm_shapes`), so the fit sees each dimension
  vary with the others held: square, tall-m, small-k, small-n at every pair of sizes;
- grouped expert GEMM (torch's grouped_mm) in its three phases: forward Y = X W, input gradient
  dX = dY W^T, weight gradient dW = X^T dY (reduction over the tokens of each expert);
- causal SDPA forward and backward by sequence length and head dim;
- memory-bound kernels of each class the model prices (`MEMORY_KERNELS`): copy, add, RMSNorm,
  SwiGLU, a row gather (permute), cross-entropy, an AdamW step;
- host figures: launch latency (cpu: an eager op with autograd), a DTensor op, a checkpointed
  region and saved tensor (cpu).

FLOP conventions match perfmodel: a GEMM (M x K)(K x N) is 2MNK (a grouped GEMM the sum over its
groups); a causal attention forward executes half of the 4 b h s^2 d of the full score and value
products, its backward 2.5x that (FlashAttention-2's convention). Bytes: what each kernel reads
and writes once (`MEMORY_KERNELS`).
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

from calibration.measurements import MEMORY_KERNELS, Measurement
from calibration.stats import summarize
from calibration.timing import Budget, synchronize, time_call, time_samples
from perfmodel.operators import FLASH_BWD_FACTOR

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
    phase: str = ""
    """grouped_gemm: fwd, dgrad or wgrad; sdpa: fwd or bwd; a memory kernel on cpu: "fixed" for
    the point that times its fixed cost (FIXED_COST_BYTES); else empty."""

    @property
    def label(self) -> str:
        return (f"{self.kind}{'/' + self.phase if self.phase else ''} {self.precision} "
                + " ".join(f"{k}={v:g}" for k, v in self.shape.items()))


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

GEMM_LEVELS = {("cpu", True): (16, 64, 256), ("cpu", False): (16, 32, 64, 128, 256, 512),
               ("accelerator", True): (256, 2048, 8192), ("accelerator", False): (128, 512, 2048, 8192)}
"""Sizes of each GEMM dimension in the factorial grid (every (M, N, K) of them). On cpu they span
the bundled trainer's GEMMs (M 10-128 rows per rank or expert, N and K 8-512): fitted to
{16, 64, 256}^3 the GEMM form predicted the trainer's shapes with a median error of 8.5%, fitted
to square, tall-m, small-k and small-n shapes of sizes 64-512 with 18% (docs/validation.md,
"Measurements behind the calibration's settings")."""
GEMM_LARGE = {("cpu", True): (512, 1024), ("cpu", False): (1024, 2048),
              ("accelerator", True): (8192, 16384), ("accelerator", False): (8192, 16384)}
"""(s, S): large shapes beside the grid, where the form's ceiling shows: the squares s^3 and S^3,
s^3 with one dimension halved, and S^2 x S/4. Without them the fit follows the grid's small
shapes and overshoots a large GEMM (on the test machine, fp32 1024^3 +29% against +15% with
them, shapes of 256^3 and more: median error 14% against 6%; docs/validation.md)."""


def _large_shapes(s: int, big: int) -> set[tuple[int, int, int]]:
    half = s // 2
    return {(s, s, s), (big, big, big), (s, s, half), (s, half, s), (half, s, s), (big, big, big // 4)}


def _device_class(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "accelerator"


def gemm_shapes(device: torch.device, quick: bool) -> list[tuple[int, int, int]]:
    """(M, N, K): the factorial grid of GEMM_LEVELS plus the GEMM_LARGE shapes, cheapest first."""
    key = (_device_class(device), quick)
    levels = GEMM_LEVELS[key]
    shapes = set(itertools.product(levels, levels, levels)) | _large_shapes(*GEMM_LARGE[key])
    return sorted(shapes, key=lambda mnk: (mnk[0] * mnk[1] * mnk[2], mnk))


GROUPED_PHASES = ("fwd", "dgrad", "wgrad")
ATTENTION_PHASES = ("fwd", "bwd")


MEMORY_BYTES = {("cpu", True): (16, 19, 1), ("cpu", False): (14, 20, 1),
                ("accelerator", True): (16, 30, 2), ("accelerator", False): (16, 30, 1)}
"""(log2 of the smallest and largest main tensor [bytes], step) of the memory points. On cpu
64 KiB to 512 KiB (quick): what the bundled trainer's memory-bound kernels move (activations of
its tiny models, 16-256 KiB), from the core's L2, where a 64 MiB stream (DRAM) runs at a third
of their rate (copy 57 GB/s at 256 KiB, 17 GB/s at 64 MiB on the test machine), which one
saturating form cannot follow across both; below 64 KiB a call's time is mostly its fixed cost
(`FIXED_COST_BYTES`), not its bytes (docs/validation.md)."""
FIXED_COST_BYTES = 256
"""On cpu each memory kernel is also timed on a tensor of this many bytes (one row of the norm,
gather and cross-entropy points): the fixed cost of one call, its aten ops' dispatch, which the
CPU model prices per op as launch_latency_s (perfmodel.host.EagerHost). Its rows are written net
of it (`calibration.tables`): a CPU rank dispatches and runs each op on one core, so the dispatch
counted in both places would be counted twice (an AdamW step of a 16 KiB tensor: 56 us, 50 of
them the dispatch of its ~12 aten ops)."""
NORM_WIDTH = {"cpu": 128, "accelerator": 4096}
"""Row width of the RMSNorm and gather points (the cpu trainer's d_model 64-128; a large model's)."""
CROSS_ENTROPY_VOCAB = {"cpu": 256, "accelerator": 32768}
"""Vocabulary (logit row width) of the cross-entropy points (the cpu trainer's 256; a 32k tokenizer)."""


def kernel_plan(device: torch.device, quick: bool, precisions: list[str]) -> list[KernelPoint]:
    """Every kernel point to time on `device`, cheapest first within each kind.

    cpu: dense GEMMs, grouped GEMMs and attention in fp32 (the bundled trainer's precision on
    cpu) and bf16; accelerators: dense GEMMs in every supported precision, grouped GEMMs and
    attention in the training precision (bf16)."""
    points: list[KernelPoint] = []
    cpu = device.type == "cpu"
    for precision in precisions:
        for M, N, K in gemm_shapes(device, quick):
            if precision == "fp8" and (M % 16 or N % 16 or K % 16):
                continue
            points.append(KernelPoint("gemm", precision, {"M": M, "N": N, "K": K}))
    compute = [p for p in ("fp32", "bf16") if p in precisions] if cpu else [main_precision(precisions)]
    if cpu:  # (E, T tokens per expert, K, N) about the cpu trainer's experts: T 10-40, widths 32-128
        grouped = [(8, t, kn, kn) for t in ((16, 64, 256) if quick else (16, 32, 64, 128, 256)) for kn in (64, 256)]
    else:
        grouped = [(e, t, 2048, 1408) for e in ((8,) if quick else (8, 32, 128))
                   for t in ((128, 512, 2048) if quick else (64, 256, 1024, 4096))]
        if not quick:
            grouped += [(8, t, 7168, 2048) for t in (256, 1024, 4096)]
    for precision in compute:
        for phase in GROUPED_PHASES:
            for e, t, k, n in grouped:
                points.append(KernelPoint("grouped_gemm", precision, {"E": e, "T": t, "K": k, "N": n, "imbalance": 1.0},
                                          phase))
    if cpu:  # (B, H, S, D) from the tiny models the bundled trainer runs on cpu up to S=512
        seqs, dims = ((32, 128, 512), (16, 64)) if quick else ((32, 64, 128, 256, 512, 1024), (16, 32, 64, 128))
        attention = [(2, 4, s, d) for s in seqs for d in dims]
    else:
        seqs, dims = ((1024, 4096), (128,)) if quick else ((512, 1024, 2048, 4096, 8192), (64, 128))
        attention = [(1, 16, s, d) for s in seqs for d in dims]
    for precision in compute:
        for phase in ATTENTION_PHASES:
            for b, h, s, d in attention:
                points.append(KernelPoint("sdpa", precision, {"B": b, "H": h, "S": s, "D": d}, phase))
    low, high, step = MEMORY_BYTES[(_device_class(device), quick)]
    for kind in MEMORY_KERNELS:
        if cpu:  # the call's fixed cost, subtracted from its other rows (FIXED_COST_BYTES)
            points.append(KernelPoint(kind, "fp32", {"bytes": FIXED_COST_BYTES}, "fixed"))
        for k in range(low, high + 1, step):
            points.append(KernelPoint(kind, "fp32", {"bytes": 2**k}))
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


def grouped_wgrad_reference(x_TK: torch.Tensor, dy_TN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Readable reference of the weight gradient: dW[e] = X_e^T dY_e over each expert's tokens."""
    outs, start = [], 0
    for n in counts:
        outs.append(x_TK[start:start + n].t() @ dy_TN[start:start + n])
        start += n
    return torch.stack(outs)


def grouped_wgrad_fast(x_TK: torch.Tensor, dy_TN: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul in its k-grouped form, as autograd runs it for the weights:
    (K, T) x (T, N) with the token dimension split at `offsets` -> (E, K, N)."""
    return F.grouped_mm(x_TK.t(), dy_TN, offs=offsets)  # type: ignore[attr-defined]


def grouped_wgrad_bmm(x_TK: torch.Tensor, dy_TN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Fallback: pad every expert's tokens to the largest count and run one batched matmul."""
    longest = max(counts)
    x_ELK = x_TK.new_zeros(len(counts), longest, x_TK.shape[1])
    dy_ELN = dy_TN.new_zeros(len(counts), longest, dy_TN.shape[1])
    start = 0
    for e, n in enumerate(counts):
        x_ELK[e, :n] = x_TK[start:start + n]
        dy_ELN[e, :n] = dy_TN[start:start + n]
        start += n
    return torch.bmm(x_ELK.transpose(1, 2), dy_ELN)


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

def cold_copies(shapes: list[tuple[int, ...]], dtype: torch.dtype,
                device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Copies of a set of tensors of `shapes` (random normal), views into one buffer spread over
    COLD_SPAN_BYTES: cycling them, every call finds its operands out of cache (see COLD_SPAN_BYTES)."""
    sizes = [math.prod(shape) for shape in shapes]
    set_elements = sum(sizes)
    copies = min(COLD_MAX_COPIES, max(2, math.ceil(COLD_SPAN_BYTES / (set_elements * dtype.itemsize))))
    stride = max(set_elements, COLD_SPAN_BYTES // dtype.itemsize // copies)
    # Only the copies are written: the span between them is never touched, so the OS never
    # backs it with memory (a 64 MiB randn per point would cost ~0.1 s and its RSS).
    # The copies hold the same random values (a memcpy each, ~20x cheaper than drawing them):
    # what keeps a call cold is where its operands lie, not what they hold.
    buffer = torch.empty(stride * copies, device=device, dtype=dtype)
    template = buffer[:set_elements].normal_()
    views = []
    for i in range(copies):
        start, tensors = i * stride, []
        if i:
            buffer[start:start + set_elements].copy_(template)
        for shape, size in zip(shapes, sizes):
            tensors.append(buffer[start:start + size].view(shape))
            start += size
        views.append(tuple(tensors))
    return views


def _cold_operand_copies(M: int, N: int, K: int, dtype: torch.dtype,
                         device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """(a, b, out) of C[M, N] = A[M, K] B[K, N] as `cold_copies`."""
    return cold_copies([(M, K), (K, N), (M, N)], dtype, device)


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
        return _grouped_point(point, device)
    if kind == "sdpa":
        dtype = DTYPES[point.precision]
        B, H, S, D = (int(shape[k]) for k in ("B", "H", "S", "D"))
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, requires_grad=point.phase == "bwd")
                   for _ in range(3))
        forward_flops = 4.0 * B * H * S * S * D / 2.0  # causal forward: half of QK^T and PV
        if point.phase == "bwd":  # the backward alone, on one retained graph
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.randn_like(out)
            return Prepared(point, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                            FLASH_BWD_FACTOR * forward_flops, 0.0)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        return Prepared(point, fn, forward_flops, 0.0)
    if kind in MEMORY_KERNELS:
        return _memory_point(point, device)
    raise AssertionError(f"unknown kernel kind {kind}")


def _grouped_point(point: KernelPoint, device: torch.device) -> Prepared:
    """One phase of a grouped expert GEMM of E experts, T tokens each, weights (K, N)."""
    dtype = DTYPES[point.precision]
    shape = point.shape
    E, T, K, N = (int(shape[k]) for k in ("E", "T", "K", "N"))
    counts = expert_token_counts(E, T, shape["imbalance"], align=1 if device.type == "cpu" else 16)
    tokens = sum(counts)
    impl, _ = grouped_impl(device, dtype)
    offsets = torch.tensor(np.cumsum(counts), device=device, dtype=torch.int32)
    phase = point.phase or "fwd"

    def call(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        w_t = w.transpose(1, 2)  # the view autograd multiplies the output gradient by
        if impl == "grouped_mm":
            return {"fwd": lambda: grouped_mm_fast(x, w, offsets), "dgrad": lambda: grouped_mm_fast(dy, w_t, offsets),
                    "wgrad": lambda: grouped_wgrad_fast(x, dy, offsets)}[phase]()
        return {"fwd": lambda: grouped_mm_bmm(x, w, counts), "dgrad": lambda: grouped_mm_bmm(dy, w_t, counts),
                "wgrad": lambda: grouped_wgrad_bmm(x, dy, counts)}[phase]()

    shapes = [(tokens, K), (E, K, N), (tokens, N)]
    if device.type == "cpu":  # cold operands, as the dense GEMMs (COLD_SPAN_BYTES)
        operands = itertools.cycle(cold_copies(shapes, dtype, device))
        return Prepared(point, lambda: call(*next(operands)), 2.0 * tokens * K * N, 0.0, impl)
    x, w, dy = (torch.randn(shape, device=device, dtype=dtype) for shape in shapes)
    return Prepared(point, lambda: call(x, w, dy), 2.0 * tokens * K * N, 0.0, impl)


def _memory_point(point: KernelPoint, device: torch.device) -> Prepared:
    """A memory-bound kernel whose main tensor holds shape["bytes"] bytes of fp32 (MEMORY_KERNELS)."""
    spec = MEMORY_KERNELS[point.kind]
    n = max(1, int(point.shape["bytes"]) // 4)
    cls = _device_class(device)
    moved = spec.bytes_per_byte * 4.0 * n
    if point.kind in ("mem_copy", "mem_add", "mem_swiglu"):
        a = torch.rand(n, device=device)
        b = torch.rand(n, device=device)
        c = torch.empty(n, device=device)
        fn = {"mem_copy": lambda: c.copy_(a), "mem_add": lambda: torch.add(a, b, out=c),
              "mem_swiglu": lambda: F.silu(a) * b}[point.kind]
        return Prepared(point, fn, 0.0, moved)
    if point.kind in ("mem_rmsnorm", "mem_permute"):
        width = NORM_WIDTH[cls]
        rows = max(1, n // width)
        x = torch.randn(rows, width, device=device)
        if point.kind == "mem_rmsnorm":
            weight = torch.ones(width, device=device)
            return Prepared(point, lambda: F.rms_norm(x, (width,), weight, 1e-6), 0.0, spec.bytes_per_byte * 4.0 * x.numel())
        order = torch.randperm(rows, device=device)
        y = torch.empty_like(x)
        return Prepared(point, lambda: torch.index_select(x, 0, order, out=y), 0.0, spec.bytes_per_byte * 4.0 * x.numel())
    if point.kind == "mem_cross_entropy":
        vocab = CROSS_ENTROPY_VOCAB[cls]
        rows = max(1, n // vocab)
        logits = torch.randn(rows, vocab, device=device)
        targets = torch.randint(0, vocab, (rows,), device=device)
        return Prepared(point, lambda: F.cross_entropy(logits, targets), 0.0, spec.bytes_per_byte * 4.0 * logits.numel())
    assert point.kind == "mem_adamw", point.kind
    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device)
    # the bundled trainer's optimizer: foreach=False (mosaic.trainer.train)
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    optimizer.step()  # allocate the moments
    return Prepared(point, optimizer.step, 0.0, moved)


def _measurement(prepared: Prepared, device: torch.device, stats: Any) -> Measurement:
    p = prepared.point
    return Measurement.from_stats(p.kind, device.type, p.precision, dict(p.shape), prepared.flops, prepared.nbytes,
                                  stats, impl=prepared.impl, phase=p.phase)


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
    "ATTENTION_PHASES", "GEMM_LEVELS", "GROUPED_PHASES", "MEMORY_KERNELS", "KernelPoint",
    "Prepared", "prepare_point", "run_points", "expert_token_counts", "gemm_shapes", "grouped_impl", "grouped_mm_bmm",
    "grouped_mm_fast", "grouped_mm_reference", "grouped_wgrad_bmm", "grouped_wgrad_fast", "grouped_wgrad_reference",
    "kernel_plan", "main_precision", "run_point", "supported_precisions",
]

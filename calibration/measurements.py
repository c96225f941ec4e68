"""One row per benchmark point, and the raw-measurements CSV written beside a profile.

The CSV is the record of what was measured: every fitted figure in a
calibrated cluster file can be recomputed from it (`calibration.fit`).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from calibration.stats import TimingStats
from perfmodel.errors import InputError
from perfmodel.specs.strict import write_text_atomic

KERNEL_KINDS = ("gemm", "grouped_gemm", "sdpa", "mem_copy", "mem_add", "mem_rmsnorm", "mem_swiglu", "mem_permute",
                "mem_cross_entropy", "mem_adamw", "launch", "dtensor_op", "checkpoint_region", "checkpoint_saved_tensor")
HOST_KINDS = ("launch", "dtensor_op", "checkpoint_region", "checkpoint_saved_tensor")
"""Kernel kinds that measure host time (seconds per op, region or tensor), not a kernel's rate."""


@dataclass(frozen=True)
class MemoryKernel:
    """A memory-bound kernel class as timed: the table's kernel name and the bytes it moves per
    byte of its main tensor (reads + writes, perfmodel's convention for the class)."""

    kernel: str
    bytes_per_byte: float
    convention: str


MEMORY_KERNELS = {
    "mem_copy": MemoryKernel("copy", 2.0, "read x, write y"),
    "mem_add": MemoryKernel("add", 3.0, "read a and b, write c"),
    "mem_rmsnorm": MemoryKernel("rmsnorm", 2.0, "read x, write y (weight negligible)"),
    "mem_swiglu": MemoryKernel("swiglu", 3.0, "silu(a) * b: read a and b, write the product (the three "
                                              "tensors perfmodel counts for SwiGLU)"),
    "mem_permute": MemoryKernel("permute", 2.0, "index_select of rows by a permutation: read x, write y"),
    "mem_cross_entropy": MemoryKernel("cross_entropy", 3.0, "forward over fp32 logits: read them, write and "
                                                            "re-read fp32 (perfmodel: (b + 8) bytes per logit, b = 4)"),
    "mem_adamw": MemoryKernel("adamw", 7.0, "AdamW step on fp32 parameters: read p, grad, m, v, write p, m, v"),
}
"""Point kind -> the kernel it times (`perfmodel.kernels.fit.MEMORY_KERNEL_CLASS` names its class)."""

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class Measurement:
    """One benchmark point: what ran, its size, and its timing summary."""

    kind: str
    """One of KERNEL_KINDS or COLLECTIVE_KINDS."""
    device: str
    """cpu, cuda or npu."""
    precision: str
    """fp32, bf16, fp16, fp8 (kernels) or the element type moved (collectives)."""
    shape: str
    """What ran, as `key=value` pairs, e.g. `M=512;N=512;K=512` or `ranks=2;bytes=4096`."""
    flops: float
    """Useful FLOPs of one call (0 for memory and collectives)."""
    bytes: float
    """Bytes moved by one call (memory kernels) or message size (collectives, nccl-tests convention)."""
    median_s: float
    mean_s: float
    min_s: float
    iqr_s: float
    noise: float
    """IQR / median."""
    repeats: int
    outliers: int
    level: str = ""
    """Fabric level of a collective's group (cluster level name)."""
    ranks: int = 1
    """Ranks in the collective's group."""
    impl: str = ""
    """Implementation used (grouped_mm / bmm / for_loop; gloo / nccl / hccl)."""
    busbw_bytes_per_s: float = 0.0
    """Bus bandwidth as nccl-tests reports it (collectives only)."""
    phase: str = ""
    """grouped_gemm: fwd, dgrad or wgrad; sdpa: fwd or bwd; "fixed": a memory kernel's fixed-cost
    point (calibration.kernels.FIXED_COST_BYTES); else empty."""

    @property
    def rate(self) -> float:
        """Achieved FLOP/s (compute kernels) or bytes/s (memory, collectives: algbw)."""
        if self.median_s <= 0:
            return 0.0
        return (self.flops if self.flops > 0 else self.bytes) / self.median_s

    def shape_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for item in filter(None, self.shape.split(";")):
            key, _, value = item.partition("=")
            out[key] = float(value)
        return out

    @classmethod
    def from_stats(cls, kind: str, device: str, precision: str, shape: dict[str, float], flops: float,
                   nbytes: float, stats: TimingStats, **extra: object) -> Measurement:
        text = ";".join(f"{k}={_fmt(v)}" for k, v in shape.items())
        return cls(kind=kind, device=device, precision=precision, shape=text, flops=float(flops), bytes=float(nbytes),
                   median_s=stats.median_s, mean_s=stats.mean_s, min_s=stats.min_s, iqr_s=stats.iqr_s,
                   noise=stats.noise, repeats=stats.repeats, outliers=stats.outliers, **extra)  # type: ignore[arg-type]


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


FIELDS = [f.name for f in dataclasses.fields(Measurement)]
_TYPES = {f.name: f.type for f in dataclasses.fields(Measurement)}


def to_csv_text(rows: Iterable[Measurement]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(dataclasses.asdict(row))
    return buffer.getvalue()


def write_csv(path: str | Path, rows: Iterable[Measurement]) -> Path:
    """Write the rows atomically (header always present)."""
    return write_text_atomic(path, to_csv_text(rows))


def _parse(name: str, value: str) -> object:
    kind = _TYPES[name]
    if kind in ("float", float):
        number = float(value)
        if math.isnan(number):
            raise ValueError("NaN")
        return number
    if kind in ("int", int):
        return int(float(value))
    return value


def read_csv(path: str | Path, required: bool = True) -> list[Measurement]:
    """Read a measurements CSV; a malformed row is an InputError naming the file and line."""
    file = Path(path)
    if not file.exists():
        if required:
            raise InputError(f"{file}: measurements file not found; run `mosaic calibrate` first")
        return []
    rows: list[Measurement] = []
    with file.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [f for f in FIELDS if f not in (reader.fieldnames or []) and _default(f) is None]
        if missing:
            raise InputError(f"{file}: missing column(s) {', '.join(missing)}; use a CSV written by `mosaic calibrate`")
        for line, record in enumerate(reader, start=2):
            try:
                values = {k: _parse(k, v) for k, v in record.items() if k in _TYPES and v not in (None, "")}
                rows.append(Measurement(**values))  # type: ignore[arg-type]
            except (TypeError, ValueError) as exc:
                raise InputError(f"{file}: line {line}: bad value ({exc}); fix or delete the row") from None
    return rows


def _default(name: str) -> Optional[object]:
    field = next(f for f in dataclasses.fields(Measurement) if f.name == name)
    return None if field.default is dataclasses.MISSING else field.default


__all__ = ["COLLECTIVE_KINDS", "FIELDS", "HOST_KINDS", "KERNEL_KINDS", "Measurement", "read_csv", "to_csv_text", "write_csv"]

"""Fitted kernel figures of an accelerator (`Accelerator.kernels`), one record per kind.

Each record holds the parameters of its form in `perfmodel.kernels.forms`, how many measured
table rows (`perfmodel/data/kernels/*.csv`) it was fitted to and their median absolute error,
the sources of those rows, and `derived`: empty when fitted to this accelerator's own rows,
otherwise the rule that carried the figure over from the nearest measured accelerator (or
precision, or kernel class). `python -m perfmodel.kernels.build` writes these records into
the bundled cluster files; `mosaic calibrate` writes them from its own measurements with the
same fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from perfmodel.specs.strict import check

PRECISION_KEYS = ("fp32", "bf16", "fp16", "fp8", "mxfp8")
MEMORY_CLASS_KEYS = ("copy", "elementwise", "norm", "activation", "permute", "cross_entropy", "optimizer", "cast")


def _positive(value: float, key: str) -> None:
    check(math.isfinite(value) and value > 0, key, f"must be a positive number, got {value}",
          "regenerate with `python -m perfmodel.kernels.build` or `mosaic calibrate`")


def provenance(rows: int, error: Optional[float], source: str, derived: str) -> None:
    """A fitted figure's provenance: rows >= 0, an error only where fitted, a rule where no row
    of its own was fitted, and a source."""
    check(rows >= 0, "rows", f"must be >= 0, got {rows}", "count the fitted table rows")
    check(error is None or (math.isfinite(error) and error >= 0), "median_abs_error", f"must be >= 0, got {error}",
          "leave it out when nothing was fitted")
    check(rows > 0 or bool(derived), "derived", "a figure fitted to no rows must say how it was derived",
          "name the nearest measured accelerator and the rule")
    check(bool(source.strip()), "source", "is empty", "name the table rows' sources")


@dataclass(frozen=True)
class GemmFigures:
    """eff(m, n, k) = e_max s(m; m_half) s(n; n_half) s(k; k_half) (`forms.gemm_efficiency`)."""

    e_max: float
    m_half: float
    n_half: float
    k_half: float
    source: str
    rows: int = 0
    median_abs_error: Optional[float] = None
    derived: str = ""
    """Empty: fitted to this accelerator's rows; else the rule it was carried over by."""

    def __post_init__(self) -> None:
        check(math.isfinite(self.e_max) and 0 < self.e_max <= 1.0, "e_max", f"must be in (0, 1], got {self.e_max}",
              "regenerate with `python -m perfmodel.kernels.build`")
        for key in ("m_half", "n_half", "k_half"):
            _positive(getattr(self, key), key)
        provenance(self.rows, self.median_abs_error, self.source, self.derived)


@dataclass(frozen=True)
class GroupedGemmFigures:
    """A grouped expert GEMM per phase (m = tokens per expert), each the GEMM form."""

    fwd: GemmFigures
    dgrad: GemmFigures
    wgrad: GemmFigures

    def phase(self, name: str) -> GemmFigures:
        return getattr(self, name)


@dataclass(frozen=True)
class AttentionFigures:
    """eff = e_max[phase] s(seq; seq_half[causal]) s(head_dim; head_dim_half)
    (`forms.attention_efficiency`), on executed FLOPs."""

    fwd_e_max: float
    bwd_e_max: float
    seq_half_causal: float
    seq_half: float
    head_dim_half: float
    source: str
    rows: int = 0
    median_abs_error: Optional[float] = None
    derived: str = ""

    def __post_init__(self) -> None:
        for key in ("fwd_e_max", "bwd_e_max"):
            value = getattr(self, key)
            check(math.isfinite(value) and 0 < value <= 1.0, key, f"must be in (0, 1], got {value}",
                  "regenerate with `python -m perfmodel.kernels.build`")
        for key in ("seq_half_causal", "seq_half", "head_dim_half"):
            _positive(getattr(self, key), key)
        provenance(self.rows, self.median_abs_error, self.source, self.derived)


@dataclass(frozen=True)
class MemoryFigures:
    """eff(class, bytes) = fraction[class] s(bytes; bytes_half) (`forms.memory_efficiency`)."""

    fraction: dict[str, float]
    bytes_half: float
    source: str
    rows: int = 0
    median_abs_error: Optional[float] = None
    derived: dict[str, str] = field(default_factory=dict)
    """Per class without rows of its own: the rule it was carried over by."""

    def __post_init__(self) -> None:
        missing = [c for c in MEMORY_CLASS_KEYS if c not in self.fraction]
        check(not missing, "fraction", f"no fraction for {', '.join(missing)}", "give every kernel class")
        for name, value in self.fraction.items():
            check(name in MEMORY_CLASS_KEYS, f"fraction.{name}", "unknown kernel class",
                  f"use one of {', '.join(MEMORY_CLASS_KEYS)}")
            check(math.isfinite(value) and 0 < value <= 1.5, f"fraction.{name}", f"must be in (0, 1.5], got {value}",
                  "regenerate with `python -m perfmodel.kernels.build`")
        _positive(self.bytes_half, "bytes_half")
        for name in self.derived:
            check(name in MEMORY_CLASS_KEYS, f"derived.{name}", "unknown kernel class",
                  f"use one of {', '.join(MEMORY_CLASS_KEYS)}")
        provenance(self.rows, self.median_abs_error, self.source, "; ".join(self.derived.values()))


@dataclass(frozen=True)
class KernelFigures:
    """The accelerator's kernels: dense and grouped GEMMs and attention per precision, memory."""

    gemm: dict[str, GemmFigures]
    grouped_gemm: dict[str, GroupedGemmFigures]
    attention: dict[str, AttentionFigures]
    memory: MemoryFigures

    def __post_init__(self) -> None:
        for kind in ("gemm", "grouped_gemm", "attention"):
            table = getattr(self, kind)
            check(len(table) > 0, kind, "is empty", "give figures for at least bf16 (fp32 on cpu)")
            for name in table:
                check(name in PRECISION_KEYS, f"{kind}.{name}", "unknown precision",
                      f"use one of {', '.join(PRECISION_KEYS)}")

    def precision(self, kind: str, precision: str) -> str:
        """The key of `kind` that serves `precision`: itself, else mxfp8 -> fp8, fp16 <-> bf16, then
        bf16, fp32 (the accelerator's peak fallbacks)."""
        table = getattr(self, kind)
        for name in (precision, {"mxfp8": "fp8", "fp16": "bf16", "bf16": "fp16"}.get(precision, ""), "bf16", "fp32"):
            if name in table:
                return name
        return next(iter(table))

"""Measured kernel tables -> fitted kernel figures: forms, tables, the fit, derivation rules, build."""

from __future__ import annotations

from perfmodel.specs.kernels import (
    MEMORY_CLASS_KEYS,
    AttentionFigures,
    GemmFigures,
    GroupedGemmFigures,
    KernelFigures,
    MemoryFigures,
)


def flat_figures(efficiency: float, precisions: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8", "mxfp8"),
                 source: str = "flat figures (what-if)") -> KernelFigures:
    """The figures of an ideal part: every GEMM and attention kernel at `efficiency` of peak at any
    shape (halves 1e-9: every saturation is 1), memory-bound kernels at the full bandwidth with no
    per-launch cost. For what-if studies and tests of the model's arithmetic; `derived` says so."""
    tiny = 1e-9
    gemm = GemmFigures(efficiency, tiny, tiny, tiny, source, derived="flat")
    attention = AttentionFigures(efficiency, efficiency, tiny, tiny, tiny, source, derived="flat")
    memory = MemoryFigures({c: 1.0 for c in MEMORY_CLASS_KEYS}, tiny, source, derived={"copy": "flat"})
    return KernelFigures(gemm={p: gemm for p in precisions},
                         grouped_gemm={p: GroupedGemmFigures(gemm, gemm, gemm) for p in precisions},
                         attention={p: attention for p in precisions}, memory=memory)

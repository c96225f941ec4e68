"""The accelerator as the candidates of one batch see it: peaks, kernel figures, bandwidth.

- Peak FLOP/s per candidate: the accelerator's dense peak of the layout's precision
  (`Accelerator.peak`: mxfp8 falls back to fp8, fp16 to bf16) for the GEMMs; bf16 for the
  flash-attention core and the `gemm_hp` GEMMs (router, LM head) under fp8/mxfp8. A precision
  the part lacks is flagged (`precision_missing`) and priced at its largest peak. Each rank's
  peak is scaled by its core share (1 off-CPU, `perfmodel.host`).
- Achieved rates from the accelerator's fitted kernel figures (`Accelerator.kernels`, forms in
  `perfmodel.kernels.forms`, fitted to measured tables by `perfmodel.kernels.fit`):
    GEMM          peak x e_max s(m) s(n) s(k), per phase on that phase's (m, n, k)
                  (`forms.phase_dims`): dense figures of the GEMM's precision; grouped
                  expert GEMMs their own figures per phase; gemm_hp at bf16
    attention     bf16 peak x e_max[phase] s(seq; seq_half_causal) s(head_dim)
    memory-bound  HBM bandwidth x fraction[class] s(bytes per kernel; bytes_half), as seconds
                  (bytes + kernels x bytes_half) / (HBM bandwidth x fraction[class])
"""

from __future__ import annotations

from typing import Union

import numpy as np

from perfmodel.choice import select
from perfmodel.errors import InputError
from perfmodel.kernels.forms import GEMM_PHASES, MEMORY_CLASSES, phase_dims, saturation
from perfmodel.operators import BF16, FP8, precision_code
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.kernels import GemmFigures
from perfmodel.specs.layout import PRECISIONS
from perfmodel.specs.protocols import LayoutLike, Values

Sizes = Union[float, np.ndarray]

_GEMM_FIELDS = ("e_max", "m_half", "n_half", "k_half")


def _gemm_table(figures: list[GemmFigures]) -> np.ndarray:
    """(precision code, field) array of a GEMM figure per precision."""
    return np.asarray([[getattr(f, name) for name in _GEMM_FIELDS] for f in figures], dtype=float)


class HardwareView:
    """Peaks and kernel figures per candidate (precision codes index PRECISIONS).

    `share`: each candidate's fraction of a core (`HostDispatch.core_share`; 1 off-CPU),
    which scales its peaks and divides its launch latency."""

    def __init__(self, cluster: ClusterSpec, lay: LayoutLike, share: np.ndarray) -> None:
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
        self.share = share
        self.gemm_peak = np.where(np.isfinite(gemm_peak), gemm_peak, fallback) * share
        self.attn_peak = np.where(np.isfinite(attn_peak), attn_peak, fallback) * share
        self.launch_latency_s = acc.launch_latency_s / share
        """Seconds per kernel launch of one rank (ranks sharing a core dispatch in turns)."""
        self.hbm_bytes_per_s = acc.hbm_bandwidth_bytes_per_s
        k = acc.kernels
        dense = _gemm_table([k.gemm[k.precision("gemm", p)] for p in PRECISIONS])
        grouped = {ph: _gemm_table([k.grouped_gemm[k.precision("grouped_gemm", p)].phase(ph) for p in PRECISIONS])
                   for ph in GEMM_PHASES}
        attention = [k.attention[k.precision("attention", p)] for p in PRECISIONS]
        attn = np.asarray([[a.fwd_e_max, a.bwd_e_max, a.seq_half_causal, a.head_dim_half] for a in attention])
        # per candidate: one row of figures each (gathered on first use; scalars when one precision is present)
        self._tables = {"dense": (dense, False), "dense_hp": (dense, True), "attention": (attn, True),
                        **{f"grouped_{ph}": (t, False) for ph, t in grouped.items()}}
        self._code, self._attn_code = code, attn_code
        self._figures: dict[str, tuple[Values, ...]] = {}
        memory = k.memory
        self._memory_fraction = {c: memory.fraction[c] for c in MEMORY_CLASSES}
        self._bytes_half = memory.bytes_half

    def take(self, rows: np.ndarray) -> HardwareView:
        """The view of the candidates at `rows`: the same peaks and figures, gathered."""
        sub = object.__new__(HardwareView)
        sub.__dict__.update(self.__dict__)
        for name in ("precision_missing", "share", "gemm_peak", "attn_peak", "launch_latency_s", "_code", "_attn_code"):
            value = getattr(self, name)
            setattr(sub, name, value[rows] if isinstance(value, np.ndarray) and value.ndim else value)
        sub._figures = {}
        return sub

    def figures(self, name: str) -> tuple[Values, ...]:
        """One figure set (dense, dense_hp, attention, grouped_<phase>) per candidate, by precision code."""
        if name not in self._figures:
            table, attention_precision = self._tables[name]
            code = self._attn_code if attention_precision else self._code
            present = np.unique(code)
            self._figures[name] = (tuple(float(v) for v in table[int(present[0])]) if len(present) == 1
                                   else tuple(np.take(table[:, j], code) for j in range(table.shape[1])))
        return self._figures[name]

    # -- rates ------------------------------------------------------------------------------
    def gemm_rate(self, kind: str, phase: str, m: Values, n: Values, k: Values) -> Values:
        """Achieved FLOP/s of a `kind` GEMM (gemm, gemm_hp, expert_gemm) of forward shape
        (m, n, k) per group in `phase` (fwd, dgrad, wgrad)."""
        pm, pn, pk = phase_dims(phase, m, n, k)
        if kind == "expert_gemm":
            e_max, hm, hn, hk = self.figures(f"grouped_{phase}")
            peak = self.gemm_peak
        elif kind == "gemm_hp":
            e_max, hm, hn, hk = self.figures("dense_hp")
            peak = self.attn_peak
        else:
            e_max, hm, hn, hk = self.figures("dense")
            peak = self.gemm_peak
        return peak * (e_max * saturation(pm, hm) * saturation(pn, hn) * saturation(pk, hk))

    def attention_rate(self, phase: str, seq_len: Values, head_dim: Values) -> Values:
        """Achieved FLOP/s (executed, causal) of the flash-attention core in phase fwd or bwd."""
        fwd_e, bwd_e, seq_half, dim_half = self.figures("attention")
        e_max = fwd_e if phase == "fwd" else bwd_e
        return self.attn_peak * (e_max * saturation(seq_len, seq_half) * saturation(head_dim, dim_half))

    def operand_seconds(self, nbytes: Values) -> Values:
        """A GEMM's or attention kernel's operand traffic: bytes / (HBM bw x fraction[copy]), the
        memory side of its roofline. No per-kernel fixed cost: the kernel-timed GEMM and attention
        rows hold that in their shape saturations (`kernels.fit`, fitted with this same side)."""
        return nbytes / (self.hbm_bytes_per_s * self._memory_fraction["copy"])

    def memory_seconds(self, nbytes: Values, kernels: Values, kernel_class: str = "copy") -> Values:
        """Seconds of memory-bound traffic: bytes / (HBM bw x fraction[class] x s(bytes per kernel;
        bytes_half)) = (bytes + kernels x bytes_half) / (HBM bw x fraction[class]): each launch
        costs bytes_half's worth of streaming; nothing when no bytes move."""
        per_s = self.hbm_bytes_per_s * self._memory_fraction[kernel_class]
        seconds = (nbytes + np.maximum(kernels, 1.0) * self._bytes_half) / per_s
        return select(np.asarray(nbytes) > 0, seconds, 0.0) if np.ndim(seconds) else (seconds if nbytes > 0 else 0.0)

"""The accelerator as the candidates of one batch see it: peaks, efficiency curves, bandwidth.

- Peak FLOP/s per candidate: the accelerator's dense peak of the layout's
  precision (`Accelerator.peak`: mxfp8 falls back to fp8, fp16 to bf16) for the
  GEMMs; bf16 for the flash-attention core and the `gemm_hp` GEMMs (router, LM
  head) under fp8/mxfp8. A precision the part lacks is flagged
  (`precision_missing`) and priced at its largest peak. Each rank's peak is
  scaled by its core share (1 off-CPU, `perfmodel.host`).
- Efficiency: eff_compute(FLOPs of one kernel call) per precision
  (`Accelerator.compute_curve`), eff_memory(bytes per kernel); both piecewise
  linear in log10(size), flat beyond the ends (`EfficiencyCurve`).
- Achieved rates: GEMM = peak x eff_compute; attention core = bf16 peak x
  `attention_efficiency_vs_gemm` x eff_compute; memory-bound = HBM bandwidth x
  eff_memory.
"""

from __future__ import annotations

from typing import Union

import numpy as np

from perfmodel.errors import InputError
from perfmodel.operators import BF16, FP8, precision_code
from perfmodel.specs.cluster import ClusterSpec, EfficiencyCurve
from perfmodel.specs.layout import PRECISIONS
from perfmodel.specs.protocols import LayoutLike, Values

Sizes = Union[float, np.ndarray]


class CurveLookup:
    """An `EfficiencyCurve` with its knots pre-logged: linear in log10(size) between the
    knots, flat beyond the ends (the same function as `EfficiencyCurve.__call__`).

    Evaluated without np.interp: its per-element binary search mispredicts on the
    random sizes of a batch; counting the knots at or below each size (one comparison
    pass per knot) and gathering that segment's slope is faster. The arithmetic is
    np.interp's, slope * (x - x_j) + y_j with slope = (y_{j+1} - y_j) / (x_{j+1} - x_j),
    so the values are bit-identical."""

    def __init__(self, curve: EfficiencyCurve) -> None:
        self.log_sizes = np.log10(np.asarray(curve.sizes, dtype=float))
        self.values = np.asarray(curve.values, dtype=float)
        # slope of the segment that starts at each knot; 0 after the last (flat)
        self.slopes = np.append(np.diff(self.values) / np.diff(self.log_sizes), 0.0)
        # knots are counted in bytes (faster passes than intp) unless there are too many
        self._count_dtype = np.uint8 if len(self.log_sizes) < 256 else np.intp

    def segment(self, log_size: Sizes) -> tuple[np.ndarray, np.ndarray]:
        """(index j of the knot at or below each log size, 0 below the first; the log
        size minus that knot's, after clipping to the knots' range)."""
        j = np.zeros(np.shape(log_size), dtype=self._count_dtype)
        for knot in self.log_sizes[1:]:
            j += log_size >= knot
        j = j.astype(np.intp)
        offset = np.clip(log_size, self.log_sizes[0], self.log_sizes[-1])
        offset -= self.log_sizes.take(j)  # take: a faster gather than [j]
        return j, offset

    def __call__(self, size: Sizes) -> np.ndarray:
        with np.errstate(divide="ignore"):
            j, offset = self.segment(np.log10(size))
        offset *= self.slopes.take(j)
        offset += self.values.take(j)
        return offset


class HardwareView:
    """Peaks and efficiency curves per candidate (precision codes index PRECISIONS).

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
        self.attn_ratio = acc.attention_efficiency_vs_gemm or 1.0  # the core's rate over a GEMM's (calibrated)
        self.curves = [CurveLookup(acc.compute_curve(name)) for name in PRECISIONS]
        self.gemm_code, self.attn_code = code, attn_code
        self.gemm_present = np.flatnonzero(np.bincount(code, minlength=len(PRECISIONS)))
        self.attn_present = np.flatnonzero(np.bincount(attn_code, minlength=len(PRECISIONS)))
        # Mixed precisions. When the present curves share their knots (the bundled clusters
        # do), each row's segment on the common knots is found once and a gather of its own
        # curve's slope and value there finishes the interpolation. Otherwise every
        # precision's curve is laid side by side on one axis (curve c shifted by 100 c
        # decades), each row clipped to its own curve's ends, so one np.interp prices all
        # rows exactly as their own curve would.
        self._stacked: dict[str, tuple[np.ndarray, ...]] = {}
        self._shared: dict[str, tuple[CurveLookup, np.ndarray, np.ndarray, np.ndarray]] = {}
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
        self.hbm_bytes_per_s = acc.hbm_bandwidth_bytes_per_s
        self.mem_curve = CurveLookup(acc.memory_efficiency)
        self._mem_cache: dict[tuple[int, object], tuple[Values, np.ndarray]] = {}

    def _eff(self, which: str, present: np.ndarray, size: Sizes) -> np.ndarray:
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

    def compute_rate(self, kind: str, kernel_flops: Sizes) -> np.ndarray:
        """Achieved FLOP/s: peak x eff_compute(FLOPs of one kernel call). Attention and the
        bf16 GEMMs (gemm_hp: router, LM head) run at bf16 under fp8/mxfp8."""
        if kind in ("attention", "gemm_hp"):
            ratio = self.attn_ratio if kind == "attention" else 1.0  # the flash core's measured fraction
            return self.attn_peak * ratio * self._eff("attention", self.attn_present, kernel_flops)
        return self.gemm_peak * self._eff("gemm", self.gemm_present, kernel_flops)

    def memory_efficiency(self, nbytes: Values, kernels: Values) -> np.ndarray:
        """eff_memory(bytes per kernel); repeated operands (the same array object, e.g.
        every norm's bytes) are looked up once."""
        key = (id(nbytes), kernels if np.ndim(kernels) == 0 else id(kernels))
        hit = self._mem_cache.get(key)
        if hit is not None and hit[0] is nbytes:
            return hit[1]
        eff = self.mem_curve(nbytes / np.maximum(kernels, 1.0))
        self._mem_cache[key] = (nbytes, eff)
        return eff

    def memory_time(self, nbytes: Values, kernels: Values) -> Values:
        """Seconds: bytes / (HBM bandwidth x eff_memory(bytes per kernel))."""
        return nbytes / (self.hbm_bytes_per_s * self.memory_efficiency(nbytes, kernels))

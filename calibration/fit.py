"""Fitters: measurements -> efficiency curves, alpha-beta figures, fabric-level figures (numpy/scipy).

- `fit_alpha_beta`: t(S) = alpha + S / algbw_peak for one (collective, level),
  fitted by robust least squares (soft-L1 loss on relative residuals, so one
  slow repeat-median does not drag the line) with standard errors from the
  Jacobian, and R^2 of log time (the scale of the relative residuals; the R^2
  of the raw times, dominated by the one or two largest messages, is kept
  beside it). Bus bandwidth follows nccl-tests.
- `fit_efficiency_curve`: achieved fraction of peak vs problem size, the median
  efficiency of each half-decade of sizes, as the cluster file's
  `EfficiencyCurve` (piecewise linear in log size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from calibration.collectives import bus_factor
from calibration.measurements import Measurement
from perfmodel.specs.cluster import EfficiencyCurve

BINS_PER_DECADE = 2
MIN_EFFICIENCY = 1e-4
"""Floor for a fitted efficiency (EfficiencyCurve needs values > 0)."""


@dataclass(frozen=True)
class AlphaBetaFit:
    """t(S) = alpha_s + S / algbw_bytes_per_s for one collective on one level."""

    collective: str
    level: str
    ranks: int
    alpha_s: float
    algbw_bytes_per_s: float
    """Asymptotic algorithm bandwidth (large messages)."""
    alpha_se_s: float
    """Standard error of alpha."""
    beta_rel_se: float
    """Relative standard error of 1/algbw."""
    r2: float
    """Coefficient of determination of log time (the scale the fit works on: relative residuals)."""
    points: int
    r2_linear: float = float("nan")
    """R^2 of the times themselves (dominated by the largest messages)."""

    @property
    def busbw_bytes_per_s(self) -> float:
        """Asymptotic bus bandwidth (nccl-tests convention)."""
        return self.algbw_bytes_per_s * bus_factor(self.collective, self.ranks)

    def predict(self, nbytes: np.ndarray | float) -> np.ndarray:
        return self.alpha_s + np.asarray(nbytes, dtype=float) / self.algbw_bytes_per_s


def r_squared(observed: Sequence[float], predicted: Sequence[float]) -> float:
    y, f = np.asarray(observed, float), np.asarray(predicted, float)
    total = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - f) ** 2)) / total if total > 0 else 1.0


def fit_alpha_beta_arrays(nbytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float, float, float, float]:
    """(alpha_s, beta_s_per_byte, alpha_se, beta_se, r2 of log time) by robust relative least squares."""
    S = np.asarray(nbytes, float)
    t = np.asarray(times_s, float)
    assert S.size >= 2 and S.size == t.size, "need two or more sizes"
    # Start from ordinary least squares (clamped to the feasible region).
    beta0, alpha0 = np.polyfit(S, t, 1) if S.size >= 2 else (t[0] / S[0], 0.0)
    beta0 = max(beta0, 1e-3 * float(np.max(t / S)))
    alpha0 = min(max(alpha0, 0.0), float(np.min(t)))
    scale = np.array([max(float(np.min(t)), 1e-9), max(beta0, 1e-18)])

    def residuals(p: np.ndarray) -> np.ndarray:
        alpha, beta = p * scale
        return (alpha + beta * S - t) / t

    result = least_squares(residuals, np.array([alpha0, beta0]) / scale, loss="soft_l1", f_scale=0.1,
                           bounds=([0.0, 1e-12], [np.inf, np.inf]), method="trf")
    alpha, beta = result.x * scale
    # Standard errors from the Jacobian of the relative residuals at the optimum.
    J = result.jac / scale  # d(residual)/d(alpha, beta) from the scaled parameters
    dof = max(S.size - 2, 1)
    s2 = float(np.sum(residuals(result.x) ** 2)) / dof
    try:
        cov = np.linalg.inv(J.T @ J) * s2
        alpha_se, beta_se = (float(math.sqrt(max(v, 0.0))) for v in np.diag(cov))
    except np.linalg.LinAlgError:
        alpha_se = beta_se = float("inf")
    return float(alpha), float(beta), alpha_se, beta_se, r_squared(np.log(t), np.log(alpha + beta * S))


def fit_alpha_beta(rows: Sequence[Measurement]) -> AlphaBetaFit:
    """Fit one (collective, level) from its measurements (one row per message size)."""
    kinds = {(r.kind, r.level, r.ranks) for r in rows}
    assert len(kinds) == 1, f"rows mix collectives/levels: {kinds}"
    collective, level, ranks = kinds.pop()
    sizes, times = [r.bytes for r in rows], [r.median_s for r in rows]
    alpha, beta, alpha_se, beta_se, r2 = fit_alpha_beta_arrays(sizes, times)
    r2_linear = r_squared(times, alpha + beta * np.asarray(sizes))
    return AlphaBetaFit(collective=collective, level=level, ranks=ranks, alpha_s=alpha, algbw_bytes_per_s=1.0 / beta,
                        alpha_se_s=alpha_se, beta_rel_se=beta_se / beta, r2=r2, points=len(rows), r2_linear=r2_linear)


def fit_collectives(rows: Sequence[Measurement]) -> list[AlphaBetaFit]:
    """One alpha-beta fit per (collective, level, ranks) that has two or more sizes (rows of one
    timing variant: see calibration.collectives.AFTER_COMPUTE)."""
    groups: dict[tuple[str, str, int], list[Measurement]] = {}
    for row in rows:
        groups.setdefault((row.kind, row.level, row.ranks), []).append(row)
    return [fit_alpha_beta(sorted(g, key=lambda r: r.bytes)) for _, g in sorted(groups.items()) if len(g) >= 2]


# --------------------------------------------------------------------------- efficiency curves

@dataclass(frozen=True)
class CurveFit:
    curve: EfficiencyCurve
    peak: float
    """FLOP/s or bytes/s that the efficiencies are fractions of."""
    median_abs_error: float
    """Median |predicted - measured| / measured time, each point predicted by a fit without it."""
    max_abs_error: float
    points: int


def binned_curve(sizes: Sequence[float], efficiencies: Sequence[float], source: str,
                 bins_per_decade: int = BINS_PER_DECADE) -> EfficiencyCurve:
    """Median efficiency per 1/bins_per_decade decade of size, at the bin's geometric-mean size."""
    x = np.log10(np.asarray(sizes, float))
    e = np.asarray(efficiencies, float)
    bins = np.floor(x * bins_per_decade).astype(int)
    out_sizes, out_values = [], []
    for b in np.unique(bins):
        mask = bins == b
        out_sizes.append(float(10 ** np.mean(x[mask])))
        out_values.append(float(np.clip(np.median(e[mask]), MIN_EFFICIENCY, 1.0)))
    return EfficiencyCurve(sizes=tuple(out_sizes), values=tuple(out_values), source=source)


def fit_efficiency_curve(sizes: Sequence[float], times_s: Sequence[float], peak: float | None,
                         source: str) -> CurveFit:
    """Efficiency curve from measured (size, time); `peak` None = the best measured rate (cpu)."""
    size = np.asarray(sizes, float)
    t = np.asarray(times_s, float)
    rate = size / t
    top = float(np.max(rate)) if peak is None else float(peak)
    curve = binned_curve(size, rate / top, source)
    errors = leave_one_out_errors(size, t, top) if size.size >= 3 else np.zeros(1)
    return CurveFit(curve=curve, peak=top, median_abs_error=float(np.median(errors)),
                    max_abs_error=float(np.max(errors)), points=int(size.size))


def leave_one_out_errors(size: np.ndarray, t: np.ndarray, peak: float) -> np.ndarray:
    """|predicted - measured| / measured time of each point from a curve fitted without it.

    The honest figure for shapes that were not measured (in-sample, a bin
    holding one point would be predicted exactly).
    """
    errors = np.empty(size.size)
    for i in range(size.size):
        keep = np.arange(size.size) != i
        curve = binned_curve(size[keep], size[keep] / t[keep] / peak, "")
        errors[i] = abs(size[i] / (peak * float(curve(size[i]))) - t[i]) / t[i]
    return errors


def predict_time_s(curve: EfficiencyCurve, peak: float, size: float) -> float:
    """Time of one kernel of `size` (FLOPs or bytes) from a calibrated curve and peak."""
    return float(size / (peak * curve(size)))


def relative_efficiency(rows: Sequence[Measurement], curve: EfficiencyCurve, peak: float) -> dict[str, float]:
    """Achieved rate of `rows` (grouped GEMM, attention) over the dense-GEMM prediction at equal FLOPs."""
    ratios = np.array([r.rate / (peak * float(curve(r.flops))) for r in rows])
    return {"median": round(float(np.median(ratios)), 4), "min": round(float(np.min(ratios)), 4),
            "max": round(float(np.max(ratios)), 4), "points": int(ratios.size)}


__all__ = [
    "AlphaBetaFit", "CurveFit", "binned_curve", "fit_alpha_beta", "fit_alpha_beta_arrays", "fit_collectives",
    "fit_efficiency_curve", "predict_time_s", "r_squared", "relative_efficiency",
]

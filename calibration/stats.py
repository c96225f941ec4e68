"""Robust timing statistics: median with an outlier filter and a noise figure.

numpy only. A benchmark point is a list of repeat times. Interference on a
shared host (other jobs, the scheduler descheduling one rank for a few ms) only
ever adds time (Chen & Revels 2016, "Robust benchmarking in noisy
environments", arXiv:1608.04295), and on a busy shared host it can hit
close to half of the repeats, so a filter centred on the median would keep
them. The filter is therefore anchored at the fast end: around the lower
quartile q1, with a robust spread from the lower half of the samples (1.4826 x
their median absolute deviation from q1, which estimates 0.59 sigma for
Gaussian noise). Kept: q1 - tol <= x <= q1 + 1.5 tol with tol = max(cutoff x
spread, 10% of q1); for Gaussian noise that keeps 99.6% of the samples
(about -3 to +2.9 sigma), for stalls it drops them as long as fewer than three
quarters of the repeats stall. We report the median of what is kept and
IQR/median of the kept samples as the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAD_CUTOFF = 4.0
"""Tolerance around the lower quartile, in robust spreads (1.5x this above it)."""
MAD_TO_SIGMA = 1.4826
"""sigma / MAD for a Gaussian."""
REL_FLOOR = 0.10
"""The tolerance is never below 10% of the lower quartile (timer jitter on very steady points)."""


@dataclass(frozen=True)
class TimingStats:
    """Summary of one benchmark point (seconds)."""

    median_s: float
    mean_s: float
    min_s: float
    iqr_s: float
    repeats: int
    """Samples taken."""
    outliers: int
    """Samples dropped by the filter."""

    @property
    def noise(self) -> float:
        """Interquartile range over median of the kept samples (dimensionless)."""
        return self.iqr_s / self.median_s if self.median_s > 0 else 0.0


def outlier_mask(samples: Sequence[float], cutoff: float = MAD_CUTOFF) -> np.ndarray:
    """True for samples kept: q1 - tol <= x <= q1 + 1.5 tol (see the module docstring)."""
    x = np.asarray(samples, dtype=float)
    assert x.ndim == 1 and x.size > 0, "need at least one sample"
    q1 = float(np.percentile(x, 25))
    lower = x[x <= np.median(x)]
    spread = MAD_TO_SIGMA * float(np.median(np.abs(lower - q1)))
    tol = max(cutoff * spread, REL_FLOOR * abs(q1))
    return (x >= q1 - tol) & (x <= q1 + 1.5 * tol)


def summarize(samples: Sequence[float], cutoff: float = MAD_CUTOFF) -> TimingStats:
    """Median, mean, min and IQR of the samples that pass `outlier_mask`."""
    x = np.asarray(samples, dtype=float)
    keep = outlier_mask(x, cutoff)
    kept = x[keep]
    q1, q3 = np.percentile(kept, [25, 75])
    return TimingStats(
        median_s=float(np.median(kept)),
        mean_s=float(np.mean(kept)),
        min_s=float(np.min(kept)),
        iqr_s=float(q3 - q1),
        repeats=int(x.size),
        outliers=int(x.size - kept.size),
    )


__all__ = ["MAD_CUTOFF", "TimingStats", "outlier_mask", "summarize"]

"""Robust timing statistics: median with an outlier filter and a noise figure.

numpy only. A benchmark point is a list of repeat times; we keep the samples
within `MAD_CUTOFF` robust standard deviations of the median (the median
absolute deviation scaled by 1.4826 estimates sigma for Gaussian noise, and
unlike the standard deviation it is not dragged by the outliers it is meant to
find), then report the median of what is kept and IQR/median as the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAD_CUTOFF = 4.0
"""Samples further than this many robust sigmas from the median are outliers."""
MAD_TO_SIGMA = 1.4826
"""sigma / MAD for a Gaussian."""
REL_FLOOR = 0.10
"""Samples within 10% of the median are never outliers (timer jitter on very steady points)."""


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
    """True for samples kept: |x - median| <= max(cutoff * 1.4826 * MAD, 10% of the median)."""
    x = np.asarray(samples, dtype=float)
    assert x.ndim == 1 and x.size > 0, "need at least one sample"
    median = np.median(x)
    mad = np.median(np.abs(x - median))
    return np.abs(x - median) <= max(cutoff * MAD_TO_SIGMA * mad, REL_FLOOR * abs(median))


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

"""Fitters: alpha-beta figures of the collectives, and the ceilings a calibration's peaks come from.

- `fit_collectives`: t(S) = alpha + S / algbw_peak for one (collective, level),
  fitted by robust least squares (soft-L1 loss on relative residuals, so one
  slow repeat-median does not drag the line) with standard errors from the
  Jacobian, and R^2 of log time (the scale of the relative residuals; the R^2
  of the raw times, dominated by the one or two largest messages, is kept
  beside it). Bus bandwidth follows nccl-tests.
- `gemm_ceilings`, `memory_ceiling`: the asymptotic rate of the kernel forms over one
  accelerator's rows (`perfmodel.kernels.fit`, the fit the cluster is then built with): what a
  machine without a datasheet figure (a CPU core) takes as its peak, so that its e_max is 1 and
  every other figure is a fraction of what its largest kernels reach.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from calibration.collectives import bus_factor
from perfmodel.kernels.tables import KernelTable


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


COLLECTIVE_OF_TABLE = {"send_recv": "p2p"}
"""The table's collective names -> perfmodel.comm's."""


def fit_collectives(table: KernelTable, timing: str = "back_to_back") -> list[AlphaBetaFit]:
    """One alpha-beta fit per (collective, level, ranks) with two or more sizes, from the rows of
    one timing variant (`timing` column: back_to_back, or after_compute: see
    calibration.collectives.AFTER_COMPUTE)."""
    if not len(table) or "level" not in table.columns:
        return []
    groups: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for name, level, ranks, size, time_us, kind in zip(table["collective"], table["level"], table["ranks"],
                                                       table["size_bytes"], table["time_us"], table["timing"]):
        if kind != timing:
            continue
        key = (COLLECTIVE_OF_TABLE.get(str(name), str(name)), str(level), int(ranks))
        groups.setdefault(key, []).append((float(size), float(time_us) * 1e-6))
    fits = []
    for (collective, level, ranks), points in sorted(groups.items()):
        if len(points) < 2:
            continue
        sizes, times = (np.asarray(v) for v in zip(*sorted(points)))
        alpha, beta, alpha_se, beta_se, r2 = fit_alpha_beta_arrays(sizes, times)
        fits.append(AlphaBetaFit(collective=collective, level=level, ranks=ranks, alpha_s=alpha, algbw_bytes_per_s=1.0 / beta,
                                 alpha_se_s=alpha_se, beta_rel_se=beta_se / beta, r2=r2, points=len(points),
                                 r2_linear=r_squared(times, alpha + beta * sizes)))
    return fits


# --------------------------------------------------------------------------- ceilings

CEILING_START = 4.0
"""The first trial peak is this multiple of the best measured rate; it grows by the same factor
until the fitted e_max leaves its bound of 1. The result does not depend on it: with e_max free,
rate = peak x e_max x s(m) s(n) s(k) is invariant under the trial peak."""
CEILING_FREE = 0.9
"""e_max below this is off its bound of 1 (the fit is unconstrained there)."""


def gemm_ceilings(table: KernelTable, accelerator: str, hbm_bytes_per_s: float,
                  copy_fraction: float) -> dict[str, float]:
    """Per precision: e_max x peak of the GEMM form fitted to `accelerator`'s dense rows of that
    precision (halves of its own, as `perfmodel.kernels.build` fits a calibrated accelerator), with
    the peak free, and at least the best measured rate [FLOP/s]: the robust fit may land below a
    lone fast row (emulated bf16 on a cpu without bf16 units: ceiling 1.80 GFLOP/s against a row
    of 2.83 in a fresh-clone CI run on an AVX2-only core)."""
    from perfmodel.kernels.fit import fit_gemm_family, gemm_entries, used_rows

    rows = table.rows_of(accelerator)
    out: dict[str, float] = {}
    for precision in sorted(set(str(p) for p in rows["precision"])):
        mine = rows.select(rows["precision"] == precision)
        best = float(np.nanmax(mine["tflops"])) * 1e12
        peak = CEILING_START * best
        for _ in range(12):
            peaks = {(accelerator, precision): peak}
            entries, measured = gemm_entries(mine, peaks, {accelerator: hbm_bytes_per_s}, {accelerator: copy_fraction},
                                             grouped=False)
            _, fits = fit_gemm_family(entries, measured, mine["source"][used_rows(mine, peaks, False)])
            e_max = fits[(accelerator, precision)].params["e_max"]
            if e_max < CEILING_FREE:
                break
            peak *= CEILING_START
        out[precision] = max(e_max * peak, best)  # a ceiling no lower than a rate the machine reached
    return out


def memory_ceiling(table: KernelTable, accelerator: str) -> float:
    """fraction[copy] x bandwidth of the memory form fitted to `accelerator`'s rows with the
    bandwidth free (the best class's where no copy was measured) [bytes/s]."""
    from perfmodel.kernels.fit import fit_memory

    rows = table.rows_of(accelerator)
    rows = rows.select(np.isfinite(rows["gbps"]))
    best = float(np.max(rows["gbps"])) * 1e9
    bandwidth = CEILING_START * best
    for _ in range(12):
        fits, _ = fit_memory(rows, bandwidth)
        fraction = fits["copy"].params["fraction"] if "copy" in fits else max(r.params["fraction"] for r in fits.values())
        if fraction < CEILING_FREE:
            break
        bandwidth *= CEILING_START
    return fraction * bandwidth


__all__ = ["AlphaBetaFit", "fit_alpha_beta_arrays", "fit_collectives", "gemm_ceilings", "memory_ceiling", "r_squared"]

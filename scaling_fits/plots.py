"""Fit plots (matplotlib, Agg): loss vs compute with fitted iso-lines, residuals, predicted vs observed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scaling_fits.data import RunData
from scaling_fits.fitfile import FittedLaw


def plot_fit(fitted: FittedLaw, data: RunData, path: str | Path) -> Path:
    """Three panels into one PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    pred = fitted.predict(data.n_total, data.sparsity, data.tokens, data.granularity)
    compute = data.compute_flops
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))

    ax = axes[0]
    sc = ax.scatter(compute, data.loss, c=data.sparsity, s=8, cmap="viridis", vmin=0, vmax=1, label="runs")
    # iso-lines: the fitted loss of a few model configurations (fixed N_tot, S, G) as D grows
    configs = np.unique(np.stack([data.n_total, data.sparsity, data.granularity], axis=1), axis=0)
    pick = configs[np.linspace(0, len(configs) - 1, min(len(configs), 8)).astype(int)]
    d_grid = np.geomspace(data.tokens.min() / 3, data.tokens.max() * 3, 60)
    cmap = plt.get_cmap("viridis")
    for n_tot, s, g in pick:
        loss = fitted.predict(n_tot, s, d_grid, g)
        ax.plot(6 * n_tot * (1 - s) * d_grid, loss, color=cmap(s), lw=1, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute 6 N_act D (FLOPs)")
    ax.set_ylabel("loss")
    ax.set_title(f"{fitted.name}: data and fitted iso-(N, S, G) lines")
    fig.colorbar(sc, ax=ax, label="sparsity S")

    ax = axes[1]
    resid = np.log(pred) - np.log(data.loss)
    ax.scatter(compute, 100 * resid, c=data.sparsity, s=8, cmap="viridis", vmin=0, vmax=1)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("compute 6 N_act D (FLOPs)")
    ax.set_ylabel("log residual, % (pred / obs - 1)")
    ax.set_title("residuals")

    ax = axes[2]
    lo, hi = float(min(pred.min(), data.loss.min())), float(max(pred.max(), data.loss.max()))
    ax.scatter(data.loss, pred, c=data.sparsity, s=8, cmap="viridis", vmin=0, vmax=1)
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8)
    ax.set_xlabel("observed loss")
    ax.set_ylabel("predicted loss")
    mape = float(np.mean(np.abs(pred / data.loss - 1)))
    ax.set_title(f"predicted vs observed (MAPE {100 * mape:.2f}%)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        tmp.replace(path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
    return path


__all__ = ["plot_fit"]

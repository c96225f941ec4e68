"""Markdown report with PNG plots for a calibration run (matplotlib, Agg backend).

Plots: achieved FLOP/s vs kernel FLOPs with the fitted curve (one panel per
precision, grouped GEMM and attention overlaid), memory bandwidth vs bytes with
its curve, alpha-beta fits per collective and level, and the noise of every
point. Tables: fit quality, nccl-tests style bus bandwidth per size.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from calibration.fit import fit_collectives
from calibration.measurements import COLLECTIVE_KINDS, Measurement
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.strict import write_text_atomic


def _save(fig: object, path: Path) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)
    return path.name


def write_report(folder: Path, rows: Sequence[Measurement], spec: ClusterSpec, profile: Path) -> Path:
    """Write `folder/report.md` and its PNGs; returns the markdown path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    acc = spec.accelerator
    cal = spec.calibration or {}
    lines = [f"# Calibration report: {spec.name}", "",
             f"Profile: `{profile}`; raw measurements: `{cal.get('measurements_csv', '')}`.", ""]
    prov = cal.get("provenance", {})
    lines += ["| provenance | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in prov.items() if k != "notes"]
    for key, value in (prov.get("notes") or {}).items():
        lines.append(f"| note: {key} | {value} |")
    lines.append("")

    gemm = [r for r in rows if r.kind == "gemm"]
    precisions = sorted({r.precision for r in gemm})
    if precisions:
        fig, axes = plt.subplots(1, len(precisions), figsize=(5.5 * len(precisions), 4), squeeze=False)
        for ax, precision in zip(axes[0], precisions):
            pts = [r for r in gemm if r.precision == precision]
            ax.loglog([r.flops for r in pts], [r.rate / 1e12 for r in pts], "o", label="GEMM (measured)")
            for kind, marker in (("grouped_gemm", "s"), ("sdpa", "^")):
                extra = [r for r in rows if r.kind == kind and r.precision == precision]
                if extra:
                    ax.loglog([r.flops for r in extra], [r.rate / 1e12 for r in extra], marker, alpha=0.6, label=kind)
            curve = acc.compute_efficiency.get(precision)
            if curve is not None:
                grid = np.logspace(np.log10(min(r.flops for r in pts)), np.log10(max(r.flops for r in pts)), 100)
                ax.loglog(grid, acc.peak(precision) * curve(grid) / 1e12, "-", label="fitted curve x peak")
            ax.set_xlabel("FLOPs per kernel call")
            ax.set_ylabel("achieved TFLOP/s")
            ax.set_title(f"{precision}: peak {acc.peak(precision) / 1e12:.3g} TFLOP/s")
            ax.legend(fontsize=7)
        lines += ["## Compute", "", f"![compute]({_save(fig, folder / 'compute.png')})", ""]
        compute = cal.get("compute", {})
        lines += ["| precision | peak TFLOP/s | from | points | median time error (leave-one-out) | max |", "|---|---|---|---|---|---|"]
        for precision, q in compute.items():
            lines.append(f"| {precision} | {q['peak_flops_per_s'] / 1e12:.4g} | {q['peak_from']} | {q['points']} | "
                         f"{100 * q['loo_time_median_abs_error']:.1f}% | {100 * q['loo_time_max_abs_error']:.1f}% |")
        for key in ("grouped_gemm", "attention"):
            if key in cal:
                e = cal[key]["efficiency_vs_dense_gemm"]
                lines.append(f"\n{key}: achieved / dense-GEMM prediction at equal FLOPs: median {e['median']:.2f} "
                             f"(min {e['min']:.2f}, max {e['max']:.2f}, {e['points']} points)"
                             + (f"; implementation {cal[key]['impl']}" if cal[key].get("impl") else ""))
        lines.append("")

    memory = [r for r in rows if r.kind in ("mem_copy", "mem_add")]
    if memory:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for kind in ("mem_copy", "mem_add"):
            pts = [r for r in memory if r.kind == kind]
            ax.loglog([r.bytes for r in pts], [r.rate / 1e9 for r in pts], "o", label=kind)
        grid = np.logspace(np.log10(min(r.bytes for r in memory)), np.log10(max(r.bytes for r in memory)), 100)
        ax.loglog(grid, acc.hbm_bandwidth_bytes_per_s * acc.memory_efficiency(grid) / 1e9, "-", label="fitted curve x peak")
        ax.set_xlabel("bytes moved per call")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
        lines += ["## Memory bandwidth", "", f"![memory]({_save(fig, folder / 'memory.png')})", "",
                  f"Peak {acc.hbm_bandwidth_bytes_per_s / 1e9:.4g} GB/s; launch latency {acc.launch_latency_s * 1e6:.3g} us.", ""]

    comm = [r for r in rows if r.kind in COLLECTIVE_KINDS]
    if comm:
        fits = fit_collectives(comm)
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for fit in fits:
            pts = sorted((r for r in comm if (r.kind, r.level, r.ranks) == (fit.collective, fit.level, fit.ranks)),
                         key=lambda r: r.bytes)
            sizes = np.array([r.bytes for r in pts])
            (line,) = ax.loglog(sizes, [r.median_s for r in pts], "o", label=f"{fit.collective} ({fit.level}, n={fit.ranks})")
            ax.loglog(sizes, fit.predict(sizes), "-", color=line.get_color())
        ax.set_xlabel("message bytes (nccl-tests size)")
        ax.set_ylabel("time (s)")
        ax.legend(fontsize=7)
        lines += ["## Collectives (alpha-beta fits)", "", f"![collectives]({_save(fig, folder / 'collectives.png')})", "",
                  "| collective | level | ranks | alpha (us) | busbw GB/s | R^2 (log time) | R^2 (time) | points |",
                  "|---|---|---|---|---|---|---|---|"]
        for fit in fits:
            lines.append(f"| {fit.collective} | {fit.level} | {fit.ranks} | {fit.alpha_s * 1e6:.3g} | "
                         f"{fit.busbw_bytes_per_s / 1e9:.3g} | {fit.r2:.3f} | {fit.r2_linear:.3f} | {fit.points} |")
        lines += ["", "Bus bandwidth per message size (nccl-tests convention, GB/s):", "",
                  "| collective | level | " + " | ".join(_human(s) for s in sorted({r.bytes for r in comm})) + " |",
                  "|---|---|" + "---|" * len({r.bytes for r in comm})]
        sizes_all = sorted({r.bytes for r in comm})
        for fit in fits:
            by_size = {r.bytes: r.busbw_bytes_per_s for r in comm if (r.kind, r.level) == (fit.collective, fit.level)}
            lines.append(f"| {fit.collective} | {fit.level} | " + " | ".join(
                f"{by_size[s] / 1e9:.3g}" if s in by_size else "-" for s in sizes_all) + " |")
        lines.append("")

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in sorted({r.kind for r in rows}):
        pts = [r for r in rows if r.kind == kind]
        ax.semilogx([max(r.flops, r.bytes, 1.0) for r in pts], [r.noise for r in pts], "o", alpha=0.7, label=kind)
    ax.set_xlabel("size (FLOPs or bytes)")
    ax.set_ylabel("noise (IQR / median)")
    ax.legend(fontsize=6, ncol=2)
    noise = cal.get("noise", {})
    lines += ["## Noise", "", f"![noise]({_save(fig, folder / 'noise.png')})", "",
              f"Median IQR/median over all points: {noise.get('median_iqr_over_median', float('nan')):.3f}; "
              f"90th percentile: {noise.get('p90_iqr_over_median', float('nan')):.3f}. Outliers beyond 4 robust sigma "
              f"(and 10% of the median) are dropped before the median: {sum(r.outliers for r in rows)} of "
              f"{sum(r.repeats for r in rows)} samples.", ""]
    if "from_runs" in cal:
        fr = cal["from_runs"]
        lines += ["## Refit from training runs", "", "| | MAPE |", "|---|---|"] + [
            f"| {k} | {100 * v:.1f}% |" for k, v in fr.get("mape", {}).items()] + [""]
    return write_text_atomic(folder / "report.md", "\n".join(lines) + "\n")


def _human(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


__all__ = ["write_from_runs_report", "write_report"]


def write_from_runs_report(folder: Path, summary: dict) -> Path:
    """Markdown + PNG (predicted vs measured step time, before and after the refit) for `--from-runs`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    per_run = summary["per_run"]
    measured = np.array([r["measured_step_time_s"] for r in per_run])
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for key, label, marker in (("predicted_before_s", "before", "x"), ("predicted_after_s", "after (in sample)", "o"),
                               ("predicted_leave_one_out_s", "leave-one-run-out", "s")):
        values = [r[key] for r in per_run]
        if all(v is not None for v in values):
            ax.loglog(measured, values, marker, label=label, alpha=0.8)
    low, high = float(measured.min()) / 3, float(measured.max()) * 3
    ax.loglog([low, high], [low, high], "k--", lw=0.8, label="perfect")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize=7)
    lines = ["# Refit from training runs", "", f"Cluster written: `{summary['output']}`; runs: {summary['runs']}.", "",
             f"![predicted vs measured]({_save(fig, folder / 'from_runs.png')})", "", "| step-time MAPE | |", "|---|---|"]
    lines += [f"| {k} | {100 * v:.1f}% |" for k, v in summary["mape"].items()]
    lines += ["", "| factor | value |", "|---|---|"] + [f"| {k} | {v:.4g} |" for k, v in summary["factors"].items()]
    lines += [f"| {k} (not fitted) | {why} |" for k, why in summary["fixed"].items()]
    lines += ["", "| run | devices | layout | measured s | before s | after s | leave-one-out s |", "|---|---|---|---|---|---|---|"]
    for r in per_run:
        lines.append(f"| {r['run']} | {r['devices']} | {r['layout']} | {r['measured_step_time_s']:.4g} | "
                     f"{r['predicted_before_s']:.4g} | {r['predicted_after_s']:.4g} | {r['predicted_leave_one_out_s']} |")
    return write_text_atomic(folder / "report.md", "\n".join(lines) + "\n")

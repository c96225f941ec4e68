"""Markdown report with PNG plots for a calibration run (matplotlib, Agg backend).

From the tables the cluster was built from (`calibration.tables`) and the built cluster: for each
kind, the measured rate of every row against the rate the fitted figures give it (the kernel
forms of `perfmodel.kernels.forms`: GEMM e_max s(m) s(n) s(k) within its roofline, grouped
GEMM per phase on its phase's dimensions, attention e_max[phase] s(seq) s(head dim), memory
fraction[class] s(bytes)), with the fit quality per figure; the memory-bound kernels by size
with each class's fitted curve; the alpha-beta fits per collective and level with nccl-tests
style bus bandwidth per size; the noise of every point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from calibration.fit import fit_collectives
from calibration.tables import MeasuredTables
from perfmodel.errors import InputError
from perfmodel.kernels.fit import MEMORY_KERNEL_CLASS, gemm_bytes
from perfmodel.kernels.forms import attention_efficiency, gemm_efficiency, memory_efficiency, phase_dims
from perfmodel.kernels.tables import KernelTable
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.strict import save_figure_atomic, write_text_atomic


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    save_figure_atomic(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path.name


def fitted_rates(kind: str, table: KernelTable, spec: ClusterSpec) -> np.ndarray:
    """The rate (TFLOP/s; memory kernels GB/s) the cluster's fitted figures give each row of a
    table of `kind` (the module doc's forms; NaN where a row's precision has no figure)."""
    acc = spec.accelerator
    k = acc.kernels
    out = np.full(len(table), np.nan)
    if kind == "memory_kernels":
        for i, (name, nbytes) in enumerate(zip(table["kernel"], table["bytes_moved"])):
            cls = MEMORY_KERNEL_CLASS.get(str(name))
            if cls is not None:
                out[i] = acc.hbm_bandwidth_bytes_per_s * memory_efficiency(
                    nbytes, k.memory.fraction[cls], k.memory.bytes_half) / 1e9
        return out
    copy_bytes_per_s = acc.hbm_bandwidth_bytes_per_s * k.memory.fraction["copy"]
    for i in range(len(table)):
        precision = str(table["precision"][i])
        try:
            peak = acc.peak(precision)
        except InputError:  # a precision the accelerator has no peak for
            continue
        if kind == "attention":
            a = k.attention[k.precision("attention", precision)]
            e_max = a.fwd_e_max if table["phase"][i] == "fwd" else a.bwd_e_max
            half = a.seq_half_causal if str(table["causal"][i]).lower() == "true" else a.seq_half
            out[i] = peak * attention_efficiency(table["seq_len"][i], table["head_dim"][i], e_max, half,
                                                 a.head_dim_half) / 1e12
            continue
        grouped = kind == "grouped_gemm"
        m = table["m_per_group"][i] if grouped else table["m"][i]
        groups = table["groups"][i] if grouped else 1.0
        phase = str(table["phase"][i]) if grouped else "fwd"
        figures = (k.grouped_gemm[k.precision("grouped_gemm", precision)].phase(phase) if grouped
                   else k.gemm[k.precision("gemm", precision)])
        pm, pn, pk = phase_dims(phase, m, table["n"][i], table["k"][i])
        eff = min(1.0, gemm_efficiency(pm, pn, pk, figures.e_max, figures.m_half, figures.n_half, figures.k_half))
        flops = 2.0 * pm * pn * pk * groups
        nbytes = groups * float(gemm_bytes(np.asarray([pm]), np.asarray([pn]), np.asarray([pk]), [precision])[0])
        out[i] = flops / max(flops / (peak * eff), nbytes / copy_bytes_per_s) / 1e12
    return out


def _groups(kind: str, table: KernelTable) -> dict[str, np.ndarray]:
    """Rows of one panel's series: precision (and phase), or the memory kernel."""
    if kind == "memory_kernels":
        labels = np.asarray([str(v) for v in table["kernel"]])
    elif kind == "gemm":
        labels = np.asarray([str(v) for v in table["precision"]])
    else:
        labels = np.asarray([f"{p} {ph}" for p, ph in zip(table["precision"], table["phase"])])
    return {label: labels == label for label in sorted(set(labels))}


PANELS = (("gemm", "dense GEMM", "TFLOP/s"), ("grouped_gemm", "grouped GEMM", "TFLOP/s"),
          ("attention", "causal attention", "TFLOP/s"), ("memory_kernels", "memory-bound kernels", "GB/s"))


def write_report(folder: Path, measured: MeasuredTables, spec: ClusterSpec, profile: Path) -> Path:
    """Write `folder/report.md` and its PNGs; returns the markdown path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    acc = spec.accelerator
    cal = spec.calibration or {}
    lines = [f"# Calibration report: {spec.name}", "",
             f"Profile: `{profile}`; measurements (kernel tables): `{cal.get('tables', measured.folder.name)}/`.", ""]
    prov = cal.get("provenance", {})
    lines += ["| provenance | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in prov.items() if k != "notes"]
    for key, value in (prov.get("notes") or {}).items():
        lines.append(f"| note: {key} | {value} |")
    lines.append("")

    panels = [(kind, title, unit) for kind, title, unit in PANELS if len(measured.rows(kind))]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
        for ax, (kind, title, unit) in zip(axes[0], panels):
            table = measured.rows(kind)
            rate = table["gbps"] if kind == "memory_kernels" else table["tflops"]
            fitted = fitted_rates(kind, table, spec)
            for label, mask in _groups(kind, table).items():
                ax.loglog(rate[mask], fitted[mask], "o", ms=4, alpha=0.75, label=label)
            finite = np.isfinite(fitted) & (fitted > 0)
            low = float(min(rate[finite].min(), fitted[finite].min())) / 1.5 if np.any(finite) else 1e-3
            high = float(max(rate[finite].max(), fitted[finite].max())) * 1.5 if np.any(finite) else 1.0
            ax.loglog([low, high], [low, high], "k--", lw=0.8)
            ax.set_xlabel(f"measured {unit}")
            ax.set_ylabel(f"fitted figures' {unit}")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=6)
        lines += ["## Kernels: measured against the fitted figures", "",
                  f"![kernels]({_save(fig, folder / 'kernels.png')})", ""]
        lines += _quality_lines(cal, acc)

    memory = measured.rows("memory_kernels")
    if len(memory):
        fig, ax = plt.subplots(figsize=(5.5, 4))
        grid = np.logspace(np.log10(np.nanmin(memory["bytes_moved"])), np.log10(np.nanmax(memory["bytes_moved"])), 100)
        for name, mask in _groups("memory_kernels", memory).items():
            (line,) = ax.loglog(memory["bytes_moved"][mask], memory["gbps"][mask], "o", label=name)
            cls = MEMORY_KERNEL_CLASS.get(name)
            if cls is not None:
                ax.loglog(grid, acc.hbm_bandwidth_bytes_per_s * memory_efficiency(
                    grid, acc.kernels.memory.fraction[cls], acc.kernels.memory.bytes_half) / 1e9, "-",
                    color=line.get_color(), lw=0.8)
        ax.set_xlabel("bytes moved per call")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
        lines += ["## Memory-bound kernels", "", f"![memory]({_save(fig, folder / 'memory.png')})", "",
                  f"Bandwidth {acc.hbm_bandwidth_bytes_per_s / 1e9:.4g} GB/s; bytes_half "
                  f"{acc.kernels.memory.bytes_half:.3g} B; launch latency {acc.launch_latency_s * 1e6:.3g} us.", ""]

    comm = measured.rows("collectives")
    fits = fit_collectives(comm)
    if fits:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for fit in fits:
            sizes, times = _series(comm, fit.collective, fit.level, fit.ranks)
            (line,) = ax.loglog(sizes, times, "o", label=f"{fit.collective} ({fit.level}, n={fit.ranks})")
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
        back = comm.select(comm["timing"] == "back_to_back")
        sizes_all = sorted({float(s) for s in back["size_bytes"]})
        lines += ["", "Bus bandwidth per message size (nccl-tests convention, GB/s):", "",
                  "| collective | level | " + " | ".join(_human(s) for s in sizes_all) + " |",
                  "|---|---|" + "---|" * len(sizes_all)]
        for fit in fits:
            mine = back.select((back["level"] == fit.level) & (back["ranks"] == fit.ranks)
                               & np.isin(back["collective"], (fit.collective, "send_recv" if fit.collective == "p2p" else "")))
            by_size = dict(zip((float(s) for s in mine["size_bytes"]), mine["busbw_gbps"]))
            lines.append(f"| {fit.collective} | {fit.level} | " + " | ".join(
                f"{by_size[s]:.3g}" if s in by_size else "-" for s in sizes_all) + " |")
        lines.append("")

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in ("gemm", "grouped_gemm", "attention", "memory_kernels", "collectives"):
        table = measured.rows(kind)
        if not len(table) or "noise" not in table.columns:
            continue
        size = table["bytes_moved"] if kind == "memory_kernels" else (
            table["size_bytes"] if kind == "collectives" else table["time_us"])
        ax.semilogx(size, [float(v) for v in table["noise"]], "o", alpha=0.7, label=kind)
    ax.set_xlabel("bytes (memory, collectives) or median us (compute)")
    ax.set_ylabel("noise (IQR / median)")
    ax.legend(fontsize=6, ncol=2)
    noise = cal.get("noise", {})
    lines += ["## Noise", "", f"![noise]({_save(fig, folder / 'noise.png')})", "",
              f"Median IQR/median over all points: {noise.get('median_iqr_over_median', float('nan')):.3f}; "
              f"90th percentile: {noise.get('p90_iqr_over_median', float('nan')):.3f}. Stalls (samples beyond 4 robust "
              f"sigma and 10% of the lower quartile, calibration.stats) are dropped before the median.", ""]
    if "from_runs" in cal:
        fr = cal["from_runs"]
        lines += ["## Refit from training runs", "", "| | MAPE |", "|---|---|"] + [
            f"| {k} | {100 * v:.1f}% |" for k, v in fr.get("mape", {}).items()] + [""]
    return write_text_atomic(folder / "report.md", "\n".join(lines) + "\n")


def _quality_lines(cal: dict[str, Any], acc: Any) -> list[str]:
    lines = ["| figure | rows | median abs error (rate) |", "|---|---|---|"]
    for key, fit in cal.get("fits", {}).items():
        error = fit.get("median_abs_error")
        lines.append(f"| {key} | {fit['rows']} | {'-' if error is None else f'{100 * error:.1f}%'} |")
    lines.append("")
    compute = cal.get("compute", {})
    if compute:
        lines += ["| precision | peak TFLOP/s | from | fitted ceiling TFLOP/s |", "|---|---|---|---|"]
        for precision, q in compute.items():
            lines.append(f"| {precision} | {q['peak_flops_per_s'] / 1e12:.4g} | {q['peak_from']} | "
                         f"{q['ceiling_flops_per_s'] / 1e12:.4g} |")
        lines.append("")
    return lines


def _series(table: KernelTable, collective: str, level: str, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    names = (collective, "send_recv") if collective == "p2p" else (collective,)
    mine = table.select(np.isin(table["collective"], names) & (table["level"] == level) & (table["ranks"] == ranks)
                        & (table["timing"] == "back_to_back"))
    order = np.argsort(mine["size_bytes"])
    return mine["size_bytes"][order], mine["time_us"][order] * 1e-6


def _human(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


__all__ = ["fitted_rates", "write_from_runs_report", "write_report"]


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

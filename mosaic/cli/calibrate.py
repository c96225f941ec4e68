"""`mosaic calibrate`: benchmark kernels and collectives, write a calibrated cluster file.

torch (and the `calibration` package, which imports it) are imported inside
the command so `mosaic --help` stays fast and works without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from mosaic.cli.common import cli_errors, console, print_json
from perfmodel.errors import InputError


@cli_errors
def calibrate(
    cluster: Optional[str] = typer.Option(None, "--cluster", "-c",
                                          help="Base cluster (name or file); default: the bundled cluster of this "
                                               "device (cpu_local on cpu, by the device's name on cuda/npu). "
                                               "With --from-runs: the (calibrated) cluster to refit."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or npu (npu needs torch_npu)."),
    quick: bool = typer.Option(False, "--quick", help="Small grids (about a minute on a 2-core cpu)."),
    nproc: int = typer.Option(2, "--nproc", help="Ranks for the collective benchmarks when not under torchrun "
                                                 "(1 = skip collectives)."),
    output: Path = typer.Option(Path("calibrated.yaml"), "--output", "-o", help="Calibrated cluster YAML to write "
                                "(the measurements go to <stem>.kernels/ beside it, as kernel tables)."),
    report: Optional[Path] = typer.Option(None, "--report", help="Folder for a markdown report with PNG plots."),
    threads: int = typer.Option(1, "--threads", help="cpu threads per rank for the kernel benchmarks "
                                                     "(torchrun runs ranks with one)."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds without a new collective measurement before "
                                                            "the run is declared hung and killed."),
    measurements: Optional[Path] = typer.Option(None, "--measurements", help="Refit without measuring, from the "
                                                "<stem>.kernels/ folder of an earlier run (or one kernel table "
                                                "KIND.csv, or an older version's measurements CSV)."),
    from_runs: Optional[Path] = typer.Option(None, "--from-runs", help="Folder of trainer runs (runs/*/metrics.jsonl "
                                             "+ run.yaml): refit the correction factors of --cluster from step times."),
    json_output: bool = typer.Option(False, "--json", help="Print a JSON summary instead of tables."),
) -> None:
    """Measure this machine's kernels and collectives and write a calibrated cluster file."""
    if from_runs is not None:
        _from_runs(from_runs, cluster, output, report, json_output)
        return
    if device not in ("cpu", "cuda", "npu"):
        raise InputError(f"--device {device!r} is not one of cpu, cuda, npu")
    base = cluster
    if base is None:  # the device's bundled cluster (asks torch for the device: imported here only)
        from calibration.timing import default_cluster_here
        from perfmodel.clusters import NoDefaultCluster

        try:
            base = default_cluster_here(device)
        except NoDefaultCluster as missing:
            raise InputError(missing.for_option("--cluster")) from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from calibration.run import calibrate as run_calibration
    from calibration.run import under_torchrun

    show = not json_output and not under_torchrun() and measurements is None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not show, transient=False) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, advance: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.advance(tasks[phase], advance)

        result = run_calibration(base, device_kind=device, quick=quick, nproc=nproc, output=output,
                                 report_dir=report, threads=threads, stall_s=timeout, measurements=measurements,
                                 progress=progress)
    if result is None:  # a non-zero rank under torchrun
        return
    _print_summary(result.spec, result.output, result.tables, result.report, json_output)


def _print_summary(spec: Any, output: Path, tables: Path, report: Optional[Path], json_output: bool) -> None:
    cal = spec.calibration or {}
    acc = spec.accelerator
    summary = {
        "output": str(output), "tables": str(tables), "report": str(report) if report else None,
        "peak_flops_per_s": acc.peak_flops_per_s, "hbm_bandwidth_bytes_per_s": acc.hbm_bandwidth_bytes_per_s,
        "launch_latency_s": acc.launch_latency_s, "compute": cal.get("compute", {}), "fits": cal.get("fits", {}),
        "collectives": cal.get("collectives", []), "noise": cal.get("noise", {}),
    }
    if json_output:
        print_json(summary)
        return
    table = Table(title=f"calibrated {spec.name}")
    for column in ("figure", "value", "fit quality"):
        table.add_column(column)
    for precision, q in cal.get("compute", {}).items():
        table.add_row(f"peak {precision}", f"{q['peak_flops_per_s'] / 1e12:.4g} TFLOP/s ({q['peak_from']})", "")
    kernels = acc.kernels
    for key, fit in cal.get("fits", {}).items():
        kind, _, rest = key.partition(".")
        if kind == "gemm":
            g = kernels.gemm[rest]
            value = f"e_max {g.e_max:.3g}, halves m {g.m_half:.3g} n {g.n_half:.3g} k {g.k_half:.3g}"
        elif kind == "grouped_gemm":
            precision, phase = rest.split(".")
            value = f"e_max {kernels.grouped_gemm[precision].phase(phase).e_max:.3g}"
        elif kind == "attention":
            a = kernels.attention[rest]
            value = f"e_max fwd {a.fwd_e_max:.3g} bwd {a.bwd_e_max:.3g}"
        else:
            value = f"bytes_half {kernels.memory.bytes_half:.3g} B"
        table.add_row(key, value, f"{fit['rows']} rows, median error {100 * (fit['median_abs_error'] or 0):.1f}%")
    table.add_row("memory bandwidth", f"{acc.hbm_bandwidth_bytes_per_s / 1e9:.4g} GB/s", "")
    table.add_row("launch latency", f"{acc.launch_latency_s * 1e6:.3g} us", "")
    for fit in cal.get("collectives", []):
        table.add_row(f"{fit['collective']} ({fit['level']}, {fit['ranks']} ranks)",
                      f"alpha {fit['alpha_s'] * 1e6:.3g} us, busbw {fit['busbw_bytes_per_s'] / 1e9:.3g} GB/s",
                      f"R^2 {fit['r2']:.3f} (log time)")
    console.print(table)
    console.print(f"wrote {output} and {tables}/" + (f"; report {report}" if report else ""))


def _from_runs(runs: Path, cluster: Optional[str], output: Path, report: Optional[Path], json_output: bool) -> None:
    if cluster is None:
        raise InputError("--from-runs needs --cluster: the (calibrated) cluster file whose correction factors to refit")
    from calibration.from_runs import refit_from_runs

    result = refit_from_runs(runs, cluster, output)
    if report is not None:
        from calibration.report import write_from_runs_report

        write_from_runs_report(report, result.summary())
    if json_output:
        print_json(result.summary())
        return
    table = Table(title=f"refit from {result.runs} runs")
    for column in ("step-time MAPE", "value"):
        table.add_column(column)
    for key, value in result.mape.items():
        table.add_row(key, f"{100 * value:.1f}%")
    console.print(table)
    for name, value in result.factors.items():
        console.print(f"{name} = {value:.4g}")
    console.print(f"wrote {result.output}" + (f"; report {report / 'report.md'}" if report else ""))

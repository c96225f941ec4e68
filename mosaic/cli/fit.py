"""`mosaic fit`: fit a scaling law to training runs (scaling_fits), with intervals and extrapolation errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mosaic.cli.common import cli_errors, console, err_console, print_json
from perfmodel.errors import InputError

LAW_NAMES = ("mosaic4d", "mosaic4d_lg2", "chinchilla", "krajewski2024", "abnar2025")


def _parse_fixed(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise InputError(f"--fix '{item}': expected NAME=VALUE, e.g. --fix eta=0.58") from None
    return out


def _fmt(value: Optional[float]) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.4g}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


@cli_errors
def fit(
    runs: Path = typer.Argument(..., help="Runs file, CSV or Parquet (columns: scaling_fits/data.py; "
                                          "e.g. the bundled scaling_fits/data/clark2022_runs.csv)."),
    law: str = typer.Option("mosaic4d", "--law", help=f"Law to fit: {', '.join(LAW_NAMES)}."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the fit (versioned YAML) here."),
    n_boot: int = typer.Option(200, "--bootstrap", help="Bootstrap refits over runs (0 = none)."),
    holdout_top: float = typer.Option(0.2, "--holdout-top",
                                      help="Fraction of runs with the largest compute to hold out (0 = none)."),
    loo: bool = typer.Option(True, "--loo/--no-loo", help="Leave-one-run-out error (warm-started refits)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write loss-vs-compute, residual and "
                                                             "predicted-vs-observed panels to this PNG."),
    starts: int = typer.Option(128, "--starts", help="Size of the start grid (scrambled Sobol points)."),
    huber_delta: float = typer.Option(1e-3, "--huber-delta", help="Huber delta on log-loss residuals."),
    fix: list[str] = typer.Option([], "--fix", help="Hold a parameter at a value (a prior), e.g. --fix eta=0.58; "
                                                    "repeatable. A coefficient fixed at 0 removes its term."),
    seed: int = typer.Option(0, "--seed", help="Seed of the start grid and the bootstrap."),
    jobs: int = typer.Option(1, "--jobs", help="Processes over starts (pays on large grids; see benchmarks/fit_speed.py)."),
    ci_level: float = typer.Option(0.95, "--ci-level", help="Bootstrap percentile interval level."),
    per_source: list[str] = typer.Option([], "--per-source", help="Fit this constant coefficient once per data source "
                                         "(the runs file's 'source' column), e.g. --per-source e: one irreducible "
                                         "loss per corpus/tokenizer, everything else shared."),
    reference_source: Optional[str] = typer.Option(None, "--reference-source", help="With --per-source: the source "
                                                   "whose values the written law keeps (default: the first by name)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Fit a scaling law to runs: parameters with bootstrap intervals, in-sample, held-out and leave-one-out MAPE."""
    from scaling_fits.errors import FitDataError

    try:
        _fit(runs, law, output, n_boot, holdout_top, loo, plot, starts, huber_delta, fix, seed, jobs, ci_level,
             json_output, tuple(per_source), reference_source)
    except FitDataError as exc:
        raise InputError(str(exc)) from None


def _check_out(path: Optional[Path], what: str) -> None:
    if path is not None and not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise InputError(f"{what} {path}: folder {path.parent} does not exist; create it or choose another path")


def _fit(runs: Path, law: str, output: Optional[Path], n_boot: int, holdout_top: float, loo: bool,
         plot: Optional[Path], starts: int, huber_delta: float, fix: list[str], seed: int, jobs: int,
         ci_level: float, json_output: bool, per_source: tuple[str, ...] = (),
         reference_source: Optional[str] = None) -> None:
    from scaling_fits.data import load_runs
    from scaling_fits.fitfile import write_fit
    from scaling_fits.fitter import FitOptions
    from scaling_fits.laws import get_law
    from scaling_fits.pipeline import fit_law

    get_law(law)
    if n_boot < 0:
        raise InputError(f"--bootstrap {n_boot}: must be >= 0")
    if starts < 1:
        raise InputError(f"--starts {starts}: must be >= 1")
    if jobs < 1:
        raise InputError(f"--jobs {jobs}: must be >= 1")
    if not 0 <= holdout_top < 1:
        raise InputError(f"--holdout-top {holdout_top}: must be in [0, 1)")
    if not huber_delta > 0:
        raise InputError(f"--huber-delta {huber_delta}: must be > 0")
    _check_out(output, "--output")
    _check_out(plot, "--plot")
    fixed = _parse_fixed(fix)
    data = load_runs(runs)
    options = FitOptions(n_starts=starts, huber_delta=huber_delta, seed=seed, fixed=fixed, n_jobs=jobs,
                         per_source=per_source, reference_source=reference_source)

    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=json_output) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        fitted = fit_law(data, law, options, n_boot=n_boot, holdout_fraction=holdout_top or None, loo=loo,
                         ci_level=ci_level, progress=progress)
    if output is not None:
        fitted.provenance["output"] = str(output)
        write_fit(fitted, output)
    if plot is not None:
        from scaling_fits.plots import plot_fit

        plot_fit(fitted, data, plot)
    m = fitted.metrics
    if json_output:
        print_json({
            "law": fitted.name,
            "params": fitted.params,
            "ci": {k: list(v) for k, v in fitted.ci.items()},
            "mape_in_sample": m["mape_in_sample"],
            "mape_holdout": m.get("mape_holdout"),
            "mape_loo": m.get("mape_loo"),
            "fixed": list(fitted.fixed),
            "not_identified": fitted.metrics["identifiability"]["flagged"],
            "sources": m.get("sources"),
            "starts": m["starts"],
            "n_points": m["n_points"],
            "n_runs": m["n_runs"],
            "hash": fitted.content_hash(),
            "output": None if output is None else str(output),
        })
        return
    table = Table(title=f"{fitted.name} fit to {data.n_points} points of {data.n_runs} runs ({runs.name})")
    table.add_column("parameter")
    table.add_column("value", justify="right")
    level = f"{100 * fitted.ci_level:.0f}% interval" if fitted.ci_level else "interval"
    table.add_column(level, justify="right")
    for name, value in fitted.params.items():
        if name in fitted.fixed:
            interval = "fixed (prior)"
        elif name in m["identifiability"]["flagged"]:
            lo_hi = fitted.ci.get(name)
            interval = (f"[{_fmt(lo_hi[0])}, {_fmt(lo_hi[1])}] " if lo_hi else "") + "NOT IDENTIFIED"
        elif name in fitted.ci:
            lo, hi = fitted.ci[name]
            interval = f"[{_fmt(lo)}, {_fmt(hi)}]"
        else:
            interval = "-"
        table.add_row(name, _fmt(value), interval)
    console.print(table)
    st = m["starts"]
    failures = ", ".join(f"{n} {why}" for why, n in st["failures"].items()) or "none"
    console.print(f"starts: {st['n_at_best']} of {st['n_starts']} reached the best objective, {st['n_converged']} "
                  f"converged; the others: {failures}", highlight=False)
    line = f"MAPE in-sample {_pct(m['mape_in_sample'])}"
    if m.get("mape_holdout") is not None:
        h = m["holdout"]
        line += f", held-out {_pct(m['mape_holdout'])} (top {h['n_runs_held_out']} runs by compute)"
    if m.get("mape_loo") is not None:
        line += f", leave-one-run-out {_pct(m['mape_loo'])}"
    console.print(line, highlight=False)
    for name, item in (m.get("sources") or {}).items():
        values = ", ".join(f"{c} {_fmt(item[c])}" + (f" [{_fmt(item[c + '_ci'][0])}, {_fmt(item[c + '_ci'][1])}]"
                                                        if c + "_ci" in item else "") for c in per_source)
        console.print(f"source {name}{' (reference)' if item['reference'] else ''}: {item['n_runs']} runs, {values}, "
                      f"MAPE {_pct(item['mape_in_sample'])}", highlight=False)
    from scaling_fits.fitter import describe_identifiability

    flagged = describe_identifiability(m["identifiability"])
    if flagged:
        console.print(f"not identified by these runs (report the measured combination, not the numbers): {flagged}",
                      highlight=False)
    r = m["residuals"]
    console.print(f"residuals: max APE {_pct(r['max_ape'])}, mean log residual {r['mean_log_residual']:+.4f}, "
                  f"corr. with log C {r['corr_log_compute']:+.2f}, with S {r['corr_sparsity']:+.2f}", highlight=False)
    if output is not None:
        console.print(f"wrote {output} (hash {fitted.content_hash()})", highlight=False)
    if plot is not None:
        console.print(f"wrote {plot}", highlight=False)

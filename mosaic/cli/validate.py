"""`mosaic validate`: the performance model against published measured runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from mosaic.cli.common import cli_errors, console, print_json


def _pct(value: float) -> str:
    """Signed percent: one decimal below 100%, none from there (the column stays narrow)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:+.1f}%" if abs(value) < 0.995 else f"{100 * value:+.0f}%"


def _num(value: float, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _times_100(value: Optional[float]) -> Optional[float]:
    return None if value is None else 100 * value


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


RUN_ID_WIDTH = 34
"""Run ids longer than this break after an underscore (the table then fits 80 columns)."""


def _break_id(run_id: str, width: int = RUN_ID_WIDTH) -> str:
    """`run_id` on lines of at most `width` characters, broken after underscores (an id without
    one stays whole)."""
    lines = []
    while len(run_id) > width and "_" in run_id[1:width]:
        cut = run_id.rindex("_", 1, width) + 1
        lines.append(run_id[:cut])
        run_id = run_id[cut:]
    return "\n".join(lines + [run_id])


@cli_errors
def validate(
    runs: Optional[Path] = typer.Argument(
        None, help="CSV of measured runs (columns: perfmodel/data/README.md). Default: the bundled published_runs.csv."),
    cluster_map: Optional[str] = typer.Option(
        None, "--cluster-map",
        help="Override the cluster a 'cluster' value loads, e.g. 'h100=site_h100.yaml,b200=b200_calibrated.yaml'."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object: rows and summary."),
) -> None:
    """Compare predicted step times with measured ones; print per-run errors and mean/max APE."""
    from perfmodel.validation import bundled_runs_path, parse_cluster_map, validate_runs

    path = runs if runs is not None else bundled_runs_path()
    frame, summary = validate_runs(path, parse_cluster_map(cluster_map))
    if json_output:
        rows = [{k: _json_value(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]
        print_json({"runs_file": str(path), "rows": rows, "summary": summary})
        return

    table = Table(title=f"predicted vs measured step time ({path.name})", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True, caption="step s: seconds per step, measured and predicted; error: "
                  "(predicted - measured) / measured; MFU %: measured→predicted")
    for column, justify in (("run", "left"), ("dev", "right"), ("prec", "left"), ("step s\nmeas.", "right"),
                            ("step s\npred.", "right"), ("error", "right"), ("MFU %\nm→p", "right")):
        table.add_column(column, justify=justify, no_wrap=True)
    why: dict[str, str] = {}
    cluster = None
    for row in frame.itertuples(index=False):
        if row.cluster != cluster:  # one section per cluster
            cluster = row.cluster
            table.add_row(f"[bold]{escape(str(cluster))}[/bold]")
        if row.reason == "memory":
            why[row.run_id] = f"memory {row.predicted_memory_per_device_bytes / 1e9:.0f}>{row.usable_hbm_bytes / 1e9:.0f} GB"
        elif row.reason:
            why[row.run_id] = str(row.reason)
        mfu = f"{_num(_times_100(row.measured_mfu), '.0f')}→{_num(_times_100(row.predicted_mfu), '.0f')}"
        table.add_row(
            escape(_break_id(row.run_id)), str(row.devices), row.precision, _num(row.measured_step_time_s, ".3g"),
            _num(row.predicted_step_time_s, ".3g") + ("*" if row.run_id in why else ""), _pct(row.signed_error), mfu,
        )
    console.print(table)
    if summary["compared"]:
        console.print(f"mean APE: {summary['mean_ape_pct']:.1f}%  max APE: {summary['max_ape_pct']:.1f}% "
                      f"({summary['worst_run_id']})  median APE: {summary['median_ape_pct']:.1f}%  "
                      f"mean signed error: {summary['mean_signed_error_pct']:+.1f}%  "
                      f"over {summary['compared']} of {summary['runs']} runs", highlight=False)
    else:
        console.print("mean APE: n/a  max APE: n/a (no run has a step-time prediction)", highlight=False)
    if summary["by_cluster"]:
        groups = Table(title="error by cluster and by kind of run", box=box.SIMPLE_HEAD, pad_edge=False)
        for column, justify in (("group", "left"), ("runs", "right"), ("mean |error|", "right"),
                                ("mean error", "right")):
            groups.add_column(column, justify=justify, no_wrap=True)
        for label, table_part in (("", summary["by_cluster"]), ("kind ", summary["by_kind"])):
            for name, part in table_part.items():
                groups.add_row(escape(label + name), str(part["runs"]), f"{part['mean_ape_pct']:.1f}%",
                               f"{part['mean_signed_error_pct']:+.1f}%")
        console.print(groups)
    if summary["memory"]:
        mem = summary["memory"]
        console.print(f"peak memory (runs that published it): {mem['runs']} runs, mean |error| "
                      f"{mem['mean_abs_error_pct']:.1f}%, mean error {mem['mean_signed_error_pct']:+.1f}%", highlight=False)
    if summary["predicted_infeasible"]:
        listed = ", ".join(f"{rid} ({why.get(rid, reason)})" for rid, reason in summary["predicted_infeasible"].items())
        console.print(f"* predicted infeasible although they ran (still scored unless unscored): {listed}", highlight=False)
    if summary["unscored"]:
        console.print(f"unscored (no meaningful prediction): {', '.join(summary['unscored'])}", highlight=False)

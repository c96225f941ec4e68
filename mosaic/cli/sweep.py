"""`mosaic sweep`: best loss per value of sparsity, granularity, devices or days, both budgets."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from mosaic.cli.common import cli_errors, console, print_json
from perfmodel.errors import InputError


def _values(text: Optional[str]) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"--values {text!r}: expected numbers separated by commas, e.g. 0.5,0.75,0.875") from None


@cli_errors
def sweep(
    cluster: str = typer.Option(..., "--cluster", help="Bundled cluster name or cluster YAML path."),
    over: str = typer.Option(..., "--over", help="sparsity | granularity | devices | days."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the table as CSV here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Draw the sweep to this PNG."),
    values: Optional[str] = typer.Option(None, "--values", help="Comma-separated values (default: from the space)."),
    devices: Optional[int] = typer.Option(None, "--devices", help="Devices (default: the cluster file's)."),
    days: Optional[float] = typer.Option(None, "--days", help="Wall time in days (default 20)."),
    hours: Optional[float] = typer.Option(None, "--hours", help="Wall time in hours."),
    fit: Optional[str] = typer.Option(None, "--fit", help="Scaling-law fit YAML (default: the bundled fit)."),
    space: Optional[str] = typer.Option(None, "--space", help="Search-space YAML (default: the bundled space)."),
    workers: int = typer.Option(0, "--workers", min=0, help="Processes for the enumeration (0 = auto: every core for a "
                                "space of over 2e7 pairs, else 1)."),
    json_output: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Best predicted loss per value under the compute-optimal and the cluster-optimal budget."""
    import math

    from mosaic.planner.sweep import optima_line, plot_sweep
    from mosaic.planner.sweep import sweep as run_sweep
    from perfmodel.specs.strict import write_text_atomic

    frame = run_sweep(cluster, over, _values(values), devices=devices, days=days, hours=hours, fit=fit, space=space,
                      workers=workers)
    if output:
        write_text_atomic(output, frame.to_csv(index=False))
    if plot:
        plot_sweep(frame, plot, title=f"{cluster}: best loss vs {over}")
    if json_output:
        rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                for r in frame.to_dict(orient="records")]
        print_json({"over": over, "rows": rows})
        return
    table = Table(title=f"{cluster}: best loss vs {over}")
    for col, justify in ((over, "right"), ("loss\ncompute-\noptimal", "right"), ("its loss\non this\ncluster", "right"),
                         ("loss\ncluster-\noptimal", "right"), ("MFU", "right"), ("cluster-optimal\ngeometry", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "cluster-optimal\ngeometry")

    def fmt(v: object, spec: str = ".4f") -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)

    for r in frame.to_dict(orient="records"):
        table.add_row(fmt(r["value"], ".4g"), fmt(r.get("compute_optimal_loss")), fmt(r.get("compute_optimal_loss_in_budget")),
                      fmt(r.get("cluster_optimal_loss")), fmt(r.get("cluster_optimal_mfu"), ".3f"),
                      str(r.get("cluster_optimal_geometry", "-")))
    console.print(table)
    if over in ("sparsity", "granularity") and len(frame):
        console.print(optima_line(frame), highlight=False)
    for path in (output, plot):
        if path:
            console.print(f"wrote {path}")

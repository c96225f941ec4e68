"""The `mosaic` command line (Typer + rich).

Each command lives in its own module under mosaic/cli and is registered here;
modules import heavy dependencies (torch, pyomo) inside the command only.
"""

from __future__ import annotations

from typing import Optional

import typer

from mosaic import __version__
from mosaic.cli import calibrate as calibrate_cmd
from mosaic.cli import clusters as clusters_cmd
from mosaic.cli import data as data_cmd
from mosaic.cli import export as export_cmd
from mosaic.cli import fit as fit_cmd
from mosaic.cli import ladder as ladder_cmd
from mosaic.cli import plan as plan_cmd
from mosaic.cli import predict as predict_cmd
from mosaic.cli import sweep as sweep_cmd
from mosaic.cli import train as train_cmd
from mosaic.cli import validate as validate_cmd
from mosaic.cli.common import Command, Group, set_debug

app = typer.Typer(
    name="mosaic",
    help="MOSAIC: choose a sparse MoE model and the way to run it, together, for your cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mosaic {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
) -> None:
    """Systems-aware planner for sparse Mixture-of-Experts training."""
    set_debug(debug)


app.command("clusters", cls=Command)(clusters_cmd.clusters)
app.command("show-cluster", cls=Command)(clusters_cmd.show_cluster)
app.command("train", cls=Command)(train_cmd.train)
app.command("calibrate", cls=Command)(calibrate_cmd.calibrate)
app.command("validate", cls=Command)(validate_cmd.validate)
app.command("plan", cls=Command)(plan_cmd.plan)
app.command("predict", cls=Command)(predict_cmd.predict)
app.command("sweep", cls=Command)(sweep_cmd.sweep)
app.command("export", cls=Command)(export_cmd.export)
app.command("fit", cls=Command)(fit_cmd.fit)
app.add_typer(data_cmd.app, name="data")
app.command("ladder", cls=Command)(ladder_cmd.ladder)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

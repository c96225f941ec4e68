"""`mosaic export`: a plan as a Megatron-LM / MindSpeed-LLM script, a torchtitan TOML or a Slurm job.

Everything is checked (plan, format, node shape) before anything is written;
with -o the file is written atomically (scripts get the executable bit),
without it the export goes to stdout.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Optional

import typer

from mosaic.cli.common import cli_errors, err_console
from mosaic.exports import EXECUTABLE, FORMATS, render, warnings_for
from mosaic.planfile import read_plan
from perfmodel.errors import InputError
from perfmodel.specs.strict import write_text_atomic


@cli_errors
def export(
    plan: Path = typer.Argument(..., help="Plan YAML written by `mosaic plan`."),
    fmt: str = typer.Option(..., "--format", "-f", help="megatron, mindspeed, torchtitan or slurm."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here (atomically) instead of stdout."),
    gpus_per_node: Optional[int] = typer.Option(
        None, "--gpus-per-node", help="Devices per node (default: the plan cluster's node size)."),
) -> None:
    """Export a plan for Megatron-LM, MindSpeed-LLM, torchtitan or a Slurm job running `mosaic train`."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    loaded = read_plan(plan)
    text = render(loaded, fmt, gpus_per_node)
    for note in warnings_for(loaded, fmt):
        err_console.print(f"warning: {note}", markup=False, highlight=False, soft_wrap=True)
    if output is None:
        sys.stdout.write(text)
        return
    if output.is_dir():
        raise InputError(f"-o {output}: is a folder; give a file name")
    written = write_text_atomic(output, text)
    mode = 0o777 if EXECUTABLE[fmt] else 0o666
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(written, mode & ~umask & (stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO))
    err_console.print(f"wrote {written} ({fmt})", markup=False, highlight=False)

"""Exporters: a plan as Megatron-LM / MindSpeed-LLM launch scripts, a torchtitan TOML, a Slurm job.

`render(plan, fmt, gpus_per_node)` returns the text of one export of a
`mosaic.planfile.Plan` (read by `mosaic.planfile.read_plan`); each format
lives in its own module, which records the upstream version its option names
were checked against.
"""

from __future__ import annotations

from typing import Optional

from mosaic.exports.megatron import render_megatron
from mosaic.exports.mindspeed import render_mindspeed
from mosaic.exports.slurm import render_slurm
from mosaic.exports.torchtitan import model_differences, render_torchtitan
from mosaic.planfile import Plan, cluster_of
from perfmodel.errors import InputError, Param

FORMATS = {
    "megatron": render_megatron,
    "mindspeed": render_mindspeed,
    "torchtitan": render_torchtitan,
    "slurm": render_slurm,
}
"""Format name -> renderer(plan, gpus_per_node) -> text."""
EXECUTABLE = {"megatron": True, "mindspeed": True, "torchtitan": False, "slurm": True}
"""Whether the export is a script (written with the executable bit)."""


def render(plan: Plan, fmt: str, gpus_per_node: Optional[int] = None) -> str:
    if fmt not in FORMATS:
        raise InputError(Param("fmt", fmt), f": use one of {', '.join(FORMATS)}")
    return FORMATS[fmt](plan, gpus_per_node)


def warnings_for(plan: Plan, fmt: str) -> list[str]:
    """Differences between the plan's model and what the target framework builds, and the plan
    file's warning when its cluster changed since planning (`PlanCluster.drift`)."""
    notes = model_differences(plan) if fmt == "torchtitan" else []
    if plan.cluster is not None:
        try:
            _, drift = cluster_of(plan)
        except InputError:  # an unloadable cluster is node_shape's error, or gpus_per_node stands in for it
            drift = None
        if drift:
            notes.append(drift)
    return notes


__all__ = ["EXECUTABLE", "FORMATS", "render", "warnings_for"]

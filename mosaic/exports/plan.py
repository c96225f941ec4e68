"""The part of a plan YAML that the exporters need, read strictly.

A plan (written by `mosaic plan`) is a versioned YAML with top-level sections
`model` (MoEArchitecture keys), `layout` (ParallelLayout keys, resolved: dp and
gbs set), `budget` (`devices`, ...), `cluster` (`name`, `hash`), `tokens`, and
sections the exporters do not use (predicted, alternatives, fit, tool_version).
The reader is strict where an export depends on it (model, layout, devices,
tokens: an unknown or missing key is a one-line InputError naming the key) and
ignores the other sections, so newer plans with more sections still export.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from perfmodel.errors import InputError
from perfmodel.specs.architecture import MoEArchitecture
from perfmodel.specs.layout import ParallelLayout
from perfmodel.specs.strict import read_yaml, section_from_mapping
from perfmodel.validity import violations

PLAN_VERSION = 1


@dataclass(frozen=True)
class ExportPlan:
    """Model, resolved layout, job size and token budget of one plan."""

    model: MoEArchitecture
    layout: ParallelLayout
    """Resolved: dp and gbs are set, tp*cp*pp*dp == devices."""
    devices: int
    """budget.devices: ranks of the job."""
    tokens: float
    """Training tokens D."""
    cluster_name: Optional[str] = None
    """cluster.name (a bundled cluster name or a file path), if the plan names one."""
    cluster_hash: Optional[str] = None
    """cluster.hash: content hash of the cluster file the plan was made for."""
    source: str = "plan"
    """Where the plan came from (for messages and export headers)."""

    @property
    def train_iters(self) -> int:
        """Optimizer steps: ceil(tokens / (gbs * seq_len)), at least 1."""
        tokens_per_step = int(self.layout.gbs) * self.model.seq_len
        return max(1, math.ceil(self.tokens / tokens_per_step))

    @property
    def micro_batches(self) -> int:
        """m = gbs / (mbs * dp): micro-batches per step per pipeline."""
        return self.layout.micro_batches()


def _section(data: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    if key not in data:
        raise InputError(f"{source}: missing key '{key}'; a plan needs model, layout, budget and tokens")
    value = data[key]
    if not isinstance(value, Mapping):
        raise InputError(f"{source}: key '{key}' must be a mapping, got {value!r}")
    return value


def plan_from_dict(data: Mapping[str, Any], source: str = "plan") -> ExportPlan:
    """Check and convert a parsed plan; every error is one line naming `source` and the key."""
    if "version" not in data:
        raise InputError(f"{source}: missing key 'version'; add 'version: {PLAN_VERSION}' at the top")
    if data["version"] != PLAN_VERSION:
        raise InputError(f"{source}: key 'version': {data['version']!r} is not supported; "
                         f"this MOSAIC reads version {PLAN_VERSION}")
    fix = "a plan needs model, layout, budget and tokens"
    model = section_from_mapping(MoEArchitecture, data, "model", source, fix)
    layout = section_from_mapping(ParallelLayout, data, "layout", source, fix)
    for key in ("dp", "gbs"):
        if getattr(layout, key) is None:
            raise InputError(f"{source}: missing key 'layout.{key}'; an exported plan needs a resolved layout "
                             "(write it with `mosaic plan`, or add dp and gbs)")
    budget = _section(data, "budget", source)
    if "devices" not in budget:
        raise InputError(f"{source}: missing key 'budget.devices'; add the job's device count")
    devices = budget["devices"]
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise InputError(f"{source}: key 'budget.devices': expected a positive integer, got {devices!r}")
    if "tokens" not in data:
        raise InputError(f"{source}: missing key 'tokens'; add the training tokens (e.g. 1.0e11)")
    tokens = data["tokens"]
    try:
        tokens = float(tokens) if not isinstance(tokens, bool) else math.nan
    except (TypeError, ValueError):
        tokens = math.nan
    if not math.isfinite(tokens) or tokens <= 0:
        raise InputError(f"{source}: key 'tokens': expected a positive number of tokens, got {data['tokens']!r}")
    cluster_name = cluster_hash = None
    cluster = data.get("cluster")
    if cluster is not None:
        if not isinstance(cluster, Mapping):
            raise InputError(f"{source}: key 'cluster' must be a mapping with 'name' (and 'hash')")
        cluster_name, cluster_hash = cluster.get("name"), cluster.get("hash")
        for key, value in (("name", cluster_name), ("hash", cluster_hash)):
            if value is not None and not isinstance(value, str):
                raise InputError(f"{source}: key 'cluster.{key}': expected a string, got {value!r}")
    problems = violations(model, layout, devices)
    if problems:
        raise InputError(f"{source}: key 'layout': " + "; ".join(problems))
    return ExportPlan(model=model, layout=layout, devices=devices, tokens=tokens, cluster_name=cluster_name,
                      cluster_hash=cluster_hash, source=source)


def read_plan(path: str | Path) -> ExportPlan:
    """Read a plan YAML strictly (model, layout, budget.devices, tokens); other sections are ignored."""
    return plan_from_dict(read_yaml(path), source=str(path))


__all__ = ["PLAN_VERSION", "ExportPlan", "plan_from_dict", "read_plan"]

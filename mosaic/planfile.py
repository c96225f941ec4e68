"""The plan file: one frozen `Plan`, one strict reader, one writer.

A plan (version 1, what `mosaic plan -o` writes and `mosaic plan --json` prints) is
a mapping with these top-level keys, in this order:

  version          PLAN_VERSION
  tool_version     the mosaic version that wrote it (optional)
  cluster          name, hash (content hash when planned), file (absolute path of a
                   cluster YAML that is not bundled); optional for hand-written plans
  fit              name, hash of the scaling-law fit (optional)
  budget           devices (required), days | hours, wall_time_s
  model            MoEArchitecture keys
  tokens           training tokens D (> 0)
  layout           ParallelLayout keys, resolved (dp and gbs set)
  predicted, derived, compute_optimal, binding, alternatives, decision, search, analysis
                   the planner's report, carried as written (`Plan.report`); no
                   reader interprets it

Every reader (`mosaic train --plan`, `mosaic export`, the Python API) goes through
`read_plan`: an unknown key, a missing required key or a layout that cannot run on
`budget.devices` (`perfmodel.validity.violations`) is one InputError line naming the
file and the key. The cluster a plan means is one rule for every reader
(`PlanCluster.source`: the recorded file while it exists, else the name), with one
warning when that cluster's content hash is not the planned one (`PlanCluster.drift`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from perfmodel.errors import InputError
from perfmodel.specs.architecture import MoEArchitecture
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import ParallelLayout
from perfmodel.specs.strict import check, plain, read_yaml, section_from_mapping, to_mapping, write_yaml_atomic
from perfmodel.validity import violations

PLAN_VERSION = 1
REPORT_KEYS = ("predicted", "derived", "compute_optimal", "binding", "alternatives", "decision", "search", "analysis")
"""The planner's report sections, in file order after `layout`."""
KEYS = ("version", "tool_version", "cluster", "fit", "budget", "model", "tokens", "layout") + REPORT_KEYS
FIX = "a plan needs model, layout, budget and tokens (write it with `mosaic plan -o`)"


@dataclass(frozen=True)
class PlanCluster:
    """The cluster a plan was made for."""

    name: str
    """Cluster name (a bundled cluster, or the `name` key of the file)."""
    hash: Optional[str] = None
    """`ClusterSpec.content_hash()` when the plan was made."""
    file: Optional[str] = None
    """Absolute path of the cluster YAML when it is not bundled (e.g. a calibrated one)."""

    def source(self) -> str:
        """What to load: the recorded file while it exists, the name otherwise."""
        return self.file if self.file is not None and Path(self.file).is_file() else self.name

    def drift(self, spec: ClusterSpec) -> Optional[str]:
        """The warning when `spec` (the cluster loaded from `source()`) is not the one planned for."""
        now = spec.content_hash()
        if self.hash is None or self.hash == now:
            return None
        return (f"cluster '{self.source()}' changed since the plan was made (hash {self.hash} -> {now}); "
                "its predictions are for the old figures: plan again to refresh them")


@dataclass(frozen=True)
class PlanFit:
    """The scaling-law fit a plan was made with."""

    name: str
    hash: Optional[str] = None


@dataclass(frozen=True)
class PlanBudget:
    """Devices and wall time of the planned job."""

    devices: int
    """Ranks of the job: tp * cp * pp * dp of the layout."""
    days: Optional[float] = None
    hours: Optional[float] = None
    wall_time_s: Optional[float] = None

    def __post_init__(self) -> None:
        check(self.devices >= 1, "devices", f"must be >= 1, got {self.devices}", "give the job's device count")


@dataclass(frozen=True)
class Plan:
    """One plan file's content: what to train, how, on what, and the planner's report."""

    model: MoEArchitecture
    layout: ParallelLayout
    """Resolved: dp and gbs are set, tp * cp * pp * dp == budget.devices."""
    budget: PlanBudget
    tokens: float
    """Training tokens D."""
    cluster: Optional[PlanCluster] = None
    fit: Optional[PlanFit] = None
    tool_version: Optional[str] = None
    report: Mapping[str, Any] = field(default_factory=dict)
    """predicted, derived, compute_optimal, binding, alternatives, search, analysis (as written)."""
    source: str = "plan"
    """Where the plan came from (for messages and export headers); not written."""

    @property
    def devices(self) -> int:
        return self.budget.devices

    @property
    def train_iters(self) -> int:
        """Optimizer steps: ceil(tokens / (gbs * seq_len)), at least 1."""
        tokens_per_step = int(self.layout.gbs) * self.model.seq_len
        return max(1, math.ceil(self.tokens / tokens_per_step))

    @property
    def micro_batches(self) -> int:
        """m = gbs / (mbs * dp): micro-batches per step per pipeline."""
        return self.layout.micro_batches()

    def to_dict(self) -> dict[str, Any]:
        """The file's mapping (module doc), JSON- and YAML-safe (non-finite numbers as null)."""
        out: dict[str, Any] = {"version": PLAN_VERSION}
        if self.tool_version is not None:
            out["tool_version"] = self.tool_version
        for key in ("cluster", "fit"):
            section = getattr(self, key)
            if section is not None:
                out[key] = {k: v for k, v in to_mapping(section).items() if v is not None}
        out["budget"] = {k: v for k, v in to_mapping(self.budget).items() if v is not None}
        out["model"] = to_mapping(self.model)
        out["tokens"] = float(self.tokens)
        out["layout"] = to_mapping(self.layout)
        out.update({k: self.report[k] for k in REPORT_KEYS if k in self.report})
        return plain(out)


def plan_from_dict(data: Mapping[str, Any], source: str = "plan") -> Plan:
    """Check and convert a parsed plan (module doc); every error is one line naming `source` and the key."""
    if not isinstance(data, Mapping):
        raise InputError(f"{source}: expected a mapping of plan sections, got {type(data).__name__}")
    if "version" not in data:
        raise InputError(f"{source}: missing key 'version'; add 'version: {PLAN_VERSION}' at the top")
    if data["version"] != PLAN_VERSION:
        raise InputError(f"{source}: key 'version': {data['version']!r} is not supported; "
                         f"this MOSAIC reads plan version {PLAN_VERSION}")
    for key in data:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            fix = f"did you mean '{close[0]}'?" if close else "plan keys: " + ", ".join(KEYS)
            raise InputError(f"{source}: unknown key '{key}'; {fix}")
    model = section_from_mapping(MoEArchitecture, data, "model", source, FIX)
    layout = section_from_mapping(ParallelLayout, data, "layout", source, FIX)
    for key in ("dp", "gbs"):
        if getattr(layout, key) is None:
            raise InputError(f"{source}: missing key 'layout.{key}'; a plan needs a resolved layout "
                             "(write it with `mosaic plan -o`, or add dp and gbs)")
    budget = section_from_mapping(PlanBudget, data, "budget", source, FIX)
    if "tokens" not in data:
        raise InputError(f"{source}: missing key 'tokens'; add the training tokens (e.g. 1.0e11)")
    tokens = data["tokens"]
    try:
        tokens = math.nan if isinstance(tokens, bool) else float(tokens)
    except (TypeError, ValueError):
        tokens = math.nan
    if not math.isfinite(tokens) or tokens <= 0:
        raise InputError(f"{source}: key 'tokens': expected a positive number of tokens, got {data['tokens']!r}")
    cluster = section_from_mapping(PlanCluster, data, "cluster", source, FIX) if "cluster" in data else None
    fit = section_from_mapping(PlanFit, data, "fit", source, FIX) if "fit" in data else None
    tool_version = data.get("tool_version")
    if tool_version is not None and not isinstance(tool_version, str):
        raise InputError(f"{source}: key 'tool_version': expected a string, got {tool_version!r}")
    problems = violations(model, layout, budget.devices)
    if problems:
        raise InputError(f"{source}: key 'layout': " + "; ".join(problems))
    report = {k: data[k] for k in REPORT_KEYS if k in data}
    return Plan(model=model, layout=layout, budget=budget, tokens=tokens, cluster=cluster, fit=fit,
                tool_version=tool_version, report=report, source=source)


def read_plan(path: str | Path) -> Plan:
    """Read a plan YAML strictly (`plan_from_dict`)."""
    return plan_from_dict(read_yaml(path), source=str(path))


def write_plan(path: str | Path, plan: Plan) -> Path:
    """Write `plan.to_dict()` atomically (temp file + rename)."""
    return write_yaml_atomic(path, plan.to_dict())


def cluster_of(plan: Plan) -> tuple[Optional[ClusterSpec], Optional[str]]:
    """The plan's cluster loaded by the one rule (`PlanCluster.source`) and its drift warning;
    (None, None) when the plan names no cluster."""
    if plan.cluster is None:
        return None, None
    from perfmodel.clusters import load_cluster

    try:
        spec = load_cluster(plan.cluster.source())
    except InputError as exc:
        raise InputError(f"{plan.source}: key 'cluster': {exc}") from None
    return spec, plan.cluster.drift(spec)


__all__ = ["KEYS", "PLAN_VERSION", "REPORT_KEYS", "Plan", "PlanBudget", "PlanCluster", "PlanFit", "cluster_of",
           "plan_from_dict", "read_plan", "write_plan"]

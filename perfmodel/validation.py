"""Predictions against published measurements (`mosaic validate`, after Calculon's `lv`).

A runs CSV holds one measured training run per row: the model geometry (every
`MoEArchitecture` field), the layout (every `ParallelLayout` field; `dp` may be
left empty and is then devices / (tp*cp*pp)), the cluster (a bundled name or a
YAML path, optionally remapped with `--cluster-map`), the device count, what was
measured and where it was published:

    run_id, cluster, devices, <arch fields>, <layout fields>, measure, value, source
    optional: model, notes, dp, and the optional architecture fields (multi-head latent
    attention q_lora_rank, kv_lora_rank, qk_rope_head_dim, v_head_dim; n_mtp_layers) and
    layout fields (the pipeline split first_stage_layers, last_stage_layers, account_embedding,
    account_loss, pp_layout, balanced_split; dispatcher, capacity_factor, pad_to_capacity);
    an empty optional cell takes the field's default

`measure` says which figure `value` is. Every measure is turned into the time of
one optimizer step over the global batch (gbs * seq_len tokens), which is what
the model predicts and what the error is computed on:

    step_time_s              value
    tokens_per_s             gbs * seq_len / value
    tokens_per_s_per_device  gbs * seq_len / (value * devices)
    tflops_per_device        gbs * seq_len * F / (value * 1e12 * devices)
    mfu                      gbs * seq_len * F / (value * peak * devices)

where F = `model_flops_per_token(arch)` (MOSAIC's convention, DESIGN.md) and
peak is the cluster's dense peak of the run's precision. The last two are only
correct when the source counts FLOPs the same way; convention-free figures
(step time, tokens/s) are preferred and are what the bundled CSV stores.

Error of a row: APE = |predicted - measured| / measured on step time; the
summary is the mean and max APE over every row with a step-time prediction.
A run that really trained but that the model calls infeasible (memory above
usable HBM, more devices than the cluster file) is still scored on step time,
since `evaluate` computes its numbers, and is listed apart: it is a model error
of a different kind. Only rows whose prediction is meaningless (a layout the
model rejects, a precision the accelerator lacks) are left unscored.
"""

from __future__ import annotations

import csv
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from perfmodel.clusters import load_cluster
from perfmodel.errors import InputError, MosaicError
from perfmodel.specs.architecture import (
    ARCH_FIELDS,
    CORE_ARCH_FIELDS,
    OPTIONAL_ARCH_FIELDS,
    ArchBatch,
    MoEArchitecture,
    model_flops_per_token,
)
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import (
    CORE_LAYOUT_FIELDS,
    LAYOUT_FIELDS,
    OPTIONAL_LAYOUT_FIELDS,
    OVERLAP_FIELDS,
    LayoutBatch,
    ParallelLayout,
)
from perfmodel.specs.stages import describe_split
from perfmodel.validity import violations

MEASURES = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu")
META_COLUMNS = ("run_id", "cluster", "devices", "measure", "value", "source")
OPTIONAL_COLUMNS = ("model", "notes", "dp", "peak_memory_bytes", "memory_source") + OPTIONAL_ARCH_FIELDS + OPTIONAL_LAYOUT_FIELDS
"""May be empty: the field then takes its default (the overlap switches off, Megatron-Core's)."""
REQUIRED_COLUMNS = META_COLUMNS + CORE_ARCH_FIELDS + tuple(f for f in CORE_LAYOUT_FIELDS if f != "dp")
KNOWN_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS

_INT_FIELDS = {
    "devices", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "seq_len", "n_experts",
    "top_k", "n_shared_experts", "d_expert", "d_ff_dense", "n_dense_layers",
    "tp", "pp", "vpp", "ep", "etp", "cp", "dp", "mbs", "gbs",
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "n_mtp_layers",
    "first_stage_layers", "last_stage_layers",
}
_FLOAT_FIELDS = {"ffn_ratio", "value", "capacity_factor", "peak_memory_bytes"}
_BOOL_FIELDS = {"gated_ffn", "tie_embeddings", "sequence_parallel", "account_embedding", "account_loss",
                "balanced_split", "pad_to_capacity", *OVERLAP_FIELDS}
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def bundled_runs_path() -> Path:
    """The CSV of published runs shipped with MOSAIC (perfmodel/data/published_runs.csv)."""
    return Path(str(resources.files("perfmodel") / "data" / "published_runs.csv"))


@dataclass(frozen=True)
class PublishedRun:
    """One measured training run: what ran, where, and the figure that was reported."""

    run_id: str
    model: str
    cluster: str
    devices: int
    arch: MoEArchitecture
    layout: ParallelLayout
    """Resolved: dp and gbs are set."""
    measure: str
    value: float
    source: str
    notes: str
    line: int
    """Line of the row in its CSV (header = line 1), for error messages."""
    file: str = ""
    """Name of the CSV the row came from, for error messages."""
    peak_memory_bytes: Optional[float] = None
    """Published peak memory per device (bytes), when the source gives it."""
    memory_source: str = ""

    @property
    def where(self) -> str:
        return f"{self.file} line {self.line} (run_id '{self.run_id}')".lstrip()

    @property
    def tokens_per_step(self) -> int:
        return int(self.layout.gbs) * self.arch.seq_len


# ---------------------------------------------------------------------------
# Loading

def _where(path: Path, line: int, run_id: str, column: str) -> str:
    rid = f" (run_id '{run_id}')" if run_id else ""
    return f"{path.name} line {line}{rid}, column '{column}'"


def _parse_cell(raw: str, column: str, where: str) -> Any:
    text = raw.strip()
    if column in _INT_FIELDS:
        try:
            return int(text)
        except ValueError:
            raise InputError(f"{where}: expected an integer, got {text!r}") from None
    if column in _FLOAT_FIELDS:
        try:
            value = float(text)
        except ValueError:
            raise InputError(f"{where}: expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise InputError(f"{where}: {text!r} is not a finite number; give the published figure")
        return value
    if column in _BOOL_FIELDS:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise InputError(f"{where}: expected true or false, got {text!r}")
    return text


def _check_header(path: Path, header: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise InputError(f"{path.name}: column '{name}' appears twice; keep one")
        seen.add(name)
        if name not in KNOWN_COLUMNS:
            close = difflib.get_close_matches(name, KNOWN_COLUMNS, n=1)
            fix = f"did you mean '{close[0]}'?" if close else "remove it (columns: see perfmodel/data/README.md)"
            raise InputError(f"{path.name}: unknown column '{name}'; {fix}")
    for name in REQUIRED_COLUMNS:
        if name not in seen:
            raise InputError(f"{path.name}: missing column '{name}'; add it (every run needs it)")


def _run_from_row(path: Path, line: int, row: Mapping[str, str]) -> PublishedRun:
    run_id = (row.get("run_id") or "").strip()
    values: dict[str, Any] = {}
    for column, raw in row.items():
        where = _where(path, line, run_id, column)
        raw = "" if raw is None else raw
        if not raw.strip():
            if column in OPTIONAL_COLUMNS:
                continue
            raise InputError(f"{where}: is empty; give a value (see perfmodel/data/README.md)")
        values[column] = _parse_cell(raw, column, where)

    measure = values["measure"]
    if measure not in MEASURES:
        raise InputError(f"{_where(path, line, run_id, 'measure')}: {measure!r} is unknown; use one of {', '.join(MEASURES)}")
    value = values["value"]
    if value <= 0 or (measure == "mfu" and value > 1):
        limit = "in (0, 1]" if measure == "mfu" else "> 0"
        raise InputError(f"{_where(path, line, run_id, 'value')}: {value} must be {limit} for measure {measure}")
    devices = values["devices"]
    if devices < 1:
        raise InputError(f"{_where(path, line, run_id, 'devices')}: must be >= 1, got {devices}")

    try:
        arch = MoEArchitecture(**{k: values[k] for k in ARCH_FIELDS if k in values})
    except InputError as exc:
        raise InputError(f"{path.name} line {line} (run_id '{run_id}'): model geometry: {exc}") from None
    try:
        layout = ParallelLayout(**{k: values[k] for k in LAYOUT_FIELDS if k in values}).resolve(devices)
    except InputError as exc:
        raise InputError(f"{path.name} line {line} (run_id '{run_id}'): layout: {exc}") from None
    problems = violations(arch, layout, devices)
    if problems:
        raise InputError(f"{path.name} line {line} (run_id '{run_id}'): invalid layout: {'; '.join(problems)}")

    return PublishedRun(
        run_id=run_id, model=values.get("model", run_id), cluster=values["cluster"], devices=devices, arch=arch,
        layout=layout, measure=measure, value=value, source=values["source"], notes=values.get("notes", ""), line=line,
        file=path.name, peak_memory_bytes=values.get("peak_memory_bytes"), memory_source=values.get("memory_source", ""),
    )


def load_runs(path: str | Path) -> list[PublishedRun]:
    """Read and check a runs CSV; any problem is one InputError naming the line and column."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"runs file '{path}' does not exist; give a CSV of measured runs "
                         f"(the bundled one is {bundled_runs_path()})")
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle, restkey="\0extra", strict=True)
        try:
            header = reader.fieldnames
            if not header:
                raise InputError(f"{path.name}: the file is empty; it needs a header row and one row per run")
            _check_header(path, [h.strip() for h in header])
            reader.fieldnames = [h.strip() for h in header]
            runs = []
            for row in reader:
                line = reader.line_num
                if "\0extra" in row:
                    raise InputError(f"{path.name} line {line}: has more cells than the header's {len(header)}; "
                                     "quote cells that contain commas")
                if any(v is None for v in row.values()):
                    raise InputError(f"{path.name} line {line}: has fewer cells than the header's {len(header)}")
                runs.append(_run_from_row(path, line, row))
        except csv.Error as exc:
            raise InputError(f"{path.name} line {reader.line_num}: malformed CSV ({exc})") from None
    if not runs:
        raise InputError(f"{path.name}: no runs; add one row per measured run")
    seen: dict[str, int] = {}
    for run in runs:
        if run.run_id in seen:
            raise InputError(f"{path.name} line {run.line}: run_id '{run.run_id}' repeats line {seen[run.run_id]}; "
                             "make run ids unique")
        seen[run.run_id] = run.line
    return runs


# ---------------------------------------------------------------------------
# Clusters

def parse_cluster_map(text: Optional[str]) -> dict[str, str]:
    """``"h100=my_h100.yaml,b200=b200_calibrated.yaml"`` -> {name: name-or-path}."""
    mapping: dict[str, str] = {}
    if not text:
        return mapping
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            raise InputError(f"--cluster-map: '{item}' is not name=cluster; write e.g. 'h100=site_h100.yaml'")
        name, target = (s.strip() for s in item.split("=", 1))
        if not name or not target:
            raise InputError(f"--cluster-map: '{item}' needs a name and a cluster file or bundled name")
        if name in mapping:
            raise InputError(f"--cluster-map: '{name}' is mapped twice; keep one")
        mapping[name] = target
    return mapping


def resolve_clusters(runs: Sequence[PublishedRun], cluster_map: Optional[Mapping[str, str]] = None) -> dict[str, ClusterSpec]:
    """Load every cluster the runs name (through `cluster_map` when given)."""
    cluster_map = dict(cluster_map or {})
    used = {run.cluster for run in runs}
    for name in cluster_map:
        if name not in used:
            raise InputError(f"--cluster-map: '{name}' is not a cluster of any run; runs use {', '.join(sorted(used))}")
    clusters: dict[str, ClusterSpec] = {}
    for run in runs:
        if run.cluster in clusters:
            continue
        target = cluster_map.get(run.cluster, run.cluster)
        try:
            clusters[run.cluster] = load_cluster(target)
        except InputError as exc:
            raise InputError(f"{run.where}, column 'cluster': {exc}") from None
    for run in runs:
        spec = clusters[run.cluster]
        try:
            spec.accelerator.peak(run.layout.precision)
        except InputError as exc:
            raise InputError(f"{run.where}, column 'precision': {exc}") from None
    return clusters


# ---------------------------------------------------------------------------
# Comparison

def measured_step_time_s(run: PublishedRun, cluster: ClusterSpec) -> float:
    """The published figure as seconds per optimizer step (formulas in the module docstring)."""
    tokens = run.tokens_per_step
    if run.measure == "step_time_s":
        return run.value
    if run.measure == "tokens_per_s":
        return tokens / run.value
    if run.measure == "tokens_per_s_per_device":
        return tokens / (run.value * run.devices)
    flops_per_token = float(model_flops_per_token(run.arch))
    if run.measure == "tflops_per_device":
        return tokens * flops_per_token / (run.value * 1e12 * run.devices)
    if run.measure == "mfu":
        peak = cluster.accelerator.peak(run.layout.precision)
        return tokens * flops_per_token / (run.value * peak * run.devices)
    raise AssertionError(f"unhandled measure {run.measure}")


UNSCORED_REASONS = ("invalid_layout", "precision", "dispatcher")
"""Infeasibility reasons whose step time is not a prediction (perfmodel.evaluate.REASONS)."""


def _reason_names(result: Any, n: int) -> list[str]:
    """Reason of each row as a name ('' when feasible); integer codes index perfmodel.evaluate.REASONS."""
    feasible = np.asarray(result.feasible, dtype=bool).reshape(-1)
    raw = np.asarray(result.reason).reshape(-1)
    if np.issubdtype(raw.dtype, np.integer):
        from perfmodel.evaluate import REASONS
        names = [REASONS[int(code)] for code in raw]
    else:
        names = [str(code) for code in raw]
    return ["" if feasible[i] else names[i] for i in range(n)]


def _default_evaluate() -> Callable[..., Any]:
    try:
        from perfmodel.evaluate import evaluate
    except ImportError as exc:  # the model module is part of the package; this is a broken install
        raise MosaicError(f"perfmodel.evaluate is not available ({exc}); reinstall mosaic-planner") from None
    return evaluate


def compare(
    runs: Sequence[PublishedRun],
    clusters: Mapping[str, ClusterSpec],
    evaluate: Optional[Callable[..., Any]] = None,
) -> pd.DataFrame:
    """Predict every run on its cluster and put prediction and measurement side by side.

    One `evaluate` call per cluster (vectorised over that cluster's runs). Columns:
    run_id, model, cluster, devices, precision, layout, measure, value,
    measured_step_time_s, predicted_step_time_s, ape, signed_error (predicted/measured - 1),
    measured/predicted tokens_per_s_per_device and mfu, predicted_memory_per_device_bytes,
    usable_hbm_bytes, feasible, reason (a name; '' when feasible), source.
    """
    evaluate = evaluate or _default_evaluate()
    frames = []
    for name, spec in clusters.items():
        group = [run for run in runs if run.cluster == name]
        if not group:
            continue
        archs = ArchBatch.stack([run.arch for run in group])
        layouts = LayoutBatch.stack([run.layout for run in group])
        devices = np.asarray([run.devices for run in group], dtype=np.int64)
        result = evaluate(archs, layouts, spec, devices=devices)
        predicted = np.asarray(result.step_time_s, dtype=float).reshape(-1)
        feasible = np.asarray(result.feasible, dtype=bool).reshape(-1)
        reason = _reason_names(result, len(group))
        memory = np.asarray(result.memory_per_device_bytes, dtype=float).reshape(-1)
        pred_tps = np.asarray(result.tokens_per_s_per_device, dtype=float).reshape(-1)
        pred_mfu = np.asarray(result.mfu, dtype=float).reshape(-1)
        for i, run in enumerate(group):
            measured = measured_step_time_s(run, spec)
            peak = spec.accelerator.peak(run.layout.precision)
            meas_tps = run.tokens_per_step / (measured * run.devices)
            ok = reason[i] not in UNSCORED_REASONS and math.isfinite(predicted[i]) and predicted[i] > 0
            frames.append({
                "run_id": run.run_id,
                "model": run.model,
                "cluster": name,
                "devices": run.devices,
                "precision": run.layout.precision,
                "layout": run.layout.to_string(),
                "pipeline_split": describe_split(run.arch.n_layers, run.arch.n_mtp_layers, run.layout),
                "measure": run.measure,
                "value": run.value,
                "measured_step_time_s": measured,
                "predicted_step_time_s": float(predicted[i]) if ok else math.nan,
                "ape": abs(predicted[i] - measured) / measured if ok else math.nan,
                "signed_error": predicted[i] / measured - 1.0 if ok else math.nan,
                "measured_tokens_per_s_per_device": meas_tps,
                "predicted_tokens_per_s_per_device": float(pred_tps[i]) if ok else math.nan,
                "measured_mfu": meas_tps * float(model_flops_per_token(run.arch)) / peak,
                "predicted_mfu": float(pred_mfu[i]) if ok else math.nan,
                "predicted_memory_per_device_bytes": float(memory[i]),
                "measured_peak_memory_bytes": run.peak_memory_bytes if run.peak_memory_bytes else math.nan,
                "memory_error": (float(memory[i]) / run.peak_memory_bytes - 1.0) if run.peak_memory_bytes else math.nan,
                "kind": "moe" if run.arch.n_experts > 0 else "dense",
                "usable_hbm_bytes": float(spec.accelerator.usable_hbm_bytes),
                "feasible": bool(feasible[i]),
                "reason": reason[i],
                "source": run.source,
            })
    order = {run.run_id: k for k, run in enumerate(runs)}
    frame = pd.DataFrame(frames)
    return frame.sort_values("run_id", key=lambda col: col.map(order)).reset_index(drop=True)


def _errors(scored: pd.DataFrame) -> dict[str, Any]:
    """Runs, mean absolute and mean signed percentage error of a scored subset."""
    return {"runs": int(len(scored)), "mean_ape_pct": float(100 * scored["ape"].mean()) if len(scored) else None,
            "mean_signed_error_pct": float(100 * scored["signed_error"].mean()) if len(scored) else None}


def summarize(frame: pd.DataFrame) -> dict[str, Any]:
    """Mean, median and max absolute percentage error (in %) over every scored row; the same per
    cluster and per kind of run (dense, moe), signed and absolute; the memory error where the
    source published a peak."""
    scored = frame[frame["ape"].notna()]
    summary: dict[str, Any] = {
        "runs": int(len(frame)),
        "compared": int(len(scored)),
        "predicted_infeasible": {str(r.run_id): str(r.reason) for r in frame.loc[~frame["feasible"]].itertuples()},
        "unscored": [str(r) for r in frame.loc[frame["ape"].isna(), "run_id"]],
        "mean_ape_pct": None,
        "max_ape_pct": None,
        "median_ape_pct": None,
        "worst_run_id": None,
        "mean_signed_error_pct": None,
        "by_cluster": {},
        "by_kind": {},
        "memory": {},
    }
    if len(scored):
        worst = scored.loc[scored["ape"].idxmax()]
        summary.update({
            "mean_ape_pct": float(100 * scored["ape"].mean()),
            "max_ape_pct": float(100 * scored["ape"].max()),
            "median_ape_pct": float(100 * scored["ape"].median()),
            "worst_run_id": str(worst["run_id"]),
            "mean_signed_error_pct": float(100 * scored["signed_error"].mean()),
        })
        summary["by_cluster"] = {str(c): _errors(g) for c, g in scored.groupby("cluster", sort=False)}
        summary["by_kind"] = {str(k): _errors(g) for k, g in scored.groupby("kind", sort=True)}
    if "memory_error" in frame:
        mem = frame[frame["memory_error"].notna()]
        if len(mem):
            summary["memory"] = {"runs": int(len(mem)), "mean_abs_error_pct": float(100 * mem["memory_error"].abs().mean()),
                                 "mean_signed_error_pct": float(100 * mem["memory_error"].mean())}
    return summary


def validate_runs(
    path: str | Path,
    cluster_map: Optional[Mapping[str, str]] = None,
    evaluate: Optional[Callable[..., Any]] = None,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Load, check, predict and score a runs CSV: (per-row frame, summary)."""
    runs = load_runs(path)
    clusters = resolve_clusters(runs, cluster_map)
    frame = compare(runs, clusters, evaluate=evaluate)
    return frame, summarize(frame)


__all__ = [
    "MEASURES", "PublishedRun", "REQUIRED_COLUMNS", "bundled_runs_path", "compare", "load_runs",
    "measured_step_time_s", "parse_cluster_map", "resolve_clusters", "summarize", "validate_runs",
]

"""Turn measurements into a calibrated cluster file: base cluster + measured figures + `calibration:`.

The calibrated YAML is the base cluster's own mapping with the measured fields
replaced (so anything not measured keeps its datasheet figure and source) and
a plain `calibration:` mapping recording provenance and fit quality. It is
validated by the strict loader before it is written, and the raw measurements
go to a CSV beside it (`<stem>.measurements.csv`), so every figure can be
recomputed. `mosaic predict/plan --cluster calibrated.yaml` use it unchanged.
"""

from __future__ import annotations

import copy
import datetime
import platform
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from calibration.collectives import AFTER_COMPUTE
from calibration.fit import (
    AlphaBetaFit,
    CurveFit,
    fit_collectives,
    fit_efficiency_curve,
    relative_efficiency,
)
from calibration.measurements import COLLECTIVE_KINDS, Measurement, write_csv
from perfmodel.clusters import resolve_cluster_path
from perfmodel.errors import InputError
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.strict import plain, read_yaml, spec_from_dict, write_text_atomic

MIN_FRACTION = 1e-4


@dataclass
class Provenance:
    """Where and how the measurements were taken."""

    device: str
    device_name: str
    ranks: int
    torch_version: str
    driver: str
    threads_per_rank: Optional[int]
    quick: bool
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    host: str = field(default_factory=socket.gethostname)
    notes: dict[str, str] = field(default_factory=dict)
    """Skipped precisions, grouped-GEMM fallback, collective failures."""
    load_average: Optional[list[float]] = None
    """1-minute host load average before and after measuring (other jobs disturb timings)."""

    def mapping(self) -> dict[str, Any]:
        return {
            "date": self.date, "host": self.host, "platform": platform.platform(), "device": self.device,
            "device_name": self.device_name, "ranks": self.ranks, "torch_version": self.torch_version,
            "driver": self.driver, "threads_per_rank": self.threads_per_rank, "quick": self.quick,
            "load_average_1min": self.load_average, "host_cpus": _cpus(), "notes": dict(self.notes),
        }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> Optional[float]:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Calibration:
    """Everything fitted from one set of measurements."""

    compute: dict[str, CurveFit]
    memory: Optional[CurveFit]
    launch_latency_s: Optional[float]
    launch_noise: Optional[float]
    dtensor_op_latency_s: Optional[float]
    checkpoint_region_latency_s: Optional[float]
    checkpoint_saved_tensor_latency_s: Optional[float]
    collectives: list[AlphaBetaFit]
    collectives_after_compute: list[AlphaBetaFit]
    """The same collectives timed after an eager compute gap (cpu; empty elsewhere)."""
    grouped_gemm: Optional[dict[str, Any]]
    attention: Optional[dict[str, Any]]
    noise_median: float
    noise_p90: float


def _median_of(rows: Sequence[Measurement], kind: str) -> Optional[float]:
    values = [r.median_s for r in rows if r.kind == kind]
    return float(np.median(values)) if values else None


def fit_all(rows: Sequence[Measurement], peaks: Optional[dict[str, float]] = None,
            hbm_bytes_per_s: Optional[float] = None) -> Calibration:
    """Fit every figure the rows allow; `peaks`/`hbm_bytes_per_s` None = use the best measured (cpu)."""
    compute: dict[str, CurveFit] = {}
    for precision in sorted({r.precision for r in rows if r.kind == "gemm"}):
        gemm = [r for r in rows if r.kind == "gemm" and r.precision == precision]
        datasheet = (peaks or {}).get(precision)
        best = max(r.rate for r in gemm)
        peak = None if datasheet is None or best > datasheet else datasheet
        compute[precision] = fit_efficiency_curve([r.flops for r in gemm], [r.median_s for r in gemm], peak,
                                                  source="")
    memory_rows = [r for r in rows if r.kind in ("mem_copy", "mem_add")]
    memory = None
    if memory_rows:
        best = max(r.rate for r in memory_rows)
        peak = None if hbm_bytes_per_s is None or best > hbm_bytes_per_s else hbm_bytes_per_s
        memory = fit_efficiency_curve([r.bytes for r in memory_rows], [r.median_s for r in memory_rows], peak, source="")
    launch = [r for r in rows if r.kind == "launch"]
    dtensor = [r for r in rows if r.kind == "dtensor_op"]
    grouped = [r for r in rows if r.kind == "grouped_gemm"]
    attention = [r for r in rows if r.kind == "sdpa"]

    def versus_dense(subset: list[Measurement]) -> Optional[dict[str, Any]]:
        if not subset or subset[0].precision not in compute:
            return None
        fit = compute[subset[0].precision]
        out: dict[str, Any] = {"precision": subset[0].precision,
                               "efficiency_vs_dense_gemm": relative_efficiency(subset, fit.curve, fit.peak)}
        impls = sorted({r.impl for r in subset if r.impl})
        if impls:
            out["impl"] = ",".join(impls)
        return out

    noises = np.array([r.noise for r in rows]) if rows else np.zeros(1)
    return Calibration(
        compute=compute, memory=memory,
        launch_latency_s=float(np.median([r.median_s for r in launch])) if launch else None,
        launch_noise=float(np.median([r.noise for r in launch])) if launch else None,
        dtensor_op_latency_s=float(np.median([r.median_s for r in dtensor])) if dtensor else None,
        checkpoint_region_latency_s=_median_of(rows, "checkpoint_region"),
        checkpoint_saved_tensor_latency_s=_median_of(rows, "checkpoint_saved_tensor"),
        collectives=fit_collectives([r for r in rows if r.kind in COLLECTIVE_KINDS and not r.impl.endswith(AFTER_COMPUTE)]),
        collectives_after_compute=fit_collectives([r for r in rows if r.kind in COLLECTIVE_KINDS
                                                   and r.impl.endswith(AFTER_COMPUTE)]),
        grouped_gemm=versus_dense(grouped), attention=versus_dense(attention),
        noise_median=float(np.median(noises)), noise_p90=float(np.percentile(noises, 90)),
    )


def _curve_mapping(fit: CurveFit, source: str) -> dict[str, Any]:
    return {"sizes": [float(f"{s:.6g}") for s in fit.curve.sizes],
            "values": [float(f"{max(v, MIN_FRACTION):.4g}") for v in fit.curve.values], "source": source}


def latency_steps(collective: str, ranks: int) -> float:
    """Latency steps perfmodel.comm charges one collective on one level (see level_figures)."""
    if collective == "p2p":
        return 1.0
    depth = max(1.0, float(np.ceil(np.log2(max(ranks, 2)) - 1e-9)))
    return 2.0 * depth if collective == "all_reduce" else depth


def sync_latency(fits: Sequence[AlphaBetaFit], after_compute: Sequence[AlphaBetaFit]) -> Optional[float]:
    """Extra seconds per collective call issued between computations (perfmodel.comm's
    `sync_latency_s`): the median over collectives of alpha after a compute gap minus alpha back
    to back (floored at 0); None without after-compute fits."""
    tight = {(f.collective, f.ranks): f.alpha_s for f in fits}
    extra = [f.alpha_s - tight[(f.collective, f.ranks)] for f in after_compute
             if (f.collective, f.ranks) in tight and f.collective != "p2p"]  # p2p pays none (perfmodel.comm)
    return max(float(np.median(extra)), 0.0) if extra else None


def level_figures(fits: Sequence[AlphaBetaFit], datasheet_bw: Optional[float],
                  after_compute: Sequence[AlphaBetaFit] = ()) -> dict[str, Any]:
    """FabricLevel fields from one level's alpha-beta fits.

    Bandwidth: the datasheet wire figure when given and not exceeded, else the
    best asymptotic bus bandwidth measured (loopback/cpu: nothing to cite).
    Per-collective efficiency = asymptotic busbw / bandwidth (perfmodel.comm
    prices S * bus factor / (bandwidth * efficiency), so this reproduces the
    measured busbw); the level's default efficiency is all-reduce's. Latency:
    perfmodel.comm charges latency_s per tree step (ceil(log2 n) steps per
    phase, two phases for all-reduce, one hop for p2p), so each fitted alpha is
    divided by its step count and the median over collectives is kept. With fits of
    the same collectives timed after a compute gap (cpu), `sync_latency_s` is what each
    call costs beyond that (`sync_latency`).
    """
    best = max(f.busbw_bytes_per_s for f in fits)
    bandwidth = datasheet_bw if datasheet_bw is not None and best <= datasheet_bw else best
    per = {f.collective: float(f"{min(1.0, max(MIN_FRACTION, f.busbw_bytes_per_s / bandwidth)):.4g}") for f in fits}
    default = per.get("all_reduce", max(per.values()))
    per_step = [f.alpha_s / latency_steps(f.collective, f.ranks) for f in fits]
    out = {
        "bandwidth_bytes_per_s": float(f"{bandwidth:.6g}"),
        "latency_s": float(f"{float(np.median(per_step)):.4g}"),
        "efficiency": default,
        "collective_efficiency": per,
        "bandwidth_from": "datasheet" if bandwidth == datasheet_bw else "measured",
    }
    sync = sync_latency(fits, after_compute)
    if sync is not None:
        out["sync_latency_s"] = float(f"{sync:.4g}")
    return out


def calibrated_mapping(base: str, rows: Sequence[Measurement], provenance: Provenance, csv_name: str) -> dict[str, Any]:
    """The base cluster's YAML mapping with measured figures and a `calibration:` section."""
    path = resolve_cluster_path(base)
    data = copy.deepcopy(read_yaml(path))
    base_spec = spec_from_dict(ClusterSpec, data, source=str(path))
    acc = data["accelerator"]
    cpu = provenance.device == "cpu"
    stamp = f"mosaic calibrate {provenance.date} on {provenance.host} ({provenance.device_name}), see calibration:"
    cal = fit_all(rows, peaks=None if cpu else dict(base_spec.accelerator.peak_flops_per_s),
                  hbm_bytes_per_s=None if cpu else base_spec.accelerator.hbm_bandwidth_bytes_per_s)
    sources = dict(acc.get("sources", {}))
    section: dict[str, Any] = {"provenance": provenance.mapping(), "base_cluster": {
        "name": base_spec.name, "file": path.name, "content_hash": base_spec.content_hash()},
        "measurements_csv": csv_name, "noise": {"median_iqr_over_median": round(cal.noise_median, 4),
                                                 "p90_iqr_over_median": round(cal.noise_p90, 4)}}

    if cal.compute:
        peaks = {} if cpu else dict(acc["peak_flops_per_s"])
        curves = {} if cpu else dict(acc.get("compute_efficiency", {}))
        quality = {}
        for precision, fit in cal.compute.items():
            measured_peak = fit.peak if cpu or fit.peak != base_spec.accelerator.peak_flops_per_s.get(precision) else None
            if measured_peak is not None:
                peaks[precision] = float(f"{fit.peak:.6g}")
            note = ("peak = best measured GEMM rate on one rank" + (" (one thread = one core)" if cpu else
                    " (above the datasheet figure)") if measured_peak is not None else "fraction of the datasheet peak")
            curves[precision] = _curve_mapping(fit, f"{stamp}; {fit.points} GEMM shapes, median per half decade; {note}")
            quality[precision] = {"peak_flops_per_s": float(f"{fit.peak:.6g}"), "peak_from": "measured" if measured_peak else "datasheet",
                                  "points": fit.points, "loo_time_median_abs_error": round(fit.median_abs_error, 4),
                                  "loo_time_max_abs_error": round(fit.max_abs_error, 4)}
        acc["peak_flops_per_s"] = peaks
        acc["compute_efficiency"] = curves
        if any(q["peak_from"] == "measured" for q in quality.values()):
            sources["peak_flops_per_s"] = f"measured: {stamp}" + (
                "" if cpu else f"; datasheet was: {sources.get('peak_flops_per_s', '')}")
        section["compute"] = quality
    if cal.memory is not None:
        fit = cal.memory
        acc["memory_efficiency"] = _curve_mapping(fit, f"{stamp}; copy and add streams, median per half decade")
        if cpu or fit.peak != base_spec.accelerator.hbm_bandwidth_bytes_per_s:
            acc["hbm_bandwidth_bytes_per_s"] = float(f"{fit.peak:.6g}")
            sources["hbm_bandwidth_bytes_per_s"] = f"measured (best copy/add stream on one rank): {stamp}"
        section["memory"] = {"peak_bytes_per_s": float(f"{fit.peak:.6g}"), "points": fit.points,
                             "loo_time_median_abs_error": round(fit.median_abs_error, 4)}
    if cal.launch_latency_s is not None:
        acc["launch_latency_s"] = float(f"{cal.launch_latency_s:.4g}")
        what = ("an eager op with autograd: RMSNorm + SwiGLU blocks forward + backward per dispatched op, "
                "calibration.eager_ops" if cpu else "host dispatch of a 1-element add")
        sources["launch_latency_s"] = f"measured (median {what}, {provenance.device}): {stamp}"
        section["launch"] = {"latency_s": float(f"{cal.launch_latency_s:.4g}"), "noise": round(cal.launch_noise or 0.0, 4)}
    if cal.dtensor_op_latency_s is not None:
        acc["dtensor_op_latency_s"] = float(f"{cal.dtensor_op_latency_s:.4g}")
        sources["dtensor_op_latency_s"] = ("measured (median host time a DTensor op adds: RMSNorm + SwiGLU blocks with "
                                           "column-/row-wise tensor-parallel linears on a fake 2-rank mesh against the "
                                           f"same blocks on one device, calibration.eager_ops, {provenance.device}): {stamp}")
        section["dtensor_op"] = {"latency_s": float(f"{cal.dtensor_op_latency_s:.4g}")}
    if cal.checkpoint_region_latency_s is not None and cal.checkpoint_saved_tensor_latency_s is not None:
        what = ("solved from RMSNorm + SwiGLU block and causal SDPA stacks with and without non-reentrant "
                f"torch.utils.checkpoint, calibration.eager_ops.checkpoint_costs, {provenance.device}")
        for key in ("checkpoint_region_latency_s", "checkpoint_saved_tensor_latency_s"):
            acc[key] = float(f"{getattr(cal, key):.4g}")
            sources[key] = f"measured ({what}): {stamp}"
        section["checkpoint"] = {"region_s": acc["checkpoint_region_latency_s"],
                                 "saved_tensor_s": acc["checkpoint_saved_tensor_latency_s"]}
    if cal.grouped_gemm is not None:
        section["grouped_gemm"] = cal.grouped_gemm
    if cal.attention is not None:
        section["attention"] = {**cal.attention, "note": "causal SDPA forward; FLOPs = half of 4*B*H*S^2*D"}
        ratio = cal.attention["efficiency_vs_dense_gemm"]
        acc["attention_efficiency_vs_gemm"] = float(f"{ratio['median']:.4g}")
        sources["attention_efficiency_vs_gemm"] = (
            f"measured (median over {ratio['points']} causal SDPA forward points, {cal.attention['precision']}, of the "
            f"achieved rate over the calibrated {cal.attention['precision']} GEMM curve at equal FLOPs; range "
            f"{ratio['min']:g}-{ratio['max']:g}, {provenance.device}): {stamp}")
    acc["sources"] = sources

    if cal.collectives:
        by_level: dict[str, list[AlphaBetaFit]] = {}
        for fit in cal.collectives:
            by_level.setdefault(fit.level, []).append(fit)
        names = [lvl["name"] for lvl in data["levels"]]
        for level, fits in by_level.items():
            if level not in names:
                raise InputError(f"measured level '{level}' is not a level of cluster '{base_spec.name}' "
                                 f"({', '.join(names)}); calibrate against the cluster the job ran on")
            entry = data["levels"][names.index(level)]
            wire = None if cpu else float(entry["bandwidth_bytes_per_s"])
            figures = level_figures(fits, wire, [f for f in cal.collectives_after_compute if f.level == level])
            bandwidth_from = figures.pop("bandwidth_from")
            old_source = entry.get("source", "")
            entry.update(figures)
            entry["source"] = (f"measured: {stamp}; alpha-beta fits of {', '.join(sorted(f.collective for f in fits))} "
                               f"over {fits[0].ranks} ranks; bandwidth {bandwidth_from}"
                               + (f"; datasheet was: {old_source}" if old_source and not cpu else ""))
        section["collectives"] = [{
            "collective": f.collective, "level": f.level, "ranks": f.ranks, "alpha_s": float(f"{f.alpha_s:.4g}"),
            "alpha_se_s": float(f"{f.alpha_se_s:.3g}"), "algbw_bytes_per_s": float(f"{f.algbw_bytes_per_s:.4g}"),
            "busbw_bytes_per_s": float(f"{f.busbw_bytes_per_s:.4g}"), "beta_rel_se": round(f.beta_rel_se, 4),
            "r2": round(f.r2, 4), "r2_linear": round(f.r2_linear, 4), "points": f.points} for f in cal.collectives]
        if cal.collectives_after_compute:
            section["collectives_after_compute"] = [{
                "collective": f.collective, "level": f.level, "ranks": f.ranks, "alpha_s": float(f"{f.alpha_s:.4g}"),
                "alpha_se_s": float(f"{f.alpha_se_s:.3g}"), "r2": round(f.r2, 4)} for f in cal.collectives_after_compute]
        section["levels_calibrated"] = sorted(by_level)
    data["name"] = f"{base_spec.name}_calibrated"
    data["description"] = f"{base_spec.description.strip()} Calibrated by mosaic calibrate on {provenance.host}, {provenance.date}."
    data["calibration"] = section
    return data


def write_calibrated(base: str, rows: Sequence[Measurement], provenance: Provenance, output: Path,
                     extra: Optional[dict[str, Any]] = None) -> tuple[Path, Path, ClusterSpec]:
    """Validate and write `output` (YAML) and its measurements CSV atomically; return both paths and the spec."""
    csv_path = measurements_path(output)
    data = calibrated_mapping(base, rows, provenance, csv_path.name)
    if extra:
        data["calibration"].update(extra)
    spec = spec_from_dict(ClusterSpec, data, source=str(output))  # validate before anything is written
    text = yaml.safe_dump(plain(data, nonfinite_to_none=False), sort_keys=False, width=100)  # fails here, before any file is touched
    write_csv(csv_path, rows)
    write_text_atomic(output, text)
    return output, csv_path, spec


def measurements_path(output: Path) -> Path:
    return output.with_name(f"{output.stem}.measurements.csv")


__all__ = ["Calibration", "Provenance", "calibrated_mapping", "fit_all", "level_figures", "measurements_path",
           "write_calibrated"]

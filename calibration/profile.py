"""The calibrated cluster file: a datasheet + the measured tables, built as a bundled cluster is.

`calibrated_mapping(base, measured)`:

1. Datasheet: the base cluster file (bundled or the user's) without its fitted kernel figures
   (`accelerator.kernels`, `perfmodel.kernels.build.GENERATED_ACCELERATOR_KEYS`), renamed
   `<base>_calibrated`. Its accelerator gets what this machine measured beyond the tables: on
   cpu the peaks (of the precisions measured; the others keep the base's) and memory bandwidth
   are the kernel forms' fitted ceilings
   (`calibration.fit.gemm_ceilings`, `memory_ceiling`: a CPU core has no datasheet figure);
   on cuda/npu the datasheet figures stay (every efficiency is measured / datasheet peak)
   unless a ceiling exceeds them. The host figures (launch latency, DTensor op, checkpointed
   region and saved tensor) come from host.csv. A fabric level measured over gloo gets its
   figures from the alpha-beta fits of its collectives (`level_figures`); one measured over
   NCCL/HCCL loses its fitted figures, which the build then fits to the rows; a level not
   measured keeps the base's figures (their `collective_fit` says so).
2. Tables: the bundled tables (`perfmodel/data/kernels`) without any row of the measured
   accelerator, plus the measured tables (its rows win: they are the only rows of an
   accelerator that is a generation of its own, `perfmodel.kernels.build.MeasuredAccelerator`).
3. `perfmodel.kernels.build.build_cluster` on them: the fit of the bundled clusters, so what
   this machine did not measure is derived from the base's accelerator by the same stated rules.
4. A `calibration:` section: provenance, base cluster, tables folder, fit quality, the
   alpha-beta fits.

The result is validated by the strict loader before it is written (`write_calibrated`).
`mosaic predict/plan --cluster calibrated.yaml` use it unchanged.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from calibration.fit import AlphaBetaFit, fit_collectives, gemm_ceilings, memory_ceiling
from calibration.tables import MeasuredTables, noise_summary
from perfmodel.clusters import resolve_cluster_path
from perfmodel.errors import InputError
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.strict import plain, read_yaml, spec_from_dict, write_text_atomic

MIN_FRACTION = 1e-4
GENERATED_HEADER = ("# Written by `mosaic calibrate`: the datasheet of {base} with this machine's measurements\n"
                    "# ({tables}/, the kernel-table format of perfmodel/data/kernels) fitted by\n"
                    "# perfmodel.kernels.build.build_cluster, as the bundled clusters are.\n")


def ceil_6g(x: float) -> float:
    """x to 6 significant digits, rounded up: a peak written to the file stays at or above the
    ceiling it comes from (and so above every measured rate, `calibration.fit.gemm_ceilings`)."""
    unit = 10.0 ** (np.floor(np.log10(x)) - 5)
    return float(f"{np.ceil(x / unit) * unit:.6g}")


def load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- fabric levels

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
    divided by its step count: that is the collective's own `collective_latency_s`
    (a 2-rank fabric's reduce-scatter alpha can sit far above its all-gather's), and
    the median over collectives is the level's `latency_s` for any other. With fits of
    the same collectives timed after a compute gap (cpu), `sync_latency_s` is what each
    call costs beyond that (`sync_latency`).
    """
    best = max(f.busbw_bytes_per_s for f in fits)
    bandwidth = datasheet_bw if datasheet_bw is not None and best <= datasheet_bw else best
    per = {f.collective: float(f"{min(1.0, max(MIN_FRACTION, f.busbw_bytes_per_s / bandwidth)):.4g}") for f in fits}
    default = per.get("all_reduce", max(per.values()))
    per_step = [f.alpha_s / latency_steps(f.collective, f.ranks) for f in fits]
    by_collective: dict[str, list[float]] = {}
    for f, step_s in zip(fits, per_step):
        by_collective.setdefault(f.collective, []).append(step_s)
    out = {
        "bandwidth_bytes_per_s": float(f"{bandwidth:.6g}"),
        "latency_s": float(f"{float(np.median(per_step)):.4g}"),
        "efficiency": default,
        "collective_efficiency": per,
        "collective_latency_s": {name: float(f"{float(np.median(v)):.4g}") for name, v in by_collective.items()},
        "bandwidth_from": "datasheet" if bandwidth == datasheet_bw else "measured",
    }
    sync = sync_latency(fits, after_compute)
    if sync is not None:
        out["sync_latency_s"] = float(f"{sync:.4g}")
    return out


def _fit_mapping(fits: Sequence[AlphaBetaFit]) -> list[dict[str, Any]]:
    return [{"collective": f.collective, "level": f.level, "ranks": f.ranks, "alpha_s": float(f"{f.alpha_s:.4g}"),
             "alpha_se_s": float(f"{f.alpha_se_s:.3g}"), "algbw_bytes_per_s": float(f"{f.algbw_bytes_per_s:.4g}"),
             "busbw_bytes_per_s": float(f"{f.busbw_bytes_per_s:.4g}"), "beta_rel_se": round(f.beta_rel_se, 4),
             "r2": round(f.r2, 4), "r2_linear": round(f.r2_linear, 4), "points": f.points} for f in fits]


def _calibrate_levels(levels: list[dict[str, Any]], measured: MeasuredTables, cpu: bool, stamp: str,
                      section: dict[str, Any]) -> None:
    """Set each level's figures from its measured collectives (module doc, step 1), in place."""
    from perfmodel.kernels.build import GENERATED_LEVEL_KEYS

    table = measured.rows("collectives")
    fits = fit_collectives(table)
    after = fit_collectives(table, "after_compute")
    names = [level["name"] for level in levels]
    measured_levels = sorted({str(v) for v in table["level"]}) if len(table) and "level" in table.columns else []
    for name in measured_levels:
        if name not in names:
            raise InputError(f"measured level '{name}' is not a level of the base cluster ({', '.join(names)}); "
                             "calibrate against the cluster the job ran on")
    for level in levels:
        mine = [f for f in fits if f.level == level["name"]]
        rows = table.select(table["level"] == level["name"]) if level["name"] in measured_levels else None
        if rows is None or not len(rows):
            fit = level.get("collective_fit")
            if isinstance(fit, dict):
                note = "not measured by this calibration: the base cluster's figures"
                fit["derived"] = f"{fit['derived']}; {note}" if fit.get("derived") else note
            continue
        if bool(np.all(rows["algorithm"] == "gloo")):
            if not mine:  # no size series to fit: the base's figures stay
                continue
            figures = level_figures(mine, None if cpu else float(level["bandwidth_bytes_per_s"]),
                                    [f for f in after if f.level == level["name"]])
            bandwidth_from = figures.pop("bandwidth_from")
            old_source = level.get("source", "")
            for key in GENERATED_LEVEL_KEYS:
                level.pop(key, None)
            level.update(figures)
            level["source"] = (f"measured: {stamp}; alpha-beta fits of {', '.join(sorted(f.collective for f in mine))} "
                               f"over {mine[0].ranks} ranks (gloo); bandwidth {bandwidth_from}"
                               + (f"; datasheet was: {old_source}" if old_source and not cpu else ""))
        else:  # NCCL / HCCL rows: the build fits this level to them, as a bundled cluster's
            for key in GENERATED_LEVEL_KEYS:
                level.pop(key, None)
    if fits:
        section["collectives"] = _fit_mapping(fits)
        section["levels_calibrated"] = measured_levels
    if after:
        section["collectives_after_compute"] = [{
            "collective": f.collective, "level": f.level, "ranks": f.ranks, "alpha_s": float(f"{f.alpha_s:.4g}"),
            "alpha_se_s": float(f"{f.alpha_se_s:.3g}"), "r2": round(f.r2, 4)} for f in after]


# --------------------------------------------------------------------------- the accelerator

def _calibrate_accelerator(acc: dict[str, Any], measured: MeasuredTables, cpu: bool, stamp: str,
                           section: dict[str, Any]) -> None:
    """Peaks, memory bandwidth and host figures of the datasheet accelerator (module doc), in place."""
    name = measured.accelerator
    sources = dict(acc.get("sources", {}))
    memory = measured.rows("memory_kernels").rows_of(name)
    if len(memory) and np.any(np.isfinite(memory["gbps"])):
        ceiling = memory_ceiling(memory, name)
        datasheet = float(acc["hbm_bandwidth_bytes_per_s"])
        if cpu or ceiling > datasheet:
            acc["hbm_bandwidth_bytes_per_s"] = float(f"{ceiling:.6g}")
            sources["hbm_bandwidth_bytes_per_s"] = (
                f"measured: the fitted copy ceiling of the memory-bound kernel rows ({stamp})"
                + ("" if cpu else f"; above the datasheet's {datasheet:.4g}: {sources.get('hbm_bandwidth_bytes_per_s', '')}"))
        section["memory"] = {"bandwidth_bytes_per_s": float(acc["hbm_bandwidth_bytes_per_s"]),
                             "ceiling_bytes_per_s": float(f"{ceiling:.6g}"),
                             "from": "measured" if cpu or ceiling > datasheet else "datasheet"}
    gemm = measured.rows("gemm").rows_of(name)
    if len(gemm):
        hbm = float(acc["hbm_bandwidth_bytes_per_s"])
        copy_fraction = 1.0 if cpu or "memory" not in section else min(1.0, section["memory"]["ceiling_bytes_per_s"] / hbm)
        ceilings = gemm_ceilings(gemm, name, hbm, copy_fraction)
        peaks = {k: float(v) for k, v in acc["peak_flops_per_s"].items()}  # a precision not measured keeps the base's
        quality = {}
        for precision, ceiling in ceilings.items():
            datasheet = peaks.get(precision)
            measured_peak = cpu or datasheet is None or ceiling > datasheet
            if measured_peak:
                peaks[precision] = ceil_6g(ceiling)
            quality[precision] = {"peak_flops_per_s": peaks[precision], "ceiling_flops_per_s": float(f"{ceiling:.6g}"),
                                  "peak_from": "measured" if measured_peak else "datasheet"}
        acc["peak_flops_per_s"] = peaks
        if any(q["peak_from"] == "measured" for q in quality.values()):
            sources["peak_flops_per_s"] = (
                f"measured: the GEMM form's fitted ceiling (e_max x peak with the peak free) over this machine's GEMM rows "
                f"({stamp})" + (" (one thread = one core)" if cpu else
                                f"; above the datasheet figure, which was: {sources.get('peak_flops_per_s', '')}"))
        section["compute"] = quality
    for figure, value in measured.host.items():
        acc[figure] = float(f"{value.seconds:.4g}")
        sources[figure] = f"measured ({value.note}): {stamp}"
    launch = measured.host.get("launch_latency_s")
    if launch is not None:
        section["launch"] = {"latency_s": acc["launch_latency_s"], "noise": round(launch.noise, 4)}
    if "dtensor_op_latency_s" in measured.host:
        section["dtensor_op"] = {"latency_s": acc["dtensor_op_latency_s"]}
    if "checkpoint_region_latency_s" in measured.host and "checkpoint_saved_tensor_latency_s" in measured.host:
        section["checkpoint"] = {"region_s": acc["checkpoint_region_latency_s"],
                                 "saved_tensor_s": acc["checkpoint_saved_tensor_latency_s"]}
    acc["sources"] = sources


def _fit_quality(kernels: dict[str, Any]) -> dict[str, Any]:
    """Rows and median |error| of each fitted (not derived) figure of the built kernels."""
    out: dict[str, Any] = {}

    def take(key: str, record: dict[str, Any]) -> None:
        if record.get("rows"):
            out[key] = {"rows": record["rows"], "median_abs_error": record.get("median_abs_error")}

    for precision, record in kernels["gemm"].items():
        take(f"gemm.{precision}", record)
    for precision, phases in kernels["grouped_gemm"].items():
        for phase, record in phases.items():
            take(f"grouped_gemm.{precision}.{phase}", record)
    for precision, record in kernels["attention"].items():
        take(f"attention.{precision}", record)
    take("memory", kernels["memory"])
    return out


def base_datasheet(data: dict[str, Any]) -> dict[str, Any]:
    """A cluster file's mapping without its fitted kernel figures (`build.GENERATED_ACCELERATOR_KEYS`)
    and without a previous `calibration:` section."""
    from perfmodel.kernels.build import GENERATED_ACCELERATOR_KEYS

    sheet = copy.deepcopy(data)
    sheet.pop("calibration", None)
    for key in GENERATED_ACCELERATOR_KEYS:
        sheet["accelerator"].pop(key, None)
    return sheet


def calibrated_mapping(base: str, measured: MeasuredTables, tables_name: str) -> dict[str, Any]:
    """The calibrated cluster's mapping (module doc)."""
    from perfmodel.kernels import derive
    from perfmodel.kernels.build import MeasuredAccelerator, TableSet, build_cluster, read_datasheets
    from perfmodel.kernels.tables import merge_tables, read_tables

    path = resolve_cluster_path(base)
    data = read_yaml(path)
    base_spec = spec_from_dict(ClusterSpec, data, source=str(path))
    name = measured.accelerator
    provenance = measured.provenance
    cpu = (provenance.get("device") == "cpu") if provenance.get("device") else base_spec.host_cores is not None \
        or bool(base_spec.size_from_host)
    stamp = (f"mosaic calibrate {provenance.get('date', '')} on {provenance.get('host', '?')} "
             f"({provenance.get('device_name', '?')}), tables {tables_name}/")
    sheet = base_datasheet(data)
    section: dict[str, Any] = {
        "provenance": dict(provenance), "base_cluster": {"name": base_spec.name, "file": path.name,
                                                         "content_hash": base_spec.content_hash()},
        "tables": tables_name}
    median, p90 = noise_summary(measured)
    section["noise"] = {"median_iqr_over_median": round(median, 4), "p90_iqr_over_median": round(p90, 4)}
    _calibrate_accelerator(sheet["accelerator"], measured, cpu, stamp, section)
    _calibrate_levels(sheet["levels"], measured, cpu, stamp, section)
    sheet["name"] = name
    sheet["description"] = (f"{base_spec.description.strip()} Calibrated by mosaic calibrate on "
                            f"{provenance.get('host', '?')}, {provenance.get('date', '?')}.")

    sheets = read_datasheets()
    like = derive.TABLE_ACCELERATOR.get(base_spec.name)
    if like is not None and base_spec.name not in sheets:
        like = None
    bundled = read_tables()
    others = {kind: table.select(table["accelerator"] != name) for kind, table in bundled.items()}
    own = {kind: table.select(table["accelerator"] == name) for kind, table in measured.tables.items()}
    reason = (f"not measured by this calibration: the base cluster's accelerator ({like}) at its achieved rate"
              if like else "")
    ts = TableSet(merge_tables(others, own), {**sheets, name: sheet},
                  measured={name: MeasuredAccelerator(like=like, reason=reason, cpu=cpu)})
    try:
        mapping = build_cluster(name, sheet, ts)
    except ValueError as exc:
        raise InputError(f"{tables_name}: the measured tables cannot describe this cluster ({exc}); measure the missing "
                         "kinds (run `mosaic calibrate` without --measurements) or calibrate on a bundled base "
                         "cluster, whose figures fill them in") from None
    section["fits"] = _fit_quality(mapping["accelerator"]["kernels"])
    mapping["calibration"] = section
    return mapping


def write_calibrated(base: str, measured: MeasuredTables, output: Path) -> tuple[Path, ClusterSpec]:
    """Validate and write `output` (YAML) atomically; return it and the spec."""
    output = Path(output)
    data = calibrated_mapping(base, measured, measured.folder.name)
    spec = spec_from_dict(ClusterSpec, data, source=str(output))  # validate before anything is written
    header = GENERATED_HEADER.format(base=data["calibration"]["base_cluster"]["file"], tables=measured.folder.name)
    text = header + yaml.safe_dump(plain(data, nonfinite_to_none=False), sort_keys=False, width=100)
    write_text_atomic(output, text)
    return output, spec


__all__ = ["base_datasheet", "calibrated_mapping", "latency_steps", "level_figures", "load_average", "sync_latency",
           "write_calibrated"]

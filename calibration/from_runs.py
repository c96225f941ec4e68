"""Refit the model's correction factors from the bundled trainer's runs (`mosaic calibrate --from-runs`).

Reads `RUNS/*/run.yaml` (resolved `model:` and `layout:`, device, world size,
the precision the trainer computed in) and `RUNS/*/metrics.jsonl` (one JSON
object per step). The measured step time of a run is the mean
`step_time_s` after warm-up (the first step, and the first 10% of longer
runs, carry allocation and first-call costs): what the run's tokens/s is
(tokens over elapsed time), and what Megatron-LM and torchtitan log (elapsed
time over a logging interval), so what published throughput figures mean.
`measured_step_time_s` says why not the median. Predictions come from
`perfmodel.evaluate` on the given cluster with four correction factors:

  efficiency_scale   multiplies every fitted kernel figure: each GEMM, grouped GEMM and
                     attention e_max (clipped to 1) and each memory-bound class's fraction of
                     the memory bandwidth (clipped to 1.5, `perfmodel.specs.kernels`)
  launch_latency_s   host dispatch time per kernel
  collective_latency_scale  multiplies every fabric level's latencies (per step, per collective
                     and per call):
                     what a synchronous job pays per collective beyond its bytes
  overlap            fraction of EP and DP communication that hides behind compute
  straggler_cv       per-node step-time variation (only visible across nodes)

Only the factors that move the predictions of these runs are fitted (a factor
whose whole range changes no prediction by 0.1% is left alone and reported as
such), at most one fewer than the runs. Least squares on log(predicted /
measured) (scipy.optimize.least_squares, bounded), then the same with a
heavy-tailed (Cauchy) prior that keeps each factor near its calibrated value
(maximum a posteriori; PRIOR_LOG_SD, the calibration's measured repeatability, sets its
width; `cauchy_residual`): a dozen runs rarely pin four factors apart (a
dispatch-bound set says little about compute), and without the prior a run
unlike the others is predicted by factors that drifted where no run checked
them. The step-time MAPE is reported before, after (in sample), and
leave-one-run-out (each run predicted by factors fitted without it: the
honest figure for a new run).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml
from scipy.optimize import least_squares

from perfmodel.clusters import load_cluster, resolve_cluster_path
from perfmodel.errors import InputError
from perfmodel.specs.architecture import ArchBatch, MoEArchitecture
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.kernels import KernelFigures
from perfmodel.specs.layout import LayoutBatch, ParallelLayout
from perfmodel.specs.strict import read_yaml, section_from_mapping, spec_from_dict, to_mapping, write_text_atomic

FACTORS = ("efficiency_scale", "launch_latency_s", "collective_latency_scale", "overlap", "straggler_cv")
BOUNDS = {"efficiency_scale": (1e-3, 5.0), "launch_latency_s": (0.0, 2e-3), "collective_latency_scale": (0.1, 10.0),
          "overlap": (0.0, 1.0), "straggler_cv": (0.0, 0.5)}
GRID = {"efficiency_scale": tuple(np.logspace(-3, 0.5, 6)), "launch_latency_s": tuple(np.logspace(-6, -3, 5)),
        "collective_latency_scale": (0.3, 1.0, 3.0), "overlap": (0.0, 0.5, 1.0), "straggler_cv": (0.0, 0.05, 0.2)}
"""Starting points: the objective is flat in a factor where another term dominates (dispatch is
max(device time, kernels x latency)), so a local fit from the datasheet values can stall; the
best few grid points (plus the current values) start the fits and the best result is kept."""
LOG_FACTORS = {"efficiency_scale": 1e-3, "launch_latency_s": 1e-7, "collective_latency_scale": 0.1}
"""Scale factors fitted as log10 (value floored here): they span decades."""
PRIOR_LOG_SD = math.log(1.2)
"""Prior on a scale factor (LOG_FACTORS), one standard deviation in natural log: how far a
calibrated figure lands from run to run of `mosaic calibrate`: the largest log standard
deviation of any calibrated figure over repeated `mosaic calibrate --quick` runs, rounded up to
ln 1.2 = 0.18 (docs/validation.md, "Measurements behind the calibration's settings"). The runs
outweigh it wherever they agree (the MAP step weighs it against their own residual scale); it
holds a factor where the runs cannot tell it from another (dispatch-bound runs trade launch
latency against GEMM efficiency). Fraction factors (overlap, straggler_cv) get half their
range."""
RUN_LOG_SD_FLOOR = 0.005
"""Smallest residual scale assumed for the runs (0.5%: a mean of steps is not more exact)."""

STARTS = 3
SENSITIVITY = 1e-3
"""A factor is fitted only if moving it across its range changes some prediction by more than 0.1%."""


@dataclass(frozen=True)
class Run:
    name: str
    arch: MoEArchitecture
    layout: ParallelLayout
    devices: int
    measured_step_time_s: float
    steps_used: int
    cluster_name: str


def _metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: line {line_no}: not JSON ({exc.msg}); fix or delete the line") from None
        if not isinstance(row, dict) or "step_time_s" not in row or "step" not in row:
            raise InputError(f"{path}: line {line_no}: needs 'step' and 'step_time_s' (a trainer metrics line)")
        value = row["step_time_s"]
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise InputError(f"{path}: line {line_no}: step_time_s must be a positive number, got {value!r}")
        rows.append(row)
    return rows


def warm_up_steps(steps: int) -> int:
    """Leading steps of a run left out of its measured step time: the first, and the first 10% of
    longer runs (allocation and first-call costs)."""
    return max(1, steps // 10)


def first_process_steps(rows: list[dict[str, Any]]) -> int:
    """Steps of a run's first process: rows carrying a "round" were appended by later processes
    that dropped their own warm-up (benchmarks/fidelity.py pools rounds so), so the warm-up rule
    applies to the leading rows without one."""
    first = sum(1 for r in rows if "round" not in r)
    return first or len(rows)


def measured_step_time_s(times: Sequence[float]) -> float:
    """A run's measured step time from its post-warm-up step times: their mean.

    The median is robust to a few slow steps but not to a machine whose speed switches between
    states (a shared host): it lands in whichever state held most of the steps, so it jumps,
    while the mean moves with the mix; over repeated fidelity benchmarks the mean was the more
    repeatable of the two (docs/validation.md, "Measurements behind the calibration's
    settings")."""
    return float(np.mean(np.asarray(times, dtype=float)))


def load_run(folder: Path) -> Run:
    """One trainer run folder: run.yaml + metrics.jsonl -> Run (mean post-warm-up step time)."""
    config = folder / "run.yaml"
    data = read_yaml(config)
    fix = "is this a run.yaml written by `mosaic train`?"
    arch = section_from_mapping(MoEArchitecture, data, "model", str(config), fix)
    layout = section_from_mapping(ParallelLayout, data, "layout", str(config), fix)
    if "world_size" not in data:
        raise InputError(f"{config}: missing key 'world_size'; {fix}")
    world = int(data["world_size"])
    precision = str(data.get("precision", layout.precision))
    layout = dataclasses.replace(layout, precision=precision).resolve(world)
    rows = _metrics(folder / "metrics.jsonl")
    if len(rows) < 2:
        raise InputError(f"{folder / 'metrics.jsonl'}: {len(rows)} step(s); need 2 or more (the first is warm-up)")
    rows.sort(key=lambda r: r["step"])
    times = [float(r["step_time_s"]) for r in rows[warm_up_steps(first_process_steps(rows)):]]
    return Run(name=folder.name, arch=arch, layout=layout, devices=world, measured_step_time_s=measured_step_time_s(times),
               steps_used=len(times), cluster_name=str(data.get("cluster", "")))


def discover_runs(runs: Path) -> list[Run]:
    """Every RUNS/*/ with run.yaml and metrics.jsonl (or RUNS itself when it is one run)."""
    if not runs.is_dir():
        raise InputError(f"--from-runs {runs}: not a folder; give the folder holding the trainer's run folders")
    folders = [runs] if (runs / "run.yaml").is_file() else sorted(
        p for p in runs.iterdir() if (p / "run.yaml").is_file() and (p / "metrics.jsonl").is_file())
    if not folders:
        raise InputError(f"--from-runs {runs}: no run folders with run.yaml and metrics.jsonl; train with `mosaic train --out {runs}/NAME`")
    return [load_run(f) for f in folders]


PER_COLLECTIVE_LATENCIES = ("collective_latency_s", "ll_collective_latency_s")
"""A fabric level's step latencies per collective (and of its low-latency protocol), scaled with
its latency_s by collective_latency_scale."""
E_MAX_FIELDS = ("e_max", "fwd_e_max", "bwd_e_max")
"""The fields of a kernel figure that efficiency_scale multiplies (clipped to 1)."""
MAX_MEMORY_FRACTION = 1.5
"""A memory class's fraction is clipped here when scaled (the bound `perfmodel.specs.kernels` checks)."""


def scaled_kernels(kernels: KernelFigures, scale: float) -> KernelFigures:
    """Every e_max (E_MAX_FIELDS) x `scale`, clipped to 1, and every memory fraction x `scale`,
    clipped to MAX_MEMORY_FRACTION; halves and provenance unchanged."""
    def figure(record: Any) -> Any:
        return dataclasses.replace(record, **{f: min(1.0, getattr(record, f) * scale)
                                              for f in E_MAX_FIELDS if hasattr(record, f)})

    return dataclasses.replace(
        kernels, gemm={p: figure(g) for p, g in kernels.gemm.items()},
        grouped_gemm={p: dataclasses.replace(g, fwd=figure(g.fwd), dgrad=figure(g.dgrad), wgrad=figure(g.wgrad))
                      for p, g in kernels.grouped_gemm.items()},
        attention={p: figure(a) for p, a in kernels.attention.items()},
        memory=dataclasses.replace(kernels.memory, fraction={c: min(MAX_MEMORY_FRACTION, f * scale)
                                                             for c, f in kernels.memory.fraction.items()}))


def apply_factors(cluster: ClusterSpec, factors: dict[str, float]) -> ClusterSpec:
    """The cluster with the given correction factors applied (others unchanged)."""
    acc = cluster.accelerator
    changes: dict[str, Any] = {}
    if "efficiency_scale" in factors:
        acc = dataclasses.replace(acc, kernels=scaled_kernels(acc.kernels, factors["efficiency_scale"]))
    if "launch_latency_s" in factors:
        acc = dataclasses.replace(acc, launch_latency_s=factors["launch_latency_s"])
    changes["accelerator"] = acc
    if "collective_latency_scale" in factors:
        s_lat = factors["collective_latency_scale"]
        changes["levels"] = tuple(dataclasses.replace(
            level, latency_s=level.latency_s * s_lat, sync_latency_s=level.sync_latency_s * s_lat,
            **{key: {c: v * s_lat for c, v in getattr(level, key).items()} for key in PER_COLLECTIVE_LATENCIES})
            for level in cluster.levels)
    if "overlap" in factors:
        changes["overlap"] = dataclasses.replace(cluster.overlap, ep=factors["overlap"], dp=factors["overlap"])
    if "straggler_cv" in factors:
        changes["straggler"] = dataclasses.replace(cluster.straggler, cv=factors["straggler_cv"])
    return dataclasses.replace(cluster, **changes)


def initial_factors(cluster: ClusterSpec) -> dict[str, float]:
    return {"efficiency_scale": 1.0, "launch_latency_s": cluster.accelerator.launch_latency_s, "collective_latency_scale": 1.0,
            "overlap": float(cluster.overlap.ep), "straggler_cv": cluster.straggler.cv}


def predict(cluster: ClusterSpec, runs: list[Run], factors: Optional[dict[str, float]] = None) -> np.ndarray:
    """Predicted step time of each run (perfmodel.evaluate, one vectorised call)."""
    from perfmodel import evaluate

    spec = apply_factors(cluster, factors or {})
    result = evaluate(ArchBatch.stack([r.arch for r in runs]), LayoutBatch.stack([r.layout for r in runs]), spec,
                      devices=np.array([r.devices for r in runs], dtype=float))
    return np.asarray(result.step_time_s, dtype=float)


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured))


def identifiable(cluster: ClusterSpec, runs: list[Run], start: dict[str, float]) -> tuple[list[str], dict[str, str]]:
    """Factors whose range moves some prediction by > SENSITIVITY, most influential first (at most runs - 1)."""
    base = np.log(predict(cluster, runs, start))
    effect: dict[str, float] = {}
    for name in FACTORS:
        low, high = BOUNDS[name]
        moved = [np.max(np.abs(np.log(predict(cluster, runs, {**start, name: v})) - base)) for v in (low, high)]
        effect[name] = float(max(moved))
    chosen = sorted((n for n in FACTORS if effect[n] > SENSITIVITY), key=lambda n: -effect[n])[:max(len(runs) - 1, 1)]
    skipped = {n: (f"moves no prediction by more than {SENSITIVITY:.1%} over its range on these runs" if effect[n] <= SENSITIVITY
                   else "fewer runs than factors: the least influential are kept fixed") for n in FACTORS if n not in chosen}
    return chosen, skipped


def fit_factors(cluster: ClusterSpec, runs: list[Run], names: list[str], start: dict[str, float]) -> dict[str, float]:
    """Least squares on log(predicted / measured) over `names`, the others held at `start`.

    Scale factors (LOG_FACTORS) are searched as log10 values; multi-start from
    the best grid points (GRID) and the current values. The best fit then starts a
    maximum a posteriori fit: each factor's departure from `start`, in prior_sd units, through
    the Cauchy prior (`cauchy_residual`), weighed against the runs' residual scale (estimated
    from that fit, as the sd of a Gaussian likelihood).
    """
    import itertools

    if not names:
        return dict(start)
    measured = np.array([r.measured_step_time_s for r in runs])

    def to_u(name: str, value: float) -> float:
        return float(np.log10(max(value, LOG_FACTORS[name]))) if name in LOG_FACTORS else float(value)

    def from_u(name: str, u: float) -> float:
        return float(10.0 ** u) if name in LOG_FACTORS else float(u)

    lower = np.array([to_u(n, max(BOUNDS[n][0], LOG_FACTORS.get(n, BOUNDS[n][0]))) for n in names])
    upper = np.array([to_u(n, BOUNDS[n][1]) for n in names])

    def residuals(u: np.ndarray) -> np.ndarray:
        values = {n: from_u(n, x) for n, x in zip(names, u)}
        return np.log(predict(cluster, runs, {**start, **values}) / measured)

    grid = [np.array([to_u(n, start[n]) for n in names])]
    grid += [np.array([to_u(n, v) for n, v in zip(names, p)]) for p in itertools.product(*(GRID[n] for n in names))]
    grid = [np.clip(u, lower, upper) for u in grid]
    costs = [float(np.sum(residuals(u) ** 2)) for u in grid]
    best = None
    for index in np.argsort(costs)[:STARTS]:
        result = least_squares(residuals, grid[index], bounds=(lower, upper), x_scale=np.maximum(upper - lower, 1e-9),
                               diff_step=1e-3, method="trf")
        if best is None or result.cost < best.cost:
            best = result
    assert best is not None
    # MAP step: the runs' residual scale (in-sample, for the fitted degrees of freedom) against the prior.
    run_log_sd = max(math.sqrt(2.0 * best.cost / max(len(runs) - len(names), 1)), RUN_LOG_SD_FLOOR)
    natural = np.array([math.log(10.0) if n in LOG_FACTORS else 1.0 for n in names])
    centre = np.array([to_u(n, start[n]) for n in names]) * natural
    prior_sds = np.array([prior_sd(n) for n in names])

    def posterior(u: np.ndarray) -> np.ndarray:
        return np.concatenate([residuals(u), run_log_sd * cauchy_residual((u * natural - centre) / prior_sds)])

    result = least_squares(posterior, np.clip(best.x, lower, upper), bounds=(lower, upper),
                           x_scale=np.maximum(upper - lower, 1e-9), diff_step=1e-3, method="trf")
    return {**start, **{n: from_u(n, u) for n, u in zip(names, result.x)}}


def cauchy_residual(z: np.ndarray) -> np.ndarray:
    """Signed prior residual for a departure of z prior standard deviations: its square,
    2 log(1 + z^2 / 2), is twice the negative log density of a Cauchy prior of scale sqrt(2) sd
    (as z^2 is a Gaussian's), so it is z^2 near the calibrated value but a factor the runs put
    10 sd away costs 7.8, not 100: a calibration is usually right to its repeatability and
    sometimes far off (a loaded machine measured 4-5x faster than it trained), and then the
    runs must win."""
    return np.sign(z) * np.sqrt(2.0 * np.log1p(0.5 * z * z))


def prior_sd(name: str) -> float:
    """Prior standard deviation of a factor, in its fitted unit (natural log for scale factors)."""
    return PRIOR_LOG_SD if name in LOG_FACTORS else 0.5 * (BOUNDS[name][1] - BOUNDS[name][0])


@dataclass(frozen=True)
class FromRunsResult:
    output: Path
    runs: int
    factors: dict[str, float]
    fitted: list[str]
    fixed: dict[str, str]
    mape: dict[str, float]
    table: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        return {"output": str(self.output), "runs": self.runs, "factors": self.factors, "fitted": self.fitted,
                "fixed": self.fixed, "mape": self.mape, "per_run": self.table}


def refit_from_runs(runs_dir: Path, cluster: str, output: Path) -> FromRunsResult:
    """Fit the correction factors of `cluster` to the runs in `runs_dir`; write the refitted cluster to `output`."""
    output = Path(output)
    if output.suffix not in (".yaml", ".yml"):
        raise InputError(f"-o {output}: the refitted cluster must be a .yaml file")
    spec = load_cluster(cluster)
    runs = discover_runs(Path(runs_dir))
    measured = np.array([r.measured_step_time_s for r in runs])
    start = initial_factors(spec)
    before = predict(spec, runs, start)
    names, fixed = identifiable(spec, runs, start)
    factors = fit_factors(spec, runs, names, start)
    after = predict(spec, runs, factors)
    loo = np.full(len(runs), np.nan)
    if len(runs) >= 2:
        for i in range(len(runs)):
            rest = [r for j, r in enumerate(runs) if j != i]
            held = fit_factors(spec, rest, names[:max(len(rest) - 1, 1)] if names else [], start)
            loo[i] = predict(spec, [runs[i]], held)[0]
    scores = {"before": mape(before, measured), "after_in_sample": mape(after, measured)}
    if len(runs) >= 2:
        scores["after_leave_one_run_out"] = mape(loo, measured)
    table = [{"run": r.name, "devices": r.devices, "layout": _layout_text(r.layout), "steps_used": r.steps_used,
              "measured_step_time_s": _sig(r.measured_step_time_s), "predicted_before_s": _sig(before[i]),
              "predicted_after_s": _sig(after[i]),
              "predicted_leave_one_out_s": None if math.isnan(loo[i]) else _sig(loo[i])} for i, r in enumerate(runs)]
    mismatched = sorted({r.cluster_name for r in runs if r.cluster_name and r.cluster_name not in (spec.name, cluster)})
    section = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "runs_dir": str(runs_dir), "runs": len(runs), "fitted": {n: _sig(factors[n]) for n in names},
               "fixed": fixed, "start": {n: _sig(v) for n, v in start.items()},
               "mape": {k: round(v, 4) for k, v in scores.items()}, "per_run": table,
               "method": ("scipy.optimize.least_squares on log(predicted/measured) step time, then with a Cauchy prior "
                          f"around the calibrated factors (scale factors: width ln {math.exp(PRIOR_LOG_SD):g}); leave-one-run-out CV")}
    if mismatched:
        section["note"] = f"runs recorded cluster(s) {', '.join(mismatched)}; refitted against {spec.name}"
    data = _write(cluster, factors, names, section, output)
    spec_from_dict(ClusterSpec, data, source=str(output))
    return FromRunsResult(output=output, runs=len(runs), factors={n: factors[n] for n in names}, fitted=names,
                          fixed=fixed, mape=scores, table=table)


def _write(cluster: str, factors: dict[str, float], names: list[str], section: dict[str, Any], output: Path) -> dict[str, Any]:
    path = resolve_cluster_path(cluster)
    data = read_yaml(path)
    acc = data["accelerator"]
    stamp = f"fitted by mosaic calibrate --from-runs ({section['runs']} runs, {section['date']}), see calibration.from_runs"
    if "efficiency_scale" in names:
        s = factors["efficiency_scale"]
        scaled = to_mapping(scaled_kernels(load_cluster(str(path)).accelerator.kernels, s))
        note = f"; scaled x {s:.4g} ({stamp})"
        for record in _figure_records(scaled):
            for key in (*E_MAX_FIELDS, "fraction"):
                if key in record and isinstance(record[key], dict):
                    record[key] = {c: float(f"{v:.4g}") for c, v in record[key].items()}
                elif key in record:
                    record[key] = float(f"{record[key]:.4g}")
            record["source"] = f"{record.get('source', '')}{note}"
        acc["kernels"] = scaled
    if "launch_latency_s" in names:
        acc["launch_latency_s"] = float(f"{factors['launch_latency_s']:.4g}")
        acc.setdefault("sources", {})["launch_latency_s"] = stamp
    if "collective_latency_scale" in names:
        s_lat = factors["collective_latency_scale"]
        for level in data["levels"]:
            level["latency_s"] = float(f"{float(level['latency_s']) * s_lat:.4g}")
            if "sync_latency_s" in level:
                level["sync_latency_s"] = float(f"{float(level['sync_latency_s']) * s_lat:.4g}")
            for key in PER_COLLECTIVE_LATENCIES:
                if level.get(key):
                    level[key] = {c: float(f"{float(v) * s_lat:.4g}") for c, v in level[key].items()}
            level["source"] = f"{level.get('source', '')}; latency scaled by {s_lat:.4g} {stamp}".lstrip("; ")
    if "overlap" in names:
        overlap = data.setdefault("overlap", {})
        overlap["ep"] = overlap["dp"] = float(f"{factors['overlap']:.4g}")
        overlap["source"] = f"ep and dp: {stamp}"
    if "straggler_cv" in names:
        straggler = data.setdefault("straggler", {})
        straggler["cv"] = float(f"{factors['straggler_cv']:.4g}")
        straggler["source"] = stamp
    calibration = data.get("calibration") or {}
    calibration["from_runs"] = section
    data["calibration"] = calibration
    text = yaml.safe_dump(data, sort_keys=False, width=100)
    spec_from_dict(ClusterSpec, yaml.safe_load(text), source=str(output))  # validate before writing
    write_text_atomic(output, text)
    return data


def _figure_records(kernels: dict[str, Any]) -> list[dict[str, Any]]:
    """The figure records of a kernels mapping (each has a source)."""
    out = [*kernels["gemm"].values(), *kernels["attention"].values(), kernels["memory"]]
    for phases in kernels["grouped_gemm"].values():
        out += list(phases.values())
    return out


def _layout_text(layout: ParallelLayout) -> str:
    return ",".join(f"{k}={getattr(layout, k)}" for k in ("tp", "pp", "ep", "dp", "dp_flavor", "mbs", "gbs", "precision"))


def _sig(value: float) -> float:
    return float(f"{float(value):.5g}")


__all__ = ["FACTORS", "PRIOR_LOG_SD", "FromRunsResult", "Run", "apply_factors", "scaled_kernels", "discover_runs", "fit_factors", "identifiable", "initial_factors",
           "load_run", "predict", "prior_sd", "refit_from_runs", "warm_up_steps"]

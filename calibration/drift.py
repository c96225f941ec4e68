"""A calibrated cluster kept in step with a machine whose speed drifts (a shared host).

A calibration is one moment of the machine; runs made minutes later meet another. Two ways
to fold later measurements into the calibrated cluster file, each writing a new file:

- `interleaved_cluster`: short probes of the host-bound figures (`drift_probe`, ~1 s; and
  optionally a 2-rank gloo all-reduce, `collective_probe`, ~5 s) taken between the runs. With
  m_k = mean over the probes of figure k and c_k its calibrated value:
  launch_latency_s = m_launch, dtensor_op_latency_s = m_dtensor; the checkpoint costs (Python
  and autograd work, like an eager op) x m_launch / c_launch; the fp32 compute figures (the e_max
  of the fp32 GEMM, grouped GEMM and attention: one core's arithmetic) x r_gemm = m_gemm /
  (peak_fp32 x eff_fp32(n, n, n)), capped at 1; with collective probes every
  level's latency_s, sync_latency_s and per-collective latencies x `collective_latency_ratio`. Means, not medians: the
  measured step time is a mean (`calibration.from_runs.measured_step_time_s`) and a step's
  host time is linear in its per-op cost, so the mean step over states that come and go is
  priced by the mean per-op cost over them.
- `bracketed_cluster`: two full calibrations, before and after the runs, merged figure by
  figure by the geometric mean sqrt(a b) (`geometric_mean_figures`).

The benchmark that uses them, and how they did, are in benchmarks/fidelity.py and
docs/validation.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfmodel.errors import MosaicRuntimeError

PROBE_GEMM_SIZE = 128
"""Side n of the square fp32 GEMM a drift probe times (2 n^3 FLOPs): the size class of the CPU
trainer's tiny models' matmuls (64-256 wide), on the calibration's cold-operand loop
(calibration.kernels)."""

PROBE_COLLECTIVE_BYTES = 16384
"""All-reduce a collective probe times [bytes]: the size of the tiny models' tensor-parallel
activations (2 x 32 tokens x 64 wide x 4 bytes fp32), latency-bound on gloo."""


@dataclass(frozen=True)
class HostProbe:
    """The host-bound figures of a cpu machine at one moment, measured as `mosaic calibrate` does."""

    launch_latency_s: float
    """Seconds per eager op with autograd (calibration.eager_ops.eager_op_seconds)."""
    dtensor_op_latency_s: float
    """Seconds a DTensor op adds (median of 3 calibration.eager_ops.dtensor_op_samples)."""
    gemm_flops_per_s: float
    """Rate of a cold square fp32 GEMM of PROBE_GEMM_SIZE (calibration.kernels)."""


def drift_probe() -> HostProbe:
    """The host-bound figures of this machine now, on one thread (about 1 s)."""
    import numpy as np
    import torch

    from calibration.eager_ops import dtensor_op_samples, eager_op_seconds
    from calibration.kernels import KernelPoint, prepare_point
    from calibration.timing import Budget, time_call

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = PROBE_GEMM_SIZE
        gemm = prepare_point(KernelPoint("gemm", "fp32", {"M": n, "N": n, "K": n}), torch.device("cpu"))
        gemm_s = time_call(gemm.fn, torch.device("cpu"), Budget(warmup=2, min_repeats=10, max_repeats=60,
                                                                max_seconds=0.15)).median_s
        return HostProbe(launch_latency_s=eager_op_seconds(repeats=15, max_seconds=0.5)[0],
                         dtensor_op_latency_s=float(np.median(dtensor_op_samples(3)[0])),
                         gemm_flops_per_s=gemm.flops / gemm_s)
    finally:
        torch.set_num_threads(threads)


def collective_probe(folder: Path) -> float:
    """Seconds of one PROBE_COLLECTIVE_BYTES all-reduce over 2 gloo ranks after an eager compute
    gap, as `mosaic calibrate` times it (calibration.collectives, quick repeats; the median of
    repeats that each batch calls for about one trainer step): what a synchronous trainer pays
    per collective. About 5 s, most of it starting two ranks (work files under `folder`).
    Raises MosaicRuntimeError when the launch fails or yields no after-compute row."""
    from calibration.collectives import AFTER_COMPUTE, run_collectives_subprocess

    launched = run_collectives_subprocess(2, "cpu", True, ["host"], [2], folder, stall_s=60.0, total_timeout_s=120.0,
                                          kinds=["all_reduce"], sizes_bytes=[PROBE_COLLECTIVE_BYTES])
    timed = [r.median_s for r in launched.rows if r.impl.endswith(AFTER_COMPUTE)]
    if launched.error is not None or not timed:
        raise MosaicRuntimeError(f"collective probe failed: {launched.error or 'no after-compute row'}")
    return float(timed[0])


def collective_latency_ratio(cluster: Any, probe_s: float) -> float:
    """Factor r on every fabric level's latency_s and sync_latency_s that makes the model's
    PROBE_COLLECTIVE_BYTES all-reduce over 2 ranks take `probe_s` [s]: with perfmodel.comm's
    t = S x slope + latency, r = (probe_s - S x slope) / latency; the same scale
    `mosaic calibrate --from-runs` fits (collective_latency_scale), floored at its lower bound."""
    from calibration.from_runs import BOUNDS
    from perfmodel.comm import collective_coefficients

    slope, latency = collective_coefficients(cluster, "all_reduce", 2, 1)
    ratio = (probe_s - PROBE_COLLECTIVE_BYTES * float(slope)) / float(latency)
    return max(ratio, BOUNDS["collective_latency_scale"][0])


def calibrated_gemm_flops_per_s(cluster: Any) -> float:
    """FLOP/s the cluster's fp32 GEMM figure gives the probe's square GEMM of PROBE_GEMM_SIZE:
    peak_fp32 x e_max s(n) s(n) s(n) (`perfmodel.kernels.forms.gemm_efficiency`)."""
    from perfmodel.kernels.forms import gemm_efficiency

    acc = cluster.accelerator
    g = acc.kernels.gemm[acc.kernels.precision("gemm", "fp32")]
    n = PROBE_GEMM_SIZE
    return acc.peak("fp32") * float(gemm_efficiency(n, n, n, g.e_max, g.m_half, g.n_half, g.k_half))


def interleaved_cluster(calibrated: Path, probes: Sequence[HostProbe], out: Path,
                        collective_probes_s: Sequence[float] = ()) -> Path:
    """Write to `out` the cluster `calibrated` (a file or bundled name) with its host-bound
    figures replaced by the means of `probes` and, given `collective_probes_s` [s]
    (`collective_probe`), its fabric latencies scaled by their mean (formulas: module doc).
    Every changed figure's source says so. Returns `out`."""
    import numpy as np

    from perfmodel.clusters import load_cluster, resolve_cluster_path
    from perfmodel.specs.strict import read_yaml, write_yaml_atomic

    if not probes:
        raise ValueError("probes: at least one HostProbe is needed")
    path = resolve_cluster_path(str(calibrated))
    data = read_yaml(path)
    base = load_cluster(str(path))
    accelerator = base.accelerator
    mean_launch_s = float(np.mean([p.launch_latency_s for p in probes]))
    mean_dtensor_s = float(np.mean([p.dtensor_op_latency_s for p in probes]))
    mean_gemm_flops_per_s = float(np.mean([p.gemm_flops_per_s for p in probes]))
    acc = data["accelerator"]
    sources = acc.setdefault("sources", {})
    basis = f"mean of {len(probes)} drift probes (calibration.drift.drift_probe); base: {calibrated}"
    for key, value in (("launch_latency_s", mean_launch_s), ("dtensor_op_latency_s", mean_dtensor_s)):
        acc[key] = float(f"{value:.4g}")
        sources[key] = basis
    host_ratio = mean_launch_s / accelerator.launch_latency_s
    for key in ("checkpoint_region_latency_s", "checkpoint_saved_tensor_latency_s"):
        acc[key] = float(f"{getattr(accelerator, key) * host_ratio:.4g}")
        sources[key] = f"calibrated figure x {host_ratio:.3f}, the per-op cost's drift ({basis})"
    gemm_ratio = mean_gemm_flops_per_s / calibrated_gemm_flops_per_s(base)
    kernels = acc["kernels"]
    if "fp32" in kernels["gemm"]:  # the figures the probe measured (a base without fp32 keeps what it has)
        note = f"; scaled x {gemm_ratio:.3f}, a cold {PROBE_GEMM_SIZE}^3 fp32 GEMM's drift ({basis})"
        records = [kernels["gemm"]["fp32"], *kernels["grouped_gemm"].get("fp32", {}).values()]
        records += [kernels["attention"]["fp32"]] if "fp32" in kernels["attention"] else []
        for record in records:
            for key in ("e_max", "fwd_e_max", "bwd_e_max"):
                if key in record:
                    record[key] = float(f"{min(1.0, float(record[key]) * gemm_ratio):.4g}")
            record["source"] = f"{record.get('source', '')}{note}"
    if collective_probes_s:
        ratio = collective_latency_ratio(base, float(np.mean(collective_probes_s)))
        note = (f"; x {ratio:.3f}, a {PROBE_COLLECTIVE_BYTES}-byte 2-rank all-reduce's drift (mean of "
                f"{len(collective_probes_s)} collective probes, calibration.drift.collective_probe)")
        from calibration.from_runs import PER_COLLECTIVE_LATENCIES

        for level in data["levels"]:
            for key in ("latency_s", "sync_latency_s"):
                if level.get(key) is not None:
                    level[key] = float(f"{float(level[key]) * ratio:.4g}")
            for key in PER_COLLECTIVE_LATENCIES:
                if level.get(key):
                    level[key] = {c: float(f"{float(v) * ratio:.4g}") for c, v in level[key].items()}
            level["source"] = f"{level.get('source', '')}{note}"
    write_yaml_atomic(out, data)
    return out


def geometric_mean_figures(first: Any, second: Any) -> Any:
    """Two calibrations of one machine merged figure by figure: sqrt(a b) of two positive
    numbers ((a + b) / 2 otherwise), 4 significant digits; lists element by element, mappings key
    by key; a curve whose `sizes` differ, text, flags and counts (integers: rows, devices) are
    kept from `first`."""
    if isinstance(first, bool) or isinstance(second, bool) or (isinstance(first, int) and isinstance(second, int)):
        return first
    if isinstance(first, (int, float)) and isinstance(second, (int, float)):
        if first == second:
            return first
        mean = math.sqrt(first * second) if first > 0 and second > 0 else (first + second) / 2
        return float(f"{mean:.4g}")
    if isinstance(first, list) and isinstance(second, list) and len(first) == len(second):
        return [geometric_mean_figures(a, b) for a, b in zip(first, second)]
    if isinstance(first, dict) and isinstance(second, dict):
        if "sizes" in first and first.get("sizes") != second.get("sizes"):
            return first
        return {k: geometric_mean_figures(v, second[k]) if k in second else v for k, v in first.items()}
    return first


def bracketed_cluster(before: Path, after: Path, out: Path) -> Path:
    """Write to `out` the calibrated cluster `before` with its accelerator and fabric levels the
    geometric mean (`geometric_mean_figures`) of `before` and `after`, two calibrations of the
    same machine; provenance is `before`'s, and `calibration.bracketed` says how it was made.
    Returns `out`."""
    from perfmodel.specs.strict import read_yaml, write_yaml_atomic

    first, second = read_yaml(before), read_yaml(after)
    merged = dict(first)
    for section in ("accelerator", "levels"):
        merged[section] = geometric_mean_figures(first[section], second[section])
    calibration = dict(merged.get("calibration") or {})
    calibration["bracketed"] = (f"accelerator and levels: geometric mean, figure by figure, of {before.name} (before "
                                f"the trainer runs) and {after.name} (after them); calibration.drift.bracketed_cluster")
    merged["calibration"] = calibration
    write_yaml_atomic(out, merged)
    return out


__all__ = ["PROBE_COLLECTIVE_BYTES", "PROBE_GEMM_SIZE", "HostProbe", "bracketed_cluster", "calibrated_gemm_flops_per_s",
           "collective_latency_ratio",
           "collective_probe", "drift_probe", "geometric_mean_figures", "interleaved_cluster"]

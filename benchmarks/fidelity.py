"""Fidelity of the whole pipeline: calibrate, predict, train, compare, refit.

    python benchmarks/fidelity.py --device cpu [--steps 30] [--out-dir benchmarks/results]

1. Calibrate this machine (`mosaic calibrate --quick`; or `--cluster FILE` to reuse a
   calibrated cluster). `--recalibrate` calibrates again after the trainer runs and predicts
   with the geometric mean of the two, figure by figure (`bracketed_cluster`): the speed of a
   shared machine drifts within minutes and the runs sit between the two. Off by default: in
   its one trial (docs/validation.md) the first calibration alone predicted better.
   On cpu the machine's host-bound figures are probed again before each trainer run and after
   the last (`drift_probe`, about 1 s: the per-op cost of an eager op with autograd, the cost a
   DTensor op adds, a cold 128^3 fp32 GEMM's rate) and their means over the whole benchmark
   replace the calibrated figures (`interleaved_cluster`; `--no-interleave` keeps the
   calibration alone): other jobs on a shared machine change its speed within minutes, and
   both sides of the comparison must see the same machine. With `--probe-collectives`, before
   each round's multi-rank runs and after the last run a 2-rank gloo all-reduce is timed the
   same way (`collective_probe`, about 5 s) and the mean scales the fabric's latencies (off by
   default: in its one trial it moved the latencies the wrong way, docs/validation.md). The
   MAPE with the calibration alone is reported beside it.
2. For each configuration (tiny MoE and dense models on 1, 2 and 4 ranks covering dp, ep,
   tp, pp, mbs and recompute) predict the step time with `perfmodel.evaluate` on the
   calibrated cluster, and run the bundled trainer (`mosaic train`, torchrun + gloo on cpu,
   one thread per rank) in `--rounds` rounds through all configurations: the first of
   `--steps / --rounds` steps, the later ones stepping for at least `--round-seconds` (steps
   from the first round's median step time; each round a fresh `mosaic train`, its metrics
   after its first `ROUND_WARMUP_STEPS` appended to the first round's metrics.jsonl). The measured step time
   is the mean after warm-up, the same definition `mosaic calibrate --from-runs` uses
   (`calibration.from_runs.measured_step_time_s`; `load_run` drops the first round's warm-up).
   On a shared machine the speed changes within seconds (other jobs; one process's 2-second
   windows measured 16-27 ms for the same step): several rounds of a couple of seconds each let
   the mean span those states, as the probes' mean does on the model's side.
3. Report per-configuration error (predicted/measured - 1), MAPE, max |error| and Kendall
   tau of the ranking (scipy.stats.kendalltau), how far each configuration's round means
   disagree (max/min), and the standard error of each measured step time (bootstrap over rounds)
   with the MAPE a perfect model would show from that noise alone: a floor under any model's
   error (the calibration's own run-to-run noise comes on top).
4. Refit the cluster from these runs (`mosaic calibrate --from-runs`) and report its
   leave-one-run-out MAPE (each run predicted by factors fitted without it).

Writes `<out-dir>/fidelity_<device>.json` and `fidelity_<device>.png` (predicted vs measured)
and keeps the run folders and cluster files under `<out-dir>/fidelity_<device>/`. The last
two printed lines are `MAPE before refit: X%` and `MAPE after refit (leave-one-out): Y%`.

On cuda/npu only the single-device configurations run (one GPU). `--configs smoke` runs two
small configurations (the test's reduced version).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_MOE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, seq_len=32,
                n_experts=8, top_k=2, n_shared_experts=1, d_expert=32, d_ff_dense=128, n_dense_layers=1,
                ffn_ratio=4.0, gated_ffn=True, tie_embeddings=False)
"""examples/tiny_moe.yaml: 2 layers (the first dense), 8 experts of width 32, top-2, one shared expert."""
TINY_DENSE = dict(TINY_MOE, n_experts=0, top_k=0, n_shared_experts=0, d_expert=0, n_dense_layers=2)
"""The same trunk with a dense FFN in both layers."""
WIDE_MOE = dict(TINY_MOE, d_model=128, head_dim=32, d_expert=64, d_ff_dense=256, seq_len=64)
"""A wider MoE (4x the GEMM FLOPs per token), so compute is not negligible beside dispatch."""
WIDE_DENSE = dict(WIDE_MOE, n_experts=0, top_k=0, n_shared_experts=0, d_expert=0, n_dense_layers=2)
"""The wide trunk with a dense FFN (256 wide) in both layers: the most GEMM-bound configuration.
With wide_moe it makes two runs that pin the GEMM efficiency, so the leave-one-out refit still
sees compute when one of them is left out (with one, the dispatch-bound rest cannot tell GEMM
efficiency from per-op cost)."""

MODELS = {"moe": TINY_MOE, "dense": TINY_DENSE, "wide_moe": WIDE_MOE, "wide_dense": WIDE_DENSE}

CONFIGS: list[tuple[str, str, str, int]] = [
    # (name, model, layout, ranks)
    ("moe_1r_mbs2", "moe", "mbs=2,gbs=4", 1),
    ("moe_1r_mbs1", "moe", "mbs=1,gbs=4", 1),
    ("moe_1r_mbs4", "moe", "mbs=4,gbs=8", 1),
    ("moe_1r_full", "moe", "mbs=2,gbs=4,recompute=full", 1),
    ("moe_1r_selective", "moe", "mbs=2,gbs=4,recompute=selective", 1),
    ("dense_1r_mbs2", "dense", "mbs=2,gbs=4", 1),
    ("wide_moe_1r_mbs2", "wide_moe", "mbs=2,gbs=4", 1),
    ("wide_dense_1r_mbs2", "wide_dense", "mbs=2,gbs=4", 1),
    ("dense_2r_dp2", "dense", "dp=2,mbs=2,gbs=8,dp_flavor=ddp", 2),
    ("moe_2r_dp2_ep2", "moe", "dp=2,ep=2,mbs=2,gbs=8,dp_flavor=ddp", 2),
    ("moe_2r_tp2", "moe", "tp=2,mbs=2,gbs=4", 2),
    ("dense_2r_pp2", "dense", "pp=2,mbs=1,gbs=4", 2),
    ("moe_4r_dp4_ep4", "moe", "dp=4,ep=4,mbs=1,gbs=8,dp_flavor=ddp", 4),
    ("dense_4r_dp2_tp2", "dense", "dp=2,tp=2,mbs=2,gbs=8,dp_flavor=ddp", 4),
]
"""Data parallel as DDP: the trainer's zero1/fsdp are FSDP2 (DTensor parameters, per-block
all-gathers and reduce-scatters), not the Megatron distributed optimizer the model prices."""
SMOKE = ["moe_1r_mbs2", "dense_1r_mbs2"]
ROUND_WARMUP_STEPS = 2
"""Steps dropped at the start of each later round: a fresh process group, allocator and first
calls (multi-rank runs take 2-4 steps to settle, measured on the 2-core test machine)."""


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def mosaic(*args: str, capture: bool = False) -> str:
    """Run the `mosaic` CLI of this interpreter; raises with its stderr on failure."""
    command = [sys.executable, "-m", "mosaic.cli.app", *args]
    done = subprocess.run(command, env=_env(), stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command[2:])} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout if capture else ""


def calibrate(device: str, folder: Path, base: str | None, name: str = "calibrated.yaml") -> Path:
    """`mosaic calibrate --quick` on top of `base` (cpu: cpu_local; cuda: the bundled cluster of the GPU's name)."""
    out = folder / name
    if base is None and device != "cpu":
        from mosaic.cli.train import _default_cluster

        base = _default_cluster(device)
    t0 = time.perf_counter()
    mosaic("calibrate", "--device", device, "--quick", "--nproc", "2" if device == "cpu" else "1", "-o", str(out),
           *(("--cluster", base) if base else ()))
    print(f"calibrated {device} in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
    return out


def train(name: str, model: str, layout: str, ranks: int, steps: int, device: str, cluster: Path, runs: Path,
          round_index: int = 0) -> float:
    """One `mosaic train` run of `steps` steps; round 0 starts runs/NAME, later rounds append their
    metrics (steps renumbered after the earlier rounds') to runs/NAME/metrics.jsonl."""
    import yaml

    from perfmodel.specs.strict import write_text_atomic

    folder = runs / name
    out = folder if round_index == 0 else runs / f"{name}.round{round_index}"
    for stale in (out, *(() if round_index else runs.glob(f"{name}.round*"))):
        if stale.exists():
            shutil.rmtree(stale)
    model_file = runs / f"{name}.model.yaml"
    write_text_atomic(model_file, yaml.safe_dump({"version": 1, **MODELS[model]}, sort_keys=False))
    t0 = time.perf_counter()
    mosaic("train", "--model", str(model_file), "--layout", layout, "--nproc", str(ranks), "--steps", str(steps),
           "--out", str(out), "--device", device, "--cluster", str(cluster), "--no-progress",
           "--checkpoint-every", str(10 * steps))
    seconds = time.perf_counter() - t0
    model_file.unlink()
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if round_index:
        pooled = folder / "metrics.jsonl"
        done = len(pooled.read_text().splitlines())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows = rows[ROUND_WARMUP_STEPS:] if len(rows) > ROUND_WARMUP_STEPS else rows[-1:]
        text = "".join(json.dumps({**row, "step": done + i + 1, "round": round_index}) + "\n" for i, row in enumerate(rows))
        write_text_atomic(pooled, pooled.read_text() + text)
        shutil.rmtree(out)
    return seconds


MAX_STEPS_PER_ROUND = 400
"""Cap on `steps_for_seconds`: a configuration far faster than its first round must not run for minutes."""


def steps_for_seconds(step_time_s: float, at_least: int, seconds: float) -> int:
    """Steps of a round that last about `seconds` at `step_time_s` (the first round's median),
    plus the ROUND_WARMUP_STEPS that `train` drops; never fewer than `at_least`, at most
    MAX_STEPS_PER_ROUND."""
    if not (step_time_s > 0 and math.isfinite(step_time_s)):
        return at_least
    wanted = math.ceil(seconds / step_time_s) + ROUND_WARMUP_STEPS
    return int(min(MAX_STEPS_PER_ROUND, max(at_least, wanted)))


def round_times(folder: Path) -> list[list[float]]:
    """Step times of each round of a pooled run, warm-up dropped as `load_run` does (the first
    round's leading steps; later rounds were appended without theirs)."""
    from calibration.from_runs import first_process_steps, warm_up_steps

    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    skip = warm_up_steps(first_process_steps(rows))
    by_round: dict[int, list[float]] = {}
    for i, row in enumerate(rows):
        if i >= skip or "round" in row:
            by_round.setdefault(int(row.get("round", 0)), []).append(float(row["step_time_s"]))
    return [times for _, times in sorted(by_round.items())]


def bootstrap_relative_se(rounds: list[list[float]], resamples: int = 2000, seed: int = 0) -> float:
    """Relative standard error of the pooled measured step time (`measured_step_time_s`, the
    mean), by the bootstrap over rounds (Efron & Tibshirani 1993, ch. 6; rounds, not steps, are
    the independent samples here: a round's steps share the machine's state): the sd of the
    pooled statistic over rounds resampled with replacement, over the pooled statistic. NaN for
    a single round."""
    import numpy as np

    from calibration.from_runs import measured_step_time_s

    if len(rounds) < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(rounds), size=(resamples, len(rounds)))
    resampled = [measured_step_time_s(np.concatenate([rounds[i] for i in pick])) for pick in picks]
    return float(np.std(resampled, ddof=1) / measured_step_time_s(np.concatenate(rounds)))


def geometric_mean_figures(first: object, second: object) -> object:
    """Two calibrations of one machine merged figure by figure: the geometric mean of two positive
    numbers (the arithmetic mean otherwise), lists element by element, mappings key by key; a
    curve whose `sizes` differ, text and flags are kept from `first`."""
    if isinstance(first, bool) or isinstance(second, bool):
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


def bracketed_cluster(before: Path, after: Path, folder: Path) -> Path:
    """The machine's figures as the geometric mean of a calibration before and one after the runs
    (accelerator and fabric levels; provenance from `before`): on a shared machine the speed
    drifts within minutes, and the runs sit between the two."""
    from perfmodel.specs.strict import read_yaml, write_yaml_atomic

    first, second = read_yaml(before), read_yaml(after)
    merged = dict(first)
    for section in ("accelerator", "levels"):
        merged[section] = geometric_mean_figures(first[section], second[section])
    calibration = dict(merged.get("calibration") or {})
    calibration["bracketed"] = (f"accelerator and levels: geometric mean, figure by figure, of {before.name} (before "
                                f"the trainer runs) and {after.name} (after them); benchmarks/fidelity.py")
    merged["calibration"] = calibration
    out = folder / "calibrated_bracketed.yaml"
    write_yaml_atomic(out, merged)
    return out


PROBE_GEMM_SIZE = 128
"""Side of the square fp32 GEMM timed between the runs: the size class of the tiny models'
matmuls (64-256 wide), on the calibration's cold-operand loop (calibration.kernels)."""


def drift_probe() -> dict[str, float]:
    """The host-bound figures of this machine now, as `mosaic calibrate` measures them on cpu
    (one thread): seconds per eager op with autograd (calibration.eager_ops.eager_op_seconds),
    seconds a DTensor op adds (dtensor_op_samples, median of 3) and the rate of a cold square
    fp32 GEMM of PROBE_GEMM_SIZE (calibration.kernels). About 1 s in all."""
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
        return {"launch_latency_s": eager_op_seconds(repeats=15, max_seconds=0.5)[0],
                "dtensor_op_latency_s": float(np.median(dtensor_op_samples(3)[0])),
                "gemm_flops_per_s": gemm.flops / gemm_s}
    finally:
        torch.set_num_threads(threads)


PROBE_COLLECTIVE_BYTES = 16384
"""All-reduce re-timed between the runs: the size of the tiny models' tensor-parallel activations
(2 x 32 tokens x 64 wide, fp32), latency-bound on gloo (its bytes cost about 1% of its time)."""


def collective_probe(folder: Path) -> float | None:
    """Seconds of one PROBE_COLLECTIVE_BYTES all-reduce over 2 gloo ranks after an eager compute
    gap, as `mosaic calibrate` times it (calibration.collectives, quick repeats; the median of
    repeats that each batch calls for about one trainer step): what a synchronous trainer pays per
    collective. About 5 s, most of it starting two ranks; None (and a warning) if the launch fails."""
    from calibration.collectives import AFTER_COMPUTE, run_collectives_subprocess

    launched = run_collectives_subprocess(2, "cpu", True, ["host"], [2], folder, stall_s=60.0, total_timeout_s=120.0,
                                          kinds=["all_reduce"], sizes_bytes=[PROBE_COLLECTIVE_BYTES])
    timed = [r.median_s for r in launched.rows if r.impl.endswith(AFTER_COMPUTE)]
    if launched.error is not None or not timed:
        print(f"warning: collective probe failed ({launched.error or 'no after-compute row'}); "
              "the calibrated collective latencies are kept", file=sys.stderr)
        return None
    return float(timed[0])


def collective_latency_ratio(cluster: object, probe_s: float) -> float:
    """Factor on every fabric level's latency_s and sync_latency_s that makes the model's
    PROBE_COLLECTIVE_BYTES all-reduce over 2 ranks (perfmodel.comm: bytes x slope + latency
    steps + sync) take `probe_s`; the same scale `mosaic calibrate --from-runs` fits
    (collective_latency_scale), floored at its lower bound."""
    from calibration.from_runs import BOUNDS
    from perfmodel.comm import collective_coefficients

    slope, latency = collective_coefficients(cluster, "all_reduce", 2, 1)
    ratio = (probe_s - PROBE_COLLECTIVE_BYTES * float(slope)) / float(latency)
    return max(ratio, BOUNDS["collective_latency_scale"][0])


def interleaved_cluster(calibrated: Path, probes: list[dict[str, float]], folder: Path,
                        collective_probes_s: tuple[float, ...] = ()) -> Path:
    """The calibrated cluster with its host-bound figures as they were while the runs ran: the
    means of `drift_probe` taken before each run and after the last replace the per-op and
    DTensor-op costs; the checkpoint costs (Python and autograd work, like an eager op) scale by
    the per-op ratio (mean / calibrated); the fp32 GEMM efficiency curve scales by the probe
    GEMM's mean rate over the calibrated curve's rate at its size. Means, not medians, because
    the measured step time is a mean (`calibration.from_runs.measured_step_time_s`) and a step's
    host time is linear in its per-op cost: the mean step over states that come and go is priced
    by the mean per-op cost over them (a median per-op cost sits in whichever state most probes
    caught). Over four benchmark runs on the 2-core test machine the MAPE before refit was
    6.3-8.6% with means on both sides against 9.3-11.8% with medians on both.

    `collective_probes_s` (`collective_probe`, seconds): their mean scales every level's
    latencies (`collective_latency_ratio`): gloo's per-call cost on this VM moves as much as the
    per-op cost (the quick calibration's fitted latency 0.70-1.45 ms over six runs)."""
    import numpy as np

    from perfmodel.clusters import load_cluster, resolve_cluster_path
    from perfmodel.specs.strict import read_yaml, write_yaml_atomic

    path = resolve_cluster_path(str(calibrated))
    data = read_yaml(path)
    base = load_cluster(str(path))
    accelerator = base.accelerator
    means = {key: float(np.mean([p[key] for p in probes])) for key in probes[0]}
    acc = data["accelerator"]
    sources = acc.setdefault("sources", {})
    basis = (f"mean of {len(probes)} drift probes (benchmarks/fidelity.py drift_probe) taken before each "
             f"trainer run and after the last; base: {calibrated}")
    host_ratio = means["launch_latency_s"] / accelerator.launch_latency_s
    for key in ("launch_latency_s", "dtensor_op_latency_s"):
        acc[key] = float(f"{means[key]:.4g}")
        sources[key] = basis
    for key in ("checkpoint_region_latency_s", "checkpoint_saved_tensor_latency_s"):
        acc[key] = float(f"{getattr(accelerator, key) * host_ratio:.4g}")
        sources[key] = f"calibrated figure x {host_ratio:.3f}, the per-op cost's drift ({basis})"
    flops = 2.0 * PROBE_GEMM_SIZE ** 3
    calibrated_rate = accelerator.peak("fp32") * float(accelerator.compute_curve("fp32")(flops))
    gemm_ratio = means["gemm_flops_per_s"] / calibrated_rate
    curve = acc["compute_efficiency"].get("fp32")
    if curve is not None:  # the curve the probe measured (a base file without one keeps what it has)
        curve["values"] = [float(f"{min(1.0, v * gemm_ratio):.4g}") for v in curve["values"]]
        curve["source"] = (f"{curve.get('source', '')}; scaled x {gemm_ratio:.3f}, a cold {PROBE_GEMM_SIZE}^3 GEMM's "
                           f"drift ({basis})")
    if collective_probes_s:
        ratio = collective_latency_ratio(base, float(np.mean(collective_probes_s)))
        note = (f"; x {ratio:.3f}, a {PROBE_COLLECTIVE_BYTES}-byte 2-rank all-reduce's drift (mean of "
                f"{len(collective_probes_s)} collective probes, benchmarks/fidelity.py collective_probe)")
        for level in data["levels"]:
            for key in ("latency_s", "sync_latency_s"):
                if level.get(key) is not None:
                    level[key] = float(f"{float(level[key]) * ratio:.4g}")
            level["source"] = f"{level.get('source', '')}{note}"
    out = folder / "calibrated_interleaved.yaml"
    write_yaml_atomic(out, data)
    return out


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a figure that cannot be computed (one round) is null."""
    return value if math.isfinite(value) else None


def kendall(predicted: list[float], measured: list[float]) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(predicted, measured).statistic) if len(predicted) >= 2 else float("nan")


def scatter(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    meas = [r["measured_step_time_s"] * 1e3 for r in rows]
    for key, marker, label in (("predicted_s", "o", "before refit"), ("predicted_loo_s", "x", "after refit (leave-one-out)")):
        pred = [r[key] * 1e3 if r.get(key) is not None else float("nan") for r in rows]
        ax.scatter(meas, pred, marker=marker, label=label)
    for r in rows:
        ax.annotate(r["name"], (r["measured_step_time_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=6, alpha=0.7)
    lo = min(meas + [r["predicted_s"] * 1e3 for r in rows]) * 0.8
    hi = max(meas + [r["predicted_s"] * 1e3 for r in rows]) * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15, label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain 10, 20, 50, ... ms: no overlapping 2x10^1-style minor labels
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured step time (ms, mean after warm-up)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu")
    parser.add_argument("--steps", type=int, default=48,
                        help="trainer steps per configuration, split over the rounds (later rounds may step longer: "
                             "--round-seconds)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="split the steps over this many rounds through all configurations (a burst of load from "
                             "other jobs then lands on several configurations a little, not on one entirely)")
    parser.add_argument("--round-seconds", type=float, default=2.0,
                        help="rounds after the first step for at least this long (steps from the first round's median "
                             "step time): the machine's speed changes within a second, and a longer round averages it")
    parser.add_argument("--configs", default="all", help="'all', 'smoke' (2 configurations) or comma-separated names")
    parser.add_argument("--cluster", default=None, help="use this (calibrated) cluster instead of calibrating")
    parser.add_argument("--base", default=None, help="base cluster to calibrate (default: cpu_local on cpu, from the GPU "
                                                     "name on cuda, ascend_910b on npu)")
    parser.add_argument("--no-interleave", action="store_true",
                        help="cpu: keep the calibrated per-op cost instead of re-measuring it between the runs")
    parser.add_argument("--probe-collectives", action="store_true",
                        help="cpu: also time a 2-rank gloo all-reduce before each round's multi-rank runs and after "
                             "the last, and scale the fabric latencies by it (off: in its one trial it did worse than "
                             "the calibration's latencies, docs/validation.md)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="calibrate again after the runs and predict with the geometric mean of the two "
                             "calibrations (default: the calibration before the runs)")
    parser.add_argument("--reuse-runs", action="store_true", help="reuse run folders of an earlier invocation")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)

    import numpy as np

    from calibration.from_runs import discover_runs, measured_step_time_s, predict
    from perfmodel.clusters import load_cluster
    from perfmodel.specs.strict import write_text_atomic

    names = {c[0] for c in CONFIGS}
    if args.configs == "all":
        chosen = list(CONFIGS)
    else:
        wanted = SMOKE if args.configs == "smoke" else [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = sorted(set(wanted) - names)
        if unknown:
            parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(sorted(names))}")
        chosen = [c for c in CONFIGS if c[0] in wanted]
    if args.device != "cpu":  # one accelerator: the single-device subset
        chosen = [c for c in chosen if c[3] == 1]
    if args.steps < 3:
        parser.error("--steps: need at least 3 (the first is warm-up)")
    if args.rounds < 1:
        parser.error("--rounds: need at least 1")
    if not args.round_seconds >= 0:
        parser.error("--round-seconds: need a number >= 0 (0: every round runs --steps / --rounds steps)")
    if args.recalibrate and args.cluster:
        parser.error("--recalibrate: calibrates this machine twice; drop --cluster, or drop --recalibrate to use that file")
    if args.probe_collectives and (args.device != "cpu" or args.no_interleave):
        parser.error("--probe-collectives: scales the cpu probes' cluster (--device cpu without --no-interleave); "
                     "drop one of them")

    folder = args.out_dir / f"fidelity_{args.device}"
    runs = folder / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    cluster_path = Path(args.cluster) if args.cluster else calibrate(args.device, folder, args.base)
    if args.cluster and not cluster_path.is_file():
        from perfmodel.clusters import resolve_cluster_path

        cluster_path = resolve_cluster_path(args.cluster)
    cluster = load_cluster(str(cluster_path))

    # stale run folders of configurations not chosen now would enter the refit
    for stale in runs.iterdir():
        if stale.is_dir() and stale.name not in {c[0] for c in chosen}:
            shutil.rmtree(stale)
    wall: dict[str, float] = {}
    probes: list[dict] = []
    interleave = args.device == "cpu" and not args.no_interleave
    per_round = max(3, args.steps // args.rounds)
    steps_in_round: dict[str, int] = {}
    reused = {c[0] for c in chosen if args.reuse_runs and (runs / c[0] / "metrics.jsonl").is_file()}
    collective_probes: list[dict] = []
    first_multi_rank = next((c[0] for c in chosen if c[3] > 1 and c[0] not in reused), None) \
        if args.probe_collectives else None  # the parser refused it off cpu and with --no-interleave

    def probe_collectives(round_index: int | None) -> None:
        seconds = collective_probe(folder / "collective_probe")
        if seconds is not None:
            collective_probes.append({"round": round_index, "all_reduce_after_compute_s": seconds})

    for round_index in range(args.rounds):
        for name, model, layout, ranks in chosen:
            if name in reused:
                continue
            if name == first_multi_rank:  # before each round's multi-rank block (--probe-collectives)
                probe_collectives(round_index)
            if interleave:
                probes.append({"before": name, "round": round_index, **drift_probe()})
            wall[name] = wall.get(name, 0.0) + train(
                name, model, f"{layout},precision=fp32" if args.device == "cpu" else layout, ranks,
                steps_in_round.get(name, per_round), args.device, cluster_path, runs, round_index)
            if round_index == 0:  # later rounds step for at least --round-seconds
                steps_in_round[name] = steps_for_seconds(float(np.median(round_times(runs / name)[0])), per_round,
                                                         args.round_seconds)
            print(f"trained {name:<20} ({ranks} rank{'s' if ranks > 1 else ''}) round {round_index + 1}/{args.rounds} "
                  f"in {wall[name]:.1f} s", flush=True)
    load_after = os.getloadavg()
    if args.recalibrate:  # the machine after the runs as well as before them
        after = calibrate(args.device, folder, args.base, "calibrated_after.yaml")
        cluster_path = bracketed_cluster(cluster_path, after, folder)
        cluster = load_cluster(str(cluster_path))
    calibrated_cluster = cluster
    if probes:  # the host-bound figures as they were while the runs ran (see module doc)
        probes.append({"before": None, "round": None, **drift_probe()})
        if first_multi_rank is not None:
            probe_collectives(None)
        figures = [{k: v for k, v in p.items() if k not in ("before", "round")} for p in probes]
        cluster_path = interleaved_cluster(cluster_path, figures, folder,
                                           tuple(p["all_reduce_after_compute_s"] for p in collective_probes))
        cluster = load_cluster(str(cluster_path))

    found = {r.name: r for r in discover_runs(runs)}
    order = [c for c in chosen if c[0] in found]
    run_list = [found[c[0]] for c in order]
    predicted = predict(cluster, run_list)
    measured = np.array([r.measured_step_time_s for r in run_list])
    errors = predicted / measured - 1.0
    predicted_calibrated = predict(calibrated_cluster, run_list)  # the calibration alone, without the probes

    refit_path = folder / "refit.yaml"
    summary = json.loads(mosaic("calibrate", "--from-runs", str(runs), "--cluster", str(cluster_path),
                                "-o", str(refit_path), "--json", capture=True))
    loo = {row["run"]: row.get("predicted_leave_one_out_s") for row in summary["per_run"]}
    loo_mape = summary["mape"].get("after_leave_one_run_out", float("nan"))

    rows = []
    relative_ses = []
    for (name, model, layout, ranks), run, p, e, p_cal in zip(order, run_list, predicted, errors, predicted_calibrated):
        per_round = round_times(runs / name)
        rounds = [measured_step_time_s(times) for times in per_round]
        relative_ses.append(bootstrap_relative_se(per_round))
        rows.append({"name": name, "model": model, "layout": layout, "ranks": ranks, "steps_used": run.steps_used,
                     "round_means_s": rounds, "round_spread": max(rounds) / min(rounds),
                     "measured_relative_se": _finite_or_none(relative_ses[-1]),
                     "measured_step_time_s": float(run.measured_step_time_s), "predicted_s": float(p),
                     "error": float(e), "predicted_calibrated_s": float(p_cal),
                     "error_calibrated": float(p_cal / run.measured_step_time_s - 1.0), "predicted_loo_s": loo.get(name),
                     "error_loo": (loo[name] / run.measured_step_time_s - 1.0) if loo.get(name) else None})
    mape_before = float(np.mean(np.abs(errors)))
    result = {
        "device": args.device, "cluster": str(cluster_path), "steps": args.steps,
        "load_average_before": [round(x, 2) for x in load_before], "load_average_after": [round(x, 2) for x in load_after],
        "cpu_count": os.cpu_count(), "configs": rows,
        "drift_probes": probes, "collective_probes": collective_probes,
        "collective_latency_s": {"calibrated": calibrated_cluster.levels[0].latency_s, "used": cluster.levels[0].latency_s},
        "host_figures_s": {key: {"calibrated": getattr(calibrated_cluster.accelerator, key),
                                 "used": getattr(cluster.accelerator, key)}
                           for key in ("launch_latency_s", "dtensor_op_latency_s", "checkpoint_region_latency_s",
                                       "checkpoint_saved_tensor_latency_s")},
        "mape_before_calibration_alone": float(np.mean(np.abs(predicted_calibrated / measured - 1.0))),
        "mape_before": mape_before, "max_abs_error_before": float(np.max(np.abs(errors))),
        "kendall_tau_before": kendall(list(predicted), list(measured)),
        "refit": {"fitted": summary["fitted"], "factors": summary["factors"], "fixed": summary["fixed"],
                  "mape": summary["mape"], "cluster": str(refit_path)},
        "mape_after_loo": loo_mape,
        "median_round_spread": float(np.median([r["round_spread"] for r in rows])),
        # a perfect model's expected MAPE against these means from their own noise alone: E|N(0, se)| = se sqrt(2/pi)
        "noise_floor_mape": _finite_or_none(float(np.sqrt(2.0 / np.pi) * np.mean(relative_ses))),
        "kendall_tau_after_loo": kendall([r["predicted_loo_s"] for r in rows if r["predicted_loo_s"]],
                                         [r["measured_step_time_s"] for r in rows if r["predicted_loo_s"]]),
        "wall_s": round(time.perf_counter() - t_start, 1), "train_wall_s": {k: round(v, 1) for k, v in wall.items()},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"fidelity_{args.device}.json"
    png_path = args.out_dir / f"fidelity_{args.device}.png"
    write_text_atomic(json_path, json.dumps(result, indent=2) + "\n")
    scatter(png_path, rows, f"{args.device}: MAPE {mape_before:.1%} before refit, {loo_mape:.1%} after (LOO); "
            f"load {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores")

    print(f"\n{'configuration':<20} {'ranks':>5} {'measured ms':>12} {'rounds max/min':>15} {'predicted ms':>13} "
          f"{'error':>8} {'LOO error':>10}")
    for r in rows:
        loo_text = f"{r['error_loo']:+.1%}" if r["error_loo"] is not None else "-"
        print(f"{r['name']:<20} {r['ranks']:>5} {r['measured_step_time_s'] * 1e3:>12.2f} {r['round_spread']:>15.2f} "
              f"{r['predicted_s'] * 1e3:>13.2f} {r['error']:>+8.1%} {loo_text:>10}")
    floor = result["noise_floor_mape"]
    print(f"rounds disagree by a median {result['median_round_spread']:.2f}x (max/min of a configuration's round means)"
          + (f"; from that noise alone a perfect model would show a MAPE of about {floor:.1%} (bootstrap over rounds; "
             "the calibration's own noise comes on top)" if floor is not None else ""))
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after the runs ({os.cpu_count()} cores)")
    if probes:
        print(f"with the calibration alone (no drift probes) the MAPE before refit would be "
              f"{result['mape_before_calibration_alone']:.1%}; probes' means: "
              + ", ".join(f"{k} {v['calibrated']:.3g} -> {v['used']:.3g}" for k, v in result["host_figures_s"].items())
              + (f", collective latency_s {result['collective_latency_s']['calibrated']:.3g} -> "
                 f"{result['collective_latency_s']['used']:.3g} ({len(collective_probes)} collective probes)"
                 if collective_probes else ""))
    print(f"max |error| before refit: {result['max_abs_error_before']:.1%}; Kendall tau: {result['kendall_tau_before']:.3f} "
          f"before, {result['kendall_tau_after_loo']:.3f} after (LOO); refit factors {summary['factors']}")
    print(f"wrote {json_path} and {png_path}")
    print(f"MAPE before refit: {mape_before * 100:.1f}%")
    print(f"MAPE after refit (leave-one-out): {loo_mape * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fidelity of the whole pipeline: calibrate, predict, train, compare, refit.

    python benchmarks/fidelity.py --device cpu [--steps 30] [--out-dir benchmarks/results]

1. Calibrate this machine (`mosaic calibrate --quick` on the bundled cluster of the device,
   or on `--base`; or `--cluster FILE` to reuse a calibrated cluster). `--recalibrate`
   calibrates again after the trainer runs and predicts with the geometric mean of the two,
   figure by figure (`calibration.drift.bracketed_cluster`).
   On cpu the host-bound figures are probed again before each trainer run and after the last
   (`calibration.drift.drift_probe`: per-op cost of an eager op with autograd, cost a DTensor
   op adds, a cold 128^3 fp32 GEMM's rate) and their means over the whole benchmark replace
   the calibrated figures (`calibration.drift.interleaved_cluster`; `--no-interleave` keeps
   the calibration alone): a shared machine's speed changes within minutes, and both sides of
   the comparison must see the same machine. With `--probe-collectives` a 2-rank gloo
   all-reduce is also timed before each round's multi-rank runs and after the last run
   (`calibration.drift.collective_probe`) and its mean scales the fabric's latencies. The MAPE
   with the calibration alone is reported beside it. Why `--recalibrate` and
   `--probe-collectives` are off by default: their trials in docs/validation.md.
2. For each configuration (tiny MoE and dense models on 1, 2 and 4 ranks covering dp, ep,
   tp, pp, mbs and recompute) predict the step time with `perfmodel.evaluate` on the
   calibrated cluster, and run the bundled trainer (`mosaic train`, torchrun + gloo on cpu,
   one thread per rank) in `--rounds` rounds through all configurations: the first of
   `--steps / --rounds` steps, the later ones stepping for at least `--round-seconds` (steps
   from the first round's median step time; each round a fresh `mosaic train`, its metrics
   after its first `ROUND_WARMUP_STEPS` appended to the first round's metrics.jsonl). The
   measured step time is the mean after warm-up, the same definition `mosaic calibrate
   --from-runs` uses (`calibration.from_runs.measured_step_time_s`; `load_run` drops the first
   round's warm-up). Several rounds of a couple of seconds each let the mean span the states
   a shared machine switches between within seconds, as the probes' mean does on the model's
   side.
3. Report per-configuration error (predicted/measured - 1), MAPE, max |error| and Kendall
   tau of the ranking (scipy.stats.kendalltau), how far each configuration's round means
   disagree (max/min), and the standard error of each measured step time (bootstrap over rounds)
   with the MAPE a perfect model would show from that noise alone, E|N(0, se)| = se sqrt(2/pi):
   a floor under any model's error (the calibration's own run-to-run noise comes on top).
4. Refit the cluster from these runs (`mosaic calibrate --from-runs`) and report its
   leave-one-run-out MAPE (each run predicted by factors fitted without it).

Writes `<out-dir>/fidelity_<device>.json` and `fidelity_<device>.png` (predicted vs measured)
and keeps the run folders and cluster files under `<out-dir>/fidelity_<device>/`. The last
two printed lines are `MAPE before refit: X%` and `MAPE after refit (leave-one-out): Y%`.

On cuda/npu only the single-device configurations run (one GPU). `--configs smoke` runs two
small configurations (the test's reduced version). Results: docs/validation.md.
"""

from __future__ import annotations

import argparse
import dataclasses
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
calls take a few steps to settle (docs/validation.md)."""


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


def calibrate(device: str, folder: Path, base: str, name: str = "calibrated.yaml") -> Path:
    """`mosaic calibrate --quick` on top of the cluster `base`."""
    out = folder / name
    t0 = time.perf_counter()
    mosaic("calibrate", "--device", device, "--quick", "--nproc", "2" if device == "cpu" else "1", "-o", str(out),
           "--cluster", base)
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
    parser.add_argument("--base", default=None, help="base cluster to calibrate (default: the bundled cluster of this "
                                                     "device: cpu_local on cpu, by the device's name on cuda/npu)")
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

    from calibration.drift import HostProbe, bracketed_cluster, collective_probe, drift_probe, interleaved_cluster
    from calibration.from_runs import discover_runs, measured_step_time_s, predict
    from perfmodel.clusters import load_cluster
    from perfmodel.errors import MosaicRuntimeError
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

    if args.cluster is None and args.base is None:
        from calibration.timing import default_cluster_here
        from perfmodel.clusters import NoDefaultCluster
        from perfmodel.errors import InputError

        try:
            args.base = default_cluster_here(args.device)
        except NoDefaultCluster as missing:
            parser.error(missing.for_option("--base"))
        except InputError as refused:  # no such device on this machine
            parser.error(str(refused))

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
        try:
            seconds = collective_probe(folder / "collective_probe")
        except MosaicRuntimeError as failed:
            print(f"warning: {failed}; the calibrated collective latencies are kept", file=sys.stderr)
            return
        collective_probes.append({"round": round_index, "all_reduce_after_compute_s": seconds})

    for round_index in range(args.rounds):
        for name, model, layout, ranks in chosen:
            if name in reused:
                continue
            if name == first_multi_rank:  # before each round's multi-rank block (--probe-collectives)
                probe_collectives(round_index)
            if interleave:
                probes.append({"before": name, "round": round_index, **dataclasses.asdict(drift_probe())})
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
        cluster_path = bracketed_cluster(cluster_path, after, folder / "calibrated_bracketed.yaml")
        cluster = load_cluster(str(cluster_path))
    calibrated_cluster = cluster
    if probes:  # the host-bound figures as they were while the runs ran (see module doc)
        probes.append({"before": None, "round": None, **dataclasses.asdict(drift_probe())})
        if first_multi_rank is not None:
            probe_collectives(None)
        figures = [HostProbe(**{k: v for k, v in p.items() if k not in ("before", "round")}) for p in probes]
        cluster_path = interleaved_cluster(cluster_path, figures, folder / "calibrated_interleaved.yaml",
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

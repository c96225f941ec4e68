"""Performance-model speed: candidates/s of the vectorised `perfmodel.evaluate` on a batch of 10^6
and of the scalar reference `perfmodel.reference.evaluate_one` on 10^3, and their ratio.

Two mixes of candidates on the bundled h100 cluster with 1024 devices: "random", every
candidate a new random MoE or dense geometry (layers, width, heads, experts, top-k,
granularity, shared experts, dense first layers, sequence length) with a random layout (tp, pp,
vpp, ep, cp, dp flavour, mbs, recompute, precision, overlap switches), the worst case; and "grid", the planner's
shape, ~1000 geometries each crossed with the same ~1000 layouts (evaluate then prices each
distinct per-layer operator table once). About 70% of the candidates are valid. The process is pinned to one core
(numpy's elementwise kernels are single-threaded anyway). Timing: one warm-up pass, then the
best of `--repeats` passes. Rates are given per CPU-second of this process (`process_time`, what
one core delivers to it) and per wall second (`perf_counter`, lower when other jobs share the
core); the target and the ratio use CPU time. Target: >= 5e5 candidates per core-second.

    python benchmarks/perfmodel_speed.py [--n 1000000] [--n-ref 1000] [--out-dir benchmarks/results]

Prints a table and writes perfmodel_speed.json and perfmodel_speed.png to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from perfmodel import evaluate, load_cluster  # noqa: E402
from perfmodel.reference import evaluate_one  # noqa: E402
from perfmodel.specs import ArchBatch, LayoutBatch  # noqa: E402
from perfmodel.specs.strict import write_text_atomic  # noqa: E402
from perfmodel.validity import valid_mask  # noqa: E402

TARGET = 5e5
CHUNK = 1 << 17


def grid_candidates(n: int, devices: int, seed: int = 1) -> tuple[ArchBatch, LayoutBatch]:
    """The planner's shape: about sqrt(n) geometries, each crossed with the same sqrt(n) layouts
    (layouts listed per geometry, as `mosaic plan` enumerates them)."""
    side = int(np.ceil(np.sqrt(n)))
    archs, _ = candidates(side, devices, seed)
    _, layouts = candidates(side, devices, seed + 1)
    index = np.arange(n)
    return archs.take(index // side), layouts.take(index % side)


def candidates(n: int, devices: int, seed: int = 0) -> tuple[ArchBatch, LayoutBatch]:
    """n random (geometry, layout) pairs for `devices` devices: every candidate a new geometry."""
    rng = np.random.default_rng(seed)
    pick = lambda values: rng.choice(np.asarray(values), n)  # noqa: E731
    d_model = pick([1024, 2048, 4096, 5120, 7168, 8192])
    head_dim = pick([64, 128])
    n_heads = np.maximum(d_model // head_dim, 1)
    n_kv = n_heads // pick([1, 4, 8])
    n_experts = pick([0, 8, 16, 64, 128, 256])
    moe = n_experts > 0
    granularity = pick([1, 2, 4, 8])
    d_expert = np.where(moe, 4 * d_model // granularity, 0)
    n_layers = pick([16, 24, 32, 48, 64])
    archs = ArchBatch(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=np.maximum(n_kv, 1), head_dim=head_dim,
        vocab_size=pick([32000, 128256]), seq_len=pick([2048, 4096, 8192]), n_experts=n_experts,
        top_k=np.where(moe, np.minimum(pick([1, 2, 4, 8]), np.maximum(n_experts, 1)), 0),
        n_shared_experts=np.where(moe, pick([0, 1, 2]), 0), d_expert=d_expert,
        d_ff_dense=np.where(moe, 0, 4 * d_model) + np.where(moe, pick([0, 1]) * 4 * d_model, 0),
        n_dense_layers=np.zeros(n, dtype=np.int64), ffn_ratio=np.full(n, 4.0),
        gated_ffn=rng.random(n) < 0.8, tie_embeddings=rng.random(n) < 0.2,
    )
    archs = ArchBatch(**{**archs.__dict__, "n_dense_layers": np.where(archs.d_ff_dense > 0, np.where(moe, 1, 0), 0)})
    tp = pick([1, 2, 4, 8])
    pp = pick([1, 2, 4, 8])
    cp = pick([1, 1, 1, 2])
    dp = devices // (tp * pp * cp)
    mbs = pick([1, 2, 4])
    layouts = LayoutBatch(
        tp=tp, pp=pp, vpp=np.where(pp > 1, pick([1, 2]), 1), ep=np.where(moe, pick([1, 4, 8, 16, 64]), 1),
        etp=np.ones(n, dtype=np.int64), cp=cp, dp=dp, dp_flavor=pick([0, 1, 2]), mbs=mbs, gbs=mbs * dp * pick([1, 4, 16]),
        recompute=pick([0, 1, 2]), sequence_parallel=tp > 1, precision=pick([1, 1, 3]),
        overlap_grad_reduce=rng.random(n) < 0.5, overlap_param_gather=rng.random(n) < 0.5,
        tp_comm_overlap=(tp > 1) & (rng.random(n) < 0.5), ep_comm_overlap=rng.random(n) < 0.5,
    )
    return archs, layouts


def bench_vectorised(archs: ArchBatch, layouts: LayoutBatch, cluster, devices: int, repeats: int) -> dict:
    n = len(layouts)
    evaluate(archs.take(slice(0, 4096)), layouts.take(slice(0, 4096)), cluster, devices)  # warm-up
    best_wall, best_cpu = float("inf"), float("inf")
    feasible = 0
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        feasible = 0
        for start in range(0, n, CHUNK):
            idx = slice(start, min(start + CHUNK, n))
            result = evaluate(archs.take(idx), layouts.take(idx), cluster, devices)
            feasible += int(result.feasible.sum())
        best_wall = min(best_wall, time.perf_counter() - wall0)
        best_cpu = min(best_cpu, time.process_time() - cpu0)
    return {"n": n, "wall_s": best_wall, "cpu_s": best_cpu, "per_s": n / best_wall, "per_cpu_s": n / best_cpu,
            "feasible": feasible}


def bench_reference(archs: ArchBatch, layouts: LayoutBatch, cluster, devices: int) -> dict:
    rows = [(archs.row(i), layouts.row(i)) for i in range(len(layouts))]
    evaluate_one(*rows[0], cluster, devices)  # warm-up
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for arch, layout in rows:
        evaluate_one(arch, layout, cluster, devices)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"n": len(rows), "wall_s": wall, "cpu_s": cpu, "per_s": len(rows) / wall, "per_cpu_s": len(rows) / cpu}


def plot(figures: dict, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["evaluate, random mix", "evaluate, planner grid", "scalar reference"]
    values = [figures["vectorised"]["per_cpu_s"], figures["vectorised_grid"]["per_cpu_s"],
              figures["reference"]["per_cpu_s"]]
    ax.barh(names, values, color=["tab:blue", "tab:cyan", "tab:gray"])
    ax.axvline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET:,.0f}/s")
    ax.set_xscale("log")
    ax.set_xlabel("candidates per CPU-second (one core)")
    ax.set_title(f"perfmodel speed: ratio {figures['ratio']:,.0f}x", fontsize=10)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="candidates for the vectorised path")
    parser.add_argument("--n-ref", type=int, default=1_000, help="candidates for the scalar reference")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    args = parser.parse_args()

    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    cluster = load_cluster("h100")
    archs, layouts = candidates(args.n, args.devices)
    valid_share = float(valid_mask(archs, layouts, args.devices).mean())
    vec = bench_vectorised(archs, layouts, cluster, args.devices, args.repeats)
    grid = bench_vectorised(*grid_candidates(args.n, args.devices), cluster, args.devices, args.repeats)
    ref = bench_reference(archs.take(slice(0, args.n_ref)), layouts.take(slice(0, args.n_ref)), cluster, args.devices)
    figures = {
        "vectorised": vec, "vectorised_grid": grid, "reference": ref, "ratio": vec["per_cpu_s"] / ref["per_cpu_s"],
        "target_per_s": TARGET, "meets_target": vec["per_cpu_s"] >= TARGET,
        "meets_target_grid": grid["per_cpu_s"] >= TARGET, "valid_share": valid_share, "cluster": "h100",
        "devices": args.devices, "chunk": CHUNK, "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
        "pinned_to_one_core": not args.no_pin,
    }
    print(f"perfmodel speed on {args.devices} h100 devices ({valid_share:.0%} of candidates valid, "
          f"load average {figures['load_average'][0] if figures['load_average'] else 'n/a'}):")
    print(f"  {'path':<22}{'candidates':>12}{'wall s':>10}{'cand/s':>14}{'cand/CPU-s':>14}")
    for name, fig in (("vectorised (random)", vec), ("vectorised (grid)", grid), ("scalar reference", ref)):
        print(f"  {name:<22}{fig['n']:>12,}{fig['wall_s']:>10.2f}{fig['per_s']:>14,.0f}{fig['per_cpu_s']:>14,.0f}")
    print(f"  ratio vectorised (random) / reference, per CPU-second: {figures['ratio']:,.0f}x")
    for label, fig in (("random", vec), ("grid", grid)):
        verdict = "meets" if fig["per_cpu_s"] >= TARGET else "MISSES"
        print(f"  target {TARGET:,.0f} candidates per core-second, {label} mix: {verdict} "
              f"({fig['per_cpu_s']:,.0f}/CPU-s; {fig['per_s']:,.0f}/s wall with load average {os.getloadavg()[0]:.1f})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out_dir / "perfmodel_speed.json", json.dumps(figures, indent=2) + "\n")
    plot(figures, args.out_dir / "perfmodel_speed.png")
    print(f"  wrote {args.out_dir / 'perfmodel_speed.json'} and perfmodel_speed.png")


if __name__ == "__main__":
    main()

"""Speed of the planner: the default `mosaic plan`, and MINLP vs enumeration on reduced spaces.

  1. Wall time of the whole default command (`mosaic plan --cluster NAME --json`, a fresh
     process: imports, search, output) on ascend_superpod (768 dies) and on a 32-node B200
     cluster (256 GPUs), and candidates/s of its search. Target: under 10 s on the 2-core
     test machine.
  2. MINLP (SCIP via pyscipopt; Bonmin / MindtPy when present) vs enumeration on three reduced
     spaces: time of each and agreement of the optimum (relative difference of the loss).

Prints the figures and writes plan_speed.json and plan_speed.png (to --out, default
benchmarks/results/). Run: python benchmarks/plan_speed.py [--repeat 3] [--fit fit.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 10.0
CLUSTERS = (("ascend_superpod", None), ("b200", 256))
REDUCED = (
    ("h100 x64, 5 days", "h100", 64, 5.0, {}),
    ("ascend x128, 20 days", "ascend_superpod", 128, 20.0, {"n_shared_experts": (0, 1)}),
    ("b200 x256, 10 days", "b200", 256, 10.0, {"d_model": (2048, 4096, 6144), "n_experts": (0, 16, 64, 128)}),
)


def cli_wall_time(cluster: str, devices: int | None, fit: str | None) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "mosaic.cli.app", "plan", "--cluster", cluster, "--json"]
    if devices:
        cmd += ["--devices", str(devices)]
    if fit:
        cmd += ["--fit", fit]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return wall, json.loads(out.stdout)


def reduced_space(geometry: dict):
    from mosaic.planner.space import load_space

    geo = dict(d_model=(2048, 4096), n_layers=(16, 32), n_experts=(0, 16, 64), top_k=(1, 2), granularity=(1.0, 4.0),
               n_shared_experts=(0,), active_params=(1e8, 1e12))
    geo.update(geometry)
    return load_space().replace_geometry(**geo).replace_layout(tp=(1, 2), pp=(1, 2), vpp=(1,), ep=(1, 8, 16), mbs=(1,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fit", default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    from mosaic.planner import build_problem
    from mosaic.planner.enumerate import rank_cluster_optimal
    from mosaic.planner.minlp import cluster_model, pair_table, solve_model, solver_available

    report: dict = {"target_s": TARGET_S, "cpus": os.cpu_count(), "default_plan": [], "minlp": []}
    print(f"default `mosaic plan` (fresh process, best of {args.repeat}); target < {TARGET_S:.0f} s")
    for cluster, devices in CLUSTERS:
        runs = [cli_wall_time(cluster, devices, args.fit) for _ in range(args.repeat)]
        walls = [w for w, _ in runs]
        payload = min(runs, key=lambda r: r[0])[1]  # the figures of the fastest run
        s = payload["search"]
        row = {"cluster": cluster, "devices": payload["budget"]["devices"], "wall_s": min(walls), "walls_s": walls,
               "search_s": s["seconds"], "candidates": s.get("candidates"), "candidates_per_s": s.get("candidates_per_s"),
               "geometries": s["geometries"], "timed_geometries": s.get("evaluated_geometries"),
               "layouts_per_geometry": s["layouts_per_geometry"], "under_target": min(walls) < TARGET_S,
               "loss": payload["predicted"]["loss"]}
        report["default_plan"].append(row)
        print(f"  {cluster:16s} {row['devices']:5d} devices: wall {row['wall_s']:.2f} s (ratio to target "
              f"{row['wall_s'] / TARGET_S:.2f}), search {row['search_s']:.2f} s, {row['candidates']:,} candidates "
              f"at {row['candidates_per_s']:,.0f}/s, {row['timed_geometries']}/{row['geometries']} geometries timed")

    print("MINLP vs enumeration on reduced spaces")
    for label, cluster, devices, days, geometry in REDUCED:
        problem = build_problem(cluster, devices=devices, days=days, fit=args.fit, space=reduced_space(geometry))
        t0 = time.perf_counter()
        ranked = rank_cluster_optimal(problem, top=1)
        t_enum = time.perf_counter() - t0
        t0 = time.perf_counter()
        table = pair_table(problem)
        model, _ = cluster_model(problem, table)
        t_build = time.perf_counter() - t0
        for solver in ("scip", "bonmin", "mindtpy"):
            ok, why = solver_available(solver)
            if not ok:
                print(f"  {label:22s} {solver:8s} skipped: {why}")
                continue
            sol = solve_model(model, solver)
            rel = abs(sol.objective - ranked.loss[0]) / abs(ranked.loss[0])
            same = int(table.geometry[sol.choice]) == int(ranked.index[0])
            row = {"space": label, "solver": solver, "geometries": len(problem.geoms), "pairs": len(table),
                   "enumerate_s": t_enum, "build_s": t_build, "solve_s": sol.seconds, "status": sol.status,
                   "gap": sol.gap, "rel_diff": rel, "same_geometry": same}
            report["minlp"].append(row)
            print(f"  {label:22s} {solver:8s} {len(problem.geoms)} geometries, {len(table)} pairs: enumerate "
                  f"{t_enum:.3f} s, MINLP build {t_build:.3f} s + solve {sol.seconds:.3f} s ({sol.status}, gap {sol.gap}); "
                  f"loss rel. diff {rel:.1e}, same geometry: {same}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_speed.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = report["default_plan"]
    axes[0].bar([r["cluster"] for r in rows], [r["wall_s"] for r in rows], color="tab:blue")
    axes[0].axhline(TARGET_S, color="red", ls="--", label="target")
    axes[0].set_ylabel("wall time of default plan (s)")
    axes[0].legend()
    m = report["minlp"]
    if m:
        labels = [f"{r['space']}\n{r['solver']}" for r in m]
        x = range(len(m))
        axes[1].bar([i - 0.2 for i in x], [r["enumerate_s"] for r in m], 0.4, label="enumerate")
        axes[1].bar([i + 0.2 for i in x], [r["build_s"] + r["solve_s"] for r in m], 0.4, label="MINLP (build + solve)")
        axes[1].set_xticks(list(x), labels, fontsize=7)
        axes[1].set_ylabel("seconds")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "plan_speed.png", dpi=110)
    print(f"wrote {out / 'plan_speed.json'} and {out / 'plan_speed.png'}")


if __name__ == "__main__":
    main()

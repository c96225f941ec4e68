"""Speed of the scaling-law fitter: the default mosaic4d fit on the bundled runs, and bootstrap 100.

  1. Wall time of `scaling_fits.fitter.fit` for mosaic4d with the default fit's settings (one e
     per source, eta at its placeholder) on the default fit's runs (scaling_fits/data/clark2022_runs.csv
     + chinchilla2022_runs.csv) with the default start grid, in one process
     with BLAS limited to one thread (the fitter does that itself). Target: under 30 s on one
     core of the 2-core test machine.
  2. The same fit followed by 100 bootstrap refits over runs (warm starts).
  3. Process parallelism over starts (`--jobs`): the same fit with 2 processes, to show where it
     pays (the result is identical; only the wall time differs).

Each timing is the best of `--repeats` runs by wall clock (`time.perf_counter`), with CPU time
(`time.process_time`, this process only) beside it because other jobs may share the machine.
Prints the figures and writes fit_speed.json and fit_speed.png to --out-dir.

    python benchmarks/fit_speed.py [--repeats 1] [--jobs 2] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scaling_fits.fitfile import write_text_atomic  # noqa: E402
from scaling_fits.fitter import FitOptions, bootstrap, fit  # noqa: E402
from scaling_fits.make_default_fit import default_options, default_runs  # noqa: E402

TARGET_S = 30.0


def timed(fn, repeats: int):
    best = None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        w, c = time.perf_counter() - w0, time.process_time() - c0
        if best is None or w < best[0]:
            best = (w, c, out)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="processes for the parallel comparison (0 = skip)")
    ap.add_argument("--n-boot", type=int, default=100)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    data = default_runs()
    options = default_options()
    print(f"data: {data.n_points} points of {data.n_runs} runs ({data.source}); grid {options.n_starts} starts; "
          f"{os.cpu_count()} CPUs visible")

    wall, cpu, res = timed(lambda: fit("mosaic4d", data, options), args.repeats)
    rep = res.report
    print(f"default fit: {wall:.1f} s wall, {cpu:.1f} s CPU ({1e3 * wall / rep.n_starts:.0f} ms/start); "
          f"{rep.n_at_best}/{rep.n_starts} starts reached the best; target < {TARGET_S:.0f} s: "
          f"{'met' if wall < TARGET_S else 'NOT met'} (ratio {wall / TARGET_S:.2f} of target)")

    def fit_and_boot():
        r = fit("mosaic4d", data, options)
        return r, bootstrap(r, data, args.n_boot, seed=0)

    wall_b, cpu_b, _ = timed(fit_and_boot, args.repeats)
    print(f"fit + bootstrap {args.n_boot}: {wall_b:.1f} s wall, {cpu_b:.1f} s CPU "
          f"({1e3 * (wall_b - wall) / args.n_boot:.0f} ms per bootstrap refit)")

    par = None
    if args.jobs > 1:
        popt = FitOptions(**{**options.as_dict(), "n_jobs": args.jobs, "per_source": tuple(options.per_source)})
        wall_p, _, res_p = timed(lambda: fit("mosaic4d", data, popt), args.repeats)
        same = bool((abs(res_p.theta - res.theta) <= 1e-9 * (1 + abs(res.theta))).all())
        par = {"jobs": args.jobs, "wall_s": wall_p, "speedup": wall / wall_p, "same_result": same}
        print(f"default fit with {args.jobs} processes: {wall_p:.1f} s wall, speed-up x{wall / wall_p:.2f} "
              f"(same result: {same})")

    result = {
        "host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "n_points": data.n_points, "n_runs": data.n_runs, "n_starts": options.n_starts,
        "fit_wall_s": wall, "fit_cpu_s": cpu, "target_s": TARGET_S, "target_met": wall < TARGET_S,
        "starts_at_best": rep.n_at_best, "n_boot": args.n_boot, "fit_bootstrap_wall_s": wall_b,
        "fit_bootstrap_cpu_s": cpu_b, "parallel": par,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out_dir / "fit_speed.json", json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["fit", f"fit + boot {args.n_boot}"] + ([f"fit, {args.jobs} procs"] if par else [])
    values = [wall, wall_b] + ([par["wall_s"]] if par else [])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["C0", "C1", "C2"][: len(values)])
    ax.axhline(TARGET_S, color="r", ls="--", label=f"target {TARGET_S:.0f} s (fit)")
    ax.set_ylabel("wall time, s")
    ax.set_title(f"mosaic4d fit, {data.n_points} points, {options.n_starts} starts")
    ax.legend()
    fig.tight_layout()
    tmp = args.out_dir / ".fit_speed.png.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, args.out_dir / "fit_speed.png")
    print(f"wrote {args.out_dir / 'fit_speed.json'} and fit_speed.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

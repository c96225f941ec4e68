"""The tiny CPU ladder end to end: wall time, runs, and how well the fit predicts the held-out largest rung.

Builds a real-text corpus from what the environment already holds (`mosaic data python-docs`:
pydoc topics and the docstrings of the standard library, numpy, scipy, pandas and matplotlib),
tokenizes it (`mosaic data prepare`, byte-level BPE, 2,048 tokens), then runs `mosaic ladder` with
the default ladder space and records the machine's load (`os.getloadavg`) before and after.
Writes OUT/benchmark.json next to the ladder folder.

    python benchmarks/ladder_cpu.py [--budget-flops 3.5e13] [--out runs/ladder_cpu] [--jobs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("numpy", "scipy", "pandas", "matplotlib")


def mosaic(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mosaic.cli.app", *args], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-flops", type=float, default=3.5e13)
    ap.add_argument("--out", type=Path, default=Path("runs/ladder_cpu"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=2048)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = args.out / "python_docs.jsonl"
    corpus = args.out / "corpus"
    load_before = os.getloadavg()
    t0 = time.time()
    if not (corpus / "corpus.yaml").is_file():
        mosaic("data", "python-docs", str(docs), *[a for p in PACKAGES for a in ("--package", p)])
        mosaic("data", "prepare", str(docs), "-o", str(corpus), "--vocab-size", str(args.vocab_size), "--no-progress")
    t1 = time.time()
    mosaic("ladder", "--data", str(corpus), "--budget-flops", repr(args.budget_flops), "--out", str(args.out / "ladder"),
           "--jobs", str(args.jobs))
    t2 = time.time()
    load_after = os.getloadavg()
    from scaling_fits import load_fit

    fitted = load_fit(args.out / "ladder" / "fit.yaml")
    report = fitted.metrics["ladder"]
    result = {"budget_flops": args.budget_flops, "jobs": args.jobs, "runs": report["n_runs"],
              "corpus_seconds": t1 - t0, "ladder_seconds": t2 - t1, "runs_seconds": report.get("wall_seconds"),
              "extrapolation": report["extrapolation"], "extrapolation_mape": report["extrapolation_mape"],
              "mape_loo": report["mape_loo"], "granularity_form": report["granularity_form"],
              "load_average_before": load_before, "load_average_after": load_after, "cpus": os.cpu_count(),
              "python": platform.python_version()}
    (args.out / "benchmark.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

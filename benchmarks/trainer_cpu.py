"""Bundled-trainer throughput: tokens/s of a tiny MoE on cpu for 1, 2 and 4 ranks, and the
share of step time spent in the expert-parallel all-to-all; on a CUDA device, MFU on one GPU.

Each configuration is a real `mosaic train` run (torchrun, gloo, one thread per rank). Figures
are means over the steps after the first (warm-up), read from the run's metrics.jsonl and
summary.json. Prints a table and writes JSON + PNG (default benchmarks/results/).

    python benchmarks/trainer_cpu.py [--steps 12] [--ranks 1 2 4] [--out-dir benchmarks/results]

On a 2-core machine 4 ranks oversubscribe the cores: tokens/s then measures the cost of
sharing, and the all-to-all share includes waiting for the slower ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TINY_MOE = REPO / "examples" / "tiny_moe.yaml"

# A GPU-sized MoE for the one-device MFU figure (bf16): 8 layers, h=2048, 16 experts top-2.
GPU_MOE = dict(n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, head_dim=128, vocab_size=32768, seq_len=2048,
               n_experts=16, top_k=2, n_shared_experts=1, d_expert=1408, d_ff_dense=5632, n_dense_layers=1,
               ffn_ratio=2.75, gated_ffn=True, tie_embeddings=False)


def run_train(model: Path, layout: str, nproc: int, steps: int, out: Path, device: str = "cpu") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "mosaic.cli.app", "train", "--model", str(model), "--layout", layout,
               "--nproc", str(nproc), "--steps", str(steps), "--out", str(out), "--device", device, "--no-progress",
               "--checkpoint-every", str(10 * steps)]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    timed = rows[1:]
    step_time_s = sum(r["step_time_s"] for r in timed) / len(timed)
    return {
        "ranks": nproc,
        "layout": layout,
        "tokens_per_s": rows[0]["tokens_per_s"] * rows[0]["step_time_s"] / step_time_s,  # global tokens / mean step
        "step_time_s": step_time_s,
        "mfu": sum(r["mfu"] for r in timed) / len(timed),
        "all_to_all_share": summary["all_to_all_share"],
        "final_loss": rows[-1]["loss"],
    }


def cpu_layout(ranks: int) -> str:
    # gbs fixed across rank counts; ep = ranks (8 experts split 8/ranks per rank), dp = ranks
    return f"dp={ranks},ep={ranks},mbs=2,gbs=16,dp_flavor=ddp"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mosaic-trainer-bench-"))
    results: dict = {"model": yaml.safe_load(TINY_MOE.read_text()), "steps": args.steps, "cpu": []}
    try:
        for ranks in args.ranks:
            row = run_train(TINY_MOE, cpu_layout(ranks), ranks, args.steps, work / f"cpu{ranks}")
            results["cpu"].append(row)
            print(f"cpu  {ranks} rank(s)  {row['layout']:<32} {row['tokens_per_s']:>9,.0f} tok/s  "
                  f"step {row['step_time_s'] * 1e3:7.1f} ms  all-to-all {row['all_to_all_share']:5.1%}  "
                  f"MFU {row['mfu']:.2%}")
        base = results["cpu"][0]["tokens_per_s"]
        for row in results["cpu"]:
            row["speedup_vs_first"] = row["tokens_per_s"] / base
        print("speed-up vs 1 rank: " + ", ".join(f"{r['ranks']}: {r['speedup_vs_first']:.2f}x" for r in results["cpu"]))
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if has_cuda:
            model = work / "gpu_moe.yaml"
            model.write_text(yaml.safe_dump({"version": 1, **GPU_MOE}))
            row = run_train(model, "dp=1,mbs=2,gbs=8,precision=bf16", 1, max(args.steps, 10), work / "cuda1", device="cuda")
            results["cuda"] = {**row, "device_name": torch.cuda.get_device_name(0), "model": GPU_MOE}
            print(f"cuda 1 device ({results['cuda']['device_name']}): {row['tokens_per_s']:,.0f} tok/s, MFU {row['mfu']:.1%}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "trainer_cpu.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(json_path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ranks = [r["ranks"] for r in results["cpu"]]
    ax1.bar([str(r) for r in ranks], [r["tokens_per_s"] for r in results["cpu"]])
    ax1.set(xlabel="ranks (dp = ep)", ylabel="tokens/s", title="tiny MoE on cpu (gloo)")
    ax2.bar([str(r) for r in ranks], [100 * r["all_to_all_share"] for r in results["cpu"]], color="tab:orange")
    ax2.set(xlabel="ranks (dp = ep)", ylabel="% of step time", title="all-to-all share")
    fig.tight_layout()
    png_path = args.out_dir / "trainer_cpu.png"
    fig.savefig(png_path.with_suffix(".tmp.png"), dpi=120)
    Path(png_path.with_suffix(".tmp.png")).replace(png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

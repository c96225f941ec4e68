"""The busiest-expert load the performance model assumes, against what the bundled trainer logs.

perfmodel.routing models routing as uniform: each token picks top_k distinct experts at random,
and the busiest of E experts then receives f(E, k, E, N) = 1 + q_E sqrt(E (E - k) / ((E - 1) N k))
times the mean over N tokens (`perfmodel.routing.expert_imbalance`). The bundled trainer logs
`expert_imbalance` = max / mean tokens per expert over each step's global batch (N = gbs * seq_len
tokens), averaged over the MoE layers. This script trains tiny MoEs on cpu (`mosaic train`, one
rank, synthetic data) with the softmax router (auxiliary loss) and the sigmoid router (DeepSeek-V3
bias balancing), and prints, per configuration, the model's figure next to the logged mean over
the first step (an untrained router), over the last half of the run, and its 90th percentile.

    python benchmarks/expert_imbalance.py [--steps 200] [--out-dir benchmarks/results]

Writes expert_imbalance.json and expert_imbalance.png to --out-dir.
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

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from perfmodel.routing import expert_imbalance  # noqa: E402

BASE = dict(version=1, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, seq_len=64,
            n_shared_experts=0, d_expert=32, d_ff_dense=128, n_dense_layers=1, ffn_ratio=4.0, gated_ffn=True,
            tie_embeddings=False)
# (n_experts, top_k, gbs): N = gbs * 64 tokens per step
CONFIGS = [(8, 2, 8), (16, 2, 8), (32, 4, 8), (16, 2, 32), (64, 6, 16)]
ROUTERS = ("softmax", "sigmoid")


def run(E: int, k: int, gbs: int, router: str, steps: int, work: Path) -> list[float]:
    model = work / f"E{E}k{k}.yaml"
    model.write_text(yaml.safe_dump({**BASE, "n_experts": E, "top_k": k}))
    out = work / f"E{E}k{k}g{gbs}{router}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "mosaic.cli.app", "train", "--model", str(model), "--layout",
               f"dp=1,mbs={gbs},gbs={gbs}", "--steps", str(steps), "--out", str(out), "--router", router,
               "--no-progress", "--checkpoint-every", str(10 * steps)]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line)["expert_imbalance"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mosaic-imbalance-"))
    rows = []
    print(f"{'E':>3} {'k':>2} {'N':>5} {'router':<8} {'model':>6} {'step 1':>7} {'2nd half':>8} {'p90':>6} {'over model':>10}")
    try:
        for E, k, gbs in CONFIGS:
            N = gbs * BASE["seq_len"]
            predicted = float(expert_imbalance(E, k, N))
            for router in ROUTERS:
                logged = run(E, k, gbs, router, args.steps, work)
                late = np.asarray(logged[len(logged) // 2:])
                row = dict(n_experts=E, top_k=k, tokens=N, router=router, predicted=predicted, first_step=logged[0],
                           late_mean=float(late.mean()), late_p90=float(np.percentile(late, 90)), logged=logged)
                row["late_over_predicted"] = row["late_mean"] / predicted
                rows.append(row)
                print(f"{E:>3} {k:>2} {N:>5} {router:<8} {predicted:6.3f} {logged[0]:7.3f} {row['late_mean']:8.3f} "
                      f"{row['late_p90']:6.3f} {row['late_over_predicted'] - 1:+10.1%}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "expert_imbalance.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"steps": args.steps, "model": BASE, "runs": rows}, indent=2) + "\n")
    tmp.replace(json_path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONFIGS), figsize=(3.2 * len(CONFIGS), 3.2), sharey=True)
    for ax, (E, k, gbs) in zip(axes, CONFIGS):
        for row in rows:
            if (row["n_experts"], row["top_k"], row["tokens"]) == (E, k, gbs * BASE["seq_len"]):
                ax.plot(range(1, len(row["logged"]) + 1), row["logged"], lw=0.8, label=f"logged, {row['router']}")
                predicted = row["predicted"]
        ax.axhline(predicted, color="black", ls="--", lw=1.0, label="model (uniform routing)")
        ax.set(title=f"E={E} k={k} N={gbs * BASE['seq_len']}", xlabel="step")
    axes[0].set_ylabel("max / mean tokens per expert")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png_path = args.out_dir / "expert_imbalance.png"
    fig.savefig(png_path.with_suffix(".tmp.png"), dpi=120)
    Path(png_path.with_suffix(".tmp.png")).replace(png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

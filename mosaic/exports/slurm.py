"""Slurm sbatch script that trains a plan with the bundled trainer (`mosaic train`) under torchrun.

One Slurm task per node runs torchrun, which starts the node's ranks and meets
the other nodes through the c10d rendezvous on the job's first node (the
multi-node recipe of the torchrun documentation). Under torchrun `mosaic train`
trains in place (it does not launch a second torchrun).

Option names were checked against:
  sbatch/srun   SchedMD/slurm commit 284c3b95f08a (2026-08-20, Slurm 26.11.0),
                doc/man/man1/sbatch.1 (-J/--job-name, -N/--nodes, --ntasks-per-node,
                --gpus-per-node, --exclusive, -o/--output; SLURM_JOB_NODELIST, SLURM_JOB_ID),
                doc/man/man1/srun.1 (--ntasks-per-node, --kill-on-bad-exit),
                doc/man/man1/scontrol.1 (`scontrol show hostnames`)
  torchrun      torch.distributed.run.get_args_parser() of torch 2.13 (--nnodes,
                --nproc_per_node, --rdzv_id, --rdzv_backend, --rdzv_endpoint, -m)
  mosaic train  mosaic/cli/train.py (--plan, --device, --steps, --out, --checkpoint-every)
Nodes = devices / devices per node, from the plan cluster's node level or --gpus-per-node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mosaic.exports.common import header, node_shape, shell_word
from mosaic.planfile import Plan
from perfmodel.errors import InputError

SLURM_MATCHED = (
    "SchedMD/slurm commit 284c3b95f08a (Slurm 26.11.0) doc/man/man1/{sbatch,srun,scontrol}.1",
    "torch 2.13 torch.distributed.run (torchrun) argument parser",
)


def render_slurm(plan: Plan, gpus_per_node: Optional[int] = None, plan_path: Optional[str] = None) -> str:
    """The sbatch script; `plan_path` is the plan file the job reads (default: the plan's absolute path).
    The job runs the bundled trainer, so a plan using what it does not implement
    (`unsupported_features`: MTP, MLA with tp > 1, another dispatcher, a capacity factor) is refused
    here, with the trainer's reason."""
    from mosaic.trainer.config import unsupported_features

    problems = unsupported_features(plan.model, plan.layout)
    if problems:
        raise InputError(f"{plan.source}: the bundled trainer (mosaic train) cannot run this plan: "
                         + "; ".join(problems))
    shape = node_shape(plan, gpus_per_node)
    path = plan_path or str(Path(plan.source).resolve())
    job_name = "mosaic-" + Path(plan.source).stem
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={shape.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if shape.device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={shape.per_node}")
    elif shape.device == "npu":
        lines.append(f"# Request {shape.per_node} NPUs per node with your site's generic resource (GRES) for NPUs.")
    lines += [
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
        header(plan, "Slurm job: train a MOSAIC plan with the bundled trainer (mosaic train) under torchrun",
               SLURM_MATCHED).rstrip("\n"),
        f"# Devices per node: {shape.per_node} ({shape.note}); nodes: {shape.nodes}; device: {shape.device}.",
        f"# Steps: ceil(tokens / (gbs * seq_len)) = ceil({plan.tokens:.6g} / ({plan.layout.gbs} * "
        f"{plan.model.seq_len})) = {plan.train_iters}.",
        "# Submit with: sbatch THIS_SCRIPT [extra mosaic train options]",
        "set -euo pipefail",
        "",
        f"PLAN=${{PLAN:-{shell_word(path)}}}",
        'OUT=${OUT:-"runs/${SLURM_JOB_NAME:-mosaic}-${SLURM_JOB_ID:-local}"}',
        "RDZV_PORT=${RDZV_PORT:-29500}",
        # awk reads the whole list: `head -n 1` would close the pipe early, and under pipefail
        # scontrol's SIGPIPE would end the job
        'HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | awk \'NR == 1\')',
        "",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"    torchrun --nnodes {shape.nodes} --nproc_per_node {shape.per_node} \\",
        '    --rdzv_id "${SLURM_JOB_ID}" --rdzv_backend c10d --rdzv_endpoint "${HEAD_NODE}:${RDZV_PORT}" \\',
        f'    -m mosaic.cli.app train --plan "${{PLAN}}" --device {shape.device} --steps {plan.train_iters} \\',
        '    --out "${OUT}" --checkpoint-every 1000 "$@"',
    ]
    return "\n".join(lines) + "\n"


__all__ = ["SLURM_MATCHED", "render_slurm"]

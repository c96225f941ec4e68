"""`mosaic train`: run a plan (or a model + layout) in the bundled trainer.

Everything is checked before any process starts: the plan/model files
(strictly), the layout against the shared validity rules and what the trainer
runs (`trainer_limits`, `trainer_precision`), the cluster file (the device peak for MFU). Then DIR/run.yaml is written
and torchrun is launched for the layout's world size (or, already under
torchrun or for one process, training runs in this process). torch is imported
inside the command only, so `mosaic --help` works without it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from mosaic import __version__
from mosaic.cli.common import cli_errors, console, err_console
from mosaic.planfile import Plan, cluster_of, read_plan
from mosaic.trainer.config import (
    DEVICES,
    RunConfig,
    TrainOptions,
    check_runnable,
    eval_limits,
    load_model_file,
    load_run_config,
    same_run,
    trainer_precision,
)
from perfmodel.clusters import NoDefaultCluster, load_cluster
from perfmodel.errors import InputError, MosaicRuntimeError
from perfmodel.specs.layout import parse_layout
from perfmodel.specs.strict import from_mapping, write_yaml_atomic


def _check_device(device: str, ranks: int) -> None:
    """The device exists here (cpu always); a one-node launch needs a device per rank."""
    if device == "cpu":
        return
    import torch

    from calibration.run import under_torchrun

    if device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise InputError("--device npu needs torch_npu (pip install 'mosaic-planner[npu]')") from None
    module = getattr(torch, device)
    count = module.device_count() if module.is_available() else 0
    if count == 0:
        raise InputError(f"--device {device}: no {device} device is visible here; use --device cpu or run on a {device} machine")
    if not under_torchrun() and ranks > count:
        raise InputError(f"--device {device}: {ranks} ranks but {count} devices on this machine; launch across nodes "
                         "with your own torchrun (each rank runs `mosaic train`) or lower the world size")


def _versions(device: str) -> dict[str, str]:
    import torch

    versions = {"mosaic": __version__, "torch": str(torch.__version__), "python": platform.python_version()}
    if device == "npu":
        import torch_npu

        versions["torch_npu"] = str(torch_npu.__version__)
    return versions


def build_config(*, plan: Optional[Path], model: Optional[Path], layout: Optional[str], nproc: Optional[int],
                 device: str, cluster: Optional[str], out: Path, options: dict) -> RunConfig:
    """Resolve and check a run; raises InputError before anything is launched or written."""
    if device not in DEVICES:
        raise InputError(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    if (plan is None) == (model is None):
        raise InputError("give either --plan plan.yaml or --model model.yaml with --layout")
    loaded: Optional[Plan] = None
    if plan is not None:
        if layout is not None:
            raise InputError("--layout comes from the plan; leave it out with --plan")
        loaded = read_plan(plan)
        arch, lay = loaded.model, loaded.layout
    else:
        if layout is None:
            raise InputError("--model needs --layout, e.g. --layout 'dp=2,ep=2,mbs=2,gbs=8'")
        arch, lay = load_model_file(model), parse_layout(layout)
    if nproc is not None and nproc < 1:
        raise InputError(f"--nproc {nproc}: must be >= 1")
    from calibration.run import under_torchrun  # the one torchrun-environment rule (scipy-heavy: imported here)

    if nproc is None and under_torchrun():
        nproc = int(os.environ["WORLD_SIZE"])  # launched by the user's own torchrun (multi-node, Slurm)
    if nproc is not None:
        devices = nproc
    elif lay.dp is not None:
        devices = lay.model_parallel * lay.dp
    else:
        raise InputError("the layout has no dp; give --nproc N (ranks) or dp= in the layout")
    resolved = check_runnable(arch, lay, devices)
    precision = trainer_precision(resolved, device)
    _check_device(device, devices)
    if cluster is None and loaded is not None and loaded.cluster is not None:
        cluster_name = loaded.cluster.source()  # the plan file's one rule: its file while it exists, else its name
        spec, drift = cluster_of(loaded)
        if drift and int(os.environ.get("RANK", "0")) == 0:
            err_console.print(f"warning: {drift}", markup=False, highlight=False, soft_wrap=True)
    else:
        from calibration.timing import default_cluster_here

        try:
            cluster_name = cluster or default_cluster_here(device)
        except NoDefaultCluster as missing:
            raise InputError(missing.for_option("--cluster")) from None
        spec = load_cluster(cluster_name)
    spec.accelerator.peak(precision)  # the cluster must know the compute precision's peak
    train = from_mapping(TrainOptions, options)
    problems = eval_limits(train, resolved)
    if problems:
        raise InputError("; ".join(problems))
    return RunConfig(model=arch, layout=resolved, cluster=cluster_name, device=device, world_size=devices,
                     precision=precision, out_dir=str(out), train=train, versions=_versions(device))


def prepare_out_dir(config: RunConfig) -> Path:
    """Refuse to mix runs in one folder; write DIR/run.yaml atomically."""
    out = Path(config.out_dir)
    run_yaml = out / "run.yaml"
    if run_yaml.exists():
        if not config.train.resume:
            raise InputError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")
        changed = same_run(load_run_config(run_yaml), config)
        if changed:
            raise InputError(f"--resume: {', '.join(changed)} differ from {run_yaml}; resume with the same "
                             "model, layout and data, or choose another --out")
    write_yaml_atomic(run_yaml, config.to_dict())
    return run_yaml


def launch(config: RunConfig, run_yaml: Path) -> None:
    """torchrun for world > 1 (unless already under it); one process trains in place."""
    from calibration.run import under_torchrun

    if under_torchrun() or config.world_size == 1:
        from mosaic.trainer.train import run

        run(config)
        return
    env = dict(os.environ)
    if config.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.world_size)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(config.world_size),
               "-m", "mosaic.trainer.train", str(run_yaml)]
    result = subprocess.run(command, env=env)
    if result.returncode != 0:
        raise MosaicRuntimeError(f"training failed (torchrun exit {result.returncode}); the rank errors are above, "
                                 f"resume with --resume --out {config.out_dir}")


@cli_errors
def train(
    plan: Optional[Path] = typer.Option(None, "--plan", help="Plan YAML (its model and layout are used)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Model YAML (MoEArchitecture keys); needs --layout."),
    layout: Optional[str] = typer.Option(None, "--layout", help="Layout string, e.g. 'dp=2,ep=2,mbs=2,gbs=8'."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Ranks (default: the layout's world size)."),
    device: str = typer.Option("cpu", "--device", help="cpu (gloo), cuda (nccl) or npu (hccl)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Cluster for the MFU peak (default: the plan's, "
                                          "else the bundled cluster of this device: cpu_local on cpu, by the "
                                          "device's name on cuda/npu)."),
    steps: int = typer.Option(100, "--steps", help="Optimizer steps in total."),
    out: Path = typer.Option(Path("runs/train"), "--out", help="Run folder: run.yaml, metrics.jsonl, checkpoints/."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint in --out."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Checkpoint every N steps (0: at the end)."),
    checkpoint: bool = typer.Option(True, "--checkpoint/--no-checkpoint", help="--no-checkpoint saves none (throughput "
                                    "runs: a checkpoint holds 16 bytes per parameter)."),
    seed: int = typer.Option(0, "--seed", help="Seed of weights and synthetic data."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate (AdamW, cosine to 10%)."),
    warmup: int = typer.Option(0, "--warmup", help="Linear warm-up steps."),
    router: str = typer.Option("softmax", "--router", help="softmax (aux loss) or sigmoid (DeepSeek-V3 bias balancing)."),
    experts: str = typer.Option("grouped", "--experts", help="grouped (grouped GEMM) or loop (reference)."),
    data: str = typer.Option("synthetic", "--data", help="'synthetic' or a token file NAME.bin (+ NAME.idx.npz)."),
    val_data: str = typer.Option("", "--val-data", help="Held-out token file for the validation loss (e.g. the val.bin "
                                 "of `mosaic data prepare`); reported in metrics.jsonl and summary.json."),
    eval_every: int = typer.Option(0, "--eval-every", help="Validate every N steps (0: at the last step)."),
    eval_batches: int = typer.Option(0, "--eval-batches", help="Micro-batches per rank per validation (0: whole file)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress display on rank 0."),
) -> None:
    """Train a plan's model with its layout (data, tensor, pipeline, expert parallel) and write metrics.jsonl."""
    options = {"steps": steps, "resume": resume, "checkpoint": checkpoint, "checkpoint_every": checkpoint_every,
               "seed": seed, "lr": lr, "warmup_steps": warmup, "router": router, "experts": experts, "data": data,
               "progress": progress, "val_data": val_data, "eval_every": eval_every, "eval_batches": eval_batches}
    config = build_config(plan=plan, model=model, layout=layout, nproc=nproc, device=device, cluster=cluster,
                          out=out, options=options)
    if data != "synthetic":
        from mosaic.trainer.data import make_source

        make_source(data, config.model.vocab_size, config.model.seq_len, seed)  # check the file before launching
    if val_data:
        from mosaic.trainer.data import make_source

        make_source(val_data, config.model.vocab_size, config.model.seq_len, seed)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    run_yaml = prepare_out_dir(config) if rank0 else Path(config.out_dir) / "run.yaml"
    launch(config, run_yaml)
    if rank0:
        console.print(f"metrics: {Path(config.out_dir) / 'metrics.jsonl'}")
        _print_summary(Path(config.out_dir) / "summary.json")


def _print_summary(path: Path) -> None:
    """End-of-run summary: final training loss and, with --val-data, the held-out loss."""
    import json

    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    line = f"final training loss {summary['final_loss']:.4f}"
    if "final_val_loss" in summary:
        line += f", validation loss {summary['final_val_loss']:.4f} on {summary['val_tokens']:,} held-out tokens"
    console.print(line + f", {summary['mean_tokens_per_s']:,.0f} tokens/s", highlight=False)

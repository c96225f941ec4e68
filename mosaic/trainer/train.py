"""The training loop; entry point of every rank: ``python -m mosaic.trainer.train DIR/run.yaml``.

`mosaic train` checks the configuration, writes DIR/run.yaml and launches
torchrun with this module (or calls `run` directly for one process).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from calibration.timing import synchronize
from mosaic.trainer import checkpoint
from mosaic.trainer.config import RunConfig, load_run_config
from mosaic.trainer.data import collate, make_source, rank_sample_indices
from mosaic.trainer.metrics import MetricsLog, peak_memory_bytes, step_metrics
from mosaic.trainer.model import Transformer
from mosaic.trainer.parallelize import (
    A2ATimer,
    build_meshes,
    clip_grad_norm,
    moe_layers,
    parallelize,
    parallelize_stage,
    reduce_expert_grads,
)
from mosaic.trainer.pipeline import Pipeline, apply_pp
from mosaic.trainer.precision import apply_fp8, autocast_context
from mosaic.trainer.validation import validation_loss
from perfmodel.clusters import load_cluster
from perfmodel.specs.strict import write_text_atomic

FAULT_ENV = "MOSAIC_TRAINER_FAULT"
"""Fault injection for tests: "RANK:STEP" makes that rank SIGKILL itself as STEP starts."""


def init_distributed(config: RunConfig) -> torch.device:
    """Process group from the torchrun environment (or a one-process group); returns the rank's device."""
    if config.device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and hccl)
    if "RANK" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if config.device == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(config.device, local_rank)
        getattr(torch, config.device).set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=config.backend)
    if dist.get_world_size() != config.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != layout world {config.world_size}")
    return device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lr_at(step: int, config: RunConfig) -> float:
    """Linear warm-up, then cosine from lr to 0.1*lr at the last step (0-based step)."""
    opts = config.train
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    span = max(1, opts.steps - opts.warmup_steps)
    progress = min(1.0, (step - opts.warmup_steps) / span)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: FSDP DTensor and plain expert tensors may share a group
    return torch.optim.AdamW(groups, lr=config.train.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def build_model(arch: Any, opts: Any, device: torch.device) -> Transformer:
    """The model, its parameters created and initialised on `device` (the same weights on every
    rank of one device type: each seeds its generator alike). Built there rather than on the host
    and copied: the host's normal_ fills about 3e7 values a second, minutes for a model of a few
    billion parameters, which a GPU does in well under a second."""
    with torch.device(device):
        return Transformer(arch, router=opts.router, experts_impl=opts.experts)


def _update_router_bias(layers: list[Any], global_load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3 aux-loss-free balancing: b_i += rate * sign(mean load - load_i)."""
    for moe, load in zip(layers, global_load):
        if moe.router.kind == "sigmoid" and rate > 0:
            load = load.float()
            moe.router.expert_bias += rate * torch.sign(load.mean() - load).to(moe.router.expert_bias.device)


def arch_moe_layers(arch: Any) -> int:
    return arch.n_layers - arch.n_dense_layers if arch.n_experts > 0 else 0


def _moe_rows(arch: Any, module: torch.nn.Module) -> list[int]:
    """Index among the model's MoE layers of each MoE layer `module` holds (in `moe_layers` order)."""
    from mosaic.trainer.parallelize import unwrap

    keys = [int(k) for k, b in unwrap(module).layers.items() if b.is_moe]
    return [k - arch.n_dense_layers for k in keys]


def run(config: RunConfig, keep_process_group: bool = False) -> list[dict[str, Any]]:
    """Train for `config.train.steps` steps; returns rank 0's metrics rows of this invocation.

    `keep_process_group`: leave the process group up for another run in the same processes
    (tests run several layouts in one torchrun launch).
    """
    device = init_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    arch, layout, opts = config.model, config.layout, config.train
    torch.manual_seed(opts.seed)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    peak = load_cluster(config.cluster).accelerator.peak(config.precision)
    out = Path(config.out_dir)

    meshes = build_meshes(layout, device.type)
    model = build_model(arch, opts, device)
    if config.precision == "fp8":
        apply_fp8(model, device)
    pipe: Optional[Pipeline] = None
    if layout.pp > 1:  # this rank's chunks as pipeline stages; `module` holds their parameters
        pipe = apply_pp(model, layout, meshes, device, lambda chunk: parallelize_stage(chunk, layout, meshes),
                        opts.aux_loss_coef, torch.float32 if config.precision == "fp32" else torch.bfloat16)
        module: torch.nn.Module = pipe.rank_model
    else:
        module = parallelize(model, layout, meshes)
    optimizer = build_optimizer(module, config)
    layers = moe_layers(module)
    # rows of the global (MoE layer, expert) load table this rank fills (pipeline stages hold different layers)
    moe_rows = _moe_rows(arch, module)
    last_stage = pipe is None or pipe.has_last

    start_step = 0
    if opts.resume:
        latest = checkpoint.latest_checkpoint(out)
        if latest is not None:
            start_step = checkpoint.load(latest, module, optimizer, meshes)
    log = MetricsLog(out / "metrics.jsonl", start_step) if rank == 0 else None
    source = make_source(opts.data, arch.vocab_size, arch.seq_len, opts.seed)
    val_source = make_source(opts.val_data, arch.vocab_size, arch.seq_len, opts.seed) if opts.val_data else None
    eval_s = 0.0
    val_rows: list[tuple[int, float, int]] = []
    dp_rank = meshes.dp_rank
    micro_batches = layout.gbs // (layout.mbs * meshes.dp)
    autocast = autocast_context(config.precision, device)
    fault = os.environ.get(FAULT_ENV, "")
    fault_rank, fault_step = (int(v) for v in fault.split(":")) if fault else (-1, -1)

    rows: list[dict[str, Any]] = []
    a2a_s = 0.0
    progress = _progress(rank == 0 and opts.progress)
    with progress:
        task = progress.add_task("train", total=opts.steps, completed=start_step) if progress else None
        for step in range(start_step, opts.steps):
            if rank == fault_rank and step + 1 == fault_step:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            A2ATimer.take()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            batches = [collate(source.batch(idx)) for idx in rank_sample_indices(step, layout.gbs, meshes.dp, dp_rank, layout.mbs)]
            # NOTE: host-device sync: the global count of target tokens normalises the loss exactly.
            n_local = sum(int((labels != -100).sum()) for _, labels, _, _ in batches)
            n_global = torch.tensor([n_local], dtype=torch.int64, device=device)
            dist.all_reduce(n_global, group=meshes.dp_group)  # tp and pp ranks of a replica see the same batch
            n_global_f = float(n_global)
            ce_sum = torch.zeros((), dtype=torch.float64, device=device)
            aux_sum = torch.zeros((), dtype=torch.float64, device=device)
            for moe in layers:
                moe.reset_load()
            if pipe is not None:
                tokens, labels, positions, doc_ids = (None if t[0] is None else torch.cat(t).to(device)
                                                      for t in zip(*batches))
                pipe.loss.n_global = n_global_f
                with autocast:
                    pipe.step(tokens, labels, positions, doc_ids)
                ce_sum, aux_sum = (t.to(device) for t in pipe.loss.take())
                batches = []
            for i, (tokens, labels, positions, doc_ids) in enumerate(batches):
                tokens, labels, positions = tokens.to(device), labels.to(device), positions.to(device)
                doc_ids = doc_ids.to(device) if doc_ids is not None else None
                sync = i == len(batches) - 1
                no_sync = module.no_sync() if hasattr(module, "no_sync") and not sync else nullcontext()
                with no_sync:
                    with autocast:
                        logits, aux = module(tokens, positions, doc_ids)
                    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
                    # dp * (this rank's share of the global objective): averaging over dp gives the global mean
                    objective = meshes.dp * ce / n_global_f + opts.aux_loss_coef * aux / micro_batches
                    objective.backward()
                ce_sum += ce.detach().double()
                aux_sum += aux.detach().double()
            reduce_expert_grads(module, meshes)
            clip_grad_norm(module, meshes, opts.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loads = torch.zeros(arch_moe_layers(arch), max(arch.n_experts, 1), dtype=torch.float64, device=device)
            for row, moe in zip(moe_rows, layers):
                loads[row] = moe.load_E.to(device).double()
            # the loss is counted once per replica: by its last pipeline stage's first tp rank
            counted = 1.0 if meshes.tp_rank == 0 and last_stage else 0.0
            stats = torch.cat([torch.stack([ce_sum, aux_sum]) * counted, loads.flatten()])
            dist.all_reduce(stats)  # NOTE: host-device sync below (.tolist())
            global_load = stats[2:].view_as(loads)
            _update_router_bias(layers, global_load[moe_rows], opts.bias_update_rate)
            synchronize(device)  # the step's kernels are done before the clock is read (cuda/npu are asynchronous)
            step_time = time.perf_counter() - t0
            a2a_s += A2ATimer.take()
            val_loss = None
            if val_source is not None and (step + 1 == opts.steps or (opts.eval_every and (step + 1) % opts.eval_every == 0)):
                t_eval = time.perf_counter()
                val_loss, val_tokens = validation_loss(module, val_source, meshes, device, layout.mbs, autocast,
                                                       opts.eval_batches)
                eval_s += time.perf_counter() - t_eval
                A2ATimer.take()
                val_rows.append((step + 1, val_loss, val_tokens))
            if rank == 0:
                loss, aux_total = (stats[:2] / torch.tensor([n_global_f, micro_batches * meshes.dp], dtype=torch.float64)).tolist()
                load = global_load.double()
                imbalance = float((load.max(1).values / load.mean(1)).mean()) if load.numel() else 1.0
                row = step_metrics(step=step + 1, loss=loss, aux_loss=aux_total, step_time_s=step_time,
                                   tokens=layout.gbs * arch.seq_len, arch=arch, world=world, peak_flops_per_s=peak,
                                   peak_memory_bytes=peak_memory_bytes(config.device), expert_imbalance=imbalance,
                                   val_loss=val_loss)
                log.append(row)
                rows.append(row)
                if progress:
                    val = f"  val {val_rows[-1][1]:.4f}" if val_rows else ""
                    progress.update(task, advance=1, description=f"loss {loss:.4f}{val}  {row['tokens_per_s']:,.0f} "
                                    f"tok/s  MFU {row['mfu']:.1%}")
            if opts.checkpoint and ((opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0)
                                    or step + 1 == opts.steps):
                checkpoint.save(out, step + 1, module, optimizer, meshes, opts.keep_checkpoints)
    if rank == 0 and rows:
        timed = rows[1:] or rows  # the first step includes warm-up
        summary = {
            "steps_run": len(rows),
            "mean_step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
            "mean_tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
            "all_to_all_share": a2a_s / sum(r["step_time_s"] for r in rows),
            "final_loss": rows[-1]["loss"],
        }
        if val_rows:
            summary.update({"final_val_loss": val_rows[-1][1], "val_tokens": val_rows[-1][2],
                            "val_data": opts.val_data, "eval_seconds": eval_s})
        write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    dist.barrier()
    if not keep_process_group:
        dist.destroy_process_group()
    return rows


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())


class _NoProgress:
    def __bool__(self) -> bool:
        return False

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m mosaic.trainer.train DIR/run.yaml", file=sys.stderr)
        return 2
    run(load_run_config(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

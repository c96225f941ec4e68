"""Save and resume with torch.distributed.checkpoint (DCP), atomically.

A checkpoint is DIR/checkpoints/step_00000010/ (DCP files + `COMPLETE`): all
ranks write into `.step_00000010.tmp/`, then rank 0 renames it once every rank
has finished, so a crash (kill -9) mid-save leaves only a temp folder that
resume ignores and the next save removes.

Contents: model and optimizer state (DDP replicated or FSDP2 DTensor shards, as
`torch.distributed.checkpoint.state_dict` gives them; expert tensors, which
differ between expert-parallel ranks, are saved as DTensors sharded along the
expert dimension of the (edp, ep) mesh so that they keep their single-device
names and global shapes), the step (the data position: data are indexed by
global sample, see data.py) and each rank's RNG state.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from mosaic.trainer.parallelize import Meshes, expert_parameters

PREFIX = "step_"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Optional[Path]:
    """Newest complete checkpoint folder (temp folders of interrupted saves are ignored)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "COMPLETE").is_file())
    return done[-1] if done else None


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def _expert_names(model: nn.Module) -> set[str]:
    experts = {id(p) for p in expert_parameters(model)}
    names = set()
    for name, p in model.named_parameters():
        if id(p) in experts:
            names.add(name.removeprefix("module."))
    return names


def _wrap(tensor: torch.Tensor, meshes: Meshes, name: str) -> Any:
    # NOTE: from_local shares storage, so DCP's in-place load fills `tensor`.
    placements = [Replicate(), Shard(0)]
    if meshes.etp > 1:  # d_expert split: dim 2 of w1/w3 (E, H, F), dim 1 of w2 (E, F, H)
        placements.append(Shard(1 if name.endswith("w2") else 2))
    return DTensor.from_local(tensor, meshes.expert_shard_mesh, placements, run_check=False)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, meshes: Meshes) -> dict[str, Any]:
    # Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): pipeline stages
    # hold different parameters, so each key must name its parameter (as in torchtitan).
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
    if meshes.ep > 1 or meshes.etp > 1:
        names = _expert_names(model)
        for name in names:
            model_sd[name] = _wrap(model_sd[name], meshes, name)
        for key, value in list(optim_sd.items()):  # a new dict: the optimizer's own state stays plain tensors
            param = key[len("state."):].rsplit(".", 1)[0]
            if key.startswith("state.") and isinstance(value, torch.Tensor) and value.ndim > 0 and param in names:
                optim_sd[key] = _wrap(value, meshes, param)
    return {"model": model_sd, "optim": optim_sd}


def _unwrap(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _unwrap(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unwrap(v) for v in tree]
    if isinstance(tree, DTensor) and tree.device_mesh.mesh_dim_names in (("edp", "ep"), ("edp", "ep", "etp")):
        return tree.to_local()
    return tree


def save(out_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meshes: Meshes,
         keep: int) -> Path:
    root = checkpoint_root(out_dir)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".{final.name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _state(model, optimizer, meshes)
    state["progress"] = {"step": torch.tensor(step, dtype=torch.int64)}
    state[f"rng_rank{rank}"] = {"cpu": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        (tmp / "COMPLETE").write_text(f"{step}\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(f".{PREFIX}*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meshes: Meshes) -> int:
    """Restore model, optimizer and RNG in place; returns the step the checkpoint was taken after."""
    rank = dist.get_rank()
    state = _state(model, optimizer, meshes)
    state["progress"] = {"step": torch.tensor(0, dtype=torch.int64)}
    state[f"rng_rank{rank}"] = {"cpu": torch.get_rng_state()}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, _unwrap(state["model"]))
    set_optimizer_state_dict(model, optimizer, _unwrap(state["optim"]), options=OPTIONS)
    torch.set_rng_state(state[f"rng_rank{rank}"]["cpu"])
    return int(state["progress"]["step"])

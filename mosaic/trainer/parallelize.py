"""Parallelism as functions applied to the single-device model over DeviceMeshes.

Order (as `parallelize` applies them):
  1. `apply_ep`  experts resident on their expert-parallel rank; tokens moved by
                 `all_to_all_single` with variable splits (dispatch and combine live
                 here, outside the MoE module).
  2. `apply_ac`  activation recompute (none / selective: attention core / full: each block).
  3. `apply_dp`  data parallel for the NON-expert parameters: DDP (`ddp`), FSDP2
                 `fully_shard` keeping weights gathered through the step (`zero1`:
                 optimizer state and gradients sharded) or resharding after forward (`fsdp`).
Expert parameters are replicated over the expert-data-parallel group (edp) and
their gradients all-reduced there by `reduce_expert_grads`.

Ranks (Megatron-Core MoE parallel folding, part 1: tp = cp = pp = 1): the dense
mesh is ("dp",) over all ranks; the expert mesh is ("edp", "ep") over the same
ranks with ep innermost, so an expert-parallel group is ep consecutive ranks.

Gradient scaling: every rank's objective is dp * (its share of the global loss),
so averaging over dp (DDP/FSDP) gives the global-batch gradient. An expert on one
rank already sums the contributions of its ep group's tokens (all-to-all backward),
so expert gradients are SUMMED over edp and divided by dp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mosaic.trainer.model import GroupedExperts, MoE, Transformer
from perfmodel.specs.layout import ParallelLayout


@dataclass
class Meshes:
    """The dense and expert meshes of one run (part 1: dp and (edp, ep))."""

    dense: DeviceMesh
    expert: DeviceMesh
    dp: int
    ep: int
    edp: int

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("dp")

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.expert.get_group("ep")

    @property
    def edp_group(self) -> dist.ProcessGroup:
        return self.expert.get_group("edp")

    @property
    def ep_rank(self) -> int:
        return self.expert.get_local_rank("ep")


def build_meshes(layout: ParallelLayout, device_type: str) -> Meshes:
    dp = int(layout.dp)
    ep = layout.ep
    edp = layout.edp()
    dense = init_device_mesh(device_type, (dp,), mesh_dim_names=("dp",))
    expert = init_device_mesh(device_type, (edp, ep), mesh_dim_names=("edp", "ep"))
    return Meshes(dense=dense, expert=expert, dp=dp, ep=ep, edp=edp)


# ---------------------------------------------------------------------------
# Expert parallel

class A2ATimer:
    """Wall time spent in all-to-all (dispatch, combine, their backward); meaningful on cpu (synchronous)."""

    seconds = 0.0

    @classmethod
    def take(cls) -> float:
        value, cls.seconds = cls.seconds, 0.0
        return value


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    start = time.perf_counter()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    A2ATimer.seconds += time.perf_counter() - start
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single: the backward sends gradients back along the reversed splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class ExpertParallelExperts(GroupedExperts):
    """The E/ep experts resident on this rank, with token dispatch and combine around them.

    Same parameter names as `GroupedExperts` (local slices along the expert
    dimension), so checkpoints name them like the single-device model.
    """

    def __init__(self, full: GroupedExperts, ep: int, ep_rank: int, group: dist.ProcessGroup):
        local = full.n_experts // ep
        super().__init__(local, full.w1.shape[1], full.w1.shape[2], full.gated, full.impl)
        self.ep, self.ep_rank, self.group, self.n_global = ep, ep_rank, group, full.n_experts
        sl = slice(ep_rank * local, (ep_rank + 1) * local)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                src = getattr(full, name)
                if src is not None:
                    getattr(self, name).copy_(src[sl])

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.n_experts
        # 1. exchange counts: recv_SE[s, e] = rows source rank s sends to my local expert e
        start = time.perf_counter()
        recv = torch.empty_like(counts_E)
        dist.all_to_all_single(recv, counts_E.contiguous(), group=self.group)
        A2ATimer.seconds += time.perf_counter() - start
        recv_SE = recv.view(ep, local)
        # NOTE: host-device sync (split sizes must be Python ints).
        in_splits = counts_E.view(ep, local).sum(1).tolist()
        out_splits = recv_SE.sum(1).tolist()
        # 2. dispatch: rows arrive grouped by source, then by local expert
        x_recv = AllToAll.apply(x_NH, out_splits, in_splits, self.group)
        # 3. regroup expert-major (expert 0 from all sources, expert 1, ...)
        perm = _source_to_expert_major(recv_SE)
        y_local = super().forward(x_recv[perm], recv_SE.sum(0))
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local) if perm.numel() else y_local
        # 4. combine: send results back along the reversed splits
        return AllToAll.apply(y_recv, in_splits, out_splits, self.group)


def _source_to_expert_major(counts_SE: torch.Tensor) -> torch.Tensor:
    """Row permutation from (source, expert)-ordered blocks to (expert, source) order."""
    flat = counts_SE.flatten()
    starts_SE = (torch.cumsum(flat, 0) - flat).view_as(counts_SE)
    counts_ES, starts_ES = counts_SE.t().flatten(), starts_SE.t().flatten()
    total = int(flat.sum())
    block = torch.repeat_interleave(torch.arange(counts_ES.numel(), device=flat.device), counts_ES)
    block_begin = torch.cumsum(counts_ES, 0) - counts_ES
    within = torch.arange(total, device=flat.device) - block_begin[block]
    return starts_ES[block] + within


def apply_ep(model: Transformer, meshes: Meshes) -> None:
    """Replace each MoE layer's experts by this rank's resident slice with all-to-all dispatch.

    Part 1 builds the whole model on every rank (same seed, so the same weights as a
    single process) and keeps the local slice; a model whose experts do not fit one
    device at init needs meta-device initialisation (not done yet).
    """
    if meshes.ep == 1:
        return
    for moe in model.moe_layers():
        moe.experts = ExpertParallelExperts(moe.experts, meshes.ep, meshes.ep_rank, meshes.ep_group)


# ---------------------------------------------------------------------------
# Activation recompute

def apply_ac(model: Transformer, mode: str) -> None:
    """none; selective: recompute the attention core (SDPA); full: recompute every block."""
    model.checkpoint_blocks = mode == "full"
    for block in model.layers:
        block.attn.checkpoint_core = mode == "selective"


# ---------------------------------------------------------------------------
# Data parallel

def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)]


def apply_dp(model: Transformer, meshes: Meshes, flavor: str) -> nn.Module:
    """Data parallel over the dense mesh for every parameter except the routed experts."""
    if meshes.dp == 1:
        return model
    experts = set(expert_parameters(model))
    if flavor == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        names = [n for n, p in model.named_parameters() if p in experts]
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
        return DDP(model, process_group=meshes.dp_group, forward_sync_buffers=False)
    from torch.distributed.fsdp import fully_shard

    reshard = flavor == "fsdp"  # zero1: weights stay gathered from forward to backward
    for block in model.layers:
        fully_shard(block, mesh=meshes.dense, reshard_after_forward=reshard, ignored_params=experts)
    fully_shard(model, mesh=meshes.dense, reshard_after_forward=reshard, ignored_params=experts)
    return model


def reduce_expert_grads(model: nn.Module, meshes: Meshes) -> None:
    """Sum expert gradients over edp, divide by dp (see the module docstring)."""
    params = expert_parameters(model)
    if not params or meshes.dp == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    if meshes.edp > 1:
        dist.all_reduce(flat, group=meshes.edp_group)
    flat /= meshes.dp
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def clip_grad_norm(model: nn.Module, meshes: Meshes, max_norm: float) -> torch.Tensor:
    """Global gradient norm over dense (replicated or FSDP-sharded) and expert (ep-sharded) parameters."""
    from torch.distributed.tensor import DTensor

    experts = set(expert_parameters(model))
    device = next(model.parameters()).device
    sharded_sq = torch.zeros((), device=device)
    replicated_sq = torch.zeros((), device=device)
    expert_sq = torch.zeros((), device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        if p in experts:
            expert_sq += p.grad.float().pow(2).sum()
        elif isinstance(p.grad, DTensor):
            sharded_sq += p.grad.to_local().float().pow(2).sum()
        else:
            replicated_sq += p.grad.float().pow(2).sum()
    if meshes.dp > 1 and any(isinstance(p, DTensor) for p in model.parameters()):
        dist.all_reduce(sharded_sq, group=meshes.dp_group)
    if meshes.ep > 1:
        dist.all_reduce(expert_sq, group=meshes.ep_group)
    total = (sharded_sq + replicated_sq + expert_sq).sqrt()
    if max_norm > 0:
        # NOTE: host-device sync (one scalar per step).
        scale = min(1.0, max_norm / (float(total) + 1e-6))
        if scale < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
    return total


def parallelize(model: Transformer, layout: ParallelLayout, meshes: Meshes) -> nn.Module:
    """Apply EP, recompute and DP in that order; returns the module to call (maybe a DDP wrapper)."""
    apply_ep(model, meshes)
    apply_ac(model, layout.recompute)
    return apply_dp(model, meshes, layout.dp_flavor)


def unwrap(module: nn.Module) -> Transformer:
    inner: Optional[nn.Module] = getattr(module, "module", None)
    return inner if isinstance(inner, Transformer) else module  # type: ignore[return-value]


def moe_layers(module: nn.Module) -> list[MoE]:
    return unwrap(module).moe_layers()

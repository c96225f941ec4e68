"""Parallelism as functions applied to the single-device model over DeviceMeshes.

Order (as `parallelize` applies them; torchtitan's order):
  0. `apply_pp`  (pipeline.py, pp > 1) split into pipeline chunks; each chunk then gets 1-4.
  1. `apply_tp`  (tensor_parallel.py) DTensor column/row-wise plans for attention, dense FFN,
                 shared experts, embedding and head (+ sequence parallel); MoE layers run on
                 this rank's sequence shard.
  2. `apply_ep`  experts resident on their expert-parallel rank; tokens moved by
                 `all_to_all_single` with variable splits (dispatch and combine live
                 here, outside the MoE module); with etp > 1 each expert's d_expert is
                 split over the etp group (rows gathered there, partial outputs summed back).
  3. `apply_ac`  activation recompute (none / selective: attention core, with MLA optionally its
                 up projections / full: each block).
  4. `apply_dp`  data parallel for the NON-expert parameters: DDP (`ddp`; FSDP2 `replicate`
                 with tensor parallel), FSDP2 `fully_shard` keeping weights gathered through
                 the step (`zero1`: optimizer state and gradients sharded) or resharding
                 after forward (`fsdp`).
Expert parameters are replicated over the expert-data-parallel group (edp) and
their gradients all-reduced there by `reduce_expert_grads`.

Ranks: the dense mesh is ("pp", "dp", "cp", "tp") (tp innermost); the expert mesh is
("pp", "edp", "ep", "etp") over the same ranks (Megatron-Core MoE parallel folding:
etp*ep*edp = tp*cp*dp within each pipeline stage), so with tp = 2 and ep = 2 an
expert-parallel group is a tensor-parallel group, whose ranks route distinct token shards.

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
from mosaic.trainer.tensor_parallel import apply_tp
from perfmodel.specs.layout import ParallelLayout


@dataclass
class Meshes:
    """The dense and expert meshes of one run, with named sub-meshes.

    dense:  ("pp", "dp", "cp", "tp") over all ranks, tp innermost (torchtitan order).
    expert: ("pp", "edp", "ep", "etp") over the same ranks: within each pipeline stage the
            tp*cp*dp ranks are refactored as edp*ep*etp (Megatron-Core MoE parallel folding,
            expert order tp-ep-dp-pp), so an expert-parallel group is ep consecutive etp-blocks.
    """

    dense: DeviceMesh
    expert: DeviceMesh
    pp: int
    dp: int
    tp: int
    ep: int
    etp: int
    edp: int

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.dense["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.dense["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("pp")

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.expert.get_group("ep")

    @property
    def edp_group(self) -> dist.ProcessGroup:
        return self.expert.get_group("edp")

    @property
    def ep_rank(self) -> int:
        return self.expert.get_local_rank("ep")

    @property
    def pp_rank(self) -> int:
        return self.dense.get_local_rank("pp")

    @property
    def dp_rank(self) -> int:
        return self.dense.get_local_rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.dense.get_local_rank("tp")

    @property
    def expert_shard_mesh(self) -> DeviceMesh:
        """("edp", "ep"[, "etp"]) of this pipeline stage: experts replicated over edp, split over ep (and etp)."""
        return self.expert["edp", "ep", "etp"] if self.etp > 1 else self.expert["edp", "ep"]


def build_meshes(layout: ParallelLayout, device_type: str) -> Meshes:
    dp, pp, cp, tp = int(layout.dp), layout.pp, layout.cp, layout.tp
    ep, etp, edp = layout.ep, layout.etp, layout.edp()
    dense = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    expert = init_device_mesh(device_type, (pp, edp, ep, etp), mesh_dim_names=("pp", "edp", "ep", "etp"))
    return Meshes(dense=dense, expert=expert, pp=pp, dp=dp, tp=tp, ep=ep, etp=etp, edp=edp)


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

    Expert-tensor parallel (etp > 1, Megatron-Core's expert TP): each expert's hidden width
    d_expert is split over the etp group (w1, w3 column-wise, w2 row-wise). After the
    expert-parallel dispatch, the etp group's tokens are gathered on every etp rank, each
    computes its slice of d_expert, and the partial outputs are summed back to the rank that
    holds the tokens (a reduce-scatter); both exchanges are differentiable all-to-alls.
    """

    def __init__(self, full: GroupedExperts, ep: int, ep_rank: int, group: dist.ProcessGroup,
                 etp: int = 1, etp_rank: int = 0, etp_group: Optional[dist.ProcessGroup] = None):
        local = full.n_experts // ep
        width = full.w1.shape[2] // etp
        super().__init__(local, full.w1.shape[1], width, full.gated, full.impl)
        self.ep, self.ep_rank, self.group, self.n_global = ep, ep_rank, group, full.n_experts
        self.etp, self.etp_group = etp, etp_group
        sl = slice(ep_rank * local, (ep_rank + 1) * local)
        fsl = slice(etp_rank * width, (etp_rank + 1) * width)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                src = getattr(full, name)
                if src is not None:
                    getattr(self, name).copy_(src[sl, fsl, :] if name == "w2" else src[sl, :, fsl])

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
        y_local = self._local_experts(x_recv[perm], recv_SE.sum(0))
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local) if perm.numel() else y_local
        # 4. combine: send results back along the reversed splits
        return AllToAll.apply(y_recv, in_splits, out_splits, self.group)

    def _local_experts(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """This rank's experts on expert-sorted rows (with etp: over the etp group's rows)."""
        if self.etp == 1:
            return super().forward(x_NH, counts_E)
        etp, group = self.etp, self.etp_group
        # counts of every etp rank: counts_TE[t, e]
        counts_TE = torch.empty(etp * counts_E.numel(), dtype=counts_E.dtype, device=counts_E.device)
        dist.all_to_all_single(counts_TE, counts_E.repeat(etp), group=group)
        counts_TE = counts_TE.view(etp, -1)
        # NOTE: host-device sync (split sizes).
        n_of = counts_TE.sum(1).tolist()
        n_me = x_NH.shape[0]
        # all-gather of the rows (its backward sums the gradients of every copy)
        x_all = AllToAll.apply(x_NH.repeat(etp, 1), n_of, [n_me] * etp, group)
        perm = _source_to_expert_major(counts_TE)
        y_part = super().forward(x_all[perm], counts_TE.sum(0))  # partial sums over my d_expert slice
        y_all = torch.empty_like(y_part).index_copy(0, perm, y_part) if perm.numel() else y_part
        # reduce-scatter: every etp rank's partial sums of my rows, added
        y_back = AllToAll.apply(y_all, [n_me] * etp, n_of, group)
        return y_back.view(etp, n_me, -1).sum(0)


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
    if meshes.ep == 1 and meshes.etp == 1:
        return
    etp_group = meshes.expert.get_group("etp") if meshes.etp > 1 else None
    for moe in model.moe_layers():
        moe.experts = ExpertParallelExperts(moe.experts, meshes.ep, meshes.ep_rank, meshes.ep_group,
                                            meshes.etp, meshes.expert.get_local_rank("etp"), etp_group)


# ---------------------------------------------------------------------------
# Activation recompute

def apply_ac(model: Transformer, mode: str, modules: Optional[str] = None) -> None:
    """none; selective: recompute the attention core (SDPA; `modules` core_attn, the default) and
    with MLA also its up projections (core_attn+mla_up_proj), or each block by torchtitan's per-op
    policy (op, `model.op_sac_context`); full: recompute every block.
    Other module sets are refused by `config.trainer_limits` (TRAINER_RECOMPUTE_MODULES)."""
    up = mode == "selective" and "mla_up_proj" in (modules or "").split("+")
    model.checkpoint_blocks = mode == "full"
    model.op_sac = mode == "selective" and modules == "op"
    for block in model.layers.values():
        block.attn.checkpoint_core = mode == "selective" and not model.op_sac
        if hasattr(block.attn, "checkpoint_up"):
            block.attn.checkpoint_up = up


# ---------------------------------------------------------------------------
# Data parallel

def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)]


def apply_dp(model: Transformer, meshes: Meshes, flavor: str, root: Optional[nn.Module] = None) -> nn.Module:
    """Data parallel over the dp mesh for every parameter except the routed experts.

    `root` (default: `model`) is the module that is called: a pipeline stage module around
    `model`. Returns the module to call (a DDP wrapper for ddp without tensor parallel).
    """
    root = model if root is None else root
    if meshes.dp == 1:
        return root
    experts = set(expert_parameters(model))
    if flavor == "ddp" and (meshes.tp > 1 or meshes.pp > 1):
        # DistributedDataParallel takes neither DTensor (tensor-parallel) parameters nor the
        # pipeline schedule's shape-inference backward; FSDP2's replicate() is DDP (replicated
        # weights, gradients averaged over dp) that does.
        import importlib

        from mosaic.trainer.config import REPLICATE_MODULE

        replicate = importlib.import_module(REPLICATE_MODULE).replicate  # checked before launch (trainer_limits)
        for block in model.layers.values():
            replicate(block, mesh=meshes.dp_mesh, ignored_params=experts)
        replicate(root, mesh=meshes.dp_mesh, ignored_params=experts)
        return root
    if flavor == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        names = [n for n, p in root.named_parameters() if p in experts]
        DDP._set_params_and_buffers_to_ignore_for_model(root, names)
        return DDP(root, process_group=meshes.dp_group, forward_sync_buffers=False)
    from torch.distributed.fsdp import fully_shard

    reshard = flavor == "fsdp"  # zero1: weights stay gathered from forward to backward
    for block in model.layers.values():
        fully_shard(block, mesh=meshes.dp_mesh, reshard_after_forward=reshard, ignored_params=experts)
    fully_shard(root, mesh=meshes.dp_mesh, reshard_after_forward=reshard, ignored_params=experts)
    return root


def reduce_expert_grads(model: nn.Module, meshes: Meshes) -> None:
    """Sum expert gradients over edp, divide by dp (see the module docstring)."""
    params = expert_parameters(model)
    if not params or (meshes.dp == 1 and meshes.edp == 1):
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
    """Global gradient norm over every parameter of every rank, each counted once.

    DTensor gradients (tensor parallel, FSDP) give their global square sums through DTensor
    (`full_tensor`: sharded dims summed, replicated ones not); plain non-expert gradients are
    replicated; expert gradients are split over ep; pipeline stages hold disjoint parameters.
    """
    from torch.distributed.tensor import DTensor

    experts = {id(p) for p in expert_parameters(model)}
    device = next(model.parameters()).device
    by_spec: dict = {}
    replicated_sq = torch.zeros((), device=device)
    expert_sq = torch.zeros((), device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) in experts:
            expert_sq += p.grad.float().pow(2).sum()
        elif isinstance(p.grad, DTensor):
            key = (p.grad.device_mesh, tuple(p.grad.placements))
            sq = p.grad.float().pow(2).sum()
            by_spec[key] = sq if key not in by_spec else by_spec[key] + sq
        else:
            replicated_sq += p.grad.float().pow(2).sum()
    sharded_sq = torch.zeros((), device=device)
    for key in sorted(by_spec, key=repr):  # the same order on every rank
        sharded_sq += by_spec[key].full_tensor()
    if meshes.ep > 1:
        dist.all_reduce(expert_sq, group=meshes.ep_group)
    if meshes.etp > 1:
        dist.all_reduce(expert_sq, group=meshes.expert.get_group("etp"))
    total_sq = sharded_sq + replicated_sq + expert_sq
    if meshes.pp > 1:
        dist.all_reduce(total_sq, group=meshes.pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        # NOTE: host-device sync (one scalar per step).
        scale = min(1.0, max_norm / (float(total) + 1e-6))
        if scale < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
    return total


def parallelize(model: Transformer, layout: ParallelLayout, meshes: Meshes) -> nn.Module:
    """Apply TP, EP, recompute and DP in that order; returns the module to call (maybe a DDP wrapper)."""
    apply_tp(model, meshes.tp_mesh, layout.sequence_parallel)
    apply_ep(model, meshes)
    apply_ac(model, layout.recompute, layout.recompute_modules)
    return apply_dp(model, meshes, layout.dp_flavor)


def parallelize_stage(chunk: Transformer, layout: ParallelLayout, meshes: Meshes) -> nn.Module:
    """One pipeline chunk: TP, EP, recompute, then DP around its stage module (see pipeline.py)."""
    from mosaic.trainer.pipeline import StageModule

    apply_tp(chunk, meshes.tp_mesh, layout.sequence_parallel)
    apply_ep(chunk, meshes)
    apply_ac(chunk, layout.recompute, layout.recompute_modules)
    return apply_dp(chunk, meshes, layout.dp_flavor, root=StageModule(chunk))


def unwrap(module: nn.Module) -> Transformer:
    inner: Optional[nn.Module] = getattr(module, "module", None)
    return inner if isinstance(inner, Transformer) else module  # type: ignore[return-value]


def moe_layers(module: nn.Module) -> list[MoE]:
    return unwrap(module).moe_layers()

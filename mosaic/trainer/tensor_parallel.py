"""Tensor parallel (Megatron-style) by DTensor plans: `apply_tp(model, tp_mesh, sequence_parallel)`.

The single-device model is parallelised in place with `parallelize_module`:

- attention: wq, wk, wv column-wise (each rank keeps n_heads/tp query and n_kv_heads/tp
  key/value heads), wo row-wise (partial sums reduced);
- dense FFN and shared experts: w1, w3 column-wise, w2 row-wise;
- embedding row-wise (vocabulary split), LM head column-wise with the logits gathered
  (Replicate), so the loss is the single-device loss;
- MoE layers: the router and the routed experts see only this rank's 1/tp of the micro-batch's
  tokens (a sequence shard, as Megatron-Core does for MoE with tp > 1): routed experts are not
  split by tp (expert parallel and expert-tensor parallel handle them over the expert mesh),
  the router's weight is a replicated DTensor whose gradient DTensor sums over the tp ranks,
  and the auxiliary loss sums its statistics over the tp ranks (`Router.sum_over_token_shards`)
  so it equals the single-device one. The MoE output is gathered back (or stays a sequence
  shard with sequence parallel).

Sequence parallel (`layout.sequence_parallel`, Korthikanti et al. 2022): between the blocks the
residual stream is split along the sequence (Shard(1)); norms run on the shard with replicated
weights; the all-reduce of each row-wise layer becomes a reduce-scatter and the input of each
column-wise block an all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mosaic.trainer.model import MoE, Transformer


class _SumOverGroup(torch.autograd.Function):
    """all-reduce (sum) in forward, identity in backward (Megatron's reduce_from_tensor_model_parallel_region):
    every rank computes the same function of the sum, so each rank's share receives the sum's gradient."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def sum_over(group: dist.ProcessGroup):
    def reduce(x: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(x, group)
    return reduce


def _ffn_plan(prefix: str, sp: bool, shard_dim: int = 1) -> dict:
    """Column-wise w1/w3, row-wise w2; with a sequence-sharded input: gather it first, scatter the output."""
    plan = {}
    if sp:
        plan[prefix] = PrepareModuleInput(input_layouts=(Shard(shard_dim),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    plan[f"{prefix}.w1"] = ColwiseParallel()
    plan[f"{prefix}.w3"] = ColwiseParallel()
    plan[f"{prefix}.w2"] = RowwiseParallel(output_layouts=Shard(shard_dim) if sp else Replicate())
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Tensor parallel over `tp_mesh` (1-D); works on a whole model or a pipeline chunk."""
    if tp_mesh.size() == 1:
        return
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    top: dict = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    group = tp_mesh.get_group()
    for block in model.layers.values():
        plan: dict = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["attn_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                              desired_input_layouts=(Replicate(), None, None), use_local_output=True)
        if isinstance(block.ffn, MoE):
            moe = block.ffn
            # the MoE layer runs on this rank's sequence shard: (B, T/tp, H) in, gathered back out
            plan["ffn"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Shard(1),),
                                             use_local_output=True)
            parallelize_module(block, tp_mesh, plan)
            parallelize_module(moe, tp_mesh, PrepareModuleOutput(
                output_layouts=(Shard(1), None), desired_output_layouts=(seq, None), use_local_output=True))
            parallelize_module(moe.router, tp_mesh, {"gate": SequenceParallel(sequence_dim=0, use_local_output=True)})
            moe.router.sum_over_token_shards = sum_over(group)
            if moe.shared is not None:  # tokens flattened to (B*T/tp, H) inside the MoE layer
                parallelize_module(moe, tp_mesh, _ffn_plan("shared", sp=True, shard_dim=0))
        else:
            plan.update(_ffn_plan("ffn", sp))
            parallelize_module(block, tp_mesh, plan)


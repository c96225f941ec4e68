"""Pipeline parallel with `torch.distributed.pipelining`: `apply_pp(model, layout, meshes, ...)`.

Split (as the performance model assumes, `perfmodel.schedule`): the L layers are cut into
pp*vpp chunks of consecutive layers as the layout splits them (`perfmodel.specs.stages`: L/(pp*vpp)
each by default, the balanced split when pp*vpp does not divide L, or Megatron's first/last,
account-for and layout-string options), so stages may differ in depth; the embedding goes with the first chunk,
the final norm, LM head and loss with the last. Chunk c lives on pipeline rank c % pp (the
looped assignment of interleaved 1F1B, Narayanan et al. 2021), so with vpp = 1 rank r holds
chunk r. Each chunk is a deep copy of the whole single-device model with the other layers and
end pieces removed (torchtitan's `pipeline_module_split` does the same), so parameter names
stay the single-device ones ("layers.5.attn.wq.weight").

Schedules: `Schedule1F1B` (vpp = 1) or `ScheduleInterleaved1F1B` (vpp > 1) over the layout's
m = gbs / (mbs * dp) micro-batches. What flows between stages is (hidden state, running
auxiliary loss), so the load-balancing loss of every stage's MoE layers reaches the last
stage's objective and its gradient flows back through the pipeline; RoPE positions and the
document ids of packed sequences reach every stage as keyword arguments of `step`.

Each chunk is parallelised like a whole model (tensor, expert, recompute, data parallel, in
that order, see parallelize.py); data parallel wraps the stage module, which the pipelining
stage recognises (gradient synchronisation only on the last micro-batch for DDP).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mosaic.trainer.model import MoE, Transformer
from perfmodel.specs.layout import ParallelLayout


class StageModule(nn.Module):
    """One pipeline chunk: positional inputs are what the previous stage sends.

    First stage: (tokens,) -> (hidden, aux); middle: (hidden, aux) -> (hidden, aux);
    last: (hidden, aux) -> (logits, aux); aux is the running auxiliary loss, shape (1,).
    """

    def __init__(self, chunk: Transformer):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor, aux_in: Optional[torch.Tensor] = None,
                positions_BT: Optional[torch.Tensor] = None,
                doc_ids_BT: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.chunk(x, positions_BT, doc_ids_BT, None if aux_in is None else aux_in.reshape(()))
        return x, aux.reshape(1)  # (1,): the schedule concatenates the last stage's outputs over micro-batches


class RankModel(nn.Module):
    """The parameters this rank holds over all its chunks, under their single-device names.

    What the optimizer, gradient clipping and checkpoints see (the chunks share these modules).
    """

    def __init__(self, chunks: list[Transformer]):
        super().__init__()
        self.tok_embeddings = next((c.tok_embeddings for c in chunks if c.tok_embeddings is not None), None)
        self.layers = nn.ModuleDict({key: block for c in chunks for key, block in c.layers.items()})
        self.norm = next((c.norm for c in chunks if c.norm is not None), None)
        self.output = next((c.output for c in chunks if c.output is not None), None)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers.values() if isinstance(b.ffn, MoE)]


def chunk_layers(n_layers: int, pp: int, vpp: int, layout: Optional[ParallelLayout] = None) -> list[range]:
    """Consecutive layers of each of the pp*vpp chunks, as the layout splits them
    (`perfmodel.specs.stages.virtual_stage_layers`: even, balanced or Megatron's uneven options;
    without a layout, the even split)."""
    from perfmodel.specs.stages import virtual_stage_layers

    if layout is None:
        layout = ParallelLayout(pp=pp, vpp=vpp)
    counts = virtual_stage_layers(n_layers, layout)
    assert len(counts) == pp * vpp and sum(counts) == n_layers, (n_layers, counts)  # validity.split_fits_layers
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def split_model(model: Transformer, pp: int, vpp: int, pp_rank: int,
                layout: Optional[ParallelLayout] = None) -> list[tuple[int, Transformer]]:
    """(stage index, chunk) of the chunks pipeline rank `pp_rank` holds: c = pp_rank, pp_rank + pp, ..."""
    ranges = chunk_layers(len(model.layers), pp, vpp, layout)
    n_chunks = len(ranges)
    out = []
    for c in range(pp_rank, n_chunks, pp):
        chunk = copy.deepcopy(model)
        keep = {str(i) for i in ranges[c]}
        for key in list(chunk.layers.keys()):
            if key not in keep:
                del chunk.layers[key]
        if c != 0:
            chunk.tok_embeddings = None
        if c != n_chunks - 1:
            chunk.norm = None
            chunk.output = None
        out.append((c, chunk))
    return out


@dataclass
class PipelineLoss:
    """The per-micro-batch objective of the last stage, with the step's normaliser.

    objective = dp * ce_sum / n_global + aux_coef * aux / m: the same as the non-pipelined loop,
    so gradients are not rescaled by the schedule (scale_grads=False).
    """

    dp: int
    aux_coef: float
    micro_batches: int
    n_global: float = 1.0
    ce: list = field(default_factory=list)
    aux: list = field(default_factory=list)

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        logits, aux = output[0], output[1].reshape(())
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        self.ce.append(ce.detach())
        self.aux.append(aux.detach())
        return self.dp * ce / self.n_global + self.aux_coef * aux / self.micro_batches

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert len(self.ce) in (0, self.micro_batches), len(self.ce)  # one call per micro-batch
        ce = torch.stack(self.ce).double().sum() if self.ce else torch.zeros((), dtype=torch.float64)
        aux = torch.stack(self.aux).double().sum() if self.aux else torch.zeros((), dtype=torch.float64)
        self.ce, self.aux = [], []
        return ce, aux


@dataclass
class Pipeline:
    """This rank's stages, its schedule and the rank view of its parameters."""

    schedule: Any
    stages: list
    rank_model: RankModel
    loss: PipelineLoss

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
             doc_ids: Optional[torch.Tensor]) -> None:
        """One step over the rank's m micro-batches (tensors of m*mbs rows, split by the schedule)."""
        kwargs = {"positions_BT": positions}
        if doc_ids is not None:
            kwargs["doc_ids_BT"] = doc_ids
        target = labels if self.has_last else None
        if self.has_first:
            self.schedule.step(tokens, target=target, **kwargs)
        else:
            self.schedule.step(target=target, **kwargs)


def apply_pp(model: Transformer, layout: ParallelLayout, meshes: Any, device: torch.device,
             parallelize_chunk: Callable[[Transformer], nn.Module], aux_coef: float,
             logits_dtype: torch.dtype = torch.float32) -> Pipeline:
    """Split `model` into this rank's chunks, parallelise each (`parallelize_chunk` returns the
    stage module to run) and build the 1F1B or interleaved 1F1B schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    pp, vpp = layout.pp, layout.vpp
    m = layout.micro_batches()
    chunks = split_model(model, pp, vpp, meshes.pp_rank, layout)
    arch = model.arch
    # Static shapes of what each stage receives and sends (one micro-batch), so the schedule skips
    # its run-time shape inference (an extra forward on placeholder inputs that would count
    # expert loads and call the loss). The residual stream stays fp32 under autocast (fp32
    # embeddings plus the blocks' outputs); with sequence parallel it is a (mbs, T/tp, H) shard.
    # The running aux loss carries a gradient once a MoE layer has been passed.
    mbs = layout.mbs
    seq = arch.seq_len // layout.tp if layout.sequence_parallel else arch.seq_len
    hidden = torch.empty(mbs, seq, arch.d_model, device="meta", requires_grad=True)
    logits = torch.empty(mbs, arch.seq_len, arch.vocab_size, device="meta", dtype=logits_dtype, requires_grad=True)
    tokens = torch.empty(mbs, arch.seq_len, device="meta", dtype=torch.int64)
    ranges = chunk_layers(arch.n_layers, pp, vpp, layout)
    n_chunks = pp * vpp

    def aux_after(c: int) -> torch.Tensor:
        moe_seen = arch.n_experts > 0 and ranges[c].stop > arch.n_dense_layers and ranges[c].stop > 0
        return torch.empty(1, device="meta", requires_grad=moe_seen)

    stages = []
    for index, chunk in chunks:
        stage_module = parallelize_chunk(chunk)
        inputs = (tokens,) if index == 0 else (hidden, aux_after(index - 1))
        outputs = (logits if index == n_chunks - 1 else hidden, aux_after(index))
        stages.append(PipelineStage(stage_module, index, n_chunks, device, input_args=inputs, output_args=outputs,
                                    group=meshes.pp_group))
    loss = PipelineLoss(dp=meshes.dp, aux_coef=aux_coef, micro_batches=m)
    if vpp == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss, scale_grads=False)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss, scale_grads=False)
    return Pipeline(schedule=schedule, stages=stages, rank_model=RankModel([c for _, c in chunks]), loss=loss)

"""The bundled trainer's eager op counts: the source of `perfmodel.eager`'s constants.

An op is what `calibration.eager_ops.OpCounter` counts (an aten op that reaches a backend
kernel, seen by a `TorchDispatchMode` below autograd), the same definition `mosaic calibrate`
uses when it prices one op (`calibration.eager_ops.eager_op_seconds`), so that the CPU model's
host time = ops counted here x seconds per op measured there.

- `count_trainer_ops(arch)`: ops of one training step of `model.Transformer` per block and
  phase (forward ops attributed by module pre-hooks, backward ops by gradient hooks on each
  block's output), and the optimizer's.
- `count_trainer_ops(arch, tp=2)` / `ep=2`: the same tensor- or expert-parallel on a fake
  world (`calibration.eager_ops.fake_world`; collectives do nothing, so only host-side work is
  seen); ops on DTensors are counted apart (`dtensor_fwd_attention`, ..., `dtensor_opt`).
- `count_saved_tensors(arch)`: tensors autograd saves in one forward, per block (what an
  activation-checkpointed region packs and unpacks).

`python -m mosaic.trainer.op_count` prints them for examples/tiny_moe.yaml and its variants.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F

from calibration.eager_ops import DTensorOpCounter, OpCounter, fake_world
from mosaic.trainer.model import Transformer
from mosaic.trainer.parallelize import apply_ac, apply_ep, build_meshes
from mosaic.trainer.tensor_parallel import apply_tp
from perfmodel.specs.architecture import MoEArchitecture
from perfmodel.specs.layout import parse_layout


def count_trainer_ops(arch: MoEArchitecture, recompute: str = "none", mbs: int = 2, tp: int = 1,
                      ep: int = 1) -> dict[str, int]:
    """Ops of one training step of the bundled model on one device, keyed phase_block
    (fwd_attention, bwd_moe, ... per micro-batch, summed over layers) and `opt` (AdamW
    foreach=False as the trainer builds it). The second of two steps is counted (the first
    creates optimizer state). With tp > 1 the model is tensor-parallel on a fake world and ops
    on DTensors are counted apart under dtensor_<key>; with ep > 1 its experts are
    expert-parallel (dp = ep) on a fake world, every rank routing alike."""
    if tp > 1 and ep > 1:
        raise ValueError("count tp and ep apart")
    if tp > 1 or ep > 1:
        with fake_world(max(tp, ep)) as mesh:
            return _count_trainer_ops(arch, recompute, mbs, mesh if tp > 1 else None, ep)
    return _count_trainer_ops(arch, recompute, mbs, None, 1)


def _count_trainer_ops(arch: MoEArchitecture, recompute: str, mbs: int, tp_mesh: Optional[Any],
                       ep: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = Transformer(arch)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=False)
    if ep > 1:
        apply_ep(model, build_meshes(parse_layout(f"dp={ep},ep={ep},mbs={mbs},gbs={mbs * ep}", devices=ep), "cpu"))
    apply_ac(model, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    counter = OpCounter() if tp_mesh is None else DTensorOpCounter()

    def start(label: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            counter.label = label
        return hook

    def on_grad(label: str) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.register_hook(lambda _grad: start(label)())
        return hook

    model.tok_embeddings.register_forward_pre_hook(start("fwd_embedding"))
    model.tok_embeddings.register_forward_hook(on_grad("bwd_embedding"))
    for block in model.layers.values():
        ffn = "moe" if block.is_moe else "dense_ffn"
        block.attn_norm.register_forward_pre_hook(start("fwd_attention"))
        block.attn.register_forward_hook(on_grad("bwd_attention"))
        block.ffn_norm.register_forward_pre_hook(start(f"fwd_{ffn}"))
        block.ffn.register_forward_hook(on_grad(f"bwd_{ffn}"))
    model.norm.register_forward_pre_hook(start("fwd_head"))
    tokens = torch.randint(0, arch.vocab_size, (mbs, arch.seq_len))
    labels = torch.randint(0, arch.vocab_size, (mbs, arch.seq_len))
    for _ in range(2):
        counter.counts.clear()
        counter.names.clear()
        with counter:
            counter.label = "fwd_embedding"
            logits, aux = model(tokens)
            ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            objective = ce / labels.numel() + 0.01 * aux
            counter.label = "bwd_head"
            objective.backward()
            counter.label = "opt"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return dict(counter.counts)


def count_saved_tensors(arch: MoEArchitecture, mbs: int = 2) -> dict[str, int]:
    """Tensors autograd saves in one forward of the bundled model (what a checkpointed region
    packs and unpacks), per block summed over layers: attention (its norm, projections, RoPE and
    core), core (the attention core alone: what selective recompute checkpoints), dense_ffn and
    moe (their norm and FFN), plus embedding and head."""
    torch.manual_seed(0)
    model = Transformer(arch)
    counts: collections.Counter[str] = collections.Counter()
    label = ["embedding"]

    def start(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            label[0] = name
        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts[label[0]] += 1
        return t

    for block in model.layers.values():
        block.attn_norm.register_forward_pre_hook(start("attention"))
        block.ffn_norm.register_forward_pre_hook(start("moe" if block.is_moe else "dense_ffn"))
        attn, core = block.attn, block.attn.core

        def counted_core(*args: Any, _core: Any = core, **kwargs: Any) -> Any:
            label[0] = "core"
            try:
                return _core(*args, **kwargs)
            finally:
                label[0] = "attention"
        attn.core = counted_core
    model.norm.register_forward_pre_hook(start("head"))
    tokens = torch.randint(0, arch.vocab_size, (mbs, arch.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    counts["attention"] += counts["core"]  # the layer region holds its core too
    return dict(counts)


def _main() -> None:
    from perfmodel.specs.strict import load_spec

    torch.set_num_threads(1)
    arch = load_spec(MoEArchitecture, "examples/tiny_moe.yaml")
    variants = {"tiny_moe (GQA, SwiGLU, shared expert)": (arch, "none"),
                "MHA": (dataclasses.replace(arch, n_kv_heads=arch.n_heads), "none"),
                "non-gated": (dataclasses.replace(arch, gated_ffn=False), "none"),
                "no shared expert": (dataclasses.replace(arch, n_shared_experts=0), "none"),
                "recompute full": (arch, "full"), "recompute selective": (arch, "selective")}
    for name, (a, ac) in variants.items():
        counts = count_trainer_ops(a, ac)
        print(f"{name}: total {sum(counts.values())}  {counts}")
    for name, a in (("tiny_moe tp=2", arch), ("dense tp=2", dataclasses.replace(
            arch, n_experts=0, top_k=0, n_shared_experts=0, d_expert=0, n_dense_layers=arch.n_layers))):
        print(f"{name}: {count_trainer_ops(a, tp=2)}")
    for ep in (2, 4):
        print(f"tiny_moe ep={ep}: {count_trainer_ops(arch, ep=ep)}")
    for name, a in (("tiny_moe", arch), ("ungated", dataclasses.replace(arch, gated_ffn=False)),
                    ("no shared expert", dataclasses.replace(arch, n_shared_experts=0))):
        print(f"saved tensors per forward, {name}: {count_saved_tensors(a)}")


if __name__ == "__main__":
    _main()

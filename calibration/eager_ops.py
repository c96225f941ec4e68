"""Eager PyTorch op counts and per-op host cost, the way the CPU model uses them.

On CPU clusters `perfmodel.evaluate` prices a training step as (ops the bundled trainer
dispatches) x `launch_latency_s` + device time (`perfmodel.eager`). Both factors come from
here, measured with one definition of "op": an aten op that reaches a backend kernel,
counted by a `TorchDispatchMode` (below autograd, so a `linear` is its `t` + `mm` + views
and the backward's ops are counted as the autograd engine runs them).

- `count_trainer_ops(arch)`: ops of one training step of `mosaic.trainer.model.Transformer`
  per block and phase (forward ops attributed by module pre-hooks, backward ops by gradient
  hooks on each block's output), and the optimizer's. The source of `perfmodel.eager`'s
  constants: `python -m calibration.eager_ops` prints them for examples/tiny_moe.yaml and
  its variants.
- `count_trainer_ops(arch, tp=2)`: the same under tensor parallel on a fake 2-rank world
  (`fake_world`: torch's in-process fake process group; collectives are no-ops, so only the
  host-side work is seen): ops on DTensors are counted apart (`dtensor_fwd_attention`, ...,
  `dtensor_opt`), each once, at the DTensor level (its local ops run inside it).
- `dtensor_op_seconds()`: host time one DTensor op adds beyond the single-device ops it
  replaces (sharding propagation, wrapping, redistribution bookkeeping): the eager block
  stack below run with column-/row-wise tensor-parallel linears on a fake 2-rank mesh,
  minus the same stack on one device, divided by its DTensor op count. `mosaic calibrate`
  on cpu stores it as `dtensor_op_latency_s`.
- `eager_op_seconds()`: host time per op of an eager transformer-style block (RMSNorm, SwiGLU
  MLP, residual; nn.Modules with autograd) run forward + backward, divided by its
  dispatch-mode op count: what one counted op costs in the trainer (Python module call,
  autograd recording, dispatcher, autograd engine). `mosaic calibrate` on cpu stores it as
  `launch_latency_s` (a bare `x.add_(1)` measures only the dispatcher: 3-5 us here, 3-4x
  less than an op of the trainer).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

EAGER_BLOCK_WIDTH = 64
EAGER_BLOCK_TOKENS = 64
"""The timed block's sizes: the tiny models the CPU trainer runs (d_model 64, 2 x 32 tokens),
small enough that dispatch, not arithmetic, sets its time."""


SAMPLE_SECONDS = 0.03
"""One timed sample lasts about as long as a CPU trainer step (10-100 ms): on a shared machine
a step is descheduled now and then, and a sample this long is too, in proportion; the median
of sub-millisecond samples would see only the uncontended core (measured at load 7.5 on the
2-core test machine: 5.4 us per op from 1 ms samples while the trainer's steps ran 2-2.5x
slower than their op count at that figure)."""


class OpCounter(TorchDispatchMode):
    """Counts aten ops reaching a kernel, under the current `label`."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "other"
        self.counts: collections.Counter[str] = collections.Counter()
        self.names: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        self.counts[self.label] += 1
        self.names[self.label][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class DTensorOpCounter(OpCounter):
    """OpCounter that files ops on DTensors under `dtensor_<label>`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.counts[f"dtensor_{self.label}"] += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def fake_world(ranks: int) -> Iterator[Any]:
    """A 1-D device mesh of `ranks` on torch's in-process fake process group (collectives do
    nothing): the host-side work of a tensor- or expert-parallel rank, in one process. An
    all_to_all_single returns its input, as on a rank whose peers route exactly like it (the
    expert-parallel dispatch then sees consistent split sizes); the copy is made outside any
    dispatch mode, so counters see the collective once, as in a real world. Refused
    (InputError) where a process group already exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import _disable_current_modes

    from perfmodel.errors import InputError

    if dist.is_initialized():
        raise InputError("DTensor op counts and costs need a process of their own (a process group is already "
                         "initialised); run them outside torchrun")
    original = dist.all_to_all_single

    def mirrored(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = original(output, input, *args, **kwargs)
        with _disable_current_modes(), torch.no_grad():
            if output.numel() == input.numel():
                output.copy_(input.reshape(output.shape))
        return work

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    dist.all_to_all_single = mirrored
    try:
        yield init_device_mesh("cpu", (ranks,))
    finally:
        dist.all_to_all_single = original
        dist.destroy_process_group()


def count_trainer_ops(arch: Any, recompute: str = "none", mbs: int = 2, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Ops of one training step of the bundled model on one device, keyed phase_block
    (fwd_attention, bwd_moe, ... per micro-batch, summed over layers) and `opt` (AdamW
    foreach=False as the trainer builds it). The second of two steps is counted (the first
    creates optimizer state). With tp > 1 the model is tensor-parallel on a fake world
    (`fake_world`) and ops on DTensors are counted apart under dtensor_<key>; with ep > 1 its
    experts are expert-parallel (dp = ep) on a fake world, every rank routing alike."""
    if tp > 1 and ep > 1:
        raise ValueError("count tp and ep apart")
    if tp > 1 or ep > 1:
        with fake_world(max(tp, ep)) as mesh:
            return _count_trainer_ops(arch, recompute, mbs, mesh if tp > 1 else None, ep)
    return _count_trainer_ops(arch, recompute, mbs, None, 1)


def _count_trainer_ops(arch: Any, recompute: str, mbs: int, tp_mesh: Any, ep: int) -> dict[str, int]:
    import torch.nn.functional as F

    from mosaic.trainer.model import Transformer
    from mosaic.trainer.parallelize import apply_ac, apply_ep, build_meshes
    from mosaic.trainer.tensor_parallel import apply_tp
    from perfmodel.specs.layout import parse_layout

    torch.manual_seed(0)
    model = Transformer(arch)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=False)
    if ep > 1:
        apply_ep(model, build_meshes(parse_layout(f"dp={ep},ep={ep},mbs={mbs},gbs={mbs * ep}", devices=ep), "cpu"))
    apply_ac(model, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    counter = OpCounter() if tp_mesh is None else DTensorOpCounter()

    def start(label: str) -> Any:
        def hook(*_: Any) -> None:
            counter.label = label
        return hook

    def on_grad(label: str) -> Any:
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


def count_saved_tensors(arch: Any, mbs: int = 2) -> dict[str, int]:
    """Tensors autograd saves in one forward of the bundled model (what a checkpointed region
    packs and unpacks), per block summed over layers: attention (its norm, projections, RoPE and
    core), core (the attention core alone: what selective recompute checkpoints), dense_ffn and
    moe (their norm and FFN), plus embedding and head."""
    from mosaic.trainer.model import Transformer

    torch.manual_seed(0)
    model = Transformer(arch)
    counts: collections.Counter[str] = collections.Counter()
    label = ["embedding"]

    def start(name: str) -> Any:
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


class _Block(torch.nn.Module):
    """RMSNorm -> SwiGLU MLP -> residual, as in the bundled model's dense layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width, eps=1e-6)
        self.w1 = torch.nn.Linear(width, 2 * width, bias=False)
        self.w3 = torch.nn.Linear(width, 2 * width, bias=False)
        self.w2 = torch.nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


def eager_op_step(width: int = EAGER_BLOCK_WIDTH, tokens: int = EAGER_BLOCK_TOKENS) -> tuple[Any, int]:
    """(sample, ops): a callable running a 4-block eager stack forward + backward on cpu with
    autograd back to back for about SAMPLE_SECONDS, and the dispatch-mode op count of one call."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[_Block(width) for _ in range(4)])
    x = torch.randn(tokens, width, requires_grad=True)

    def step() -> None:
        blocks(x).sum().backward()
        for p in blocks.parameters():
            p.grad = None
        x.grad = None

    counter = OpCounter()
    with counter:
        step()
    ops = sum(counter.counts.values())
    for _ in range(3):
        step()
    reps = _reps_per_sample(step)

    def sample() -> None:
        for _ in range(reps):
            step()

    return sample, reps * ops


def _stack_step(blocks: torch.nn.Module, x: torch.Tensor) -> Any:
    def step() -> None:
        blocks(x).sum().backward()
        for p in blocks.parameters():
            p.grad = None
        x.grad = None
    return step


def dtensor_op_samples(samples: int = 15, width: int = EAGER_BLOCK_WIDTH,
                       tokens: int = EAGER_BLOCK_TOKENS) -> tuple[list[float], int]:
    """(seconds each DTensor op adds, one figure per paired sample; DTensor ops per call): the
    eager block stack with w1/w3 column-wise and w2 row-wise (torch's ColwiseParallel /
    RowwiseParallel, as the trainer's FFNs) on a fake 2-rank mesh, timed against the same stack
    on one device in alternating samples of about SAMPLE_SECONDS each."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_world(2) as mesh:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(*[_Block(width) for _ in range(4)])
        sharded = torch.nn.Sequential(*[_Block(width) for _ in range(4)])
        for block in sharded:
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
        x = torch.randn(tokens, width, requires_grad=True)
        plain_step, sharded_step = _stack_step(plain, x), _stack_step(sharded, x)
        counter = DTensorOpCounter()
        with counter:
            sharded_step()
        ops = sum(v for k, v in counter.counts.items() if k.startswith("dtensor_"))
        for _ in range(3):
            plain_step()
            sharded_step()
        reps = _reps_per_sample(sharded_step)

        out = []
        for _ in range(samples):
            out.append((_timed(sharded_step, reps) - _timed(plain_step, reps)) / ops)
        return out, ops


def dtensor_op_seconds(samples: int = 15) -> tuple[float, float, int]:
    """(median seconds a DTensor op adds, IQR/median noise, DTensor ops per call) of `dtensor_op_samples`."""
    from calibration.stats import summarize

    values, ops = dtensor_op_samples(samples)
    stats = summarize([max(v, 1e-9) for v in values])
    return float(stats.median_s), float(stats.iqr_s / stats.median_s), ops


def _reps_per_sample(step: Any) -> int:
    """Calls of `step` that last about SAMPLE_SECONDS (from one timed call)."""
    t0 = time.perf_counter()
    step()
    return max(1, round(SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-6)))


def _timed(step: Any, reps: int) -> float:
    """Seconds per call of `reps` calls back to back."""
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - t0) / reps


class _Core(torch.nn.Module):
    """Causal SDPA over q, k, v: the region selective recompute checkpoints (few saved tensors)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _saved_per_call(fn: Any, *args: Any) -> int:
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved[0]


def checkpoint_costs(samples: int = 9) -> tuple[list[float], list[float], dict[str, Any]]:
    """(seconds per checkpointed region, seconds per tensor it saves -- one figure per paired
    sample each --, details): host time
    `torch.utils.checkpoint` (non-reentrant, as the trainer's recompute) adds beyond the ops it
    dispatches, from two stacks of 4 regions each -- the eager RMSNorm + SwiGLU block (many saved
    tensors) and a causal SDPA core (few) -- each timed with and without checkpointing in
    alternating samples of about SAMPLE_SECONDS; the extra time per region minus its extra ops at
    the per-op cost is solved for cost = region + saved x per_saved in each sample."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_Block(EAGER_BLOCK_WIDTH) for _ in range(4)])
    x = torch.randn(EAGER_BLOCK_TOKENS, EAGER_BLOCK_WIDTH, requires_grad=True)
    core = _Core()
    qkv = [torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3)]

    def block_stack(ck: bool) -> Any:
        def step() -> None:
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if ck else b(h)
            h.sum().backward()
            for p in blocks.parameters():
                p.grad = None
            x.grad = None
        return step

    def core_stack(ck: bool) -> Any:
        def step() -> None:
            outs = [checkpoint(core, *qkv, use_reentrant=False) if ck else core(*qkv) for _ in range(4)]
            torch.stack([o.sum() for o in outs]).sum().backward()
            for t in qkv:
                t.grad = None
        return step

    stacks = {"block": (block_stack, _saved_per_call(blocks[0], x)), "core": (core_stack, _saved_per_call(core, *qkv))}
    extra: dict[str, list[float]] = {}
    for name, (make, _) in stacks.items():
        plain, ck = make(False), make(True)
        ops = {}
        for key, step in (("plain", plain), ("ck", ck)):
            counter = OpCounter()
            with counter:
                step()
            ops[key] = sum(counter.counts.values())
            for _ in range(3):
                step()
        reps = _reps_per_sample(ck)

        values = []
        for _ in range(samples):
            t_plain, t_ck = _timed(plain, reps), _timed(ck, reps)
            per_op = t_plain / ops["plain"]
            values.append((t_ck - t_plain - (ops["ck"] - ops["plain"]) * per_op) / 4)
        extra[name] = values
    s_block, s_core = stacks["block"][1], stacks["core"][1]
    per_saved = [max((b - c) / (s_block - s_core), 0.0) if s_block != s_core else 0.0
                 for b, c in zip(extra["block"], extra["core"])]
    per_region = [max(c - p * s_core, 0.0) for c, p in zip(extra["core"], per_saved)]
    return per_region, per_saved, {"saved": {"block": s_block, "core": s_core}}


def eager_op_seconds(repeats: int = 15, max_seconds: float = 0.6) -> tuple[float, float, int]:
    """(median seconds per op, IQR/median noise, ops per sample) of `eager_op_step`."""
    from calibration.stats import summarize

    step, ops = eager_op_step()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < repeats or (time.perf_counter() - started < max_seconds and len(samples) < 4 * repeats):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) / ops)
    stats = summarize(samples)
    return float(stats.median_s), float(stats.iqr_s / stats.median_s), ops


def _main() -> None:
    from perfmodel.specs.architecture import MoEArchitecture
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
        counts = count_trainer_ops(a, tp=2)
        print(f"{name}: {counts}")
    per_op, noise, ops = eager_op_seconds()
    print(f"eager op with autograd (fwd + bwd, {ops} ops per sample): {per_op * 1e6:.2f} us per op (noise {noise:.2f})")
    regions, saved, details = checkpoint_costs()
    print(f"activation checkpoint: {sorted(regions)[len(regions) // 2] * 1e6:.1f} us per region + "
          f"{sorted(saved)[len(saved) // 2] * 1e6:.2f} us per saved tensor ({details})")
    for name, a in (("tiny_moe", arch), ("ungated", dataclasses.replace(arch, gated_ffn=False)),
                    ("no shared expert", dataclasses.replace(arch, n_shared_experts=0))):
        print(f"saved tensors per forward, {name}: {count_saved_tensors(a)}")
    dt_op, dt_noise, dt_ops = dtensor_op_seconds()
    print(f"DTensor op beyond the single-device ops ({dt_ops} DTensor ops per call): {dt_op * 1e6:.2f} us per op "
          f"(noise {dt_noise:.2f})")


if __name__ == "__main__":
    _main()

"""Eager PyTorch ops: one definition of an op, and the host time one costs.

On CPU clusters `perfmodel.evaluate` prices a training step's host time as (ops the bundled
trainer dispatches) x `launch_latency_s` (+ per DTensor op `dtensor_op_latency_s`, + per
checkpointed region and saved tensor the checkpoint costs; `perfmodel.eager`). An op is an
aten op that reaches a backend kernel, counted by a `TorchDispatchMode` (`OpCounter`; below
autograd, so a `linear` is its `t` + `mm` + views and the backward's ops are counted as the
autograd engine runs them). The trainer's counts are `mosaic.trainer.op_count`'s, with this
counter; the seconds are measured here:

- `eager_op_seconds()` [s/op]: host time of an eager transformer-style block (RMSNorm, SwiGLU
  MLP, residual; nn.Modules with autograd) run forward + backward, divided by its op count:
  what one counted op costs in the trainer (Python module call, autograd recording,
  dispatcher, autograd engine). `mosaic calibrate` on cpu stores it as `launch_latency_s`.
  A bare `x.add_(1)` would time the dispatcher only, a few times less (docs/validation.md,
  "Measurements behind the calibration's settings").
- `dtensor_op_seconds()` [s/op]: host time one DTensor op adds beyond the single-device ops it
  replaces (sharding propagation, wrapping, redistribution bookkeeping) = (t(block stack with
  column-/row-wise tensor-parallel linears on a fake 2-rank mesh) - t(same stack on one
  device)) / its DTensor op count. Stored as `dtensor_op_latency_s`.
- `checkpoint_costs()` [s per region, s per saved tensor]: what `torch.utils.checkpoint`
  adds beyond the ops it re-dispatches, solved from two stacks with few and many saved
  tensors. Stored as `checkpoint_region_latency_s`, `checkpoint_saved_tensor_latency_s`.
- `fake_world(ranks)`: torch's in-process fake process group (collectives are no-ops), so a
  tensor- or expert-parallel rank's host-side work runs in one process.

`python -m calibration.eager_ops` prints the three costs on this machine.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
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
of sub-millisecond samples would see only the uncontended core (docs/validation.md,
"Measurements behind the calibration's settings")."""


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


class EagerBlock(torch.nn.Module):
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


def stack_step(blocks: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of `blocks` on `x` with autograd, gradients dropped after it."""
    def step() -> None:
        blocks(x).sum().backward()
        for p in blocks.parameters():
            p.grad = None
        x.grad = None
    return step


def eager_op_step(width: int = EAGER_BLOCK_WIDTH, tokens: int = EAGER_BLOCK_TOKENS) -> tuple[Any, int]:
    """(sample, ops): a callable running a 4-block eager stack forward + backward on cpu with
    autograd back to back for about SAMPLE_SECONDS, and the dispatch-mode op count of one call."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[EagerBlock(width) for _ in range(4)])
    step = stack_step(blocks, torch.randn(tokens, width, requires_grad=True))
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


def dtensor_op_samples(samples: int = 15, width: int = EAGER_BLOCK_WIDTH,
                       tokens: int = EAGER_BLOCK_TOKENS) -> tuple[list[float], int]:
    """(seconds each DTensor op adds, one figure per paired sample; DTensor ops per call): the
    eager block stack with w1/w3 column-wise and w2 row-wise (torch's ColwiseParallel /
    RowwiseParallel, as the trainer's FFNs) on a fake 2-rank mesh, timed against the same stack
    on one device in alternating samples of about SAMPLE_SECONDS each."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_world(2) as mesh:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(*[EagerBlock(width) for _ in range(4)])
        sharded = torch.nn.Sequential(*[EagerBlock(width) for _ in range(4)])
        for block in sharded:
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
        x = torch.randn(tokens, width, requires_grad=True)
        plain_step, sharded_step = stack_step(plain, x), stack_step(sharded, x)
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
    blocks = torch.nn.ModuleList([EagerBlock(EAGER_BLOCK_WIDTH) for _ in range(4)])
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
    torch.set_num_threads(1)
    per_op, noise, ops = eager_op_seconds()
    print(f"eager op with autograd (fwd + bwd, {ops} ops per sample): {per_op * 1e6:.2f} us per op (noise {noise:.2f})")
    regions, saved, details = checkpoint_costs()
    print(f"activation checkpoint: {sorted(regions)[len(regions) // 2] * 1e6:.1f} us per region + "
          f"{sorted(saved)[len(saved) // 2] * 1e6:.2f} us per saved tensor ({details})")
    dt_op, dt_noise, dt_ops = dtensor_op_seconds()
    print(f"DTensor op beyond the single-device ops ({dt_ops} DTensor ops per call): {dt_op * 1e6:.2f} us per op "
          f"(noise {dt_noise:.2f})")


if __name__ == "__main__":
    _main()

"""Device selection and device-side timing (imports torch; torch_npu only when asked).

Timing follows nanoGPT's `bench.py` discipline: warm up, then time each repeat
between synchronisations. On cuda/npu a repeat is timed by device events
recorded around the call (the kernels' own time, not the host's); on cpu the
call is synchronous and `time.perf_counter` is the clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from calibration.stats import TimingStats, summarize
from perfmodel.errors import InputError

DEVICES = ("cpu", "cuda", "npu")


def _backend_module(kind: str) -> Any:
    """torch.cuda / torch.npu for `kind`, checked to see a device (one error naming --device
    and the fix otherwise); None for cpu."""
    if kind not in DEVICES:
        raise InputError(f"--device {kind!r} is not one of {', '.join(DEVICES)}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: torch sees no CUDA device; install a CUDA build of torch or use --device cpu")
        return torch.cuda
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu backend)
        except ImportError:
            raise InputError("--device npu: torch_npu is not installed; `pip install torch_npu` "
                             "(matching your CANN and torch versions) or use --device cpu") from None
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise InputError("--device npu: torch_npu sees no NPU; check the CANN driver (npu-smi info)")
        return torch.npu  # type: ignore[attr-defined]
    return None


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    """torch.device for `kind` (cpu, cuda, npu); a clear error when the backend is missing."""
    backend = _backend_module(kind)
    if backend is None:
        return torch.device("cpu")
    backend.set_device(local_rank % backend.device_count())
    return torch.device(kind, local_rank % backend.device_count())


def default_cluster_here(kind: str) -> str:
    """The bundled cluster of this machine's first `kind` device
    (`perfmodel.clusters.default_cluster_for_device` on the name torch reports for it); raises
    NoDefaultCluster when none matches, the errors of `resolve_device` when there is no device."""
    from perfmodel.clusters import default_cluster_for_device

    if kind == "cpu":
        return default_cluster_for_device(kind)
    _backend_module(kind)
    return default_cluster_for_device(kind, device_name(torch.device(kind, 0)))


def _backend(device: torch.device) -> Any:
    return getattr(torch, device.type) if device.type in ("cuda", "npu") else None


def synchronize(device: torch.device) -> None:
    backend = _backend(device)
    if backend is not None:
        backend.synchronize()  # NOTE: host-device sync


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name


@dataclass(frozen=True)
class Budget:
    """How hard to time one point: warm-up calls, repeat bounds, and a time cap."""

    warmup: int = 2
    min_repeats: int = 5
    max_repeats: int = 30
    max_seconds: float = 0.5
    """Stop adding repeats (beyond min_repeats) once this much time was spent timing."""


def time_samples(fn: Callable[[], Any], device: torch.device, budget: Budget) -> list[float]:
    """Seconds per call for each repeat of `fn` (after warm-up), device-timed where possible."""
    for _ in range(budget.warmup):
        fn()
    synchronize(device)
    samples: list[float] = []
    backend = _backend(device)
    started = time.perf_counter()
    while len(samples) < budget.max_repeats:
        if backend is not None:
            begin, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()  # NOTE: host-device sync per repeat
            samples.append(begin.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        if len(samples) >= budget.min_repeats and time.perf_counter() - started > budget.max_seconds:
            break
    return samples


def time_call(fn: Callable[[], Any], device: torch.device, budget: Budget) -> TimingStats:
    """`summarize(time_samples(...))`: median with outlier filter and noise."""
    return summarize(time_samples(fn, device, budget))


__all__ = ["DEVICES", "Budget", "default_cluster_here", "device_name", "resolve_device", "synchronize", "time_call", "time_samples"]

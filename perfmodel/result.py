"""`EvalResult`: the predictions of `perfmodel.evaluate` for n candidates, and its keys.

Breakdown (seconds per step): the STEP_COMPONENTS add up to step_time_s; the
HIDDEN_COMPONENTS are communication that ran under compute (not added).
Infeasible candidates carry a reason code into REASONS; their numbers are still
computed (meaningless for invalid_layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

REASONS = ("ok", "invalid_layout", "devices", "precision", "memory", "dispatcher")
"""Reason code -> name. invalid_layout: a `perfmodel.validity` rule fails (see
`validity.violations`); devices: more than the cluster has; precision: the
accelerator has no peak for it; dispatcher: the cluster has no measured figures for
the fused dispatcher over the fabric level the EP group spans (`perfmodel.dispatch`);
memory: above usable HBM. Priority (the first that applies): invalid_layout, devices,
precision, dispatcher, memory."""

STEP_COMPONENTS = ("compute", "attention", "expert_gemm", "recompute", "tp_exposed", "cp_exposed",
                   "ep_exposed", "pp_exposed", "dp_exposed", "dispatch", "overlap_slowdown", "bubble", "optimizer",
                   "straggler")
"""Seconds per step that add up to step_time_s. compute: dense GEMMs and
bandwidth-bound kernels (norms, activations, permutes, embedding, LM head,
cross-entropy); attention: the flash-attention core; expert_gemm: routed
experts' grouped GEMMs; recompute: forward work repeated in the backward pass;
*_exposed: communication not hidden (ep includes etp); dispatch: host launch
time beyond device time; overlap_slowdown: compute slowed by the communication
hidden beside it; bubble: pipeline fill/drain; optimizer: Adam step;
straggler: slowdown from the slowest node."""

HIDDEN_COMPONENTS = ("tp_hidden", "cp_hidden", "ep_hidden", "pp_hidden", "dp_hidden")
"""Seconds per step of communication hidden behind compute, per class (not in step_time_s)."""

BREAKDOWN_KEYS = STEP_COMPONENTS + HIDDEN_COMPONENTS

Index = Union[int, slice, np.ndarray]
"""What `EvalResult.take` selects by: an integer array, a slice or a boolean mask."""


@dataclass(frozen=True)
class EvalResult:
    """Predictions for n candidates (numpy arrays of length n)."""

    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    tokens_per_s_per_device: np.ndarray
    mfu: np.ndarray
    """Model FLOP/s (`model_flops_per_token`: causal attention as executed) / (devices x peak)."""
    tflops_per_device: np.ndarray
    """Achieved model TFLOP/s per device (model FLOPs, no recompute)."""
    memory_per_device_bytes: np.ndarray
    feasible: np.ndarray
    reason: np.ndarray
    """Codes into REASONS."""
    breakdown: dict[str, np.ndarray] = field(default_factory=dict)
    """Seconds per step per component (BREAKDOWN_KEYS)."""
    memory_breakdown: dict[str, np.ndarray] = field(default_factory=dict)
    """Bytes per device per component (memory.MEMORY_COMPONENTS)."""
    devices: np.ndarray = field(default_factory=lambda: np.zeros(0))
    micro_batches: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """m = gbs / (mbs * dp)."""
    mfu_palm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """MFU under the PaLM / Megatron count (attention without causal halving), for comparison
    with published MFUs; can pass 1 at long context."""
    bottleneck_stage: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """0: the first pipeline stage sets the step, 1: the last, 2: a middle one."""
    bottleneck_rank: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Pipeline rank of the stage that sets the step."""
    dropped_fraction: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Fraction of routed token copies a capacity factor drops (0: dropless)."""

    def __len__(self) -> int:
        return int(np.size(self.step_time_s))

    @property
    def reason_names(self) -> list[str]:
        return [REASONS[int(c)] for c in self.reason]

    def row(self, i: int) -> dict[str, Any]:
        """One candidate as plain JSON-ready values (reason as its name, reason_code as int)."""
        def num(x: Any) -> Optional[float]:
            v = float(x)
            return v if math.isfinite(v) else None
        return {
            "step_time_s": num(self.step_time_s[i]),
            "tokens_per_s": num(self.tokens_per_s[i]),
            "tokens_per_s_per_device": num(self.tokens_per_s_per_device[i]),
            "mfu": num(self.mfu[i]),
            "mfu_palm": num(self.mfu_palm[i]) if len(self.mfu_palm) else None,
            "tflops_per_device": num(self.tflops_per_device[i]),
            "memory_per_device_bytes": num(self.memory_per_device_bytes[i]),
            "feasible": bool(self.feasible[i]),
            "reason": REASONS[int(self.reason[i])],
            "reason_code": int(self.reason[i]),
            "devices": int(self.devices[i]),
            "micro_batches": num(self.micro_batches[i]),
            "bottleneck_stage": ("first", "last", "middle")[int(self.bottleneck_stage[i])],
            "bottleneck_rank": int(self.bottleneck_rank[i]) if len(self.bottleneck_rank) else 0,
            "dropped_fraction": num(self.dropped_fraction[i]) if len(self.dropped_fraction) else 0.0,
            "breakdown": {k: num(v[i]) for k, v in self.breakdown.items()},
            "memory_breakdown": {k: num(v[i]) for k, v in self.memory_breakdown.items()},
        }

    def take(self, index: Index) -> EvalResult:
        """The candidates at `index` (an integer array, slice or boolean mask)."""
        values: dict[str, Any] = {}
        for name in EvalResult.__dataclass_fields__:
            value = getattr(self, name)
            values[name] = {k: v[index] for k, v in value.items()} if isinstance(value, dict) else value[index]
        return EvalResult(**values)

    @staticmethod
    def concat(parts: list[EvalResult]) -> EvalResult:
        if len(parts) == 1:
            return parts[0]
        values: dict[str, Any] = {}
        for name in EvalResult.__dataclass_fields__:
            first = getattr(parts[0], name)
            if isinstance(first, dict):
                values[name] = {k: np.concatenate([getattr(p, name)[k] for p in parts]) for k in first}
            else:
                values[name] = np.concatenate([getattr(p, name) for p in parts])
        return EvalResult(**values)

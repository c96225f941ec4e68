"""Per-step metrics as JSON lines (what `mosaic calibrate --from-runs` reads).

One line per optimizer step with exactly the keys `METRIC_KEYS`:
  step               1-based optimizer step
  loss               cross-entropy over the global batch (nats/token), without the aux loss
  aux_loss           load-balancing loss summed over MoE layers, mean over micro-batches
  tokens_per_s       global batch tokens / step_time_s
  step_time_s        wall time of the step on rank 0 (data, forward, backward, optimizer)
  mfu                model FLOP/s / (world * device peak of the compute precision)
  mfu_palm           the same with the PaLM / Megatron attention count (12*L*s*h_q, no causal halving)
  tflops_per_device  model FLOP/s per device / 1e12
  peak_memory_bytes  cuda/npu: peak allocated device memory; cpu: peak resident set of rank 0
  expert_imbalance   max / mean tokens per expert over the global batch, averaged over MoE
                     layers (1.0 for a dense model)
  val_loss           cross-entropy on the held-out token file after this step (nats/token,
                     `validation.validation_loss`), null at steps without a validation
Model FLOPs follow the perfmodel convention: `model_flops_per_token`
(6*N_act + 6*h*V + 6*L*s*h_q, causal attention as executed; recompute not counted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from perfmodel.specs.architecture import MoEArchitecture, model_flops_per_token, model_flops_per_token_palm
from perfmodel.specs.strict import write_text_atomic

METRIC_KEYS = ("step", "loss", "aux_loss", "tokens_per_s", "step_time_s", "mfu", "mfu_palm", "tflops_per_device",
               "peak_memory_bytes", "expert_imbalance", "val_loss")


def step_metrics(*, step: int, loss: float, aux_loss: float, step_time_s: float, tokens: int,
                 arch: MoEArchitecture, world: int, peak_flops_per_s: float, peak_memory_bytes: int,
                 expert_imbalance: float, val_loss: Optional[float] = None) -> dict[str, Any]:
    """One metrics row; the FLOP convention is perfmodel's."""
    tokens_per_s = tokens / step_time_s
    flops_per_s = float(model_flops_per_token(arch)) * tokens_per_s
    per_device = flops_per_s / world
    return {
        "step": int(step),
        "loss": float(loss),
        "aux_loss": float(aux_loss),
        "tokens_per_s": float(tokens_per_s),
        "step_time_s": float(step_time_s),
        "mfu": per_device / peak_flops_per_s,
        "mfu_palm": float(model_flops_per_token_palm(arch)) * tokens_per_s / world / peak_flops_per_s,
        "tflops_per_device": per_device / 1e12,
        "peak_memory_bytes": int(peak_memory_bytes),
        "expert_imbalance": float(expert_imbalance),
        "val_loss": None if val_loss is None else float(val_loss),
    }


class MetricsLog:
    """DIR/metrics.jsonl: a fresh run starts it empty, a resumed one keeps the lines up to its step."""

    def __init__(self, path: str | Path, resume_step: int):
        self.path = Path(path)
        kept = []
        if resume_step > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if row.get("step", 0) <= resume_step:
                    kept.append(line)
        write_text_atomic(self.path, "".join(f"{line}\n" for line in kept))

    def append(self, row: dict[str, Any]) -> None:
        assert tuple(row) == METRIC_KEYS, row.keys()
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row, allow_nan=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def peak_memory_bytes(device: str) -> int:
    """Peak device memory (cuda/npu allocator) or this process's peak RSS on cpu."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    if device == "npu":
        import torch

        return int(torch.npu.max_memory_allocated())  # type: ignore[attr-defined]
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB

"""Compute precision of a run: bf16 autocast (cuda/npu), fp32 (cpu), fp8 through torchao (cuda).

fp8 (`config.trainer_precision` == "fp8"): torchao's `convert_to_float8_training` swaps the
nn.Linear layers of attention, dense FFN and shared experts for Float8Linear (tensorwise
dynamic scaling, the torchao default recipe; torchtitan's `Float8Converter`), everything else
runs in bf16 autocast. Left in high precision, as torchtitan does: the LM head (`output`) and
the router gate (routing decisions are sensitive), and any Linear whose dimensions are not
multiples of 16 (the fp8 GEMM's requirement). Routed experts (grouped GEMM) stay bf16.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from perfmodel.errors import InputError

FP8_MIN_CAPABILITY = (8, 9)
"""fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) and later (NVIDIA CUDA C++ programming guide)."""


def check_fp8_device(device: torch.device) -> None:
    """Refuse fp8 where the GPU has no fp8 tensor cores (one clear message)."""
    if device.type != "cuda":
        raise InputError(f"precision=fp8 needs a cuda device, got {device.type}; use precision=bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise InputError(f"precision=fp8 needs compute capability >= 8.9 (fp8 tensor cores); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use precision=bf16")


def _fp8_filter(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if fqn == "output" or fqn.endswith("router.gate"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, device: torch.device) -> int:
    """Swap eligible nn.Linear layers for torchao Float8Linear on an fp8-capable `device`; returns how many."""
    check_fp8_device(device)
    return convert_fp8(model)


def convert_fp8(model: nn.Module) -> int:
    """Swap the nn.Linear layers `_fp8_filter` admits for torchao Float8Linear; returns how many were swapped."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:  # checked before launch too; a rank's environment may differ
        raise InputError("precision=fp8 trains through torchao, which is not installed; pip install torchao, "
                         "or use precision=bf16") from None
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=_fp8_filter)
    after = sum(type(m) is nn.Linear for m in model.modules())
    return before - after


def autocast_context(precision: str, device: torch.device) -> Any:
    """bf16 autocast for bf16 and fp8 runs (fp8 GEMMs inside Float8Linear); fp32 runs without."""
    if precision in ("bf16", "fp8"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()

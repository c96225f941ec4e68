"""fp8 training through torchao, checked on cpu where torchao is installed: which layers become
Float8Linear, and that a step runs and stays near bf16 (the speed is the GPU check's business,
benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")
pytest.importorskip("torchao", reason="fp8 trains through torchao (pip install torchao)")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from mosaic.trainer.model import Transformer  # noqa: E402
from mosaic.trainer.precision import convert_fp8  # noqa: E402


def test_float8_replaces_attention_dense_and_shared_linears_but_not_head_or_router(tiny_arch):
    torch.manual_seed(0)
    model = Transformer(tiny_arch)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, tiny_arch.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference, _ = model(tokens)
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    swapped = convert_fp8(model)
    kinds = {name: type(m) for name, m in model.named_modules() if name in linears}
    kept = {name for name, kind in kinds.items() if kind is torch.nn.Linear}
    assert kept == {"output"} | {name for name in linears if name.endswith("router.gate")}
    assert swapped == len(linears) - len(kept) and all(kinds[n] is Float8Linear for n in linears - kept)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, aux = model(tokens)
    (logits.float().square().mean() + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    relative = (logits.float() - reference.float()).norm() / reference.float().norm()
    assert relative < 0.1  # e4m3 activations and weights: a few percent from bf16

"""perfmodel.eager's op counts are the bundled trainer's: counted again here with the trainer's own
counter (mosaic.trainer.op_count, on calibration.eager_ops' definition of an op) on the tiny MoE
and its variants."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch", reason="counting the trainer's ops needs torch")

from mosaic.trainer.op_count import count_saved_tensors, count_trainer_ops  # noqa: E402
from perfmodel import eager  # noqa: E402
from perfmodel.specs.architecture import MoEArchitecture  # noqa: E402

TINY = MoEArchitecture(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, seq_len=32,
                       n_experts=8, top_k=2, n_shared_experts=1, d_expert=32, d_ff_dense=128, n_dense_layers=1,
                       ffn_ratio=4.0, gated_ffn=True, tie_embeddings=False)
DENSE = dataclasses.replace(TINY, n_experts=0, top_k=0, n_shared_experts=0, d_expert=0, n_dense_layers=2)


def predicted(arch: MoEArchitecture, recompute: str = "none") -> tuple[float, float, float]:
    """(forward, backward, optimizer) ops of one micro-batch and the AdamW step, from perfmodel.eager."""
    ops = eager.eager_block_ops(arch)
    layers = {"attention": arch.n_layers, "dense_ffn": arch.n_dense_layers if arch.n_experts else arch.n_layers,
              "moe": arch.n_layers - arch.n_dense_layers if arch.n_experts else 0, "embedding": 1, "head": 1}
    fwd = sum(layers[b] * float(ops[b][0]) for b in ops)
    bwd = sum(layers[b] * float(ops[b][1]) for b in ops)
    if recompute == "full":
        bwd += sum(layers[b] * float(ops[b][0]) for b in ("attention", "dense_ffn", "moe"))
        bwd += eager.EAGER_FULL_RECOMPUTE_OPS * arch.n_layers
    elif recompute == "selective":
        bwd += eager.EAGER_SELECTIVE_RECOMPUTE_OPS * arch.n_layers
    tensors = sum(layers[b] * float(n) for b, n in eager.eager_param_tensors(arch).items())
    return fwd, bwd, tensors


@pytest.mark.parametrize("arch,recompute", [
    (TINY, "none"), (DENSE, "none"), (dataclasses.replace(TINY, n_kv_heads=4), "none"),
    (dataclasses.replace(TINY, gated_ffn=False), "none"), (dataclasses.replace(TINY, n_shared_experts=0), "none"),
    (TINY, "full"), (TINY, "selective"), (dataclasses.replace(TINY, n_layers=3), "none"),
], ids=["tiny_moe", "dense", "mha", "ungated", "no_shared", "full", "selective", "three_layers"])
def test_model_counts_equal_the_trainers_ops(arch: MoEArchitecture, recompute: str) -> None:
    counts = count_trainer_ops(arch, recompute)
    fwd = sum(v for k, v in counts.items() if k.startswith("fwd_"))
    bwd = sum(v for k, v in counts.items() if k.startswith("bwd_"))
    want_fwd, want_bwd, tensors = predicted(arch, recompute)
    # full recompute re-runs the forward inside backward, where the forward hooks label it fwd_*
    assert fwd + bwd == pytest.approx(want_fwd + want_bwd, rel=0.02)
    if recompute == "none":
        assert fwd == pytest.approx(want_fwd, rel=0.02)
    # AdamW (foreach=False) ops per tensor, without the gradient-norm ops the trainer adds
    adam_per_tensor = eager.EAGER_OPS_PER_PARAM_TENSOR - 3.0
    assert counts["opt"] == pytest.approx(adam_per_tensor * tensors, abs=4)


def predicted_dtensor(arch: MoEArchitecture, recompute: str = "none") -> tuple[float, float]:
    """(forward + backward DTensor ops of one micro-batch, DTensor parameters) under tp > 1, from perfmodel.eager."""
    ops = eager.eager_dtensor_block_ops(arch)
    layers = {"attention": arch.n_layers, "dense_ffn": arch.n_dense_layers if arch.n_experts else arch.n_layers,
              "moe": arch.n_layers - arch.n_dense_layers if arch.n_experts else 0, "embedding": 1, "head": 1}
    total = sum(layers[b] * float(ops[b][0] + ops[b][1]) for b in ops)
    if recompute == "full":
        total += eager.EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR * sum(
            layers[b] * float(ops[b][0]) for b in ("attention", "dense_ffn", "moe"))
    tensors = sum(layers[b] * float(n) for b, n in eager.eager_dtensor_param_tensors(arch).items())
    return total, tensors


@pytest.mark.parametrize("arch,recompute", [
    (TINY, "none"), (DENSE, "none"), (dataclasses.replace(TINY, n_kv_heads=4), "none"),
    (dataclasses.replace(TINY, n_shared_experts=0), "none"), (TINY, "full"), (dataclasses.replace(TINY, n_layers=3), "none"),
], ids=["tiny_moe", "dense", "mha", "no_shared", "full", "three_layers"])
def test_model_dtensor_counts_equal_the_tensor_parallel_trainers(arch: MoEArchitecture, recompute: str) -> None:
    counts = count_trainer_ops(arch, recompute, tp=2)
    mb = sum(v for k, v in counts.items() if k.startswith(("dtensor_fwd_", "dtensor_bwd_")))
    want_mb, tensors = predicted_dtensor(arch, recompute)
    assert mb == pytest.approx(want_mb, rel=0.05)
    # AdamW (foreach=False) ops per DTensor parameter, without the gradient-norm ops the trainer adds
    assert counts["dtensor_opt"] == pytest.approx((eager.EAGER_DTENSOR_OPS_PER_PARAM_TENSOR - 3.0) * tensors, abs=2)


@pytest.mark.parametrize("ep", [2, 4])
def test_model_expert_parallel_ops_equal_the_trainers(ep: int) -> None:
    one = count_trainer_ops(TINY)
    spread = count_trainer_ops(TINY, ep=ep)
    moe_layers = TINY.n_layers - TINY.n_dense_layers
    assert spread["fwd_moe"] - one["fwd_moe"] == eager.EAGER_EP_OPS[0] * moe_layers
    assert spread["bwd_moe"] - one["bwd_moe"] == eager.EAGER_EP_OPS[1] * moe_layers
    assert {k: v for k, v in spread.items() if "moe" not in k} == {k: v for k, v in one.items() if "moe" not in k}


@pytest.mark.parametrize("arch", [TINY, DENSE, dataclasses.replace(TINY, gated_ffn=False),
                                  dataclasses.replace(TINY, n_shared_experts=0), dataclasses.replace(TINY, n_kv_heads=4)],
                         ids=["tiny_moe", "dense", "ungated", "no_shared", "mha"])
def test_model_saved_tensor_counts_equal_the_trainers(arch: MoEArchitecture) -> None:
    counted = count_saved_tensors(arch)
    saved = eager.eager_saved_tensors(arch)
    dense_layers = arch.n_dense_layers if arch.n_experts else arch.n_layers
    assert counted["attention"] == float(saved["attention"]) * arch.n_layers
    assert counted["core"] == eager.EAGER_SAVED_CORE * arch.n_layers
    assert counted["dense_ffn"] == float(saved["dense_ffn"]) * dense_layers
    assert counted.get("moe", 0) == float(saved["moe"]) * (arch.n_layers - dense_layers)

"""Fidelity of the model against independent sources (each test names the source it restates)."""

from __future__ import annotations

import numpy as np
import pytest

from perfmodel import evaluate, load_cluster
from perfmodel import operators as ops
from perfmodel.memory import stage_memory
from perfmodel.schedule import stage_layer_counts
from perfmodel.specs import LayoutBatch, MoEArchitecture, parse_layout

H100 = load_cluster("h100")

GPT = MoEArchitecture(
    n_layers=16, d_model=1024, n_heads=16, n_kv_heads=16, head_dim=64, vocab_size=51200, seq_len=2048,
    d_ff_dense=4096, gated_ffn=False, tie_embeddings=True,
)
LLAMA = MoEArchitecture(
    n_layers=16, d_model=2048, n_heads=16, n_kv_heads=4, head_dim=128, vocab_size=32000, seq_len=4096,
    d_ff_dense=5632, gated_ffn=True,
)
MOE = MoEArchitecture(
    n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, head_dim=64, vocab_size=32000, seq_len=2048,
    n_experts=32, top_k=4, d_expert=512,
)


def megatron_activation_bytes(arch, tp, pp, vpp, mbs, microbatches):
    """Megatron-LM `megatron/training/theoretical_memory_usage.py::compute_activation_memory`
    (sequence parallel + selective recompute; Korthikanti et al. 2022 Table 2), first stage,
    restated for a configuration with pp > 1 (no output layer on the first stage)."""
    s, b, h = arch.seq_len, mbs, arch.d_model
    memory = s * b * h * (18 + 4 * arch.d_ff_dense / h) * arch.n_layers
    memory += 8 * s * b * pp  # token ids to the embedding (int64)
    memory += s * b * h * pp  # embedding dropout mask
    if vpp > 1:
        memory *= 1 + (pp - 1) / (pp * vpp)
    elif pp > 1:
        memory *= min(1, microbatches / pp)
    return memory / tp


@pytest.mark.parametrize("tp,pp,vpp,mbs,gbs", [(2, 4, 1, 1, 64), (4, 2, 2, 2, 32), (2, 4, 1, 1, 2)])
def test_selective_sp_activations_match_megatron_formula_without_dropout(tp, pp, vpp, mbs, gbs):
    """MOSAIC has no dropout: Megatron's figure minus its dropout masks (one byte per element:
    attention-output and MLP-output masks per layer, the embedding mask) and the int64 token ids
    (the data loader's, not the model's) is MOSAIC's first-stage activation memory."""
    layout = parse_layout(f"tp={tp},pp={pp},vpp={vpp},mbs={mbs},gbs={gbs},sp=true,recompute=selective",
                          devices=tp * pp)
    m = gbs // mbs
    s, h = GPT.seq_len, GPT.d_model
    penalty = 1 + (pp - 1) / (pp * vpp) if vpp > 1 else min(1, m / pp)
    masks = (2 * s * mbs * h * GPT.n_layers * penalty + s * mbs * h * pp * penalty) / tp
    token_ids = 8 * s * mbs * pp * penalty / tp
    expected = megatron_activation_bytes(GPT, tp, pp, vpp, mbs, m) - masks - token_ids
    counts = stage_layer_counts(GPT, layout)["first"]
    mosaic = stage_memory(GPT, layout, H100, "first", counts)["activations"]
    assert float(mosaic) == pytest.approx(expected, rel=1e-9)


def test_weights_and_distributed_optimizer_match_megatron_formula():
    """Megatron-LM `compute_weight_and_optimizer_memory`: (6 + 12/dp) bytes per parameter of the
    most loaded shard ((transformer block / pp + embedding) / tp) with the distributed optimizer,
    18 without. MOSAIC keeps RMSNorm weights whole on every tp rank and the final norm on the
    last stage (Megatron divides them like the rest): a difference below 0.1% here."""
    a = LLAMA
    h, h_q, h_kv = a.d_model, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    layer = 2 * h * h_q + 2 * h * h_kv + 3 * h * a.d_ff_dense + 2 * h
    block = layer * a.n_layers + h
    for flavor, dp in (("zero1", 4), ("ddp", 4)):
        tp, pp = 2, 2
        layout = parse_layout(f"tp={tp},pp={pp},dp={dp},dp_flavor={flavor},sp=true,mbs=1,gbs=16",
                              devices=tp * pp * dp)
        shard = (block / pp + a.vocab_size * h) / tp
        per_param = 6 + 12 / dp if flavor == "zero1" else 18
        counts = stage_layer_counts(a, layout)["first"]
        mem = stage_memory(a, layout, H100, "first", counts)
        mosaic = mem["weights"] + mem["gradients"] + mem["optimizer"]
        assert float(mosaic) == pytest.approx(shard * per_param, rel=1e-3)


def test_moe_stored_activations_use_mean_load_but_time_uses_busiest_rank(monkeypatch):
    """Activations summed over many layers concentrate at the mean tokens per rank; each
    all-to-all and grouped GEMM waits for the busiest rank (`routing.busiest_load_factor`)."""
    layout = parse_layout("ep=8,mbs=1,gbs=64", devices=8)
    base = evaluate(MOE, layout, H100)
    factor = ops.busiest_load_factor
    monkeypatch.setattr(ops, "busiest_load_factor", lambda *args: 2.0 * factor(*args))
    heavy = evaluate(MOE, layout, H100)
    assert heavy.memory_breakdown["activations"][0] == pytest.approx(base.memory_breakdown["activations"][0])
    assert heavy.memory_breakdown["moe_buffers"][0] > base.memory_breakdown["moe_buffers"][0]
    assert heavy.breakdown["expert_gemm"][0] > base.breakdown["expert_gemm"][0]
    # the stored routed-expert tensors: M_mean rows x (input h + gate/up 2d + weighted act d) x 2 B
    # + the fp32 probability (Megatron-Core applies probs in the activation: no output kept)
    rows = MOE.seq_len * MOE.top_k
    per_row = 2 * (MOE.d_model + 3 * MOE.d_expert) + 4
    act = base.memory_breakdown["activations"][0]
    without_experts = evaluate(MOE.replace(n_experts=0, top_k=0, d_expert=0, d_ff_dense=1),
                               parse_layout("mbs=1,gbs=8", devices=1), H100)
    router_and_norm = MOE.n_layers * MOE.seq_len * (2 * 2 * MOE.d_model + 4 * MOE.n_experts)
    ffn_of_dense = MOE.n_layers * MOE.seq_len * (2 * 2 * MOE.d_model + (2 * 2 + 2) * 1)  # gated, d_ff 1
    expected = without_experts.memory_breakdown["activations"][0] - ffn_of_dense + router_and_norm \
        + MOE.n_layers * rows * per_row
    assert act == pytest.approx(expected, rel=1e-12)


def test_cpu_local_hides_no_context_parallel_exchange():
    """gloo collectives on CPU are synchronous: nothing hides, cp included (cpu_local.yaml)."""
    cpu = load_cluster("cpu_local")
    assert cpu.overlap.cp == 0.0
    small = GPT.replace(n_layers=2, seq_len=512)
    result = evaluate(small, parse_layout("cp=2,mbs=1,gbs=2", devices=2), cpu, devices=2)
    assert result.breakdown["cp_hidden"][0] == 0.0
    assert result.breakdown["cp_exposed"][0] > 0.0


@pytest.mark.parametrize("cluster", ["h100", "b200"])
def test_mixed_precision_batch_equals_single_rows(cluster):
    """A batch mixing precisions prices each row with its own efficiency curve (shared-knot
    gather on h100, side-by-side curves on b200 whose fp8 curve has other knots)."""
    from perfmodel.specs import ArchBatch
    spec = load_cluster(cluster)
    archs = [GPT, LLAMA, MOE, LLAMA, MOE]
    layouts = [parse_layout(t, devices=8) for t in (
        "tp=2,pp=2,sp=true,recompute=selective,gbs=32", "tp=2,sp=true,precision=fp8,gbs=16",
        "ep=8,precision=fp8,gbs=16", "tp=8,sp=true,precision=fp32,gbs=8", "ep=8,precision=mxfp8,gbs=16")]
    batch = evaluate(ArchBatch.stack(archs), LayoutBatch.stack(layouts), spec)
    for i, (a, lay) in enumerate(zip(archs, layouts)):
        one = evaluate(a, lay, spec)
        assert batch.step_time_s[i] == pytest.approx(one.step_time_s[0], rel=1e-12)
        assert batch.memory_per_device_bytes[i] == pytest.approx(one.memory_per_device_bytes[0], rel=1e-12)


def _op(arch, layout, block, name):
    return next(op for op in ops.layer_ops(arch, layout)[block] if op.name == name)


def test_fp8_casts_are_memory_bound_kernels_with_current_scaling_and_transposes():
    """Transformer Engine FP8 current scaling: amax read + cast read (2 x 2 B) + rowwise and
    columnwise fp8 writes (2 x 1 B) per element; MXFP8: one read + two writes with 1/32 scales."""
    layout = parse_layout("tp=2,sp=true,mbs=1,gbs=8,precision=fp8", devices=2)
    t, hq, hkv, h = LLAMA.seq_len, LLAMA.n_heads * LLAMA.head_dim, LLAMA.n_kv_heads * LLAMA.head_dim, LLAMA.d_model
    cast = _op(LLAMA, layout, "attention", "fp8_cast")
    assert cast.bytes[0] == pytest.approx(6.0 * t * hq / 2)                    # out_proj input
    assert cast.bytes[1] == pytest.approx(6.0 * t * (h + (hq + 2 * hkv) / 2))  # both output gradients
    mx = _op(LLAMA, parse_layout("tp=2,sp=true,mbs=1,gbs=8,precision=mxfp8", devices=2), "attention", "fp8_cast")
    assert mx.bytes[0] == pytest.approx((2.0 + 2 * (1 + 1 / 32)) * t * hq / 2)
    bf16 = _op(LLAMA, parse_layout("tp=2,sp=true,mbs=1,gbs=8", devices=2), "attention", "fp8_cast")
    assert float(np.sum(bf16.bytes)) == 0.0 and float(np.sum(bf16.kernels)) == 0.0
    # the casts make fp8 slower than its GEMMs alone would: compute at fp8 > bf16 compute / 2
    both = evaluate(LLAMA, layout, H100), evaluate(LLAMA, parse_layout("tp=2,sp=true,mbs=1,gbs=8", devices=2), H100)
    assert both[0].breakdown["compute"][0] > both[1].breakdown["compute"][0] / 2


def test_router_and_lm_head_stay_bf16_under_fp8():
    """Megatron's output_layer is not a TE module and torchtitan float8 skips `output`; the
    router is a plain linear: their time does not change when the layout's GEMMs go fp8."""
    from perfmodel.hardware import HardwareView
    from perfmodel.host import host_dispatch
    from perfmodel.inputs import as_float
    from perfmodel.specs import ArchBatch
    from perfmodel.tables import op_times
    a = as_float(ArchBatch.stack([MOE]))
    times = {}
    for precision in ("bf16", "fp8"):
        lay = as_float(LayoutBatch.stack([parse_layout(f"ep=8,gbs=8,precision={precision}", devices=8)]))
        hw = HardwareView(H100, lay, host_dispatch(H100).core_share(np.array([8.0])))
        table = ops.layer_ops(a, lay)
        times[precision] = {name: op_times(next(o for o in table[blk] if o.name == name), hw)[0]
                            for blk, name in (("head", "lm_head"), ("moe", "router"), ("moe", "expert_up"))}
    for name in ("lm_head", "router"):
        assert float(times["fp8"][name][0]) == pytest.approx(float(times["bf16"][name][0]))
    assert float(times["fp8"]["expert_up"][0]) < float(times["bf16"]["expert_up"][0])


def test_absent_shared_experts_launch_no_kernels():
    """A MoE layer without shared experts launches nothing for them (host dispatch counts kernels)."""
    layout = parse_layout("ep=8,gbs=8", devices=8)
    for n_shared, launched in ((0, 0.0), (1, 1.0)):
        shared = [op for op in ops.moe_ops(MOE.replace(n_shared_experts=n_shared), layout)
                  if op.name.startswith("shared_")]
        assert {float(np.asarray(op.kernels[0])) for op in shared} == {launched}


def test_grouped_expert_gemm_launches_one_gemm_per_local_expert():
    """TE GroupedLinear -> nvte_multi_stream_cublas_gemm: one cuBLAS call per local expert and
    phase, each sized as one expert's GEMM (the efficiency size)."""
    for ep in (1, 4, 8):
        layout = parse_layout(f"ep={ep},gbs=8", devices=8)
        up = _op(MOE, layout, "moe", "expert_up")
        local = MOE.n_experts / ep
        assert [float(k) for k in up.kernels] == [local] * 3
        # each launch is one expert's GEMM: the efficiency is read at one group's rows
        assert float(up.shape[0]) * local == pytest.approx(float(up.flops[0]) / (2 * float(up.shape[1]) * float(up.shape[2])))


def test_expert_optimizer_states_shard_over_expert_data_parallel_group():
    """Megatron-Core distributed optimizer: dense states shard over dp (x cp), routed experts
    over their own expert-data-parallel group edp = tp*cp*dp / (etp*ep) (MoE parallel folding)."""
    dp, ep = 8, 4
    expert_params = MOE.n_layers * MOE.n_experts / ep * 3 * MOE.d_model * MOE.d_expert
    mem = {}
    for flavor in ("ddp", "zero1"):
        layout = parse_layout(f"dp={dp},ep={ep},dp_flavor={flavor},mbs=1,gbs=64", devices=dp)
        mem[flavor] = stage_memory(MOE, layout, H100, "first", stage_layer_counts(MOE, layout)["first"])
    dense_params = float(mem["ddp"]["optimizer"]) / 12 - expert_params
    assert dense_params > 0
    edp = dp // ep
    assert float(mem["zero1"]["optimizer"]) == pytest.approx(12 * (dense_params / dp + expert_params / edp))
    # weights and main gradients stay whole under the distributed optimizer (6 B per parameter)
    assert float(mem["zero1"]["weights"] + mem["zero1"]["gradients"]) == pytest.approx(
        6 * (dense_params + expert_params))


def test_router_load_balancing_loss_is_a_memory_bound_cost_of_tokens_times_experts():
    layout = parse_layout("tp=2,sp=true,ep=4,gbs=8", devices=8)
    aux = _op(MOE, layout, "moe", "router_aux_loss")
    tokens = MOE.seq_len / 2  # routed per rank: sequence-split over tp
    assert float(aux.bytes[0]) == pytest.approx(13 * tokens * MOE.n_experts)
    assert float(aux.bytes[1]) == pytest.approx(16 * tokens * MOE.n_experts)
    doubled = _op(MOE.replace(n_experts=64), layout, "moe", "router_aux_loss")
    assert float(doubled.bytes[0]) == pytest.approx(2 * float(aux.bytes[0]))

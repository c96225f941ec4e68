"""perfmodel.evaluate: hand-computed cases, invariants, reasons, API shape."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from perfmodel import REASONS, evaluate, goodput, load_cluster
from perfmodel.comm import collective_time
from perfmodel.errors import InputError
from perfmodel.evaluate import HIDDEN_COMPONENTS, STEP_COMPONENTS
from perfmodel.kernels import flat_figures
from perfmodel.memory import MEMORY_COMPONENTS
from perfmodel.operators import PHASES, layer_ops
from perfmodel.specs import ArchBatch, LayoutBatch, MoEArchitecture, ParallelLayout, parse_layout
from perfmodel.specs.architecture import active_params, norm_params

H100 = load_cluster("h100")

MIXTRAL = MoEArchitecture(
    n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=32000, seq_len=4096,
    n_experts=8, top_k=2, d_expert=14336, ffn_ratio=3.5, gated_ffn=True,
)
DENSE = MoEArchitecture(
    n_layers=4, d_model=512, n_heads=8, n_kv_heads=8, head_dim=64, vocab_size=8000, seq_len=1024,
    d_ff_dense=2048, gated_ffn=False,
)
SMALL_MOE = MoEArchitecture(
    n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, head_dim=64, vocab_size=32000, seq_len=2048,
    n_experts=16, top_k=2, n_shared_experts=1, d_expert=512, d_ff_dense=4096, n_dense_layers=1,
)


def ideal_cluster(efficiency: float = 0.5):
    """One flat compute efficiency, effectively infinite memory bandwidth, no latency or stragglers."""
    acc = H100.accelerator
    acc = dataclasses.replace(acc, kernels=flat_figures(efficiency), hbm_bandwidth_bytes_per_s=1e30,
                              launch_latency_s=0.0)
    return dataclasses.replace(H100, accelerator=acc, straggler=dataclasses.replace(H100.straggler, cv=0.0))


def test_one_device_time_is_flops_over_effective_peak():
    """Single device, no communication, memory free: step = executed FLOPs / (peak x eff).

    Executed per token: 6 x (N_act without norms) + 6hV (LM head) + causal flash attention
    2·s·h_q forward and 2.5x that backward per layer (7·L·s·h_q in all).
    """
    cluster = ideal_cluster(0.5)
    layout = ParallelLayout(mbs=2, gbs=8).resolve(1)
    result = evaluate(DENSE, layout, cluster)
    a = DENSE
    h_q = a.n_heads * a.head_dim
    per_token = (6 * (active_params(a) - norm_params(a)) + 6 * a.d_model * a.vocab_size
                 + 7 * a.n_layers * a.seq_len * h_q)
    expected = 8 * a.seq_len * per_token / (989e12 * 0.5)
    assert result.step_time_s[0] == pytest.approx(expected, rel=1e-6)
    comm = [k for k in result.breakdown if k.endswith(("_exposed", "_hidden"))]
    assert all(result.breakdown[k][0] == 0 for k in comm)
    assert result.breakdown["bubble"][0] == 0
    # MFU = model FLOPs / executed FLOPs x efficiency
    model = a.model_flops_per_token
    assert result.mfu[0] == pytest.approx(0.5 * model / per_token, rel=1e-6)


def test_recompute_full_adds_one_forward():
    cluster = ideal_cluster(0.5)
    base = evaluate(DENSE, ParallelLayout(mbs=1, gbs=4).resolve(1), cluster)
    full = evaluate(DENSE, ParallelLayout(mbs=1, gbs=4, recompute="full").resolve(1), cluster)
    fwd_layers = (base.breakdown["compute"] + base.breakdown["attention"])[0]
    assert full.breakdown["recompute"][0] > 0.2 * fwd_layers
    assert full.step_time_s[0] == pytest.approx(base.step_time_s[0] + full.breakdown["recompute"][0], rel=1e-9)
    assert full.mfu[0] < base.mfu[0]
    assert full.memory_breakdown["activations"][0] < base.memory_breakdown["activations"][0]


def test_breakdown_adds_up_and_memory_adds_up():
    layouts = [parse_layout(s, devices=256) for s in (
        "tp=1,ep=8,pp=4,mbs=1,gbs=1024", "tp=2,ep=8,pp=4,vpp=2,sp=true,recompute=selective,gbs=512",
        "tp=1,ep=8,cp=2,dp_flavor=fsdp,recompute=full,gbs=256", "tp=4,ep=4,etp=2,pp=2,dp_flavor=ddp,gbs=512")]
    result = evaluate(MIXTRAL, LayoutBatch.stack(layouts), H100)
    assert len(result) == 4
    total = sum(result.breakdown[k] for k in STEP_COMPONENTS)
    np.testing.assert_allclose(total, result.step_time_s, rtol=1e-12)
    mem = sum(result.memory_breakdown[k] for k in MEMORY_COMPONENTS)
    np.testing.assert_allclose(mem, result.memory_per_device_bytes, rtol=1e-12)
    for key in STEP_COMPONENTS + HIDDEN_COMPONENTS:
        assert np.all(result.breakdown[key] >= 0), key


def test_bubble_is_zero_without_pipeline_and_shrinks_with_interleaving():
    pp1 = evaluate(MIXTRAL, parse_layout("tp=1,ep=8,pp=1,gbs=512", devices=256), H100)
    assert pp1.breakdown["bubble"][0] == 0
    plain = evaluate(MIXTRAL, parse_layout("ep=8,pp=4,vpp=1,gbs=512", devices=256), H100)
    inter = evaluate(MIXTRAL, parse_layout("ep=8,pp=4,vpp=2,gbs=512", devices=256), H100)
    assert 0 < inter.breakdown["bubble"][0] < plain.breakdown["bubble"][0]
    # 1F1B: the bubble is (pp - 1) / m of the useful time
    m = plain.micro_batches[0]
    useful = plain.step_time_s[0] - plain.breakdown["bubble"][0] - plain.breakdown["straggler"][0]
    useful -= plain.breakdown["optimizer"][0] + plain.breakdown["dp_exposed"][0]
    assert plain.breakdown["bubble"][0] == pytest.approx(useful * 3 / m, rel=1e-9)


def test_exposed_communication_never_exceeds_total():
    strings = ["tp=2,ep=8,pp=2,sp=true,gbs=512", "tp=4,ep=4,cp=2,gbs=256", "ep=16,dp_flavor=fsdp,gbs=256"]
    layouts = LayoutBatch.stack([parse_layout(s, devices=256) for s in strings])
    no_overlap = dataclasses.replace(H100, overlap=dataclasses.replace(H100.overlap, tp=0.0, ep=0.0, dp=0.0, pp=0.0,
                                                                       cp=0.0))
    full_overlap = dataclasses.replace(H100, overlap=dataclasses.replace(H100.overlap, tp=1.0, ep=1.0, dp=1.0,
                                                                         pp=1.0, cp=1.0))
    none = evaluate(SMALL_MOE, layouts, no_overlap)
    full = evaluate(SMALL_MOE, layouts, full_overlap)
    for cls in ("tp", "cp", "ep", "pp"):
        assert np.all(none.breakdown[f"{cls}_hidden"] == 0)
        total = none.breakdown[f"{cls}_exposed"]
        assert np.all(full.breakdown[f"{cls}_exposed"] <= total + 1e-15)
        np.testing.assert_allclose(full.breakdown[f"{cls}_exposed"] + full.breakdown[f"{cls}_hidden"], total,
                                   rtol=1e-9, atol=1e-15)
    assert np.all(full.step_time_s <= none.step_time_s)


def test_fsdp_never_communicates_less_than_ddp():
    strings = ["ep=8,gbs=256", "tp=2,ep=4,pp=2,gbs=512", "ep=1,gbs=64", "tp=8,ep=8,gbs=1024"]
    for s in strings:
        ddp = evaluate(SMALL_MOE, parse_layout(s + ",dp_flavor=ddp", devices=64), H100)
        fsdp = evaluate(SMALL_MOE, parse_layout(s + ",dp_flavor=fsdp", devices=64), H100)
        ddp_total = ddp.breakdown["dp_exposed"][0] + ddp.breakdown["dp_hidden"][0]
        fsdp_total = fsdp.breakdown["dp_exposed"][0] + fsdp.breakdown["dp_hidden"][0]
        assert fsdp_total >= ddp_total > 0, s


def test_ep_group_crossing_nodes_is_never_faster():
    # collective level: 8 ranks inside a node vs the same 8 ranks one per node
    for size in (1e3, 1e6, 1e9):
        inside = collective_time(H100, "all_to_all", size, 8, 1)
        across = collective_time(H100, "all_to_all", size, 8, 8)
        half = collective_time(H100, "all_to_all", size, 8, 2)
        assert across >= half >= inside > 0
    # whole model: the same layout on nodes of 8 and of 4 devices
    small_nodes = dataclasses.replace(H100, levels=(dataclasses.replace(H100.levels[0], devices=4), H100.levels[1]))
    layout = parse_layout("ep=8,gbs=256", devices=64)
    inside = evaluate(SMALL_MOE, layout, H100)
    across = evaluate(SMALL_MOE, layout, small_nodes)
    ep = lambda r: r.breakdown["ep_exposed"][0] + r.breakdown["ep_hidden"][0]  # noqa: E731
    assert ep(across) > ep(inside)
    assert across.step_time_s[0] >= inside.step_time_s[0]


def test_more_hbm_never_makes_a_feasible_config_infeasible():
    rng = np.random.default_rng(0)
    strings = [f"tp={tp},ep={ep},pp={pp},mbs={mbs},recompute={rc}"
               for tp in (1, 2, 8) for ep in (1, 8) for pp in (1, 4) for mbs in (1, 4) for rc in ("none", "full")]
    layouts = LayoutBatch.stack([parse_layout(s, devices=64) for s in strings])
    small = evaluate(MIXTRAL, layouts, H100)
    acc = H100.accelerator
    bigger = dataclasses.replace(H100, accelerator=dataclasses.replace(acc, hbm_bytes=160e9, hbm_usable_bytes=158e9))
    big = evaluate(MIXTRAL, layouts, bigger)
    assert np.all(big.feasible[small.feasible])
    assert np.any(big.feasible & ~small.feasible)  # the test has teeth: some became feasible
    assert rng is not None


def test_mfu_in_unit_interval_for_feasible_candidates():
    strings = [f"tp={tp},ep={ep},pp={pp},mbs={mbs},dp_flavor={fl}" for tp in (1, 2, 4) for ep in (1, 4, 16)
               for pp in (1, 2, 8) for mbs in (1, 2) for fl in ("ddp", "zero1", "fsdp")]
    result = evaluate(SMALL_MOE, LayoutBatch.stack([parse_layout(s, devices=128) for s in strings]), H100)
    ok = result.feasible
    assert ok.sum() > 10
    assert np.all((result.mfu[ok] > 0) & (result.mfu[ok] < 1))
    np.testing.assert_allclose(result.tflops_per_device, result.mfu * 989.0, rtol=1e-9)


def test_reasons_and_no_exceptions():
    cases = {
        "tp=3,dp=2,gbs=64": "invalid_layout",                    # 3 does not divide the heads
        "tp=1,ep=8,pp=1,dp=2048,gbs=2048": "devices",             # beyond the 1024 devices
        "tp=1,ep=1,pp=1,mbs=16,gbs=16,dp=1": "memory",            # Mixtral on one GPU
    }
    for text, reason in cases.items():
        layout = parse_layout(text)
        layout = layout if layout.dp is not None else layout.resolve(64)
        result = evaluate(MIXTRAL, layout, H100)
        assert not result.feasible[0]
        assert REASONS[result.reason[0]] == reason, text
        assert result.row(0)["reason"] == reason
    cpu_like = dataclasses.replace(H100, accelerator=dataclasses.replace(
        H100.accelerator, peak_flops_per_s={"fp32": 1e12, "bf16": 2e12}))
    fp8 = evaluate(DENSE, parse_layout("precision=fp8", devices=8), cpu_like)
    assert REASONS[fp8.reason[0]] == "precision"
    assert np.isfinite(fp8.step_time_s[0])


def test_devices_argument_must_match_world():
    layout = parse_layout("tp=2,ep=8,gbs=256", devices=64)
    assert evaluate(SMALL_MOE, layout, H100, devices=64).feasible[0]
    assert REASONS[evaluate(SMALL_MOE, layout, H100, devices=128).reason[0]] == "invalid_layout"


def test_batches_broadcast_and_match_single_calls():
    layouts = [parse_layout(s, devices=64) for s in ("ep=8,gbs=128", "tp=2,ep=16,pp=2,gbs=256", "ep=4,mbs=2,gbs=256")]
    batch = evaluate(SMALL_MOE, LayoutBatch.stack(layouts), H100)
    for i, layout in enumerate(layouts):
        single = evaluate(SMALL_MOE, layout, H100)
        assert single.step_time_s[0] == pytest.approx(batch.step_time_s[i], rel=1e-12)
    archs = ArchBatch.stack([SMALL_MOE, SMALL_MOE.replace(top_k=4), SMALL_MOE.replace(n_layers=16)])
    by_arch = evaluate(archs, layouts[0], H100)
    assert len(by_arch) == 3
    assert by_arch.step_time_s[1] > by_arch.step_time_s[0]  # more experts per token costs time
    assert by_arch.step_time_s[2] > by_arch.step_time_s[0]


def test_empty_batch_gives_empty_result():
    empty = LayoutBatch.stack([parse_layout("gbs=8", devices=8)]).take(np.zeros(0, dtype=np.int64))
    result = evaluate(DENSE, empty, H100)
    assert len(result) == 0 and result.breakdown["compute"].shape == (0,)


def test_large_batches_are_chunked_consistently():
    layout = LayoutBatch.stack([parse_layout("ep=8,gbs=128", devices=64), parse_layout("tp=2,ep=4,gbs=256", devices=64)])
    many = layout.take(np.arange(70000) % 2)
    result = evaluate(SMALL_MOE, many, H100)
    assert len(result) == 70000
    two = evaluate(SMALL_MOE, layout, H100)
    np.testing.assert_allclose(result.step_time_s[:2], two.step_time_s)
    np.testing.assert_allclose(result.step_time_s[-2:], two.step_time_s)


def test_row_is_json_ready():
    result = evaluate(MIXTRAL, parse_layout("ep=8,pp=4,gbs=512", devices=256), H100)
    row = result.row(0)
    text = json.dumps(row, allow_nan=False)
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "tflops_per_device",
                "memory_per_device_bytes", "feasible", "reason", "breakdown", "memory_breakdown"):
        assert key in row
    assert "bubble" in json.loads(text)["breakdown"]
    assert row["tokens_per_s"] == pytest.approx(512 * 4096 / row["step_time_s"])


def test_mixed_precision_memory_is_18_bytes_per_parameter():
    """Megatron: bf16 weight 2 + fp32 grad 4 + fp32 master/moments 12; ZeRO-1 shards the 12."""
    ddp = evaluate(DENSE, parse_layout("dp_flavor=ddp,gbs=8", devices=8), H100)
    zero1 = evaluate(DENSE, parse_layout("dp_flavor=zero1,gbs=8", devices=8), H100)
    fsdp = evaluate(DENSE, parse_layout("dp_flavor=fsdp,gbs=8", devices=8), H100)
    params = ddp.memory_breakdown["weights"][0] / 2
    states = lambda r: sum(r.memory_breakdown[k][0] for k in ("weights", "gradients", "optimizer"))  # noqa: E731
    assert states(ddp) == pytest.approx(18 * params)
    assert states(zero1) == pytest.approx((6 + 12 / 8) * params)
    assert states(fsdp) == pytest.approx(18 / 8 * params)


def test_activations_follow_korthikanti_without_dropout():
    """Non-gated MHA with a 4h MLP, no parallelism: 32·s·b·h bytes per layer (their 34 minus two
    dropout masks; flash attention stores no s x s scores) + the fp32 log-sum-exp 4·s·b·a.
    Selective recompute of core_attn drops only the log-sum-exp: the attention output is
    the input out_proj keeps (Korthikanti et al. Table 2: selective keeps 34·s·b·h)."""
    arch = DENSE
    for recompute, expected_per_layer in (("none", 32 * arch.d_model + 4 * arch.n_heads),
                                          ("selective", 32 * arch.d_model)):
        result = evaluate(arch, parse_layout(f"mbs=2,gbs=2,recompute={recompute}", devices=1), H100)
        tokens = 2 * arch.seq_len
        assert result.memory_breakdown["activations"][0] == pytest.approx(arch.n_layers * tokens * expected_per_layer)
    # fp8: tensors kept only as GEMM inputs are Transformer Engine's 1-byte copies:
    # norm inputs 2+2, QKV input 1, Q/K/V 6, attention output 2 (flash) + 1 (fp8 copy),
    # MLP input 1, GeLU input 8, GeLU output (down-projection input) 4 -> 27·h + 4·a
    fp8 = evaluate(arch, parse_layout("mbs=2,gbs=2,precision=fp8", devices=1), H100)
    assert fp8.memory_breakdown["activations"][0] == pytest.approx(
        arch.n_layers * 2 * arch.seq_len * (27 * arch.d_model + 4 * arch.n_heads))
    # tensor parallel with sequence parallel divides everything by t
    sp = evaluate(arch, parse_layout("tp=4,sp=true,mbs=2,gbs=2", devices=4), H100)
    assert sp.memory_breakdown["activations"][0] == pytest.approx(
        arch.n_layers * 2 * arch.seq_len * (32 * arch.d_model + 4 * arch.n_heads) / 4)


def test_dispatch_bounds_tiny_micro_batches():
    tiny = DENSE.replace(seq_len=16, d_model=64, n_heads=1, n_kv_heads=1, d_ff_dense=128, vocab_size=256)
    slow_host = dataclasses.replace(H100, accelerator=dataclasses.replace(H100.accelerator, launch_latency_s=1e-3))
    result = evaluate(tiny, parse_layout("gbs=1", devices=1), slow_host)
    assert result.breakdown["dispatch"][0] > 0.5 * result.step_time_s[0]


def test_cpu_ranks_beyond_cores_share_the_peak():
    cpu = dataclasses.replace(ideal_cluster(0.5), host_cores=2, devices=8)
    two = evaluate(DENSE, parse_layout("gbs=2", devices=2), cpu)
    four = evaluate(DENSE, parse_layout("gbs=4", devices=4), cpu)
    # same work per rank, half the peak per rank
    assert four.breakdown["compute"][0] == pytest.approx(2 * two.breakdown["compute"][0], rel=1e-9)
    # MFU against the cores the ranks share: 2 cores x peak, not 4 ranks x peak
    model_flops_per_s = DENSE.model_flops_per_token * four.tokens_per_s[0]
    assert four.mfu[0] == pytest.approx(model_flops_per_s / (2 * 989e12), rel=1e-9)


def test_straggler_and_goodput():
    result = [evaluate(SMALL_MOE, parse_layout("ep=8,gbs=1024", devices=d), H100) for d in (8, 64, 1024)]
    assert result[0].breakdown["straggler"][0] == 0
    factors = [r.step_time_s[0] / (r.step_time_s[0] - r.breakdown["straggler"][0]) for r in result]
    assert factors[0] < factors[1] < factors[2]
    assert factors[2] == pytest.approx(1 + 0.01 * math.sqrt(2 * math.log(128)), rel=1e-9)
    g = goodput(H100, np.array([8, 1024, 16384]))
    assert 1 > g[0] > g[1] > g[2] > 0
    mtbf = 6340.0 * 3600 / 128
    assert goodput(H100, 1024) == pytest.approx(1 - math.sqrt(2 * 60 / mtbf) - 600 / mtbf)
    fixed = dataclasses.replace(H100, goodput=dataclasses.replace(H100.goodput, eta=0.9, node_mtbf_hours=None))
    assert goodput(fixed, 4096) == 0.9


def test_layer_ops_explain_every_phase():
    ops = layer_ops(SMALL_MOE, parse_layout("tp=2,ep=4,gbs=64", devices=16))
    names = {op.name for block in ops.values() for op in block}
    assert {"qkv_proj", "core_attention", "router", "permute", "expert_up", "expert_down", "unpermute_combine",
            "shared_up", "lm_head", "cross_entropy", "embedding"} <= names
    qkv = next(op for op in ops["attention"] if op.name == "qkv_proj")
    row = qkv.row()
    assert row["fwd_flops"] == row["dgrad_flops"] == row["wgrad_flops"] > 0
    core = next(op for op in ops["attention"] if op.name == "core_attention")
    assert core.row()["wgrad_flops"] == 0 and core.row()["dgrad_flops"] == 2.5 * core.row()["fwd_flops"]
    assert set(PHASES) == {"fwd", "dgrad", "wgrad"}


def test_shared_block_tables_equal_pricing_every_row(monkeypatch):
    """Grids (geometries x layouts) price each distinct block table once; results are identical."""
    import sys

    module = sys.modules["perfmodel.tables"]
    strings = [f"tp={tp},ep={ep},pp={pp},mbs={mbs},dp_flavor={fl},recompute={rc}"
               for tp in (1, 2) for ep in (1, 4, 16) for pp in (1, 2, 4) for mbs in (1, 2) for fl in ("ddp", "fsdp")
               for rc in ("none", "full")]
    layouts = LayoutBatch.stack([parse_layout(s, devices=64) for s in strings])
    archs = ArchBatch.stack([SMALL_MOE, SMALL_MOE.replace(top_k=4), DENSE.replace(n_layers=8)])
    index = np.arange(3 * len(layouts))
    a, lay = archs.take(index // len(layouts)), layouts.take(index % len(layouts))
    tokens = module.pack_columns([np.asarray(getattr(a, f), dtype=float) for f in module.TOKEN_FIELDS[0]]
                                 + [np.asarray(getattr(lay, f), dtype=float) for f in module.TOKEN_FIELDS[1]])
    for block in module.GROUPED_BLOCKS:  # the shared path runs
        assert module.block_groups(block, a, lay, tokens) is not None, block
    shared = evaluate(a, lay, H100)
    monkeypatch.setattr(module, "block_groups", lambda *args: None)
    plain = evaluate(a, lay, H100)
    np.testing.assert_array_equal(shared.step_time_s, plain.step_time_s)
    np.testing.assert_array_equal(shared.memory_per_device_bytes, plain.memory_per_device_bytes)
    np.testing.assert_array_equal(shared.reason, plain.reason)


def test_mixed_precision_batch_equals_single_calls():
    strings = [f"ep=8,mbs={mbs},precision={p}" for p in ("bf16", "fp8", "fp32", "mxfp8", "fp16") for mbs in (1, 4)]
    layouts = [parse_layout(s, devices=64) for s in strings]
    batch = evaluate(SMALL_MOE, LayoutBatch.stack(layouts), H100)
    for i, layout in enumerate(layouts):
        single = evaluate(SMALL_MOE, layout, H100)
        assert single.step_time_s[0] == pytest.approx(batch.step_time_s[i], rel=1e-12), strings[i]
        assert single.mfu[0] == pytest.approx(batch.mfu[i], rel=1e-12)


def test_batch_of_even_and_uneven_splits_equals_single_calls():
    # even splits (closed form), uneven ones (general rule, timed middle ranks) and a dense model in one batch
    strings = ["pp=4,ep=4,mbs=1", "pp=4,ep=2,balanced_split=true,mbs=1", "pp=8,ep=2,mbs=1",
               "pp=4,first_stage_layers=1,last_stage_layers=1,ep=2,mbs=1", "pp=2,vpp=2,ep=4,mbs=2", "ep=8,mbs=1"]
    archs = [SMALL_MOE, SMALL_MOE.replace(n_layers=10), DENSE.replace(n_layers=12)]
    pairs = [(a, parse_layout(s, devices=64)) for a in archs for s in strings]
    batch = evaluate(ArchBatch.stack([a for a, _ in pairs]), LayoutBatch.stack([lay for _, lay in pairs]), H100)
    assert set(batch.bottleneck_stage) == {0, 1, 2}  # first, last and middle ranks set the step
    for i, (arch, layout) in enumerate(pairs):
        single = evaluate(arch, layout, H100)
        for got, want in ((batch.step_time_s[i], single.step_time_s[0]), (batch.memory_per_device_bytes[i],
                          single.memory_per_device_bytes[0]), (batch.bottleneck_rank[i], single.bottleneck_rank[0])):
            assert got == pytest.approx(want, rel=1e-12), (arch.n_layers, layout.to_string())


def test_cpu_ranks_pay_launch_time_on_top():
    gpu = H100
    cpu = dataclasses.replace(H100, host_cores=16)  # 2 ranks on 16 cores: no sharing of the peak
    on_cpu = evaluate(DENSE, parse_layout("mbs=4,gbs=8", devices=2), cpu)
    on_gpu = evaluate(DENSE, parse_layout("mbs=4,gbs=8", devices=2), gpu)
    assert on_gpu.breakdown["dispatch"][0] == 0  # the device is busy longer than the host launches
    assert on_cpu.breakdown["dispatch"][0] > 0
    assert on_cpu.breakdown["compute"][0] == pytest.approx(on_gpu.breakdown["compute"][0])
    assert on_cpu.step_time_s[0] > on_gpu.step_time_s[0]


def test_cpu_ranks_beyond_cores_share_the_fabric_too():
    cpu = dataclasses.replace(ideal_cluster(0.5), host_cores=2, devices=8)
    two = evaluate(DENSE, parse_layout("dp=2,gbs=4", devices=2), cpu)
    four = evaluate(DENSE, parse_layout("dp=2,tp=2,gbs=4", devices=4), cpu)
    own_cores = dataclasses.replace(cpu, host_cores=4)
    four_alone = evaluate(DENSE, parse_layout("dp=2,tp=2,gbs=4", devices=4), own_cores)
    # gloo moves and reduces on the shared cores: every collective of a rank takes 1/share as long
    for key in ("tp_exposed", "dp_exposed"):
        assert four.breakdown[key][0] == pytest.approx(2 * four_alone.breakdown[key][0], rel=1e-9)
    assert two.breakdown["dp_exposed"][0] > 0


def test_eager_tensor_parallel_pays_dtensor_ops_only_on_cpu_ranks():
    cpu = dataclasses.replace(H100, host_cores=16)
    priced = dataclasses.replace(cpu, accelerator=dataclasses.replace(
        cpu.accelerator, dtensor_op_latency_s=1e-4, sources={**cpu.accelerator.sources, "dtensor_op_latency_s": "test"}))
    layout = parse_layout("tp=2,gbs=4", devices=2)
    without = evaluate(DENSE, layout, cpu)
    with_cost = evaluate(DENSE, layout, priced)
    # every DTensor op of the micro-batches and of the optimizer adds its latency
    assert with_cost.breakdown["dispatch"][0] > without.breakdown["dispatch"][0]
    assert with_cost.breakdown["optimizer"][0] > without.breakdown["optimizer"][0]
    no_tp = parse_layout("dp=2,gbs=4", devices=2)
    assert evaluate(DENSE, no_tp, priced).step_time_s[0] == pytest.approx(evaluate(DENSE, no_tp, cpu).step_time_s[0])
    gpu = dataclasses.replace(priced, host_cores=None)  # GPUs: the host enqueues ahead, DTensor is not priced
    assert evaluate(DENSE, layout, gpu).step_time_s[0] == pytest.approx(evaluate(DENSE, layout, H100).step_time_s[0])


def test_eager_recompute_pays_checkpoint_host_time_per_region_and_saved_tensor():
    cpu = dataclasses.replace(H100, host_cores=16)
    sources = {**cpu.accelerator.sources, "checkpoint_region_latency_s": "test", "checkpoint_saved_tensor_latency_s": "test"}
    priced = dataclasses.replace(cpu, accelerator=dataclasses.replace(
        cpu.accelerator, checkpoint_region_latency_s=2e-4, checkpoint_saved_tensor_latency_s=1e-5, sources=sources))
    extra = {}
    for mode in ("none", "selective", "full"):
        layout = parse_layout(f"mbs=1,gbs=2,recompute={mode}", devices=1)
        extra[mode] = evaluate(DENSE, layout, priced).breakdown["dispatch"][0] - evaluate(DENSE, layout, cpu).breakdown["dispatch"][0]
    assert extra["none"] == 0
    # two micro-batches, one region per layer each; a layer saves more tensors than its attention core
    layers = DENSE.n_layers
    assert extra["selective"] == pytest.approx(2 * layers * (2e-4 + 1e-5 * 5.0), rel=1e-9)
    assert extra["full"] > extra["selective"]


def test_attention_core_runs_at_its_own_fitted_efficiency():
    """Halving the attention figures' e_max doubles the flash core's time and leaves the GEMMs alone."""
    ideal = ideal_cluster(0.5)
    acc = ideal.accelerator
    attn = {p: dataclasses.replace(a, fwd_e_max=a.fwd_e_max / 2, bwd_e_max=a.bwd_e_max / 2)
            for p, a in acc.kernels.attention.items()}
    slower = dataclasses.replace(ideal, accelerator=dataclasses.replace(
        acc, kernels=dataclasses.replace(acc.kernels, attention=attn)))
    layout = parse_layout("mbs=1,gbs=1", devices=1)
    base, priced = evaluate(DENSE, layout, ideal), evaluate(DENSE, layout, slower)
    # memory is free on the ideal part: the flash core takes twice as long; GEMMs (incl. the bf16 head) are untouched
    assert priced.breakdown["attention"][0] == pytest.approx(2 * base.breakdown["attention"][0], rel=1e-6)
    assert priced.breakdown["compute"][0] == pytest.approx(base.breakdown["compute"][0], rel=1e-9)
    assert priced.step_time_s[0] > base.step_time_s[0]

def test_moe_host_synchronisations_serialise_once_per_routed_layer_forward():
    """Each routed MoE layer's forward waits one device-to-host read (split sizes): the step
    pays (host_sync + launch) per MoE layer and micro-batch, twice under full recompute; a
    dense model and a cluster that prices no sync pay nothing of it."""
    from perfmodel.host import MOE_HOST_SYNCS_PER_LAYER

    acc = H100.accelerator
    assert acc.host_sync_latency_s and "host_sync_latency_s" in acc.sources
    no_sync = dataclasses.replace(H100, accelerator=dataclasses.replace(acc, host_sync_latency_s=None))
    per_sync = acc.host_sync_latency_s + acc.launch_latency_s
    moe_layers = SMALL_MOE.n_layers - SMALL_MOE.n_dense_layers
    for recompute, factor in (("none", 1.0), ("full", 2.0)):
        layout = ParallelLayout(mbs=1, gbs=4, recompute=recompute).resolve(1)
        micro_batches = 4
        with_sync = evaluate(SMALL_MOE, layout, H100).breakdown["dispatch"][0]
        without = evaluate(SMALL_MOE, layout, no_sync).breakdown["dispatch"][0]
        expected = micro_batches * factor * MOE_HOST_SYNCS_PER_LAYER * moe_layers * per_sync
        assert with_sync - without == pytest.approx(expected, rel=1e-6)
    layout = ParallelLayout(mbs=1, gbs=4).resolve(1)
    assert evaluate(DENSE, layout, H100).breakdown["dispatch"][0] == evaluate(DENSE, layout, no_sync).breakdown["dispatch"][0]


def test_mfu_at_128k_context_counts_the_causal_attention_executed():
    """At 128k tokens attention is most of the step: MFU counts the causal half the kernels
    execute, so it stays below 1 even on a device that runs every kernel at its peak, while
    the PaLM/Megatron convention (non-causal 12·L·s·h_q) reports more than was run."""
    long = MoEArchitecture(n_layers=4, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=32000,
                           seq_len=131072, d_ff_dense=14336, gated_ffn=True)
    layout = ParallelLayout(mbs=1, gbs=1).resolve(1)
    perfect = evaluate(long, layout, ideal_cluster(1.0))
    assert perfect.mfu[0] <= 1.0 + 1e-9
    assert perfect.mfu_palm[0] > 1.0  # the convention's numerator counts the masked half too
    real = evaluate(long, layout, H100)
    assert 0.0 < real.mfu[0] < 1.0 and real.mfu_palm[0] > real.mfu[0]


MLA_MOE = MoEArchitecture(
    n_layers=4, d_model=512, n_heads=8, n_kv_heads=8, head_dim=64, vocab_size=32000, seq_len=1024,
    n_experts=8, top_k=2, n_shared_experts=1, d_expert=256, d_ff_dense=1024, n_dense_layers=1,
    q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, v_head_dim=64)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_each_recompute_module_drops_the_tensors_it_discards_and_repeats_its_ops(precision):
    """Megatron-Core --recompute-modules: each module added to core_attn lowers the stored bytes by
    exactly what memory.py says it discards, and adds the forward of its ops to the backward."""
    from perfmodel.memory import layer_activation_bytes
    from perfmodel.operators import activation_bytes, gemm_operand_bytes, mla_widths, shapes

    cluster = load_cluster("h100")

    def layout(modules):
        return parse_layout(f"ep=8,mbs=1,gbs=8,recompute=selective,precision={precision}"
                            + (f",recompute_modules={modules}" if modules else ""), devices=8)

    base = layout(None)
    assert base.recompute_modules is None and layout("core_attn").recompute_modules is None  # the default
    sh, w = shapes(MLA_MOE, base), mla_widths(MLA_MOE, base)
    b, g = activation_bytes(base), gemm_operand_bytes(base)
    T, h, M = float(sh["T"]), float(sh["h"]), float(sh["M_kept"])
    dropped = {  # per block of one layer and micro-batch
        "mla_up_proj": {"attention": b * T * w["H"] * (2 * w["d_q"] + w["d_v"])},
        "layernorm": {"attention": g * T * h, "dense_ffn": g * T * h, "moe": b * T * h},
        "moe_act": {"moe": g * M * MLA_MOE.d_expert},
        "mlp": {"dense_ffn": (2 * b + g) * T * MLA_MOE.d_ff_dense},
    }
    before = layer_activation_bytes(MLA_MOE, base)
    r0 = evaluate(MLA_MOE, base, cluster)
    for module, by_block in dropped.items():
        lay = layout(f"core_attn+{module}")
        after = layer_activation_bytes(MLA_MOE, lay)
        for block in ("attention", "dense_ffn", "moe"):
            assert float(before[block] - after[block]) == pytest.approx(float(by_block.get(block, 0.0)), rel=1e-9), \
                (module, block)
        r = evaluate(MLA_MOE, lay, cluster)
        assert r.memory_breakdown["activations"][0] < r0.memory_breakdown["activations"][0], module
        assert r.breakdown["recompute"][0] > r0.breakdown["recompute"][0], module
    # without core_attn the core keeps its output and log-sum-exp again
    alone = layer_activation_bytes(MLA_MOE, layout("mla_up_proj"))
    with_core = layer_activation_bytes(MLA_MOE, layout("core_attn+mla_up_proj"))
    assert float(alone["attention"]) > float(with_core["attention"])


@pytest.mark.parametrize("text, field", [
    ("recompute=full,recompute_modules=moe_act", "recompute_modules"),
    ("recompute=selective,recompute_modules=moe", "recompute_modules"),
    ("recompute=selective,recompute_modules=core_attn+attn", "recompute_modules"),
])
def test_a_bad_recompute_module_list_names_the_field_and_the_fix(text, field):
    with pytest.raises(InputError, match=f"'{field}'.*; "):
        parse_layout(text)


def test_recompute_modules_round_trip_in_one_spelling():
    lay = parse_layout("recompute=selective,recompute_modules=moe_act+layernorm", devices=1)
    assert lay.recompute_modules == "layernorm+moe_act" and "rc=selective[layernorm+moe_act]" in lay.label()
    assert parse_layout(lay.to_string(), devices=1) == lay
    assert LayoutBatch.stack([lay]).row(0) == lay


def test_torchtitan_op_policy_saves_every_other_matmul_and_the_attention_core():
    """recompute_modules=op (torchtitan's selective_ac_option "op"): per transformer block the
    outputs of aten.mm (all but every second one), flash SDPA and max are saved; torchao float8
    linears call aten._scaled_mm, which is not saved, so under fp8 every projection is recomputed."""
    from perfmodel.memory import layer_activation_bytes
    from perfmodel.operators import activation_bytes, shapes

    gqa = dataclasses.replace(DENSE, n_heads=8, n_kv_heads=2, gated_ffn=True)
    mla = dataclasses.replace(MLA_MOE, n_experts=0, top_k=0, n_shared_experts=0, d_expert=0, n_dense_layers=0)
    cluster = load_cluster("h100")
    for precision in ("bf16", "fp8"):
        lay = parse_layout(f"mbs=1,gbs=8,recompute=selective,recompute_modules=op,precision={precision}", devices=8)
        sh, b = shapes(gqa, lay), activation_bytes(lay)
        T, h, h_q, h_kv = (float(sh[k]) for k in ("T", "h", "h_q", "h_kv"))
        stored = layer_activation_bytes(gqa, lay)
        # wq, wv (mm 1, 3) saved, wk, wo (2, 4) recomputed; w1 (5) saved, w3 (6) recomputed, w2 (7) saved
        mm_out = (h_q + h_kv) if precision == "bf16" else 0.0
        core = b * T * h_q + 4.0 * T * gqa.n_heads
        assert float(stored["attention"]) == pytest.approx(b * T * h + b * T * mm_out + core, rel=1e-12)
        ffn_out = (gqa.d_ff_dense + h) if precision == "bf16" else 0.0
        assert float(stored["dense_ffn"]) == pytest.approx(b * T * ffn_out, rel=1e-12)
        times = {rc: evaluate(gqa, parse_layout(f"mbs=1,gbs=8,precision={precision},{rc}", devices=8),
                              cluster).breakdown["recompute"][0]
                 for rc in ("recompute=selective", "recompute=selective,recompute_modules=op", "recompute=full")}
        assert times["recompute=selective"] < times["recompute=selective,recompute_modules=op"] < times["recompute=full"]
    # MLA with a q down projection makes 5 attention matmuls: the FFN's w1 is the 6th (recomputed),
    # w3 the 7th (saved), w2 the 8th (recomputed)
    lay = parse_layout("mbs=1,gbs=8,recompute=selective,recompute_modules=op", devices=8)
    sh, b = shapes(mla, lay), activation_bytes(lay)
    assert float(layer_activation_bytes(mla, lay)["dense_ffn"]) == pytest.approx(
        b * float(sh["T"]) * mla.d_ff_dense, rel=1e-12)


def test_grouped_block_tables_price_the_op_policy_of_every_row():
    """Block tables are shared by rows equal in their table fields (recompute is not one), so a
    batch mixing torchtitan's op policy with Megatron's modules prices each row as alone."""
    gqa = dataclasses.replace(DENSE, n_heads=8, n_kv_heads=2, gated_ffn=True)
    cluster = load_cluster("h100")
    texts = ["mbs=1,gbs=8,recompute=selective,recompute_modules=op", "mbs=1,gbs=8,recompute=selective"]
    layouts = [parse_layout(texts[i % 2], devices=8) for i in range(300)]  # >= 256 rows: grouped tables
    batch = evaluate(ArchBatch.stack([gqa] * 300), LayoutBatch.stack(layouts), cluster)
    for i in (0, 1):
        alone = evaluate(gqa, layouts[i], cluster)
        assert batch.step_time_s[i] == pytest.approx(alone.step_time_s[0], rel=1e-12)
        assert batch.breakdown["recompute"][i] == pytest.approx(alone.breakdown["recompute"][0], rel=1e-12)
    assert batch.breakdown["recompute"][0] > batch.breakdown["recompute"][1]

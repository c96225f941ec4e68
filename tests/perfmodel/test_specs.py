"""Spec types: published parameter counts, strict loading, layout parsing, validity rules."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import yaml

from perfmodel.errors import InputError
from perfmodel.specs import (
    ArchBatch,
    LayoutBatch,
    MoEArchitecture,
    ParallelLayout,
    active_params,
    model_flops_per_token,
    parse_layout,
    sparsity,
    total_params,
)
from perfmodel.specs.strict import load_spec, spec_from_dict, spec_to_dict, write_yaml_atomic
from perfmodel.validity import valid_mask, validate, violations

MIXTRAL_8X7B = MoEArchitecture(
    n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=32000, seq_len=4096,
    n_experts=8, top_k=2, d_expert=14336, ffn_ratio=3.5, gated_ffn=True,
)

# DeepSeek-V3 (arXiv 2412.19437): 61 layers, h=7168, 3 dense layers (d_ff 18432), 256 routed
# experts (top-8) + 1 shared of width 2048, V=129280, multi-head latent attention (128 heads,
# q rank 1536, kv rank 512, query/key heads 128 + 64 rotary, value heads 128), one MTP module.
DEEPSEEK_V3 = MoEArchitecture(
    n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128, head_dim=192, vocab_size=129280, seq_len=4096,
    n_experts=256, top_k=8, n_shared_experts=1, d_expert=2048, d_ff_dense=18432, n_dense_layers=3,
    ffn_ratio=18432 / 7168, gated_ffn=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    v_head_dim=128, n_mtp_layers=1,
)

# GPT-3 175B (Brown et al. 2020): 96 layers, h=12288, 96 heads of 128, plain 4h MLP, tied embeddings.
GPT3_175B = MoEArchitecture(
    n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, head_dim=128, vocab_size=50257, seq_len=2048,
    d_ff_dense=4 * 12288, gated_ffn=False, tie_embeddings=True,
)


@pytest.mark.parametrize(
    ("arch", "total_b", "active_b"),
    [(MIXTRAL_8X7B, 46.7, 12.9), (DEEPSEEK_V3, 671.0, 37.0), (GPT3_175B, 175.0, 175.0)],
    ids=["mixtral_8x7b", "deepseek_v3", "gpt3_175b"],
)
def test_parameter_counts_match_published_totals(arch, total_b, active_b):
    assert arch.total_params(embeddings=True) / 1e9 == pytest.approx(total_b, rel=0.02)
    assert arch.active_params(embeddings=True) / 1e9 == pytest.approx(active_b, rel=0.02)


@pytest.mark.parametrize("name,total_b,active_b", [("deepseek_v3", 671, 37), ("qwen3_235b_a22b", 235, 22),
                                                   ("kimi_k2", 1000, 32)])
def test_frontier_examples_match_published_counts(name, total_b, active_b):
    """Totals within 0.5% (Kimi K2's '1T' is a round figure: 3%); the cards' active counts, whole
    billions, are the model-card count (no input embedding) rounded: 36.62B -> '37B' etc."""
    from perfmodel.specs.architecture import model_card_active_params
    from perfmodel.specs.strict import load_spec

    arch = load_spec(MoEArchitecture, f"examples/models/{name}.yaml")
    assert arch.total_params(embeddings=True) / 1e9 == pytest.approx(total_b, rel=0.005 if total_b != 1000 else 0.03)
    assert round(float(model_card_active_params(arch)) / 1e9) == active_b


def test_mla_projections_are_the_attention_gemms():
    """MLA parameters (module doc formula) = the forward FLOPs of its projection GEMMs / 2 per token
    (tp = 1) plus the two latent norms; the MTP module adds a layer, 3 norms and 2h^2."""
    from perfmodel.operators import attention_ops
    from perfmodel.specs.architecture import attention_params_per_layer, mtp_params

    arch = DEEPSEEK_V3.replace(seq_len=128)
    layout = parse_layout("mbs=1,gbs=1", devices=1)
    tokens = arch.seq_len
    gemm_flops = sum(float(op.flops[0]) for op in attention_ops(arch, layout) if op.kind == "gemm")
    assert gemm_flops / (2 * tokens) + arch.q_lora_rank + arch.kv_lora_rank == float(attention_params_per_layer(arch))
    h = arch.d_model
    layer = float(attention_params_per_layer(arch)) + 2 * h + 3 * h * arch.d_expert * (256 + 1) + h * 256
    assert float(mtp_params(arch)) == layer + 3 * h + 2 * h * h


@pytest.mark.parametrize(("changes", "field"), [
    ({"kv_lora_rank": 8000}, "kv_lora_rank"),
    ({"q_lora_rank": 7168}, "q_lora_rank"),
    ({"n_kv_heads": 8}, "n_kv_heads"),
    ({"qk_rope_head_dim": 192}, "qk_rope_head_dim"),
    ({"kv_lora_rank": 0}, "q_lora_rank"),
])
def test_bad_mla_fields_name_the_field(changes, field):
    with pytest.raises(InputError, match=f"key '{field}'"):
        DEEPSEEK_V3.replace(**changes)


def test_bad_split_and_missing_dispatcher_are_one_line_errors():
    from perfmodel.clusters import load_cluster
    from perfmodel.dispatch import dispatcher_problem

    problems = violations(DEEPSEEK_V3, parse_layout("pp=4,first_stage_layers=14,last_stage_layers=14,dp=1"), 4)
    assert len(problems) == 1 and problems[0].startswith("split_fits_layers: first_stage_layers")
    assert "add up" in violations(DEEPSEEK_V3, parse_layout("pp=2,first_stage_layers=70,dp=1"), 2)[0]
    with pytest.raises(InputError, match="key 'pp_layout'.*8 stages"):
        parse_layout("pp=4,pp_layout=Et|t|t|t|t|t|t|tL")
    with_commas = parse_layout("pp=4,pp_layout=Et*3|t*4,t*4|t*8|t*3L,mbs=1")  # Megatron's cosmetic commas
    assert with_commas.pp_layout == "Et*3|t*4,t*4|t*8|t*3L" and parse_layout(with_commas.to_string()) == with_commas
    message = dispatcher_problem(load_cluster("h100"), parse_layout("ep=8,dispatcher=deepep", devices=8))
    assert message.startswith("layout: dispatcher=deepep") and "use dispatcher=alltoall" in message
    assert dispatcher_problem(load_cluster("h100"), parse_layout("ep=16,dispatcher=hybridep", devices=16)) is None


def test_dense_model_has_zero_sparsity_and_unit_granularity():
    assert GPT3_175B.sparsity == 0.0
    assert GPT3_175B.granularity == 1.0
    assert GPT3_175B.total_params() == GPT3_175B.active_params()


def test_sparsity_and_granularity_definitions():
    assert MIXTRAL_8X7B.sparsity == pytest.approx(1 - MIXTRAL_8X7B.active_params() / MIXTRAL_8X7B.total_params())
    fine = MIXTRAL_8X7B.replace(n_experts=64, top_k=16, d_expert=14336 // 8)
    assert fine.granularity == pytest.approx(8.0)
    assert fine.total_params() == pytest.approx(MIXTRAL_8X7B.total_params() + 32 * 4096 * 56, rel=1e-12)


def test_model_flops_per_token_convention():
    """MOSAIC counts causal attention as executed (6 L s h_q); the PaLM figure beside it does not halve it."""
    arch = MIXTRAL_8X7B
    expected = 6 * arch.active_params() + 6 * 4096 * 32000 + 6 * 32 * 4096 * 32 * 128
    assert arch.model_flops_per_token == pytest.approx(expected)
    assert arch.model_flops_per_token_palm == pytest.approx(expected + 6 * 32 * 4096 * 32 * 128)


def test_batch_functions_equal_scalar_functions():
    archs = [MIXTRAL_8X7B, DEEPSEEK_V3, GPT3_175B]
    batch = ArchBatch.stack(archs)
    for fn in (total_params, active_params, sparsity, model_flops_per_token):
        np.testing.assert_allclose(fn(batch), [float(fn(a)) for a in archs])
    assert batch.row(1) == DEEPSEEK_V3


def test_architecture_yaml_round_trip(tmp_path):
    path = write_yaml_atomic(tmp_path / "m.yaml", spec_to_dict(DEEPSEEK_V3))
    assert load_spec(MoEArchitecture, path) == DEEPSEEK_V3


MODEL_YAML = """\
version: 1
n_layers: 2
d_model: 64
n_heads: 4
n_kv_heads: 2
head_dim: 16
vocab_size: 256
seq_len: 32
n_experts: 4
top_k: 2
d_expert: 32
"""


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("n_layers", "n_layer"), "unknown key 'n_layer'; did you mean 'n_layers'?"),
        (lambda t: t.replace("d_model: 64", "d_model: sixty"), "key 'd_model': expected an integer"),
        (lambda t: t.replace("head_dim: 16\n", ""), "missing key 'head_dim'"),
        (lambda t: t.replace("top_k: 2", "top_k: 9"), "key 'top_k': 9 must be in [1, n_experts=4]"),
        (lambda t: t.replace("n_kv_heads: 2", "n_kv_heads: 3"), "key 'n_kv_heads': 3 does not divide n_heads=4"),
        (lambda t: t.replace("version: 1", "version: 7"), "key 'version': 7 is not supported"),
        (lambda t: t.replace("version: 1\n", ""), "missing key 'version'"),
        (lambda t: t.replace("seq_len: 32", "seq_len: [32"), "malformed YAML"),
        (lambda t: t.replace("d_model: 64", "d_model: .nan"), "key 'd_model': expected an integer"),
        (lambda t: t.replace("d_model: 64", "d_model: -64"), "key 'd_model': must be >= 1"),
    ],
    ids=["unknown_key", "wrong_type", "missing_field", "impossible_topk", "kv_heads", "version", "no_version",
         "malformed", "nan", "negative"],
)
def test_bad_model_yaml_gives_named_one_line_error(tmp_path, edit, message):
    path = tmp_path / "model.yaml"
    path.write_text(edit(MODEL_YAML))
    with pytest.raises(InputError) as info:
        load_spec(MoEArchitecture, path)
    text = str(info.value)
    assert "\n" not in text
    assert str(path) in text
    assert message in text


def test_good_model_yaml_loads(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(MODEL_YAML)
    arch = load_spec(MoEArchitecture, path)
    assert arch.n_experts == 4 and arch.gated_ffn is True


def test_parse_layout_compact_string_and_defaults():
    layout = parse_layout("tp=8,pp=8,vpp=3,mbs=1,gbs=64,recompute=full")
    assert (layout.tp, layout.pp, layout.vpp, layout.recompute, layout.dp) == (8, 8, 3, "full", None)
    resolved = parse_layout("tp=8,pp=8,vpp=3,mbs=1,gbs=64,recompute=full", devices=512)
    assert resolved.dp == 8 and resolved.world() == 512
    assert resolved.micro_batches() == 8
    assert parse_layout(resolved.to_string()) == resolved
    assert parse_layout("sp=true,tp=2").sequence_parallel is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tpp=2", "unknown key 'tpp'; did you mean 'tp'?"),
        ("tp=two", "key 'tp': expected an integer"),
        ("tp", "is not key=value"),
        ("recompute=some", "'some' is not one of"),
        ("tp=0", "key 'tp': must be >= 1"),
    ],
)
def test_bad_layout_string(text, message):
    with pytest.raises(InputError, match=None) as info:
        parse_layout(text)
    assert message in str(info.value)


def test_layout_resolve_rejects_device_count_not_divisible():
    with pytest.raises(InputError, match="not a multiple of tp\\*cp\\*pp"):
        parse_layout("tp=3", devices=8)


@pytest.mark.parametrize(
    ("layout", "devices", "rule"),
    [
        ("tp=3", 3, "tp_divides_heads"),
        ("ep=3,dp=3", 3, "ep_divides_experts"),
        ("ep=8,dp=4", 4, "expert_folding"),
        ("pp=3,dp=1,account_embedding=true,account_loss=true", 3, "split_fits_layers"),
        ("vpp=2", 1, "vpp_needs_pp"),
        ("dp=2,mbs=2,gbs=6", 2, "batch_divides"),
        ("dp=2", 4, "world_matches"),
        ("cp=3,dp=1", 3, "cp_divides_seq"),
    ],
)
def test_validate_names_each_violated_rule(layout, devices, rule):
    problems = violations(MIXTRAL_8X7B, parse_layout(layout), devices)
    assert any(p.startswith(rule + ":") for p in problems), problems
    with pytest.raises(InputError, match=rule):
        validate(MIXTRAL_8X7B, parse_layout(layout), devices)


def test_expert_parallel_is_carved_out_of_data_parallel():
    layout = parse_layout("tp=2,pp=4,ep=8,mbs=1,gbs=64", devices=64)
    assert layout.dp == 8 and layout.edp() == 2  # tp*dp = 16 = etp*ep*edp = 1*8*2
    assert violations(MIXTRAL_8X7B, layout, 64) == []


def test_valid_mask_matches_violations_on_a_batch():
    layouts = [parse_layout(t, devices=8) for t in ("tp=8", "tp=2,ep=4", "ep=8", "tp=4,ep=4", "pp=2,tp=4,gbs=16")]
    mask = valid_mask(ArchBatch.stack([MIXTRAL_8X7B] * len(layouts)), LayoutBatch.stack(layouts), 8)
    assert list(mask) == [violations(MIXTRAL_8X7B, lay, 8) == [] for lay in layouts]
    assert LayoutBatch.stack(layouts).row(4) == layouts[4]


def test_layout_yaml_round_trip():
    layout = ParallelLayout(tp=2, ep=4, dp=8, gbs=256, recompute="selective", sequence_parallel=True)
    data = yaml.safe_load(yaml.safe_dump(spec_to_dict(layout)))
    assert spec_from_dict(ParallelLayout, data, source="layout.yaml") == layout


def test_spec_error_names_nested_key(tmp_path):
    text = textwrap.dedent("""\
        version: 1
        tp: 2
        dp_flavor: zero3
    """)
    path = tmp_path / "layout.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match="key 'dp_flavor'"):
        load_spec(ParallelLayout, path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "plan.yaml: missing key 'model'; write the plan"),
        ({"model": [1, 2]}, "plan.yaml: key 'model': expected a mapping (MoEArchitecture)"),
        ({"model": {**yaml.safe_load(MODEL_YAML), "n_layer": 2}}, "plan.yaml: unknown key 'model.n_layer'"),
        ({"model": {**yaml.safe_load(MODEL_YAML), "top_k": 9}}, "plan.yaml: key 'model.top_k': 9 must be in"),
    ],
    ids=["missing", "not_a_mapping", "unknown_key", "impossible"],
)
def test_section_errors_name_the_file_and_the_key_path(data, message):
    from perfmodel.specs.strict import section_from_mapping

    data = {k: ({kk: vv for kk, vv in v.items() if kk != "version"} if isinstance(v, dict) else v) for k, v in data.items()}
    with pytest.raises(InputError) as info:
        section_from_mapping(MoEArchitecture, data, "model", "plan.yaml", "write the plan with `mosaic plan -o`")
    assert message in str(info.value)


def test_spec_protocols_name_exactly_the_spec_fields():
    """ArchLike / LayoutLike (what the formulas read) list every field of the specs and no other,
    and a single spec and its batch both satisfy them."""
    from perfmodel.specs import ARCH_FIELDS, LAYOUT_FIELDS
    from perfmodel.specs.protocols import ArchLike, LayoutLike

    def members(proto):
        return {name for name in vars(proto) if isinstance(vars(proto)[name], property)}

    assert members(ArchLike) == set(ARCH_FIELDS)
    assert members(LayoutLike) == set(LAYOUT_FIELDS)
    layout = parse_layout("tp=2,ep=2", devices=8)
    assert isinstance(MIXTRAL_8X7B, ArchLike) and isinstance(ArchBatch.stack([MIXTRAL_8X7B]), ArchLike)
    assert isinstance(layout, LayoutLike) and isinstance(LayoutBatch.stack([layout]), LayoutLike)

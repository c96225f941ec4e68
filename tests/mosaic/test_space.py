"""Search space: loading, defaults, geometry and layout expansion."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from mosaic.planner import space as space_mod
from mosaic.planner.space import (
    TP_RULES,
    default_space_path,
    geometries,
    layout_grid,
    load_space,
    resolve_space,
    scale_up_devices,
    space_from_dict,
    usable_tp,
)
from perfmodel.errors import InputError
from perfmodel.specs.architecture import ARCH_FIELDS, active_params
from perfmodel.specs.layout import RECOMPUTE_MODES, gbs_holding_tokens
from perfmodel.specs.strict import spec_to_dict


def test_default_space_expands_to_valid_geometries():
    space = load_space()
    c_model = 2.0e23
    resolved = resolve_space(space, tp_domain_devices=16, compute_optimal_flops=c_model)
    geoms = geometries(resolved)
    archs = geoms.archs
    assert len(geoms) > 100
    lo, hi = resolved.active_params_range
    assert np.isclose(hi, np.sqrt(c_model / (6 * 5))) and np.isclose(lo, np.sqrt(c_model / (6 * 2000)))
    n_act = active_params(archs)
    assert np.all((n_act >= lo) & (n_act <= hi))
    ratio = archs.d_model / archs.n_layers
    assert np.all((ratio >= 32) & (ratio <= 256))
    mla = archs.kv_lora_rank > 0  # the default searches both attentions
    assert np.any(mla) and np.any(~mla)
    assert np.all(archs.n_heads[~mla] * archs.head_dim[~mla] == archs.d_model[~mla])
    assert np.all(archs.n_heads[mla] * archs.v_head_dim[mla] == archs.d_model[mla])
    moe = archs.n_experts > 0
    assert np.all(archs.top_k[moe] < archs.n_experts[moe]) and np.all(archs.top_k[~moe] == 0)
    for i in np.random.default_rng(0).choice(len(geoms), 50, replace=False):
        archs.row(int(i))  # each row is a valid MoEArchitecture (its __post_init__ checks)
    rows = np.stack([np.asarray(getattr(archs, f), dtype=float) for f in ARCH_FIELDS], 1)
    assert len(np.unique(rows, axis=0)) == len(rows)  # dense rows collapsed, no duplicates


def test_tp_auto_reaches_the_scale_up_domain_where_the_geometries_allow_it():
    from perfmodel.clusters import load_cluster

    assert {name: scale_up_devices(load_cluster(name)) for name in ("b200", "gb200_nvl72", "ascend_superpod")} == {
        "b200": 8, "gb200_nvl72": 72, "ascend_superpod": 768}
    resolved = resolve_space(load_space(), tp_domain_devices=768, compute_optimal_flops=1e23)
    assert resolved.tp == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert usable_tp(resolved, geometries(resolved)).tp == (1, 2, 4, 8, 16, 32, 64)  # MLA: d_model/128 K/V heads
    gqa = resolve_space(load_space().replace_geometry(attention=("gqa",)), tp_domain_devices=768,
                        compute_optimal_flops=1e23)
    assert usable_tp(gqa, geometries(gqa)).tp == (1, 2, 4, 8)  # kv_heads 8: tp must divide the KV heads
    wide = load_space().replace_geometry(kv_heads=16, d_model=(4096, 8192), attention=("gqa",))
    wide_resolved = resolve_space(wide, tp_domain_devices=768, compute_optimal_flops=1e23)
    assert usable_tp(wide_resolved, geometries(wide_resolved)).tp == (1, 2, 4, 8, 16)


def test_tp_rules_read_only_tp_and_the_geometry():
    """`usable_tp` evaluates TP_RULES with a layout holding tp alone."""
    import types

    from perfmodel.validity import RULES

    resolved = resolve_space(load_space(), tp_domain_devices=16, compute_optimal_flops=1e23)
    geoms = geometries(resolved)
    names = {name for name, _, _ in RULES}
    assert set(TP_RULES) <= names
    for name, rule, _ in RULES:
        if name in TP_RULES:
            rule(geoms.archs, types.SimpleNamespace(tp=4))


def test_tp_auto_and_sequence_parallel_rule():
    resolved = resolve_space(load_space(), tp_domain_devices=16, compute_optimal_flops=1e23)
    assert resolved.tp == (1, 2, 4, 8, 16)
    grid = layout_grid(resolved, devices=768)
    world = grid.tp * grid.cp * grid.pp * grid.dp
    assert np.all(world == 768)
    assert np.all(grid.sequence_parallel == (grid.tp > 1))
    assert np.all((grid.vpp == 1) | (grid.pp > 1))
    assert set(np.unique(grid.recompute)) == set(range(len(RECOMPUTE_MODES)))


def test_global_batch_rule_is_smallest_multiple_holding_the_target():
    mbs = np.array([1, 2, 1, 4])
    dp = np.array([64, 48, 768, 3])
    seq = np.array([4096, 4096, 2048, 8192])
    gbs = gbs_holding_tokens(mbs, dp, seq, 8.0e6)
    unit = mbs * dp
    assert np.all(gbs % unit == 0)
    assert np.all(gbs * seq >= 8.0e6)
    assert np.all(((gbs - unit) * seq < 8.0e6) | (gbs == unit))


def test_unknown_key_and_bad_value_name_the_key(tmp_path):
    data = yaml.safe_load(default_space_path().read_text())
    data["layout"]["recompte"] = ["none"]
    with pytest.raises(InputError, match="recompte.*did you mean 'recompute'"):
        space_from_dict(data, "space.yaml")
    data = yaml.safe_load(default_space_path().read_text())
    data["layout"]["recompute"] = ["none", "sometimes"]
    with pytest.raises(InputError, match="recompute"):
        space_from_dict(data, "space.yaml")
    data = yaml.safe_load(default_space_path().read_text())
    data["geometry"]["aspect_ratio"] = [300, 32]
    with pytest.raises(InputError, match="aspect_ratio"):
        space_from_dict(data, "space.yaml")
    path = tmp_path / "space.yaml"
    path.write_text("version: 1\ngeometry: {d_model: [1024]}\n")
    with pytest.raises(InputError, match="n_layers"):
        load_space(str(path))


def test_no_layout_divides_devices_is_an_input_error():
    space = load_space().replace_layout(tp=(2,), pp=(2,), cp=(1,))
    resolved = resolve_space(space, tp_domain_devices=8, compute_optimal_flops=1e22)
    with pytest.raises(InputError, match="divides devices=7"):
        layout_grid(resolved, devices=7)


def test_overlap_lists_cross_into_the_grid_and_the_planner_chooses():
    """Listing [false, true] puts both settings of a switch into the grid; the default space lists
    every switch both ways (the search keeps the dominant one, tests/mosaic/test_bounds.py)."""
    one = load_space().replace_layout(overlap_grad_reduce=(True,), overlap_param_gather=(True,),
                                      tp_comm_overlap=(False,), ep_comm_overlap=(False,))
    grid = layout_grid(resolve_space(one, tp_domain_devices=8, compute_optimal_flops=1e22), devices=64)
    assert grid.overlap_grad_reduce.all() and grid.overlap_param_gather.all()
    assert not grid.tp_comm_overlap.any() and not grid.ep_comm_overlap.any()
    both = one.replace_layout(overlap_grad_reduce=(False, True), ep_comm_overlap=(False, True))
    grid2 = layout_grid(resolve_space(both, tp_domain_devices=8, compute_optimal_flops=1e22), devices=64)
    assert len(grid2) == 4 * len(grid)
    assert {(bool(a), bool(b)) for a, b in zip(grid2.overlap_grad_reduce, grid2.ep_comm_overlap)} == {
        (False, False), (False, True), (True, False), (True, True)}
    default = load_space().layout
    assert all(getattr(default, f) == (False, True) for f in
               ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap"))


def test_a_bad_overlap_list_names_the_key():
    data = yaml.safe_load(default_space_path().read_text())
    data["layout"]["ep_comm_overlap"] = []
    with pytest.raises(InputError, match="ep_comm_overlap"):
        space_from_dict(data, "space.yaml")


def test_the_default_space_is_the_full_one():
    """What users expect searched by default (issue: interleaving, dense first layers, overlaps)."""
    space = load_space()
    assert space.layout.vpp == (1, 2)
    assert set(space.geometry.n_dense_layers) == {0, 1, 3}
    assert space.layout.tp == "auto"
    assert {e for e in space.layout.ep} >= {1, 8, 64}


@pytest.mark.parametrize(("splits", "dispatchers"), [(("balanced",), ("alltoall",)), (("default",), ("deepep",)),
                                                     (("balanced",), ("allgather", "hybridep"))])
def test_a_split_or_dispatcher_list_keeps_the_rows_it_does_not_apply_to(splits, dispatchers):
    """pp = 1 rows under `balanced` alone and ep = 1 rows without `alltoall` stay, once, at the default."""
    from mosaic.planner.space import split_and_dispatch_variants
    from perfmodel.layouts import layout_grid as base_grid
    from perfmodel.specs.layout import DISPATCHERS

    grid = base_grid(16, tp=(1,), pp=(1, 2), vpp=(1,), ep=(1, 2), etp=(1,), cp=(1,), dp_flavor=("zero1",), mbs=(1,),
                     recompute=("none",), precision=("bf16",), overlaps=((True, True, False, False),))
    out = split_and_dispatch_variants(grid, splits, dispatchers)
    pp, ep = np.asarray(out.pp), np.asarray(out.ep)
    balanced, disp = np.asarray(out.balanced_split), np.asarray(out.dispatcher)
    assert set(pp.tolist()) == {1, 2} and set(ep.tolist()) == {1, 2}
    assert not balanced[pp == 1].any() and (disp[ep == 1] == DISPATCHERS.index("alltoall")).all()
    single = (pp == 1) & (ep == 1)
    assert single.sum() == ((np.asarray(grid.pp) == 1) & (np.asarray(grid.ep) == 1)).sum()  # once, not per choice


def test_mla_geometries_join_the_space_with_their_ranks():
    """attention: [gqa, mla] adds each geometry once more with DeepSeek's latent attention: every
    head its own K and V (n_kv = n_heads), query/key heads head_dim + rope wide, the ranks of
    `mla`, query compression only where its rank is below d_model; no other field changes."""
    from perfmodel.specs.architecture import CORE_ARCH_FIELDS

    space = load_space().replace_geometry(d_model=(1536, 2048, 4096), n_layers=(16, 32), active_params=(1e7, 1e13))
    resolved = resolve_space(space.replace_geometry(attention=("gqa",)), tp_domain_devices=8, compute_optimal_flops=1e23)
    gqa = geometries(resolved).archs
    both = geometries(resolved_mla := resolve_space(space.replace_geometry(attention=("gqa", "mla")), 8, 1e23)).archs
    mla = both.kv_lora_rank > 0
    ranks = resolved_mla.space.geometry.mla
    assert (ranks.q_lora_rank, ranks.kv_lora_rank, ranks.qk_rope_head_dim) == (1536, 512, 64)  # DeepSeek-V3
    assert np.sum(~mla) == len(gqa) and np.any(mla)
    assert np.all(both.kv_lora_rank[mla] == 512) and np.all(both.v_head_dim[mla] == 128)
    assert np.all(both.head_dim[mla] == 192) and np.all(both.n_kv_heads[mla] == both.n_heads[mla])
    assert np.all(both.n_heads[mla] * 128 == both.d_model[mla])
    assert np.all((both.q_lora_rank[mla] == 1536) == (both.d_model[mla] > 1536))
    assert not np.any(both.kv_lora_rank[~mla] | both.q_lora_rank[~mla] | both.v_head_dim[~mla])
    # h1536 has 12 heads: no GQA row (8 KV heads do not divide 12), MLA rows (12 K/V heads)
    assert not np.any(gqa.d_model == 1536) and np.any(both.d_model[mla] == 1536)
    # the same shapes otherwise (the active-parameter band is wide enough to keep both)
    def keys(a, sel):
        names = [f for f in CORE_ARCH_FIELDS if f not in ("n_kv_heads", "head_dim")]
        return {tuple(int(getattr(a, f)[i]) for f in names) for i in np.flatnonzero(sel)}

    assert keys(both, mla & (both.d_model > 1536)) <= keys(gqa, np.ones(len(gqa), dtype=bool))
    for i in np.flatnonzero(mla)[:20]:
        assert space_mod.geometry_label(both.row(int(i))).endswith(" MLA")  # and each row is a valid architecture


def test_mla_lets_tp_reach_past_the_kv_heads():
    """GQA with 8 KV heads caps tp at 8; MLA geometries have a K/V head per query head."""
    space = load_space().replace_geometry(attention=("gqa", "mla"), d_model=(4096, 8192))
    resolved = resolve_space(space, tp_domain_devices=768, compute_optimal_flops=1e23)
    assert usable_tp(resolved, geometries(resolved)).tp == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("bad,key", [({"attention": ["gqa", "mha"]}, "attention"), ({"attention": []}, "attention"),
                                     ({"mla": {"kv_lora_rank": 0}}, "mla.kv_lora_rank"),
                                     ({"mla": {"qk_rope_head_dim": 63}}, "mla.qk_rope_head_dim"),
                                     ({"mla": {"kv_rank": 512}}, "mla.kv_rank")])
def test_a_bad_attention_entry_names_the_key(bad, key):
    data = spec_to_dict(load_space())
    data["geometry"].update(bad)
    with pytest.raises(InputError, match=f"key 'geometry.{key}'"):
        space_from_dict(data)

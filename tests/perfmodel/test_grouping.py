"""Exact row grouping (`perfmodel.grouping`) and the formulas that run once per group."""

from __future__ import annotations

import numpy as np

from perfmodel import grouping
from perfmodel.clusters import load_cluster
from perfmodel.comm import CollectivePricer, collective_time, group_geometry
from perfmodel.specs.layout import LayoutBatch, parse_layout


def _columns(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.choice([1.0, 2.0, 0.5, np.nan, -0.0, 0.0], n), rng.integers(0, 3, n), rng.random(n) < 0.5]


def _check_groups(columns: list[np.ndarray], first: np.ndarray, inverse: np.ndarray) -> None:
    keys = [grouping.key_column(c) for c in columns]
    for col in keys:  # every row equals its group's first row, bit for bit
        np.testing.assert_array_equal(col[first[inverse]], col)
    distinct = {tuple(int(col[i]) for col in keys) for i in range(len(inverse))}
    assert len(first) == len(distinct)  # and different rows are in different groups


def test_row_groups_exact_by_bits():
    rng = np.random.default_rng(0)
    columns = _columns(rng, 500)
    first, inverse = grouping.row_groups(columns)
    _check_groups(columns, first, inverse)
    zero = grouping.key_column(np.array([0.0, -0.0]))
    assert zero[0] != zero[1]  # -0.0 is its own key: a formula may tell it apart


def test_row_groups_hash_collision_falls_back_to_exact(monkeypatch):
    rng = np.random.default_rng(1)
    columns = _columns(rng, 300)
    monkeypatch.setattr(grouping, "row_hash", lambda cols: np.zeros(len(cols[0]), dtype=np.int64))
    first, inverse = grouping.row_groups(columns)
    _check_groups(columns, first, inverse)


def test_pricer_per_distinct_shape_equals_every_row():
    """The pricer walks each group geometry on the distinct layout shapes only: the same seconds
    as `collective_time` on every row's own (n, stride)."""
    cluster = load_cluster("gb200_nvl72")
    strings = [f"tp={tp},cp={cp},pp={pp},ep={ep},etp={etp}" for tp in (1, 2, 4) for cp in (1, 2) for pp in (1, 2, 4)
               for ep in (1, 4, 8) for etp in (1, 2)]
    lay = LayoutBatch.stack([parse_layout(s, devices=1152) for s in strings])
    lay = lay.take(np.random.default_rng(2).integers(0, len(lay), 400))
    size = np.random.default_rng(3).choice([0.0, 1e3, 3e6, 5e8], len(lay))
    pricer = CollectivePricer(cluster, lay)
    for group in ("tp", "cp", "dp", "ep", "etp", "ep_etp", "edp", "pp"):
        n, stride = group_geometry(lay, group)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
            np.testing.assert_array_equal(pricer.time(group, kind, size), collective_time(cluster, kind, size, n, stride))


def _varied_batch(n: int, devices: int, seed: int):
    """Random candidates over every field the block tables may read (MLA, MTP, dispatchers, capacity)."""
    from perfmodel.specs import ArchBatch

    rng = np.random.default_rng(seed)
    pick = lambda values: rng.choice(np.asarray(values), n)  # noqa: E731
    d_model, head_dim = pick([1024, 2048, 4096]), pick([64, 128])
    n_heads = d_model // head_dim
    n_experts = pick([0, 8, 64])
    moe = n_experts > 0
    mla = rng.random(n) < 0.4
    archs = ArchBatch(
        n_layers=pick([8, 16]), d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads // pick([1, 4]), head_dim=head_dim,
        vocab_size=pick([32000, 65536]), seq_len=pick([2048, 4096]), n_experts=n_experts,
        top_k=np.where(moe, pick([1, 2, 6]), 0), n_shared_experts=np.where(moe, pick([0, 1, 2]), 0),
        d_expert=np.where(moe, pick([512, 1024]), 0), d_ff_dense=np.where(moe, pick([0, 4096]), pick([4096, 8192])),
        n_dense_layers=np.where(moe, pick([0, 1]), 0), ffn_ratio=np.full(n, 4.0), gated_ffn=rng.random(n) < 0.7,
        tie_embeddings=rng.random(n) < 0.3, q_lora_rank=np.where(mla, pick([0, 1536]), 0),
        kv_lora_rank=np.where(mla, 512, 0), qk_rope_head_dim=np.where(mla, 64, 0), v_head_dim=np.where(mla, 128, 0),
        n_mtp_layers=pick([0, 0, 1]))
    archs = ArchBatch(**{**vars(archs), "n_dense_layers": np.where(archs.d_ff_dense > 0, archs.n_dense_layers, 0)})
    tp, pp, cp = pick([1, 2, 4]), pick([1, 2, 4]), pick([1, 2])
    dp = devices // (tp * pp * cp)
    mbs = pick([1, 2])
    lay = LayoutBatch(
        tp=tp, pp=pp, vpp=np.where(pp > 1, pick([1, 2]), 1), ep=np.where(moe, pick([1, 2, 8]), 1), etp=pick([1, 1, 2]),
        cp=cp, dp=dp, dp_flavor=pick([0, 1, 2]), mbs=mbs, gbs=mbs * dp * pick([1, 4]), recompute=pick([0, 1, 2]),
        sequence_parallel=(tp > 1) & (rng.random(n) < 0.8), precision=pick([1, 1, 3, 4]),
        overlap_grad_reduce=rng.random(n) < 0.5, overlap_param_gather=rng.random(n) < 0.5,
        tp_comm_overlap=rng.random(n) < 0.5, ep_comm_overlap=rng.random(n) < 0.5, dispatcher=pick([0, 1, 2, 3]),
        capacity_factor=pick([0.0, 1.0, 1.25]), pad_to_capacity=rng.random(n) < 0.3,
        first_stage_layers=pick([-1, -1, 1]), account_embedding=rng.random(n) < 0.2)
    return archs, lay


def _block_tables(cluster, devices: int, archs, lay):
    """`tables.block_tables` of every row (no grouping)."""
    from perfmodel.hardware import HardwareView
    from perfmodel.host import host_dispatch
    from perfmodel.inputs import as_float
    from perfmodel.tables import block_tables

    host = host_dispatch(cluster)
    archs, lay = as_float(archs), as_float(lay)
    hw = HardwareView(cluster, lay, host.core_share(np.full(len(lay), float(devices))))
    return block_tables(archs, lay, host.block_comms, CollectivePricer(cluster, lay, hw.share), hw)


def test_grouped_blocks_depend_on_their_fields_only():
    """Each GROUPED_BLOCKS table (what `block_groups` groups rows by) is unchanged when any field
    outside TOKEN_FIELDS and the block's own fields changes: the grouping key is complete."""
    from perfmodel.specs.architecture import ARCH_FIELDS
    from perfmodel.specs.layout import LAYOUT_FIELDS
    from perfmodel.tables import GROUPED_BLOCKS, TOKEN_FIELDS

    for name, devices in (("h100", 64), ("cpu_local", 8)):
        cluster = load_cluster(name)
        archs, lay = _varied_batch(240, devices, seed=len(name))
        base = _block_tables(cluster, devices, archs, lay)
        rolled = lambda batch, field: type(batch)(**{  # noqa: E731
            k: (np.roll(v, 7) if k == field else v) for k, v in vars(batch).items() if k not in ("stage_layers", "stage_mtp")})
        changes = [(rolled(archs, f), lay, f) for f in ARCH_FIELDS] + [(archs, rolled(lay, f), f) for f in LAYOUT_FIELDS]
        for new_archs, new_lay, field in changes:
            tables = _block_tables(cluster, devices, new_archs, new_lay)
            for block, (arch_fields, lay_fields) in GROUPED_BLOCKS.items():
                if field in arch_fields + lay_fields + TOKEN_FIELDS[0] + TOKEN_FIELDS[1]:
                    continue
                for key, value in base[block].items():
                    np.testing.assert_array_equal(tables[block][key], value, err_msg=f"{name} {block}.{key} reads {field}")

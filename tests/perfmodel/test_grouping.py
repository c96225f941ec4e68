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

"""The exact prunings of the layout search: the compute bound, overlap dominance, recompute dominance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import perfmodel
from mosaic.planner import build_problem
from mosaic.planner import problem as problem_mod
from mosaic.planner.bounds import SHAPE_FIELDS, ComputeBound
from mosaic.planner.candidates import OVERLAP_RULES, memory_per_device, overlap_allowed, overlap_dominated
from mosaic.planner.enumerate import rank_cluster_optimal
from perfmodel.specs.layout import OVERLAP_FIELDS
from perfmodel.stage import hidden_ep_cost
from perfmodel.tables import block_tables, fused_dispatch_figures
from perfmodel.validity import FUSED_CODES, LAYOUT_ONLY_RULES, RULES, valid_mask

BOTH = (False, True)


def _space(make_space, **layout):
    space = make_space(n_shared_experts=(0, 1), n_dense_layers=(0, 1), n_layers=(16, 24, 32))
    return space.replace_layout(**{"vpp": (1, 2), "mbs": (1, 2), **{f: BOTH for f in OVERLAP_FIELDS}, **layout})


@pytest.mark.parametrize("cluster,devices", [("h100", 64), ("ascend_superpod", 128), ("cpu_local", 8)])
def test_compute_bound_holds_on_every_valid_pair(law, make_space, cluster, devices):
    p = build_problem(cluster, devices=devices, days=5, fit=law, space=_space(make_space), prune=False)
    ev = p.evaluator
    bound = ComputeBound(p.geoms.archs, ev.grid, p.cluster, devices)
    idx = np.arange(0, len(p.geoms), 3)
    archs, lays, g, lay_i = ev.pairs(idx)
    v = np.flatnonzero(valid_mask(archs, lays, devices))
    res = perfmodel.evaluate(archs.take(v), lays.take(v), p.cluster, devices)
    ub = bound.tokens_per_s(g[v], lay_i[v], archs.take(v), lays.take(v))
    assert len(v) > 500
    assert np.all(res.tokens_per_s <= ub * (1 + 1e-12))
    # the geometry bound is above every pair bound of that geometry, hence above every pair
    per_geometry = np.zeros(len(p.geoms))
    per_geometry[idx] = bound.geometry_tokens_per_s(idx)
    assert np.all(ub <= per_geometry[g[v]] * (1 + 1e-12))
    assert np.median(ub / res.tokens_per_s) < 3.0  # and it is not vacuous
    # the layout-table bound (the search cuts pairs by it before building them) holds on every pair
    table = np.zeros((len(p.geoms), len(bound.table_first)))
    table[idx] = bound.table_tokens_per_s(idx)
    per_pair = table[g[v], bound.table_of_layout[lay_i[v]]]
    assert np.all(res.tokens_per_s <= per_pair * (1 + 1e-12))
    # and lowered by the pipeline's bubble slots (what the search uses)
    share = ComputeBound.pipeline_share(lays.take(v))
    assert np.all(res.tokens_per_s <= per_pair * share * (1 + 1e-12)) and np.any(share < 1.0)
    np.testing.assert_allclose(per_geometry[idx], table[idx].max(axis=1), rtol=0)
    assert np.mean(per_pair < per_geometry[g[v]] * (1 - 1e-9)) > 0.3  # tighter than the geometry's


def test_block_tables_do_not_read_the_layer_counts(law, make_space):
    """The bound caches one table per layer shape (SHAPE_FIELDS): depth and dense layers only count."""
    p = build_problem("h100", devices=64, days=5, fit=law, space=_space(make_space))
    archs = p.geoms.archs
    moe = np.flatnonzero(np.asarray(archs.n_experts) > 0)[:1]
    base = archs.take(np.repeat(moe, 3))
    varied = dataclasses.replace(base, n_layers=np.asarray([16, 24, 48]), n_dense_layers=np.asarray([0, 1, 3]))
    lays = p.evaluator.grid.take(np.zeros(3, dtype=np.int64))
    lays = dataclasses.replace(lays, gbs=np.asarray(lays.mbs) * np.asarray(lays.dp))
    from perfmodel.comm import CollectivePricer
    from perfmodel.hardware import HardwareView
    from perfmodel.host import host_dispatch
    from perfmodel.inputs import as_float

    host = host_dispatch(p.cluster)
    lf = as_float(lays)
    hw = HardwareView(p.cluster, lf, np.ones(3))
    tables = block_tables(as_float(varied), lf, host.block_comms, CollectivePricer(p.cluster, lf, hw.share), hw)
    for block in tables.values():
        for key, value in block.items():
            assert np.ptp(np.broadcast_to(np.asarray(value, dtype=float), (3,))) == 0.0, key
    assert "n_layers" not in SHAPE_FIELDS and "n_dense_layers" not in SHAPE_FIELDS


def test_overlap_rules_read_the_layout_only_and_memory_ignores_the_switches(law, make_space):
    space = _space(make_space, dp_flavor=("ddp", "zero1", "fsdp"))
    p = build_problem("h100", devices=64, days=5, fit=law, space=space, prune=False)
    archs, lays, _, lay_i = p.evaluator.pairs(np.arange(len(p.geoms)))
    reading = set()
    for name, rule, _ in RULES:
        for field in OVERLAP_FIELDS:
            flipped = dataclasses.replace(lays, **{field: ~np.asarray(getattr(lays, field))})
            if not np.array_equal(np.asarray(rule(archs, lays)), np.asarray(rule(archs, flipped))):
                reading.add(name)
    assert reading == set(OVERLAP_RULES)  # every rule that reads a switch is in OVERLAP_RULES
    grid = p.evaluator.grid
    for name, rule, _ in RULES:
        if name in OVERLAP_RULES:
            np.testing.assert_array_equal(np.asarray(rule(archs, lays)), np.asarray(rule(None, grid))[lay_i])
    sample = np.arange(0, len(lay_i), 7)
    base = lays.take(sample)
    mem = memory_per_device(archs.take(sample), base, p.cluster)
    for field in OVERLAP_FIELDS:
        flipped = dataclasses.replace(base, **{field: ~np.asarray(getattr(base, field))})
        np.testing.assert_array_equal(memory_per_device(archs.take(sample), flipped, p.cluster), mem)


def test_overlap_dominance_keeps_one_row_per_reachable_switch_set(law, make_space):
    p = build_problem("h100", devices=64, days=5, fit=law, space=_space(make_space), prune=False)
    grid = p.evaluator.grid
    dominated = overlap_dominated(grid, p.cluster)
    assert 0 < dominated.sum() < len(grid)
    kept = grid.take(np.flatnonzero(~dominated & overlap_allowed(grid)))
    # a kept row with a switch off is one whose sibling with it on is not allowed (e.g. tp overlap at
    # tp 1), or one whose DDP / ZeRO-1 step sync the switch could take window from (overlap_dominated)
    off_tp = ~np.asarray(kept.tp_comm_overlap) & (np.asarray(kept.tp) > 1) & np.asarray(kept.sequence_parallel)
    fsdp = np.asarray(kept.dp_flavor) == perfmodel.specs.layout.DP_FLAVORS.index("fsdp")
    cheap_ep = hidden_ep_cost(fused_dispatch_figures(p.cluster, kept)[1], p.cluster.overlap) < p.cluster.overlap.compute_slowdown
    assert np.any(off_tp) and not np.any(off_tp & fsdp & ~cheap_ep)
    assert np.all(np.asarray(kept.overlap_grad_reduce))


@pytest.mark.parametrize("cluster,devices", [("h100", 64), ("ascend_superpod", 128)])
def test_every_pruning_together_leaves_the_answer_unchanged(law, make_space, cluster, devices, monkeypatch):
    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 3000)
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    space = _space(make_space)
    pruned_p = build_problem(cluster, devices=devices, days=5, fit=law, space=space)
    full_p = build_problem(cluster, devices=devices, days=5, fit=law, space=space, prune=False)
    pruned = rank_cluster_optimal(pruned_p, top=5)
    full = rank_cluster_optimal(full_p, top=5)
    assert pruned.pruned_geometries > 0
    assert len(pruned_p.evaluator.grid) < len(full_p.evaluator.grid)  # overlap dominance shrank the grid
    assert int(pruned.results.n_timed.sum()) < int(full.results.n_timed.sum()) / 10
    np.testing.assert_array_equal(pruned.index[:5], full.index[:5])
    np.testing.assert_allclose(pruned.loss[:5], full.loss[:5], rtol=1e-12)
    np.testing.assert_allclose(pruned.results.tokens_per_s[:5], full.results.tokens_per_s[:5], rtol=1e-12)


def test_a_bound_that_fails_reruns_the_search_without_it(law, make_space, monkeypatch):
    """If perfmodel ever prices a pair above its bound, the search notices and searches everything."""
    space = _space(make_space)
    reference = rank_cluster_optimal(build_problem("h100", devices=64, days=5, fit=law, space=space, prune=False), top=3)
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    real = ComputeBound.tokens_per_s
    monkeypatch.setattr(ComputeBound, "tokens_per_s", lambda self, *a, **k: real(self, *a, **k) * 0.5)
    ranked = rank_cluster_optimal(p, top=3)
    assert p.evaluator.bound is None
    np.testing.assert_array_equal(ranked.index[:3], reference.index[:3])
    np.testing.assert_allclose(ranked.loss[:3], reference.loss[:3], rtol=1e-12)


def test_a_bound_that_fails_in_a_worker_process_reaches_the_parent(law, make_space, monkeypatch):
    """With --workers the layout searches run in worker processes; a pair priced above its bound
    there must still mark the parent's evaluator, which the search reads (bounds_failed)."""
    from mosaic.planner import problem as problem_mod

    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 2000)  # several chunks, so the pool is used
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    real = ComputeBound.tokens_per_s
    monkeypatch.setattr(ComputeBound, "tokens_per_s", lambda self, *a, **k: real(self, *a, **k) * 0.5)
    p = build_problem("h100", devices=64, days=5, fit=law, space=_space(make_space))
    with problem_mod.worker_pool(p, 2) as pool:  # forked: the workers see the halved bound
        p.evaluate(np.arange(len(p.geoms)), pool=pool)
    assert p.evaluator.bound_violated and p.evaluator.counts["timed"] > 0


@pytest.mark.parametrize("cluster", ["gb200_nvl72", "b200", "ascend_superpod"])
def test_overlap_dominance_keeps_the_fastest_row_of_every_switch_set(law, make_space, cluster):
    """Fused dispatchers' hidden EP seconds cost sm/(1 - sm) (perfmodel.stage.hidden_ep_cost), not
    compute_slowdown: tp overlap is dominated only where that is >= compute_slowdown, EP overlap only
    where it is <=. Checked by pricing every valid pair: in each group of rows equal but for the
    switches, the kept rows hold the group's fastest."""
    space = _space(make_space, ep=(1, 8), tp=(1, 2), dispatcher=("alltoall", "allgather", "deepep", "hybridep"))
    p = build_problem(cluster, devices=64, days=5, fit=law, space=space, prune=False)
    grid, ev = p.evaluator.grid, p.evaluator
    dominated = overlap_dominated(grid, p.cluster)
    kept = ~dominated & overlap_allowed(grid)
    cost = hidden_ep_cost(fused_dispatch_figures(p.cluster, grid)[1], p.cluster.overlap)
    fused = np.isin(np.asarray(grid.dispatcher), FUSED_CODES) & (np.asarray(grid.ep) > 1)
    assert fused.any() and dominated[fused].any()
    if cluster == "gb200_nvl72":  # hybridep holds 24-32 of 148 SMs: EP overlap off is kept beside on
        slow = fused & (cost > p.cluster.overlap.compute_slowdown)
        assert slow.any() and np.any(kept & slow & ~np.asarray(grid.ep_comm_overlap))
    moe = np.flatnonzero(np.asarray(p.geoms.archs.n_experts) > 0)
    idx = moe[:: max(1, len(moe) // 12)]
    archs, lays, g, lay_i = ev.pairs(idx)
    v = np.flatnonzero(valid_mask(archs, lays, 64))
    res = perfmodel.evaluate(archs.take(v), lays.take(v), p.cluster, 64)
    tokens = np.where(res.feasible, res.tokens_per_s, 0.0)
    fields = [f for f in perfmodel.specs.layout.LAYOUT_FIELDS if f not in OVERLAP_FIELDS]
    _, group = np.unique(grid.key_columns(fields), axis=0, return_inverse=True)
    key = g[v] * (int(group.max()) + 1) + group.ravel()[lay_i[v]]
    _, pair_group = np.unique(key, return_inverse=True)
    best_all = np.zeros(pair_group.max() + 1)
    best_kept = np.zeros_like(best_all)
    np.maximum.at(best_all, pair_group, tokens)
    np.maximum.at(best_kept, pair_group, np.where(kept[lay_i[v]], tokens, 0.0))
    assert np.sum(best_all > 0) > 50
    np.testing.assert_allclose(best_kept, best_all, rtol=1e-12)


def test_recompute_dominance_prunes_and_keeps_the_answer(law, make_space):
    """A layout whose twin with less recompute fits is never timed, and the answer is unchanged."""
    space = _space(make_space, recompute=("none", "selective", "full"))
    pruned = rank_cluster_optimal(build_problem("h100", devices=64, days=5, fit=law, space=space), top=3)
    full = rank_cluster_optimal(build_problem("h100", devices=64, days=5, fit=law, space=space, prune=False), top=3)
    assert int(np.sum(pruned.results.n_dominated)) > 0
    np.testing.assert_array_equal(pruned.index[:3], full.index[:3])
    np.testing.assert_allclose(pruned.results.tokens_per_s[:3], full.results.tokens_per_s[:3], rtol=1e-12)


def test_validity_per_dispatch_set_is_the_validity_of_every_row(law, make_space):
    """The search checks validity once per set of layouts equal but for the dispatch fields and the
    switches: the rules that read those read the layout only (LAYOUT_ONLY_RULES), so the planner's
    per-row validity equals `valid_mask` on every (geometry, row) pair."""
    space = _space(make_space, ep=(1, 8), etp=(1, 2), dispatcher=("alltoall", "allgather", "deepep", "hybridep"))
    p = build_problem("gb200_nvl72", devices=64, days=5, fit=law, space=space)
    ev = p.evaluator
    archs, lays, _, _ = ev.pairs(np.arange(len(p.geoms)), ev.rep_grid)
    reading = set()
    for name, rule, _ in RULES:
        for field, other in (("dispatcher", (np.asarray(lays.dispatcher) + 2) % 4),
                             ("pad_to_capacity", ~np.asarray(lays.pad_to_capacity)), *(
                                 (f, ~np.asarray(getattr(lays, f))) for f in OVERLAP_FIELDS)):
            if not np.array_equal(np.asarray(rule(archs, lays)), np.asarray(rule(archs, dataclasses.replace(lays, **{field: other})))):
                reading.add(name)
    assert reading and reading <= set(LAYOUT_ONLY_RULES)
    for name, rule, _ in RULES:
        if name in LAYOUT_ONLY_RULES:
            np.testing.assert_array_equal(np.asarray(rule(archs, lays), dtype=bool), np.asarray(rule(None, lays), dtype=bool))
    assert ev.valid_grid is not None and len(ev.valid_grid) < len(ev.rep_grid)
    planner, _ = ev.rep_valid(np.arange(len(p.geoms)))
    direct = valid_mask(archs, lays, 64).reshape(len(p.geoms), -1)
    assert direct.any() and (~direct).any()
    np.testing.assert_array_equal(planner, direct)


def test_validity_asked_on_some_pairs_is_the_validity_of_those_pairs(law, make_space):
    """The search checks validity only where the static memory fits (`rep_valid(wanted)`), and for a
    geometry with no valid pair that fits, by increasing static memory until its smallest valid
    one is found (`smallest_valid`): equal to the full check on the pairs asked, and the smallest
    valid memory is the full check's."""
    space = _space(make_space, ep=(1, 8), etp=(1, 2), dispatcher=("alltoall", "deepep"))
    p = build_problem("gb200_nvl72", devices=64, days=5, fit=law, space=space)
    ev = p.evaluator
    idx = np.arange(len(p.geoms))
    full, _ = ev.rep_valid(idx)
    rng = np.random.default_rng(0)
    wanted = rng.random(full.shape) < 0.3
    part, _ = ev.rep_valid(idx, wanted)
    np.testing.assert_array_equal(part, full & wanted)
    static = ev.static_memory(idx)
    keys = rng.random(full.shape) < 0.5
    np.testing.assert_array_equal(np.isfinite(ev.static_memory(idx, keys)) | ~keys, np.ones_like(keys))
    np.testing.assert_array_equal(np.where(keys, ev.static_memory(idx, keys), 0), np.where(keys, static, 0))
    truth = np.where(full, static, np.inf).min(axis=1)
    for first in (1, 8, 128):
        found = ev.smallest_valid(idx, static, first=first)
        assert not np.any(found & ~full)
        np.testing.assert_array_equal(np.where(found, static, np.inf).min(axis=1), truth)
    assert np.isfinite(truth).any() and (np.sum(ev.smallest_valid(idx, static, first=8)) < np.sum(full))


def test_a_geometry_nothing_fits_is_left_at_a_floor_and_sized_without_one(law, make_space):
    """With a floor (the caller has a threshold) a geometry with no valid layout that fits is left
    there, not exact and so not cached; without one its smallest valid memory is found, the figure
    an infeasible plan reports."""
    p = build_problem("h100", devices=64, days=5, fit=law, space=_space(make_space))
    ev = p.evaluator
    idx = np.arange(min(6, len(p.geoms)))
    static = ev.static_memory(idx)
    valid, _ = ev.rep_valid(idx)
    ev.hbm = 1.0  # nothing fits
    floored = ev.run(idx, floor=np.full(len(idx), 1.0))
    assert not np.any(floored.exact) and np.all(floored.best_layout < 0)
    sized = ev.run(idx)
    assert np.all(sized.exact) and np.all(sized.best_layout < 0)
    np.testing.assert_array_equal(sized.min_memory_bytes, np.where(valid, static, np.inf).min(axis=1))


def test_geometries_nothing_fits_leave_the_rest_of_their_chunk_searched_as_alone(law, make_space):
    """`run` takes the geometries with no valid layout that fits (under a floor) out of its chunk
    after the screen: the others get the results they get searched alone, those left get none
    feasible and not exact, and the chunk's order and counts are kept."""
    p = build_problem("h100", devices=64, days=5, fit=law, space=_space(make_space))
    ev = p.evaluator
    idx = np.arange(min(40, len(p.geoms)))
    static = ev.static_memory(idx)
    valid, _ = ev.rep_valid(idx)
    smallest = np.where(valid, static, np.inf).min(axis=1)
    ev.hbm = float(np.median(smallest[np.isfinite(smallest)]))  # about half the chunk fits
    floor = np.full(len(idx), 1e-9)  # below every bound: a floor that holds nothing back
    before = dict(ev.counts)
    chunk = ev.run(idx, floor=floor)
    counts = {k: ev.counts[k] - before[k] for k in before}
    np.testing.assert_array_equal(chunk.index, idx)
    left = ~(smallest <= ev.hbm)
    assert left.any() and (~left).sum() >= 5
    assert not np.any(chunk.exact[left]) and np.all(chunk.best_layout[left] < 0)
    assert np.all(chunk.n_valid[left] == 0) and np.all(chunk.n_timed[left] == 0)
    assert np.all(np.isinf(chunk.min_memory_bytes[left]))
    kept = np.flatnonzero(~left)
    alone = ev.run(idx[kept], floor=floor[kept])
    for name in ("index", "best_layout", "best_gbs", "tokens_per_s", "mfu", "step_time_s", "memory_bytes",
                 "min_memory_bytes", "min_memory_layout", "n_valid", "n_dominated", "n_memory_ok", "n_bounded",
                 "n_timed", "bound_ok", "exact"):
        np.testing.assert_array_equal(getattr(chunk, name)[kept], getattr(alone, name), err_msg=name)
    assert np.any(alone.tokens_per_s > 0)
    np.testing.assert_array_equal(chunk.take(kept).evaluations.step_time_s, alone.evaluations.step_time_s)
    assert counts["built"] == len(idx) * len(ev.grid) and counts["timed"] == int(chunk.n_timed.sum())

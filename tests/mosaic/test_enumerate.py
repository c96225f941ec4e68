"""Exact enumeration: brute-force reference, pruning never changes the answer, both budgets."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

import perfmodel
from mosaic.planner import build_problem
from mosaic.planner import enumerate as enumerate_mod
from mosaic.planner import problem as problem_mod
from mosaic.planner.candidates import STATIC_FREE_FIELDS, memory_per_device
from mosaic.planner.enumerate import rank_cluster_optimal, rank_compute_optimal
from mosaic.planner.plan import solve
from perfmodel.errors import InfeasibleError
from perfmodel.memory import STATIC_COMPONENTS, stage_memory
from perfmodel.specs.architecture import model_flops_per_token, total_params
from perfmodel.specs.layout import DISPATCH_FIELDS, DISPATCHERS, OVERLAP_FIELDS, LayoutBatch, ParallelLayout


def _problem(law, space, prune=True, devices=64, days=5.0, cluster="h100"):
    return build_problem(cluster, devices=devices, days=days, fit=law, space=space, prune=prune)


@pytest.mark.parametrize("attention", [("gqa",), ("gqa", "mla")])
def test_enumeration_matches_a_brute_force_loop(law, make_space, attention):
    """Every geometry's loss equals a loop over hand-built ParallelLayouts through evaluate (MLA
    geometries too, when the space lists them)."""
    space = make_space(attention=attention)
    p = _problem(law, space)
    assert np.any(p.geoms.archs.kv_lora_rank > 0) == ("mla" in attention)
    ranked = rank_cluster_optimal(p, top=len(p.geoms))
    lay_space = space.layout
    layouts = []
    overlaps = itertools.product(*(getattr(lay_space, key) for key in OVERLAP_FIELDS))
    for tp, pp, ep, flavor, rec, ov, dispatcher, split in itertools.product(
            (1, 2), (1, 2), lay_space.ep, lay_space.dp_flavor, lay_space.recompute, list(overlaps),
            lay_space.dispatcher, lay_space.pipeline_split):
        if (ep == 1 and dispatcher != "alltoall") or (pp == 1 and split != "default"):
            continue  # the same layout as the alltoall / default one
        lay = ParallelLayout(tp=tp, pp=pp, ep=ep, dp_flavor=flavor, recompute=rec, sequence_parallel=tp > 1,
                             dispatcher=dispatcher, balanced_split=split == "balanced",
                             **dict(zip(OVERLAP_FIELDS, ov))).resolve(64)
        unit = lay.mbs * lay.dp
        layouts.append(dataclasses.replace(lay, gbs=int(np.ceil(np.ceil(8.0e6 / 4096) / unit)) * unit))
    batch = LayoutBatch.stack(layouts)
    archs = p.geoms.archs
    best_loss = {}
    for g in range(len(p.geoms)):
        arch = archs.row(g)
        res = perfmodel.evaluate(arch, batch, p.cluster, 64)
        if res.feasible.any():
            d = res.tokens_per_s[res.feasible].max() * p.eta * p.budget.wall_time_s
            best_loss[g] = float(law.predict(total_params(arch), arch.sparsity, d, arch.granularity))
    ok = np.isfinite(ranked.loss)
    assert len(best_loss) == ok.sum() > 3
    for g, loss in zip(ranked.index[ok], ranked.loss[ok]):
        assert loss == pytest.approx(best_loss[int(g)], rel=1e-12)
    assert int(ranked.index[0]) == min(best_loss, key=best_loss.get)


@pytest.mark.parametrize("cluster,devices", [("h100", 64), ("ascend_superpod", 128)])
def test_pruned_and_unpruned_agree(law, make_space, cluster, devices, monkeypatch):
    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 2000)  # several chunks, so the loss bound can stop early
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    space = make_space(n_shared_experts=(0, 1)).replace_layout(mbs=(1, 2), vpp=(1, 2))
    pruned_p = _problem(law, space, True, devices, cluster=cluster)
    full_p = _problem(law, space, False, devices, cluster=cluster)
    pruned = rank_cluster_optimal(pruned_p, top=5)
    full = rank_cluster_optimal(full_p, top=5)
    assert pruned.pruned_geometries > 0  # the bound did skip geometries
    np.testing.assert_array_equal(pruned.index[:5], full.index[:5])
    np.testing.assert_allclose(pruned.loss[:5], full.loss[:5], rtol=1e-12)
    np.testing.assert_allclose(pruned.results.tokens_per_s[:5], full.results.tokens_per_s[:5], rtol=1e-12)
    for p, r in ((pruned_p, pruned), (full_p, full)):  # the same layouts (grid rows differ: dominance drops some)
        r.layouts = [p.evaluator.layout(r.results.best_layout[i], r.results.best_gbs[i]) for i in range(5)]
    for a, b in zip(pruned.layouts, full.layouts):
        assert a == b or (a.tp, a.pp, a.vpp, a.ep, a.dp_flavor, a.mbs, a.recompute) == (b.tp, b.pp, b.vpp, b.ep, b.dp_flavor, b.mbs, b.recompute)


def test_the_seeded_first_threshold_changes_only_the_order_of_work(law, make_space, monkeypatch):
    """The search takes its first threshold from geometries likely to fit (`likely_fits`), then
    goes on in loss-bound order past them: the same top geometries as without the seeds and as
    the unpruned search, with chunks of a few geometries so that some hold only seeds."""
    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 300)
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    space = make_space(n_shared_experts=(0, 1)).replace_layout(mbs=(1, 2), vpp=(1, 2))
    seeded_p = _problem(law, space, True, 128, cluster="ascend_superpod")
    seeded = rank_cluster_optimal(seeded_p, top=5)
    monkeypatch.setattr(enumerate_mod, "SEED_SCAN_GEOMETRIES", 0)
    plain = rank_cluster_optimal(_problem(law, space, True, 128, cluster="ascend_superpod"), top=5)
    full = rank_cluster_optimal(_problem(law, space, False, 128, cluster="ascend_superpod"), top=5)
    fits = seeded_p.evaluator.likely_fits(np.arange(len(seeded_p.geoms)))
    assert fits.any() and not fits.all()
    for other in (plain, full):
        np.testing.assert_array_equal(seeded.index[:5], other.index[:5])
        np.testing.assert_allclose(seeded.loss[:5], other.loss[:5], rtol=1e-12)


@pytest.mark.parametrize("tighten", [1, 7])
def test_the_lazy_loss_bound_changes_only_the_work(law, make_space, monkeypatch, tighten):
    """The MFU cap's bound first, tightened by the compute bound only at the front of the order
    (`TIGHTEN_GEOMETRIES` at a time, no seeds): the same top geometries as the unpruned search, the
    peak bound never above the full one, and block tables built for fewer shapes than the space has."""
    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 2000)
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    monkeypatch.setattr(enumerate_mod, "SEED_SCAN_GEOMETRIES", 0)
    monkeypatch.setattr(enumerate_mod, "TIGHTEN_GEOMETRIES", tighten)
    space = make_space(n_shared_experts=(0, 1)).replace_layout(mbs=(1, 2), vpp=(1, 2))
    lazy_p = _problem(law, space, True, 128, cluster="ascend_superpod")
    lazy = rank_cluster_optimal(lazy_p, top=5)
    full = rank_cluster_optimal(_problem(law, space, False, 128, cluster="ascend_superpod"), top=5)
    np.testing.assert_array_equal(lazy.index[:5], full.index[:5])
    np.testing.assert_allclose(lazy.loss[:5], full.loss[:5], rtol=1e-12)
    bound = lazy_p.evaluator.bound
    filled = bound._done.any(axis=1)
    assert 0 < filled.sum() < len(filled)  # some shapes' tables were never needed
    index = np.arange(len(lazy_p.geoms))
    peak, tight = lazy_p.loss_lower_bound(index, tables=False), lazy_p.loss_lower_bound(index)
    assert np.all(peak <= tight) and np.any(peak < tight)
    np.testing.assert_array_equal(lazy_p.loss_lower_bound(index[::3]), tight[::3])


def test_loss_bound_holds_for_every_timed_geometry(law, space):
    p = _problem(law, space, prune=False)
    ranked = rank_cluster_optimal(p, top=len(p.geoms), bound=False)
    lb = p.loss_lower_bound()[ranked.index]
    ok = np.isfinite(ranked.loss)
    assert np.all(lb[ok] <= ranked.loss[ok])
    assert np.all(ranked.results.mfu <= p.mfu_cap()[ranked.index])


def test_static_memory_is_a_lower_bound_independent_of_batch_and_recompute(law, space):
    p = _problem(law, space)
    ev = p.evaluator
    idx = np.arange(len(p.geoms))
    archs, lays, _, _ = ev.pairs(idx, ev.rep_grid)
    full = memory_per_device(archs, lays, p.cluster).reshape(len(idx), len(ev.rep_grid))
    static = ev.static_memory(idx)
    assert np.all(static <= full * (1 + 1e-12))
    variants = [dataclasses.replace(lays, mbs=lays.mbs * 2), dataclasses.replace(lays, recompute=(lays.recompute + 1) % 3),
                dataclasses.replace(lays, sequence_parallel=~lays.sequence_parallel), dataclasses.replace(lays, gbs=lays.gbs * 2),
                dataclasses.replace(lays, dispatcher=(lays.dispatcher + 1) % len(DISPATCHERS)),
                dataclasses.replace(lays, capacity_factor=np.full(len(lays), 1.25), pad_to_capacity=~lays.pad_to_capacity),
                dataclasses.replace(lays, **{f: ~np.asarray(getattr(lays, f)) for f in OVERLAP_FIELDS})]
    assert set(STATIC_FREE_FIELDS) <= {"mbs", "recompute", "sequence_parallel", "gbs", *DISPATCH_FIELDS, *OVERLAP_FIELDS}
    for stage in ("first", "last"):
        base = sum(stage_memory(archs, lays, p.cluster, stage)[c] for c in STATIC_COMPONENTS)
        for v in variants:
            np.testing.assert_allclose(sum(stage_memory(archs, v, p.cluster, stage)[c] for c in STATIC_COMPONENTS), base)


def test_memory_pruning_matches_evaluate(law, space):
    p = _problem(law, space)
    archs, lays, _, _ = p.evaluator.pairs(np.arange(4))
    res = perfmodel.evaluate(archs, lays, p.cluster, 64)
    np.testing.assert_allclose(memory_per_device(archs, lays, p.cluster), res.memory_per_device_bytes, rtol=1e-12)


def test_compute_optimal_budget_is_the_classic_answer(law, space):
    p = _problem(law, space)
    acc = p.cluster.accelerator
    c_model = 64 * acc.peak("bf16") * 0.40 * perfmodel.goodput(p.cluster, 64) * 5 * 86400
    assert p.c_model == pytest.approx(c_model, rel=1e-12)
    co = rank_compute_optimal(p)
    tokens = c_model / model_flops_per_token(p.geoms.archs)
    losses = law.predict(total_params(p.geoms.archs), np.asarray([p.geoms.archs.row(i).sparsity for i in range(len(p.geoms))]),
                         tokens, np.asarray([p.geoms.archs.row(i).granularity for i in range(len(p.geoms))]))
    assert int(co.index[0]) == int(np.argmin(losses))
    assert co.loss[0] == pytest.approx(losses.min(), rel=1e-12)


def test_more_budget_lowers_the_cluster_optimal_loss(law, space):
    short = solve(_problem(law, space, days=5.0), top=1).cluster_optimal.predicted["loss"]
    long = solve(_problem(law, space, days=10.0), top=1).cluster_optimal.predicted["loss"]
    assert long < short


def test_infeasible_budget_names_memory_and_the_relaxation(law, space):
    c = perfmodel.load_cluster("h100")
    tiny = dataclasses.replace(c, accelerator=dataclasses.replace(c.accelerator, hbm_usable_bytes=3.5e9))
    p = build_problem(tiny, devices=64, days=5, fit=law, space=space)
    with pytest.raises(InfeasibleError, match="memory binds.*nearest feasible relaxation: usable HBM >= ") as info:
        solve(p)
    assert info.value.exit_code == 1


def test_process_parallel_search_gives_the_same_answer(law, space, monkeypatch):
    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 2000)
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    one = rank_cluster_optimal(_problem(law, space), top=3)
    p_two = _problem(law, space)
    two = rank_cluster_optimal(p_two, top=3, workers=2)
    np.testing.assert_array_equal(one.index[:3], two.index[:3])
    counts = p_two.evaluator.counts  # the workers' pairs reach the parent's counts
    assert counts["built"] == two.pairs_seen > counts["timed"] > 0
    np.testing.assert_allclose(one.loss[:3], two.loss[:3], rtol=1e-12)


def test_auto_workers_use_every_core_only_on_a_large_space(law, space, monkeypatch):
    from mosaic.planner import enumerate as enumerate_mod

    p = _problem(law, space)
    assert len(p.geoms) * len(p.evaluator.grid) < enumerate_mod.AUTO_WORKERS_PAIRS
    assert enumerate_mod.auto_workers(p) == 1 and enumerate_mod.auto_workers(p, 3) == 3
    monkeypatch.setattr(enumerate_mod, "AUTO_WORKERS_PAIRS", 0)
    monkeypatch.setattr(enumerate_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert enumerate_mod.auto_workers(p) == 4 and enumerate_mod.auto_workers(p, 1) == 1


def test_progress_counts_every_candidate_seen(law, space, monkeypatch):
    monkeypatch.setattr(problem_mod, "CHUNK_PAIRS", 500)
    monkeypatch.setattr(problem_mod, "CHUNK_MIN_GEOMETRIES", 1)
    seen = []
    p = _problem(law, space)
    ranked = rank_cluster_optimal(p, top=2, progress=seen.append)
    layouts = len(p.evaluator.grid)
    assert sum(seen) == ranked.pairs_seen == (ranked.evaluated + ranked.bounded_geometries) * layouts and len(seen) > 1


def test_best_timed_is_the_row_argmax_of_the_full_pair_matrix():
    """`_best_timed` from the timed batches alone equals argmax over the n_g x n_l matrix (0 where
    not timed or infeasible): ties go to the lowest grid row, a geometry with nothing feasible gets -1."""
    from mosaic.planner.candidates import _best_timed

    rng = np.random.default_rng(3)
    n_g, n_l = 6, 40
    flat = rng.choice(n_g * n_l, 90, replace=False)
    tok = np.round(rng.uniform(-1, 3, len(flat)).clip(0), 0)  # many ties and zeros
    tok[flat // n_l == 4] = 0.0  # geometry 4: timed, none feasible
    keep = flat // n_l != 5  # geometry 5: never timed
    flat, tok = flat[keep], tok[keep]
    batches = [(flat[:30], None), (flat[30:], None)]
    best, at = _best_timed(batches, [tok[:30], tok[30:]], n_g, n_l)
    full = np.zeros(n_g * n_l)
    full[flat] = tok
    mat = full.reshape(n_g, n_l)
    np.testing.assert_array_equal(best, mat.max(axis=1))
    has = best > 0
    assert not has[4] and not has[5] and np.all(at[~has] == -1)
    np.testing.assert_array_equal(flat[at[has]] % n_l, np.argmax(mat, axis=1)[has])

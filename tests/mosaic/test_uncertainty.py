"""Decision under uncertainty: measured errors drawn jointly, indistinguishable plans, the robust pick."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from mosaic.planner import build_problem
from mosaic.planner import uncertainty as unc
from mosaic.planner.enumerate import rank_cluster_optimal
from mosaic.planner.plan import solve
from perfmodel.clusters import load_cluster


def test_throughput_error_is_the_validation_of_this_cluster():
    frame = unc._validation_frame()
    err = unc.throughput_error(load_cluster("b200"))
    rows = frame[(frame["cluster"] == "b200") & (frame["kind"] == "moe") & frame["signed_error"].notna()]
    np.testing.assert_allclose(np.sort(err.own["moe"]), np.sort(np.log1p(rows["signed_error"].to_numpy())))
    summary = err.summary("moe")
    assert summary["bias_measured"] and summary["own_rows"] == len(rows) >= unc.MIN_ROWS
    # a cluster without rows of its own borrows the biases the others show
    none = unc.throughput_error(load_cluster("ascend_superpod")).summary("moe")
    assert not none["bias_measured"] and none["borrowed_bias_range_pct"][0] < 0 < none["borrowed_bias_range_pct"][1]


def test_a_calibrated_cluster_uses_its_own_leave_one_out_errors():
    spec = load_cluster("h100")
    runs = [{"measured_step_time_s": 1.0, "predicted_leave_one_out_s": v} for v in (0.9, 1.1, 1.0, 1.2)]
    calibrated = dataclasses.replace(spec, calibration={"from_runs": {"per_run": runs}})
    err = unc.throughput_error(calibrated)
    assert "calibration" in err.source
    np.testing.assert_allclose(err.own["moe"], np.log([0.9, 1.1, 1.0, 1.2]))


def test_without_any_spread_the_draws_are_the_nominal_losses(law, space):
    """A law without bootstrap and an error with no spread and no bias: every draw is the prediction."""
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    ranked = rank_cluster_optimal(p, top=5)
    ok = np.flatnonzero(np.isfinite(ranked.loss))
    zero = unc.ThroughputError(own={"moe": np.zeros(5), "dense": np.zeros(5)},
                               residuals={"moe": np.zeros(5), "dense": np.zeros(5)},
                               cluster_means={"moe": np.zeros(1), "dense": np.zeros(1)}, source="test")
    layouts = unc.layout_classes(p, ranked.results.best_layout[ok])
    losses = unc.draw_losses(p, ranked.index[ok], ranked.tokens[ok], zero, layouts, draws=7)
    np.testing.assert_allclose(losses, np.broadcast_to(ranked.loss[ok], losses.shape), rtol=1e-12)


def test_plans_of_one_layout_share_their_residual():
    err = unc.ThroughputError(own={"moe": np.zeros(0)}, residuals={"moe": np.linspace(-0.3, 0.3, 11)},
                              cluster_means={"moe": np.zeros(1)}, source="test")
    draws = err.draw(np.asarray(["moe"] * 4), np.asarray([0, 0, 1, 1]), 200, np.random.default_rng(0))
    np.testing.assert_array_equal(draws[:, 0], draws[:, 1])
    assert not np.array_equal(draws[:, 0], draws[:, 2])


def test_decision_on_the_bundled_fit_states_probabilities_and_follows_its_rule():
    p = build_problem("b200", devices=16, days=2)
    ranked = rank_cluster_optimal(p, top=11)
    cands, d = unc.decide(p, ranked, top=11)
    assert d["available"] and d["draws"] == unc.DRAWS and d["fit_draws"] == 200
    rows = d["per_candidate"]
    assert rows[0]["p_beats_best"] == 0.0 and rows[0]["indistinguishable"]
    assert sum(r["p_best"] for r in rows) == pytest.approx(1.0)
    assert all(np.diff([r["loss"] for r in rows]) >= 0)  # candidates in nominal order
    pool = [r for r in rows if r["indistinguishable"]]
    assert d["indistinguishable"] == len(pool) - 1
    assert rows[d["chosen_rank"]]["loss_q90"] == min(r["loss_q90"] for r in pool)  # the stated rule
    assert all((r["p_beats_best"] >= unc.P_INDISTINGUISHABLE) == r["indistinguishable"] for r in rows[1:])
    # the candidates are the exact best ones: enumeration ranks the same geometries first
    np.testing.assert_array_equal(cands.index[:len(rows)], rank_cluster_optimal(
        build_problem("b200", devices=16, days=2), top=len(rows)).index[:len(rows)])


def test_the_plan_picks_robustly_by_default_and_nominally_when_asked():
    robust = solve(build_problem("b200", devices=16, days=2), top=3)
    nominal = solve(build_problem("b200", devices=16, days=2), top=3, pick="nominal")
    best = rank_cluster_optimal(build_problem("b200", devices=16, days=2), top=1)
    assert nominal.decision["chosen_rank"] == 0
    assert nominal.cluster_optimal.predicted["loss"] == pytest.approx(float(best.loss[0]), rel=1e-12)
    r = robust.decision["chosen_rank"]
    assert robust.cluster_optimal.predicted["decision"]["rank"] == r
    assert robust.cluster_optimal.predicted["loss"] >= nominal.cluster_optimal.predicted["loss"]
    if r != 0:  # the nominal best is then among the listed alternatives
        assert any(a.predicted["decision"]["rank"] == 0 for a in robust.alternatives)
    data = robust.to_plan().to_dict()
    assert json.loads(json.dumps(data["decision"]))["rule"] == unc.ROBUST_RULE


def test_decide_without_any_measured_uncertainty_says_so(law, space, monkeypatch):
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    empty = unc.ThroughputError(own={}, residuals={}, cluster_means={}, source="none")
    monkeypatch.setattr(unc, "throughput_error", lambda cluster: empty)
    ranked = rank_cluster_optimal(p, top=3)
    _, d = unc.decide(p, ranked, top=3)
    assert not d["available"] and "bootstrap" in d["note"]


def test_one_set_of_rows_gives_dense_and_moe_one_bias_per_draw():
    """A calibration's rows stand for both kinds: a draw's bias is the same for dense and MoE plans."""
    rows = np.log([0.8, 0.9, 1.1, 1.3])
    err = unc.ThroughputError(own={"dense": rows, "moe": rows}, residuals={"dense": np.zeros(1), "moe": np.zeros(1)},
                              cluster_means={}, source="test")
    draws = err.draw(np.asarray(["dense", "moe"]), np.asarray([0, 1]), 300, np.random.default_rng(1))
    np.testing.assert_array_equal(draws[:, 0], draws[:, 1])
    assert np.std(draws[:, 0]) > 0


def test_layouts_that_differ_only_in_the_dispatcher_are_two_classes(law, make_space):
    space = make_space().replace_layout(ep=(1, 8), dispatcher=("alltoall", "allgather"))
    p = build_problem("h100", devices=64, days=5, fit=law, space=space)
    grid = p.evaluator.grid
    disp = np.asarray(grid.dispatcher)
    a = np.flatnonzero(disp == 1)[0]
    twin = [i for i in np.flatnonzero(disp == 0)
            if all(np.array_equal(np.asarray(getattr(grid, f))[i], np.asarray(getattr(grid, f))[a])
                   for f in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp_flavor", "mbs", "recompute", "precision"))]
    classes = unc.layout_classes(p, np.asarray([a, twin[0]]))
    assert classes[0] != classes[1]


def test_the_prefetched_validation_frame_is_the_one_computed_here(monkeypatch):
    """`prefetch_validation` runs `mosaic validate` of the bundled runs in a side process while the
    search starts; the decision then reads that process's frame, equal to the one computed here."""
    from perfmodel.validation import bundled_runs_path, validate_runs

    monkeypatch.setattr(unc, "_VALIDATION", {})
    unc.prefetch_validation()
    assert "future" in unc._VALIDATION and "frame" not in unc._VALIDATION
    frame = unc._validation_frame()
    assert "future" not in unc._VALIDATION and unc._validation_frame() is frame
    here = validate_runs(bundled_runs_path())[0]
    assert len(frame) > 10
    assert frame.equals(here)

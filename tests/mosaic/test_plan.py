"""Both budgets side by side, the plan file, and the sweeps / sensitivity APIs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from mosaic.planfile import read_plan, write_plan
from mosaic.planner import build_problem
from mosaic.planner.plan import solve
from mosaic.planner.sensitivity import bootstrap_comparison, sensitivity_table
from mosaic.planner.sweep import plot_sweep, sweep
from perfmodel.errors import InputError
from perfmodel.specs.architecture import ARCH_FIELDS
from perfmodel.specs.layout import LAYOUT_FIELDS

PREDICT_KEYS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "tflops_per_device",
                "memory_per_device_bytes", "feasible", "reason", "breakdown")


@pytest.fixture
def result(law, space):
    return solve(build_problem("h100", devices=64, days=5, fit=law, space=space), top=3)


def test_plan_has_both_answers_with_their_predictions(result):
    payload = result.to_plan().to_dict()
    assert set(payload) >= {"model", "layout", "tokens", "predicted", "compute_optimal", "alternatives"}
    cl = {"model": {**payload["model"], **payload["derived"]}, "layout": payload["layout"],
          "tokens": payload["tokens"], "predicted": payload["predicted"]}
    co = payload["compute_optimal"]
    for plan in (cl, co):
        assert set(ARCH_FIELDS) | {"n_total_params", "n_active_params", "sparsity", "granularity"} <= set(plan["model"])
    assert set(PREDICT_KEYS) | {"loss", "wall_time_s", "model_flops", "deliverable_flops"} <= set(cl["predicted"])
    assert set(LAYOUT_FIELDS) == set(cl["layout"])
    # cluster-optimal: D = C_deliverable / FLOPs per token, so C_model = C_deliverable
    assert cl["predicted"]["model_flops"] == pytest.approx(cl["predicted"]["deliverable_flops"], rel=1e-9)
    assert cl["predicted"]["model_flops"] == pytest.approx(cl["tokens"] * cl["predicted"]["flops_per_token"], rel=1e-12)
    assert cl["predicted"]["memory_per_device_bytes"] <= result.problem.cluster.accelerator.usable_hbm_bytes
    # compute-optimal: fixed C_model, and what it costs here
    assert co["predicted"]["model_flops"] == pytest.approx(result.problem.c_model)
    assert co["predicted"]["nominal_mfu"] == 0.40 and "Llama 3" in co["predicted"]["nominal_mfu_source"]
    on = co["predicted"]["on_cluster"]
    if on["feasible"]:
        assert on["days_needed"] == pytest.approx(co["tokens"] / (on["tokens_per_s"] * result.problem.eta) / 86400)
        assert on["loss_in_budget"] >= cl["predicted"]["loss"] - 1e-12  # the cluster optimum is optimal here
    else:
        assert on["reason"] in ("memory", "invalid_layout")
    losses = [cl["predicted"]["loss"]] + [a["predicted"]["loss"] for a in payload["alternatives"]]
    assert losses == sorted(losses) and len(payload["alternatives"]) == 3
    assert payload["binding"]["constraint"] in ("none", "memory", "throughput")


def test_plan_file_round_trip(result, tmp_path):
    path = tmp_path / "plans" / "plan.yaml"
    write_plan(str(path), result.to_plan())
    data = yaml.safe_load(path.read_text())
    assert data["version"] == 1
    for key in ("tool_version", "cluster", "fit", "budget", "model", "tokens", "layout", "predicted", "alternatives"):
        assert key in data
    assert data["cluster"] == {"name": "h100", "hash": result.problem.cluster.content_hash()}
    assert data["fit"]["hash"] == result.problem.law.content_hash()
    assert data["budget"] == {"devices": 64, "days": 5.0, "wall_time_s": 5 * 86400.0}
    plan = read_plan(str(path))
    assert plan.model == result.cluster_optimal.arch and plan.layout == result.cluster_optimal.layout
    assert [p.name for p in path.parent.iterdir()] == ["plan.yaml"]  # no temp file left
    assert plan.to_dict() == data == result.to_plan().to_dict()  # what is read is what was written


def test_load_plan_rejects_unknown_keys(result, tmp_path):
    path = tmp_path / "plan.yaml"
    write_plan(str(path), result.to_plan())
    data = yaml.safe_load(path.read_text())
    data["layout"]["tpp"] = 2
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match="tpp"):
        read_plan(str(path))
    data["layout"].pop("tpp")
    data["predicteed"] = {}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match="unknown key 'predicteed'; did you mean 'predicted'"):
        read_plan(str(path))


def test_sparsity_sweep_contains_the_global_optimum(law, space, result, tmp_path):
    frame = sweep("h100", "sparsity", devices=64, days=5, fit=law, space=space)
    assert list(frame["value"]) == sorted(frame["value"]) and frame["value"].iloc[0] == 0.0
    assert np.nanmin(frame["cluster_optimal_loss"]) == pytest.approx(result.cluster_optimal.predicted["loss"], rel=1e-12)
    assert np.nanmin(frame["compute_optimal_loss"]) == pytest.approx(result.compute_optimal.predicted["loss"], rel=1e-12)
    plot_sweep(frame, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_days_sweep_is_monotone(law, space):
    frame = sweep("h100", "days", values=[2, 4, 8], devices=64, fit=law, space=space)
    assert np.all(np.diff(frame["cluster_optimal_loss"]) < 0)
    assert np.all(np.diff(frame["compute_optimal_loss"]) < 0)
    with pytest.raises(InputError, match="over='layers' is unknown"):
        sweep("h100", "layers", fit=law, space=space)


def test_sensitivity_moves_the_right_way(result):
    rows = {r["change"]: r for r in sensitivity_table(result)}
    base = result.cluster_optimal.predicted["loss"]
    assert rows["budget x1.2"]["loss"] < base < rows["budget x0.8"]["loss"]
    assert rows["hbm x1.2"]["loss"] <= base + 1e-12  # more memory never removes a feasible option
    assert rows["bandwidth x1.2"]["loss"] <= base + 1e-12
    note = bootstrap_comparison(result)
    assert note["p_beats_runner_up"] is None and "bootstrap" in note["note"]


def test_trainer_reads_the_plan_file(law, space, result, tmp_path):
    """A plan for the bundled trainer's dispatcher (alltoall) is read as planned; a plan with a fused
    dispatcher (the default space searches them) is refused with the fix named."""
    from mosaic.cli.train import build_config

    runnable = solve(build_problem("h100", devices=64, days=5, fit=law, space=space.replace_layout(dispatcher=("alltoall",))),
                     top=1)
    path = tmp_path / "plan.yaml"
    write_plan(str(path), runnable.to_plan())
    config = build_config(plan=path, model=None, layout=None, nproc=None, device="cpu", cluster=None,
                          out=tmp_path / "run", options={})
    assert config.model == runnable.cluster_optimal.arch and config.layout == runnable.cluster_optimal.layout
    assert config.cluster == "h100"
    fused = dataclasses.replace(runnable.cluster_optimal.layout, dispatcher="hybridep")
    plan = runnable.to_plan()
    write_plan(str(path), dataclasses.replace(plan, layout=fused))
    with pytest.raises(InputError, match="set dispatcher=alltoall"):
        build_config(plan=path, model=None, layout=None, nproc=None, device="cpu", cluster=None,
                     out=tmp_path / "run2", options={})


def _with_law(result, law):
    return dataclasses.replace(result, problem=dataclasses.replace(result.problem, law=law))


def test_bootstrap_probability_that_the_plan_beats_the_runner_up(result, planted_law_cls):
    class Boot(planted_law_cls):
        """Bootstrap samples: the planted parameters with b scaled by `scales`."""

        def __init__(self, scales):
            super().__init__()
            self.scales = np.asarray(scales, dtype=float)
            self.bootstrap_params = np.ones((len(scales), 11))

        def predict_bootstrap(self, n_total, sparsity, tokens, granularity):
            base = self.predict(n_total, sparsity, tokens, granularity)
            d_term = self.params["b"] / np.asarray(tokens, dtype=float) ** self.params["beta"]
            return base + (self.scales - 1.0)[:, None] * np.atleast_1d(d_term)[None, :]

    # every sample is the point fit: the plan always wins
    out = bootstrap_comparison(_with_law(result, Boot([1.0] * 20)))
    assert out["p_beats_runner_up"] == 1.0 and out["samples"] == 20
    lo, hi = out["loss_interval_90"]
    assert lo == pytest.approx(hi) == pytest.approx(result.cluster_optimal.predicted["loss"])
    scales = np.linspace(0.0, 3.0, 41)
    p = bootstrap_comparison(_with_law(result, Boot(scales)))["p_beats_runner_up"]
    best, runner = result.cluster_optimal, result.alternatives[0]
    law = planted_law_cls()

    def boot(choice):  # each plan at its own tokens D
        base = choice.predicted["loss"]
        return base + (scales - 1.0) * law.params["b"] / choice.tokens ** law.params["beta"]

    assert p == pytest.approx(np.mean(boot(best) < boot(runner)))
    assert 0.0 < p < 1.0 or best.tokens == runner.tokens


def test_plan_from_a_cluster_file_records_it_for_every_reader(law, space, tmp_path):
    """A calibrated (non-bundled) cluster is not findable by name: the plan records its file, and
    the trainer and the exporters load it by the same rule and warn alike when it changed."""
    from mosaic.exports.common import node_shape
    from mosaic.planfile import cluster_of
    from perfmodel.clusters import resolve_cluster_path

    site = tmp_path / "site.yaml"
    text = resolve_cluster_path("h100").read_text().replace("name: h100", "name: h100_site", 1)
    site.write_text(text)
    path = tmp_path / "plan.yaml"
    write_plan(str(path), solve(build_problem(str(site), devices=64, days=5, fit=law, space=space), top=1).to_plan())
    data = yaml.safe_load(path.read_text())
    assert data["cluster"]["name"] == "h100_site" and data["cluster"]["file"] == str(site.resolve())
    plan = read_plan(path)
    assert plan.cluster.source() == str(site.resolve())
    spec, drift = cluster_of(plan)
    assert spec.name == "h100_site" and drift is None
    assert "NOTE" not in node_shape(plan).note
    site.write_text(text.replace("devices: 1024", "devices: 2048", 1))  # the file changed since planning
    spec, drift = cluster_of(plan)
    assert drift is not None and plan.cluster.hash in drift and spec.content_hash() in drift
    assert f"NOTE {drift}" in node_shape(plan).note
    site.unlink()  # moved away: every reader falls back to the recorded name
    assert plan.cluster.source() == "h100_site"


def test_choices_carry_the_search_evaluation_of_their_pair(result, monkeypatch):
    """Each chosen pair's predictions are the search's own evaluate row, equal to a fresh evaluate."""
    import perfmodel

    fresh = [perfmodel.evaluate(c.arch, c.layout, result.problem.cluster, result.problem.budget.devices).row(0)
             for c in [result.cluster_optimal, *result.alternatives]]
    for choice, row in zip([result.cluster_optimal, *result.alternatives], fresh):
        assert {k: choice.predicted[k] for k in row} == row
    calls = []
    monkeypatch.setattr(perfmodel, "evaluate", lambda *a, **k: calls.append(a) or pytest.fail("evaluated again"))
    solve(result.problem, top=3)  # the problem's search is cached: nothing is evaluated again
    assert calls == []


def test_the_search_picks_the_split_and_dispatcher_that_run_fastest(law, make_space):
    """With both pipeline splits and two dispatchers in the space, every geometry's choice is the
    fastest of its variants: the same layout priced with the other split / dispatcher is no faster."""
    import perfmodel

    space = make_space(n_layers=(24,), n_experts=(16,), top_k=(2,), granularity=(1.0,), d_model=(2048,))
    space = space.replace_layout(tp=(1,), pp=(2, 4), ep=(8,), recompute=("none",), dp_flavor=("zero1",),
                                 pipeline_split=("default", "balanced"), dispatcher=("alltoall", "allgather"))
    problem = build_problem("h100", devices=64, days=5, fit=law, space=space)
    assert len(problem.evaluator.rep_grid) == 2 * 2 * 2  # (pp 2, 4) x (default, balanced) x (alltoall, allgather)
    chosen = solve(problem, top=1).cluster_optimal
    rate = chosen.predicted["tokens_per_s"]
    for changes in ({"balanced_split": not chosen.layout.balanced_split},
                    {"dispatcher": "allgather" if chosen.layout.dispatcher == "alltoall" else "alltoall"}):
        other = dataclasses.replace(chosen.layout, **changes)
        result = perfmodel.evaluate(chosen.arch, other, problem.cluster, 64)
        assert result.tokens_per_s[0] <= rate * (1 + 1e-12)


def test_the_search_tries_each_recompute_module_list_on_the_selective_rows(law, make_space):
    """recompute_modules in the space copies the selective rows once per list (none and full
    once): the choice is no slower than the same layout with any other list that fits."""
    import perfmodel

    space = make_space(n_layers=(24,), n_experts=(16,), top_k=(2,), granularity=(1.0,), d_model=(2048,))
    lists = (None, "layernorm+moe_act", "core_attn+layernorm+moe_act")
    space = space.replace_layout(tp=(1,), pp=(1,), ep=(8,), recompute=("none", "selective", "full"),
                                 dp_flavor=("zero1",), recompute_modules=lists)
    problem = build_problem("h100", devices=64, days=5, fit=law, space=space)
    base = build_problem("h100", devices=64, days=5, fit=law, space=space.replace_layout(recompute_modules=(None,)))
    per_mode = len(base.evaluator.rep_grid) // 3
    assert len(problem.evaluator.rep_grid) == per_mode * (2 + len(lists))  # none, full, and selective per list
    chosen = solve(problem, top=1).cluster_optimal
    rate = chosen.predicted["tokens_per_s"]
    for modules in lists:
        other = dataclasses.replace(chosen.layout, recompute="selective", recompute_modules=modules)
        result = perfmodel.evaluate(chosen.arch, other, problem.cluster, 64)
        assert not result.feasible[0] or result.tokens_per_s[0] <= rate * (1 + 1e-12), modules

"""`--from-runs`: correction factors are recovered from step times the model itself generated; MAPE is honest."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from calibration.from_runs import discover_runs, initial_factors, predict, refit_from_runs, warm_up_steps
from mosaic.cli.app import app
from perfmodel.clusters import load_cluster
from perfmodel.errors import InputError
from perfmodel.specs.strict import to_mapping

from .conftest import base_cluster

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "vocab_size": 256,
         "seq_len": 32, "n_experts": 8, "top_k": 2, "n_shared_experts": 1, "d_expert": 32, "d_ff_dense": 128,
         "n_dense_layers": 1, "ffn_ratio": 4.0, "gated_ffn": True, "tie_embeddings": False}
LAYOUTS = [({"dp": 2, "ep": 2, "mbs": 2, "gbs": 8}, 2), ({"dp": 2, "ep": 1, "mbs": 2, "gbs": 8}, 2),
           ({"dp": 2, "ep": 2, "mbs": 1, "gbs": 8}, 2), ({"dp": 1, "ep": 1, "mbs": 2, "gbs": 8}, 1),
           ({"dp": 1, "ep": 1, "mbs": 4, "gbs": 16}, 1), ({"dp": 2, "ep": 2, "mbs": 4, "gbs": 16}, 2)]
SYNTHETIC_STEPS = 21
"""Steps per synthetic run (the first is warm-up, then 1% noise per step): 19 kept steps make each
run's mean good to about 0.25%, so the factors can be checked to 5% (with 6 steps, 0.45% per run,
the one dispatch-bound run left the launch latency 5.4% off)."""


def _write_run(folder, layout, world, step_time_s, rng, steps=None):
    from perfmodel.specs.layout import ParallelLayout

    lay = ParallelLayout(**layout, precision="bf16").resolve(world)
    folder.mkdir(parents=True)
    run = {"version": 1, "model": MODEL, "layout": to_mapping(lay), "cluster": "cpu_local", "device": "cpu",
           "world_size": world, "precision": "fp32", "out_dir": str(folder)}
    (folder / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    lines = []
    for step in range(1, (steps or SYNTHETIC_STEPS) + 1):
        t = step_time_s * (3.0 if step == 1 else 1.0 + 0.01 * rng.standard_normal())  # step 1 is warm-up
        lines.append(json.dumps({"step": step, "loss": 5.0, "aux_loss": 1.0, "tokens_per_s": 1.0, "step_time_s": t,
                                 "mfu": 0.01, "tflops_per_device": 0.001, "peak_memory_bytes": 1, "expert_imbalance": 1.2}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _write_runs(folder, layouts, step_times, rng):
    """Runs of `layouts` whose step times are `step_times(runs)` (the runs read back from placeholders)."""
    for i, (layout, world) in enumerate(layouts):
        _write_run(folder / f"r{i}", layout, world, 1.0, rng)
    times = step_times(discover_runs(folder))
    for i, (layout, world) in enumerate(layouts):
        for path in (folder / f"r{i}").iterdir():
            path.unlink()
        (folder / f"r{i}").rmdir()
        _write_run(folder / f"r{i}", layout, world, float(times[i]), rng)


@pytest.fixture(scope="module")
def synthetic_runs(tmp_path_factory):
    """Runs whose step times are the model's own predictions with known factors (plus 1% noise)."""
    cluster = load_cluster(base_cluster())
    folder = tmp_path_factory.mktemp("runs")
    # launch latency: the eager op counts (perfmodel.eager) are ~10x the fused-kernel counts, so 20 us per op
    # keeps dispatch and compute both visible in these runs (both factors identifiable)
    truth = {**initial_factors(cluster), "efficiency_scale": 0.05, "launch_latency_s": 2.0e-5}
    _write_runs(folder, LAYOUTS, lambda runs: predict(cluster, runs, truth), np.random.default_rng(0))
    return folder, truth


def test_refit_recovers_known_factors_and_reduces_mape(synthetic_runs, tmp_path):
    folder, truth = synthetic_runs
    result = refit_from_runs(folder, base_cluster(), tmp_path / "refit.yaml")
    assert result.runs == len(LAYOUTS)
    assert result.mape["before"] > 0.5  # the uncorrected model is far off these runs
    assert result.mape["after_in_sample"] < 0.03  # back to the 1% step-time noise
    # Honest cross-validation: a run that is the only one bound by dispatch cannot be predicted
    # by factors fitted without it, so the held-out error is larger, but far below "before".
    assert result.mape["after_in_sample"] <= result.mape["after_leave_one_run_out"] < result.mape["before"] / 4
    assert "efficiency_scale" in result.fitted and "launch_latency_s" in result.fitted
    assert result.factors["efficiency_scale"] == pytest.approx(truth["efficiency_scale"], rel=0.05)
    assert result.factors["launch_latency_s"] == pytest.approx(truth["launch_latency_s"], rel=0.05)
    predicted = predict(load_cluster(base_cluster()), discover_runs(folder), {**truth, **result.factors})
    measured = np.array([r.measured_step_time_s for r in discover_runs(folder)])
    assert np.max(np.abs(predicted / measured - 1)) < 0.05
    refit = load_cluster(str(tmp_path / "refit.yaml"))
    section = refit.calibration["from_runs"]
    assert section["runs"] == len(LAYOUTS) and set(section["mape"]) == {"before", "after_in_sample", "after_leave_one_run_out"}
    assert refit.accelerator.launch_latency_s == pytest.approx(result.factors["launch_latency_s"], rel=1e-3)
    # the efficiency scale acts on every kernel figure (e_max and memory fractions), as written
    scale, base = result.factors["efficiency_scale"], load_cluster(base_cluster()).accelerator.kernels
    written = refit.accelerator.kernels
    for precision, figure in base.gemm.items():
        assert written.gemm[precision].e_max == pytest.approx(min(1.0, figure.e_max * scale), rel=1e-3)
        assert written.gemm[precision].m_half == figure.m_half and "from-runs" in written.gemm[precision].source
        for phase in ("fwd", "dgrad", "wgrad"):
            assert written.grouped_gemm[precision].phase(phase).e_max == pytest.approx(
                min(1.0, base.grouped_gemm[precision].phase(phase).e_max * scale), rel=1e-3)
    for precision, figure in base.attention.items():
        assert written.attention[precision].bwd_e_max == pytest.approx(min(1.0, figure.bwd_e_max * scale), rel=1e-3)
    for cls, fraction in base.memory.fraction.items():
        assert written.memory.fraction[cls] == pytest.approx(min(1.5, fraction * scale), rel=1e-3)
    assert "from-runs" in refit.accelerator.sources["launch_latency_s"]
    assert "straggler_cv" in result.fixed  # one host: the straggler factor cannot be seen, and is not fitted


def test_warm_up_step_is_excluded(synthetic_runs):
    folder, _ = synthetic_runs
    for run in discover_runs(folder):
        assert run.steps_used == SYNTHETIC_STEPS - warm_up_steps(SYNTHETIC_STEPS)
        first = json.loads((folder / run.name / "metrics.jsonl").read_text().splitlines()[0])["step_time_s"]
        assert run.measured_step_time_s < first / 2


def test_warm_up_counts_the_first_process_only(tmp_path):
    """Rows a later process appended (marked "round", their warm-up already dropped) do not
    lengthen the first process's warm-up: 10 steps of the first keep 9, all 40 appended stay."""
    from calibration.from_runs import first_process_steps, load_run

    folder = tmp_path / "pooled"
    _write_run(folder, *LAYOUTS[3], 1.0, np.random.default_rng(0), steps=10)
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows += [dict(rows[-1], step=11 + i, round=1, step_time_s=2.0) for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert first_process_steps(rows) == 10
    run = load_run(folder)
    assert run.steps_used == 49  # max(1, 50 // 10) = 5 would have dropped 4 first-process steps more
    kept = [r["step_time_s"] for r in rows[1:]]
    assert run.measured_step_time_s == pytest.approx(sum(kept) / len(kept))
    assert first_process_steps([{"round": 1}] * 3) == 3  # no first-process rows: the plain rule on all


def test_measured_step_time_is_the_mean_of_a_machine_that_switches_speed():
    """A run whose steps switch between a fast and a slow state is measured by its mean: the
    median would sit in whichever state held most steps (here 1.0 for 11 fast of 20) and jump to
    the other with one step more, while the mean moves with the mix."""
    from calibration.from_runs import measured_step_time_s

    fast_heavy = [1.0] * 11 + [2.0] * 9
    slow_heavy = [1.0] * 9 + [2.0] * 11
    assert measured_step_time_s(fast_heavy) == pytest.approx(1.45)
    assert measured_step_time_s(slow_heavy) == pytest.approx(1.55)
    assert np.median(fast_heavy) == 1.0 and np.median(slow_heavy) == 2.0  # what the median would have said


def test_cli_from_runs_prints_mape_and_writes(synthetic_runs, tmp_path):
    import shutil

    folder = tmp_path / "runs"
    for name in ("r0", "r2", "r4"):  # three runs keep this CLI check quick
        shutil.copytree(synthetic_runs[0] / name, folder / name)
    out = tmp_path / "cli.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--from-runs", str(folder), "--cluster", base_cluster(), "-o", str(out),
                                      "--json", "--report", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["mape"]["after_leave_one_run_out"] < summary["mape"]["before"]
    assert out.exists()
    assert "after_leave_one_run_out" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "from_runs.png").stat().st_size > 1000


def test_bad_runs_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no run folders"):
        discover_runs(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "run.yaml").write_text(yaml.safe_dump({"version": 1, "model": MODEL, "world_size": 1}))
    (bad / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 1.0}\n')
    with pytest.raises(InputError, match="layout"):
        discover_runs(tmp_path)
    (bad / "run.yaml").write_text(yaml.safe_dump({"version": 1, "model": MODEL, "world_size": 1,
                                                  "layout": {"dp": 1, "mbs": 1, "gbs": 1}}))
    (bad / "metrics.jsonl").write_text('{"step": 1, "step_time_s": -1.0}\n')
    with pytest.raises(InputError, match="step_time_s"):
        discover_runs(tmp_path)


def test_prior_keeps_weakly_determined_factors_near_their_calibrated_values(tmp_path, monkeypatch):
    """Runs that agree with the calibrated cluster up to 15% noise: the MAP fit moves the factors
    less than plain least squares does (which chases the noise), and no factor leaves its bounds."""
    import calibration.from_runs as from_runs

    cluster = load_cluster(base_cluster())
    start = initial_factors(cluster)
    rng = np.random.default_rng(3)
    _write_runs(tmp_path, LAYOUTS[:4],
                lambda runs: predict(cluster, runs, start) * np.exp(0.15 * rng.standard_normal(len(runs))), rng)
    runs = discover_runs(tmp_path)
    names = ["efficiency_scale", "launch_latency_s"]
    with_prior = from_runs.fit_factors(cluster, runs, names, start)
    monkeypatch.setattr(from_runs, "PRIOR_LOG_SD", 1e9)  # no prior: plain least squares
    plain = from_runs.fit_factors(cluster, runs, names, start)

    def departure(factors):
        return sum(abs(np.log(factors[n] / start[n])) for n in names)

    assert departure(plain) > 0.05  # the noise does move an unconstrained fit
    assert departure(with_prior) < departure(plain)
    assert all(from_runs.BOUNDS[n][0] <= with_prior[n] <= from_runs.BOUNDS[n][1] for n in names)


def test_cauchy_prior_residual_is_gaussian_near_the_centre_and_heavy_tailed():
    """Near the calibrated value the prior costs z^2 (a Gaussian of the same sd); far away it grows
    like log z, so runs that all agree on a far-off factor outweigh it."""
    from calibration.from_runs import cauchy_residual

    z = np.array([-0.05, 0.0, 0.05])
    assert np.allclose(cauchy_residual(z) ** 2, z ** 2, rtol=1e-2, atol=1e-12)
    assert np.allclose(cauchy_residual(-z), -cauchy_residual(z))  # odd: the sign tells the solver which way
    far = cauchy_residual(np.array([10.0, 100.0])) ** 2
    assert far[0] < 10.0 and far[1] < 20.0  # a Gaussian would charge 100 and 10,000
    assert np.all(np.diff(cauchy_residual(np.linspace(-50, 50, 1001))) > 0)  # monotone: one minimum

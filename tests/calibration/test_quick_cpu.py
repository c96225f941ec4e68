"""`mosaic calibrate --quick` on cpu with 2 gloo ranks: a valid profile, sane figures, honest predictions."""

from __future__ import annotations

import math

import pytest
import yaml

from calibration.measurements import COLLECTIVE_KINDS, KERNEL_KINDS
from perfmodel.specs.cluster import COLLECTIVES


def test_quick_run_writes_a_valid_profile_csv_and_report(quick_run, calibrated, rows):
    assert quick_run["result"].exit_code == 0, quick_run["result"].output
    assert calibrated.name.endswith("_calibrated")
    cal = calibrated.calibration
    prov = cal["provenance"]
    for key in ("date", "host", "device", "device_name", "torch_version", "driver", "ranks"):
        assert prov[key] not in (None, ""), key
    assert prov["device"] == "cpu" and prov["ranks"] == 2 and prov["threads_per_rank"] == 1
    assert cal["measurements_csv"] == quick_run["csv"].name and quick_run["csv"].exists()
    assert {r.kind for r in rows} == set(KERNEL_KINDS) | set(COLLECTIVE_KINDS)
    report = quick_run["report"]
    text = (report / "report.md").read_text()
    for png in ("compute.png", "memory.png", "collectives.png", "noise.png"):
        assert (report / png).stat().st_size > 1000 and png in text
    # The file on disk is plain YAML with a plain-mapping calibration section.
    raw = yaml.safe_load(quick_run["output"].read_text())
    assert isinstance(raw["calibration"], dict) and raw["version"] == 1


def test_fitted_figures_are_sane(calibrated, rows):
    acc = calibrated.accelerator
    assert set(acc.peak_flops_per_s) == {"fp32", "bf16"}
    for precision, peak in acc.peak_flops_per_s.items():
        assert math.isfinite(peak) and peak > 1e9  # any cpu core does more than 1 GFLOP/s on a 1024^3 matmul
        curve = acc.compute_efficiency[precision]
        assert all(0 < v <= 1 for v in curve.values) and max(curve.values) == pytest.approx(1.0, abs=0.1)
        assert "mosaic calibrate" in curve.source
    assert acc.hbm_bandwidth_bytes_per_s > 1e9
    assert all(0 < v <= 1 for v in acc.memory_efficiency.values)
    assert 0 < acc.launch_latency_s < 1e-3
    # the attention core against the fp32 GEMM curve the cpu trainer computes with (torch's cpu flash
    # kernel: 0.2-0.6 of a GEMM's rate at these sizes, never faster than 4x)
    attention = calibrated.calibration["attention"]
    assert attention["precision"] == "fp32" and attention["efficiency_vs_dense_gemm"]["points"] == 5
    assert acc.attention_efficiency_vs_gemm == pytest.approx(attention["efficiency_vs_dense_gemm"]["median"], rel=1e-3)
    assert 0 < acc.attention_efficiency_vs_gemm <= 4 and "SDPA" in acc.sources["attention_efficiency_vs_gemm"]
    host = calibrated.levels[0]
    assert host.bandwidth_bytes_per_s > 0 and 0 < host.efficiency <= 1 and host.latency_s > 0
    assert set(host.collective_efficiency) == set(COLLECTIVES)
    assert all(0 < v <= 1 for v in host.collective_efficiency.values())
    fits = calibrated.calibration["collectives"]
    assert {f["collective"] for f in fits} == set(COLLECTIVES)
    # alpha-beta describes loopback gloo: the sizes span 4 KiB..16 MiB (three decades of time);
    # the small ones carry the scheduler stalls a trainer pays (batched means), so the fit of log
    # time scatters more than the fit of time. Typical here: r2 0.90-0.99, r2_linear 0.95-0.999;
    # one collective's r2_linear fell to 0.9 or below once in about ten calibrations on the shared VM
    r2 = sorted(fit["r2"] for fit in fits)
    r2_linear = sorted(fit["r2_linear"] for fit in fits)
    assert r2[len(r2) // 2] > 0.8 and r2_linear[len(r2_linear) // 2] > 0.9, fits
    assert all(value > 0.5 for value in r2_linear), fits  # every collective's time grows with its bytes
    assert calibrated.calibration["collectives_after_compute"]  # the same collectives after an eager compute gap
    assert host.sync_latency_s >= 0
    for fit in fits:
        assert fit["busbw_bytes_per_s"] > 0 and fit["alpha_s"] >= 0
    for row in rows:
        assert row.median_s > 0 and row.noise >= 0 and row.repeats >= 5


def test_collective_rows_report_nccl_tests_bus_bandwidth(rows):
    for row in rows:
        if row.kind in COLLECTIVE_KINDS:
            factor = {"all_reduce": 2 * (row.ranks - 1) / row.ranks, "p2p": 1.0}.get(row.kind, (row.ranks - 1) / row.ranks)
            assert row.busbw_bytes_per_s == pytest.approx(row.bytes / row.median_s * factor, rel=1e-6)
            assert row.level == "host" or row.level == "node"


@pytest.mark.parametrize(("precision", "shapes"), [("fp32", [(384, 384, 384), (320, 640, 448)]),
                                                   ("bf16", [(384, 384, 384), (200, 600, 300)])])
def test_calibrated_model_predicts_unmeasured_gemms_within_25_percent(precision, shapes):
    """Calibrate the GEMM curve on the --quick grid and predict shapes outside it.

    The unmeasured shapes are timed in the same interleaved session as the grid
    (and left out of the fit), so a change in the load other jobs put on this
    shared 2-core machine between two sessions cannot decide the outcome.
    """
    import torch

    from calibration.fit import fit_efficiency_curve, predict_time_s
    from calibration.kernels import KernelPoint, cpu_has_native_bf16, kernel_plan, run_points
    from calibration.timing import Budget

    if precision == "bf16" and cpu_has_native_bf16() is False:
        pytest.skip("this CPU has no bf16 GEMM units: torch's emulated bf16 GEMM depends on shape, not only size "
                    "(calibration.kernels.NATIVE_BF16_CPU_FLAGS), so no size curve predicts it")
    device = torch.device("cpu")
    grid = [p for p in kernel_plan(device, True, [precision]) if p.kind == "gemm"]
    unmeasured = [KernelPoint("gemm", precision, {"M": M, "N": N, "K": K}) for M, N, K in shapes]
    assert not {tuple(p.shape.values()) for p in unmeasured} & {tuple(p.shape.values()) for p in grid}
    def session_errors() -> list[tuple[str, float, float]]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as calibrated: one thread per rank
        try:
            rows = run_points(grid + unmeasured, device, Budget(warmup=1, min_repeats=9, max_repeats=25, max_seconds=0.2))
        finally:
            torch.set_num_threads(threads)
        fit = fit_efficiency_curve([r.flops for r in rows[:len(grid)]], [r.median_s for r in rows[:len(grid)]], None, "test")
        return [(row.shape, predict_time_s(fit.curve, fit.peak, row.flops), row.median_s) for row in rows[len(grid):]]

    # A burst of load from other processes can disturb one whole session on a shared
    # 2-core machine; the claim is checked on the first of up to three sessions in which
    # it holds, and every session's figures are reported when none does.
    sessions = []
    for _ in range(3):
        errors = session_errors()
        sessions.append(errors)
        if all(abs(predicted - measured) / measured < 0.25 for _, predicted, measured in errors):
            return
    pytest.fail(f"unmeasured GEMMs predicted outside 25% in all three sessions: {sessions}")


def test_profile_curves_are_the_fit_of_the_csv_rows(calibrated, rows):
    from calibration.fit import fit_efficiency_curve

    for precision, curve in calibrated.accelerator.compute_efficiency.items():
        gemm = [r for r in rows if r.kind == "gemm" and r.precision == precision]
        fit = fit_efficiency_curve([r.flops for r in gemm], [r.median_s for r in gemm], None, "")
        assert calibrated.accelerator.peak(precision) == pytest.approx(fit.peak, rel=1e-5)
        assert curve.values == pytest.approx(fit.curve.values, rel=1e-3)
        assert curve.sizes == pytest.approx(fit.curve.sizes, rel=1e-5)


def test_refit_from_the_measurements_csv_reproduces_the_profile(quick_run, calibrated, tmp_path):
    from calibration.run import calibrate

    again = calibrate(calibrated.calibration["base_cluster"]["name"], output=tmp_path / "again.yaml",
                      measurements=quick_run["csv"])
    assert again.spec.accelerator.peak_flops_per_s == calibrated.accelerator.peak_flops_per_s
    assert again.spec.levels[0] == calibrated.levels[0].__class__(**{**calibrated.levels[0].__dict__,
                                                                    "source": again.spec.levels[0].source})
    assert (tmp_path / "again.measurements.csv").read_text() == quick_run["csv"].read_text()


def test_perfmodel_prices_collectives_as_measured(calibrated, rows):
    """The written level figures, read back through perfmodel.comm, reproduce the measured bandwidth."""
    from perfmodel.comm import collective_time

    largest = max(r.bytes for r in rows if r.kind in COLLECTIVE_KINDS)
    for fit in calibrated.calibration["collectives"]:
        measured = next(r for r in rows if r.kind == fit["collective"] and r.bytes == largest)
        model = float(collective_time(calibrated, fit["collective"], largest, 2, 1))
        fitted = fit["alpha_s"] + largest / fit["algbw_bytes_per_s"]
        assert model == pytest.approx(fitted, rel=0.15), fit["collective"]
        assert model == pytest.approx(measured.median_s, rel=0.6), fit["collective"]  # the point itself is noisier


def test_mosaic_predict_uses_the_calibrated_cluster(quick_run, calibrated):
    import json

    from typer.testing import CliRunner

    from mosaic.cli.app import app
    from perfmodel.clusters import bundled_cluster_paths

    if "predict" not in {c.name for c in app.registered_commands}:
        pytest.skip("`mosaic predict` is not registered in this build")
    model = quick_run["folder"] / "model.yaml"
    model.write_text(yaml.safe_dump({"version": 1, "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
                                     "head_dim": 16, "vocab_size": 256, "seq_len": 32, "n_experts": 8, "top_k": 2,
                                     "n_shared_experts": 1, "d_expert": 32, "d_ff_dense": 128, "n_dense_layers": 1,
                                     "ffn_ratio": 4.0, "gated_ffn": True, "tie_embeddings": False}))
    args = ["predict", "--model", str(model), "--layout", "dp=2,ep=2,mbs=2,gbs=8,precision=fp32", "--json"]
    calibrated_out = CliRunner().invoke(app, [*args, "--cluster", str(quick_run["output"])])
    assert calibrated_out.exit_code == 0, calibrated_out.output
    result = json.loads(calibrated_out.output)
    assert result["cluster"] == calibrated.name and result["step_time_s"] > 0
    base = calibrated.calibration["base_cluster"]["name"]
    if base in bundled_cluster_paths():
        base_out = json.loads(CliRunner().invoke(app, [*args, "--cluster", base]).output)
        assert base_out["step_time_s"] != result["step_time_s"]  # the measured figures are what it used

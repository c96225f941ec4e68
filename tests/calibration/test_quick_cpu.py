"""`mosaic calibrate --quick` on cpu with 2 gloo ranks: kernel tables, a valid profile built from them,
sane figures, honest predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from perfmodel.specs.cluster import COLLECTIVES

TABLE_FILES = ("gemm.csv", "grouped_gemm.csv", "attention.csv", "memory_kernels.csv", "collectives.csv", "host.csv",
               "provenance.yaml")
MEMORY_KERNELS = {"copy", "add", "rmsnorm", "swiglu", "permute", "cross_entropy", "adamw"}
TABLE_COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
GEMM_FIT_BOUND = {"fp32": 0.25, "bf16": 0.4}
"""Median |error| a cpu calibration's GEMM figure must fit its own rows within. fp32 (the cpu
trainer's precision): 0.10 on the AMX Xeon of notebooks/data/cpu_quick.yaml. bf16 runs
through oneDNN, whose per-call cost (about 30 us on that Xeon: every shape from 16x16x64 to
64^3 took 28-31 us) the product of saturations can only absorb into large halves: 0.107 there,
0.24-0.32 on Zen 4 (avx512_bf16; 0.32 in the CI run of stop 24)."""


def test_quick_run_writes_tables_a_valid_profile_and_report(quick_run, calibrated, measured):
    assert quick_run["result"].exit_code == 0, quick_run["result"].output
    assert calibrated.name.endswith("_calibrated")
    cal = calibrated.calibration
    prov = cal["provenance"]
    for key in ("date", "host", "device", "device_name", "torch_version", "driver", "ranks"):
        assert prov[key] not in (None, ""), key
    assert prov["device"] == "cpu" and prov["ranks"] == 2 and prov["threads_per_rank"] == 1
    folder = quick_run["tables"]
    assert cal["tables"] == folder.name and sorted(p.name for p in folder.iterdir()) == sorted(TABLE_FILES)
    # every row in the bundled tables' format, naming this machine as the calibrated cluster
    source = f"mosaic calibrate on {prov['host']} at {prov['date']}"
    for kind in ("gemm", "grouped_gemm", "attention", "memory_kernels", "collectives"):
        table = measured.rows(kind)
        assert len(table) and set(table["accelerator"]) == {calibrated.name}, kind
        assert set(table["source"]) == {source} and all(prov["device_name"] in h for h in table["hardware"])
        assert all(s.startswith("torch ") for s in table["software"])
    gemm, grouped, attention = measured.rows("gemm"), measured.rows("grouped_gemm"), measured.rows("attention")
    assert set(gemm["precision"]) == {"fp32", "bf16"}
    for precision in ("fp32", "bf16"):
        mine = grouped.select(grouped["precision"] == precision)
        assert set(mine["phase"]) == {"fwd", "dgrad", "wgrad"}
        assert set(attention.select(attention["precision"] == precision)["phase"]) == {"fwd", "bwd"}
    assert set(attention["causal"]) == {"true"}
    assert set(measured.rows("memory_kernels")["kernel"]) == MEMORY_KERNELS
    collectives = measured.rows("collectives")
    assert set(collectives["collective"]) == TABLE_COLLECTIVES
    assert set(collectives["timing"]) == {"back_to_back", "after_compute"}
    assert set(measured.host) == {"launch_latency_s", "dtensor_op_latency_s", "checkpoint_region_latency_s",
                                  "checkpoint_saved_tensor_latency_s"}
    report = quick_run["report"]
    text = (report / "report.md").read_text()
    for png in ("kernels.png", "memory.png", "collectives.png", "noise.png"):
        assert (report / png).stat().st_size > 1000 and png in text
    # The file on disk is plain YAML with a plain-mapping calibration section.
    raw = yaml.safe_load(quick_run["output"].read_text())
    assert isinstance(raw["calibration"], dict) and raw["version"] == 1


def test_fitted_figures_are_sane(calibrated, measured):
    from calibration.kernels import cpu_has_native_bf16

    acc = calibrated.accelerator
    kernels = acc.kernels
    gemm = measured.rows("gemm")
    assert set(acc.peak_flops_per_s) == {"fp32", "bf16"}
    for precision, peak in acc.peak_flops_per_s.items():
        assert math.isfinite(peak) and peak > 1e9  # any cpu core does more than 1 GFLOP/s on a 1024^3 matmul
        rows = gemm.select(gemm["precision"] == precision)
        assert peak >= np.max(rows["tflops"]) * 1e12  # the form's ceiling: every measured rate is a fraction of it
        figure = kernels.gemm[precision]
        assert 0 < figure.e_max <= 1 and not figure.derived and figure.rows == len(rows)
        assert min(figure.m_half, figure.n_half, figure.k_half) > 0 and "mosaic calibrate" in figure.source
        if precision == "fp32" or cpu_has_native_bf16():  # emulated bf16 is not monotone in shape
            assert figure.median_abs_error < GEMM_FIT_BOUND[precision], (precision, figure)
    grouped = measured.rows("grouped_gemm")
    for precision in ("fp32", "bf16"):
        mine = grouped.select(grouped["precision"] == precision)
        figures = kernels.grouped_gemm[precision]
        # the input gradient shares the forward's figure (perfmodel.kernels.fit.gemm_entries): fitted together
        assert figures.fwd.rows == int(np.sum(np.isin(mine["phase"], ("fwd", "dgrad"))))
        assert figures.wgrad.rows == int(np.sum(mine["phase"] == "wgrad")) and not figures.wgrad.derived
        assert figures.dgrad.e_max == figures.fwd.e_max and "dgrad = fwd" in figures.dgrad.derived
        assert all(0 < f.e_max <= 1 for f in (figures.fwd, figures.dgrad, figures.wgrad))
    attention = measured.rows("attention")
    for precision in ("fp32", "bf16"):  # fitted to its own rows at its own peak (the cpu trainer runs fp32)
        figure = kernels.attention[precision]
        assert figure.rows == int(np.sum(attention["precision"] == precision)) and not figure.derived
        assert 0 < figure.fwd_e_max <= 1 and 0 < figure.bwd_e_max <= 1 and "mosaic calibrate" in figure.source
    memory = kernels.memory
    table = measured.rows("memory_kernels")
    assert memory.rows == int(np.sum(table["excluded"] == "")) and memory.bytes_half > 0
    # on cpu each kernel's fixed cost (its aten ops' dispatch, priced per op by launch_latency_s) was
    # timed and taken out of its other rows; rows within twice it are kept out of the fit, saying why
    for kernel in MEMORY_KERNELS:
        mine = table.select(table["kernel"] == kernel)
        fixed = mine.select(np.char.startswith(mine["excluded"].astype(str), "the call's fixed cost"))
        assert len(fixed) == 1, kernel
        others = mine.select(~np.char.startswith(mine["excluded"].astype(str), "the call's fixed cost"))
        fixed_us = float(fixed["time_us"][0])
        net_s = (others["time_us"] - fixed_us) * 1e-6  # a median at or below the fixed cost resolves no rate
        assert np.allclose(others["gbps"], np.where(net_s > 0, others["bytes_moved"] / np.where(net_s > 0, net_s, 1) / 1e9,
                                                    np.nan), equal_nan=True), kernel
        assert all(e == "" or e.startswith("within twice the call's fixed cost") for e in others["excluded"])
        assert np.all((others["excluded"] == "") == (others["time_us"] >= 2 * fixed_us)), kernel
    assert all(0 < v <= 1.5 for v in memory.fraction.values())
    assert memory.fraction["copy"] == pytest.approx(1.0, rel=0.05)  # the bandwidth is the copy ceiling
    assert set(memory.derived) == {"cast"}  # every other class measured here
    assert acc.hbm_bandwidth_bytes_per_s > 1e9
    assert 0 < acc.launch_latency_s < 1e-3
    assert acc.launch_latency_s == pytest.approx(measured.host["launch_latency_s"].seconds, rel=1e-3)
    host = calibrated.levels[0]
    assert host.bandwidth_bytes_per_s > 0 and 0 < host.efficiency <= 1 and host.latency_s > 0
    assert set(host.collective_efficiency) == set(COLLECTIVES)
    assert all(0 < v <= 1 for v in host.collective_efficiency.values())
    assert host.collective_fit is None and "alpha-beta" in host.source  # gloo: calibrate's fits, not the table fit
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
    for kind in ("gemm", "grouped_gemm", "attention", "memory_kernels", "collectives"):
        table = measured.rows(kind)
        assert np.all(table["time_us"] > 0), kind
        assert all(float(v) >= 0 for v in table["noise"]) and all(int(v) >= 5 for v in table["repeats"]), kind
    assert all(h.seconds > 0 and h.repeats >= 5 for h in measured.host.values())


def test_collective_rows_report_nccl_tests_bus_bandwidth(measured):
    table = measured.rows("collectives")
    for i in range(len(table)):
        ranks, size, time_s = table["ranks"][i], table["size_bytes"][i], table["time_us"][i] * 1e-6
        factor = {"all_reduce": 2 * (ranks - 1) / ranks, "send_recv": 1.0}.get(table["collective"][i], (ranks - 1) / ranks)
        assert table["algbw_gbps"][i] == pytest.approx(size / time_s / 1e9, rel=1e-6)
        assert table["busbw_gbps"][i] == pytest.approx(size / time_s * factor / 1e9, rel=1e-6)
        assert table["level"][i] in ("host", "node") and table["span"][i] == "node"
        assert table["algorithm"][i] == "gloo" and table["excluded"][i]  # a gloo level is calibrate's alpha-beta


@pytest.mark.parametrize(("precision", "shapes"), [("fp32", [(384, 384, 384), (320, 640, 448)]),
                                                   ("bf16", [(384, 384, 384), (192, 576, 320)])])
def test_calibrated_model_predicts_unmeasured_gemms_within_25_percent(precision, shapes, tmp_path):
    """Build a cluster from the --quick GEMM grid's rows and predict shapes outside it.

    The unmeasured shapes are timed in the same interleaved session as the grid
    (and left out of the build), so a change in the load other jobs put on this
    shared 2-core machine between two sessions cannot decide the outcome.
    bf16 shapes are multiples of 32: on a CPU with AMX tiles a shape off them runs up to 2x
    slower than its neighbours (one core, torch 2.13: (200, 600, 300) 304 GFLOP/s, (192, 576, 320)
    574), which no saturating form follows (the FLOPs curve before it missed them as well).
    """
    import torch

    from calibration.kernels import KernelPoint, cpu_has_native_bf16, kernel_plan, run_points
    from calibration.profile import calibrated_mapping
    from calibration.report import fitted_rates
    from calibration.tables import Provenance, read_folder, write_folder
    from calibration.timing import Budget
    from perfmodel.specs.cluster import ClusterSpec
    from perfmodel.specs.strict import spec_from_dict

    from .conftest import base_cluster

    if precision == "bf16" and cpu_has_native_bf16() is False:
        pytest.skip("this CPU has no bf16 GEMM units: torch's emulated bf16 GEMM is not monotone in shape "
                    "(calibration.kernels.NATIVE_BF16_CPU_FLAGS), so no saturating form predicts it")
    device = torch.device("cpu")
    grid = [p for p in kernel_plan(device, True, [precision]) if p.kind == "gemm"]
    unmeasured = [KernelPoint("gemm", precision, {"M": M, "N": N, "K": K}) for M, N, K in shapes]
    assert not {tuple(p.shape.values()) for p in unmeasured} & {tuple(p.shape.values()) for p in grid}
    provenance = Provenance(device="cpu", device_name="test", ranks=1, torch_version=torch.__version__, driver="none",
                            threads_per_rank=1, quick=True)
    name = "cpu_local_calibrated"

    def session_errors(index: int) -> list[tuple[str, float, float]]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as calibrated: one thread per rank
        try:
            rows = run_points(grid + unmeasured, device, Budget(warmup=1, min_repeats=9, max_repeats=25, max_seconds=0.2))
        finally:
            torch.set_num_threads(threads)
        fitted = write_folder(tmp_path / f"grid{index}", rows[:len(grid)], provenance, name, ["host"])
        spec = spec_from_dict(ClusterSpec, calibrated_mapping(base_cluster(), read_folder(fitted), "grid"), source="test")
        held = read_folder(write_folder(tmp_path / f"held{index}", rows[len(grid):], provenance, name, ["host"]))
        predicted = fitted_rates("gemm", held.rows("gemm"), spec)
        return [(row.shape, float(p), row.rate / 1e12) for row, p in zip(rows[len(grid):], predicted)]

    # A burst of load from other processes can disturb one whole session on a shared
    # 2-core machine; the claim is checked on the first of up to three sessions in which
    # it holds, and every session's figures are reported when none does.
    sessions = []
    for index in range(3):
        errors = session_errors(index)
        sessions.append(errors)
        if all(abs(predicted - measured) / measured < 0.25 for _, predicted, measured in errors):
            return
    pytest.fail(f"unmeasured GEMMs predicted outside 25% in all three sessions: {sessions}")


def test_profile_figures_are_the_fit_of_the_table_rows(calibrated, measured):
    """The cluster's figures are the build's fit of the folder's rows (rebuilt here), and reproduce
    each row's rate to the median error they state."""
    from calibration.profile import calibrated_mapping
    from calibration.report import fitted_rates
    from perfmodel.specs.cluster import ClusterSpec
    from perfmodel.specs.strict import spec_from_dict, to_mapping

    base = calibrated.calibration["base_cluster"]["name"]
    rebuilt = spec_from_dict(ClusterSpec, calibrated_mapping(base, measured, measured.folder.name), source="rebuilt")
    assert to_mapping(rebuilt.accelerator.kernels) == to_mapping(calibrated.accelerator.kernels)
    assert rebuilt.accelerator.peak_flops_per_s == calibrated.accelerator.peak_flops_per_s
    gemm = measured.rows("gemm")
    rates = fitted_rates("gemm", gemm, calibrated)
    for precision, figure in calibrated.accelerator.kernels.gemm.items():
        mine = gemm["precision"] == precision
        time_errors = gemm["tflops"][mine] / rates[mine] - 1.0  # predicted / measured time - 1
        assert float(np.median(np.abs(time_errors))) == pytest.approx(figure.median_abs_error, rel=0.02, abs=1e-3)
    memory = measured.rows("memory_kernels")
    memory = memory.select(memory["excluded"] == "")  # the rows the fit used
    errors = fitted_rates("memory_kernels", memory, calibrated) / memory["gbps"] - 1.0
    assert float(np.median(np.abs(errors))) == pytest.approx(calibrated.accelerator.kernels.memory.median_abs_error,
                                                              rel=0.02, abs=1e-3)


def test_refit_from_the_tables_reproduces_the_profile(quick_run, calibrated, tmp_path):
    from calibration.run import calibrate

    again = calibrate(calibrated.calibration["base_cluster"]["name"], output=tmp_path / "again.yaml",
                      measurements=quick_run["tables"])
    assert again.spec.accelerator.peak_flops_per_s == calibrated.accelerator.peak_flops_per_s
    assert again.spec.accelerator.kernels == calibrated.accelerator.kernels
    assert again.spec.levels[0] == calibrated.levels[0].__class__(**{**calibrated.levels[0].__dict__,
                                                                    "source": again.spec.levels[0].source})
    assert again.tables == tmp_path / "again.kernels"
    for name in TABLE_FILES:
        assert (again.tables / name).read_text() == (quick_run["tables"] / name).read_text(), name


def test_one_measured_table_refits_that_kind_and_derives_the_rest(quick_run, calibrated, tmp_path):
    """`--measurements gemm.csv`: the GEMM figures are fitted to its rows; what it did not measure
    comes from the base cluster's accelerator, saying so."""
    from calibration.run import calibrate

    base = calibrated.calibration["base_cluster"]["name"]
    only = calibrate(base, output=tmp_path / "gemm_only.yaml", measurements=quick_run["tables"] / "gemm.csv")
    kernels = only.spec.accelerator.kernels
    assert kernels.gemm["fp32"].rows == calibrated.accelerator.kernels.gemm["fp32"].rows and not kernels.gemm["fp32"].derived
    assert kernels.attention["fp32"].rows == 0 and f"from {base}" in kernels.attention["fp32"].derived
    assert "not measured by this calibration" in kernels.attention["fp32"].derived
    assert sorted(p.name for p in only.tables.iterdir()) == ["gemm.csv"]


def test_perfmodel_prices_collectives_as_measured(calibrated, measured):
    """The written level figures, read back through perfmodel.comm, reproduce the measured bandwidth."""
    from perfmodel.comm import collective_time

    table = measured.rows("collectives")
    back = table.select(table["timing"] == "back_to_back")
    largest = float(np.max(back["size_bytes"]))
    for fit in calibrated.calibration["collectives"]:
        name = "send_recv" if fit["collective"] == "p2p" else fit["collective"]
        point = back.select((back["collective"] == name) & (back["size_bytes"] == largest))
        model = float(collective_time(calibrated, fit["collective"], largest, 2, 1))
        fitted = fit["alpha_s"] + largest / fit["algbw_bytes_per_s"]
        assert model == pytest.approx(fitted, rel=0.15), fit["collective"]
        assert model == pytest.approx(float(point["time_us"][0]) * 1e-6, rel=0.6), fit["collective"]  # noisier


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

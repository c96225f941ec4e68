"""calibration.tables: measurements as kernel-table rows (conventions, one folder per run, one
machine per folder), and the bundled cpu_local built from such rows as the GPUs are from theirs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from calibration.measurements import Measurement
from calibration.stats import TimingStats
from calibration.tables import (
    AFTER_COMPUTE_EXCLUDED,
    GLOO_EXCLUDED,
    Provenance,
    bundle,
    copy_folder,
    read_folder,
    table_rows,
    write_folder,
)
from perfmodel.errors import InputError

PROVENANCE = Provenance(device="cpu", device_name="Test CPU", ranks=2, torch_version="2.13.0", driver="none (cpu)",
                        threads_per_rank=1, quick=True, date="2026-12-01T00:00:00+00:00", host="box")


def _m(kind: str, median_s: float, shape: dict, flops: float = 0.0, nbytes: float = 0.0, **extra) -> Measurement:
    stats = TimingStats(median_s=median_s, mean_s=median_s, min_s=median_s, iqr_s=0.1 * median_s, repeats=9, outliers=1)
    return Measurement.from_stats(kind, "cpu", extra.pop("precision", "fp32"), shape, flops, nbytes, stats, **extra)


ROWS = [
    _m("gemm", 1e-3, {"M": 64, "N": 128, "K": 256}, flops=2 * 64 * 128 * 256),
    _m("grouped_gemm", 2e-3, {"E": 8, "T": 16, "K": 64, "N": 32, "imbalance": 1.0}, flops=2 * 128 * 64 * 32,
       phase="wgrad", impl="grouped_mm"),
    _m("sdpa", 4e-3, {"B": 2, "H": 4, "S": 128, "D": 64}, flops=2.5 * 4 * 2 * 4 * 128 * 128 * 64 / 2, phase="bwd"),
    _m("mem_rmsnorm", 1e-5, {"bytes": 65536}, nbytes=2 * 65536),
    _m("all_reduce", 1e-4, {"ranks": 2, "bytes": 4096}, nbytes=4096, level="host", ranks=2, impl="gloo",
       busbw_bytes_per_s=4096 / 1e-4),
    _m("p2p", 2e-4, {"ranks": 2, "bytes": 4096}, nbytes=4096, level="host", ranks=2, impl="gloo+after-compute",
       busbw_bytes_per_s=4096 / 2e-4),
    _m("launch", 5e-6, {"batch": 600}),
]


def test_rows_follow_the_bundled_tables_conventions():
    rows = table_rows(ROWS, PROVENANCE, "box_calibrated", ["host"])
    gemm, = rows["gemm"]
    assert (gemm["m"], gemm["n"], gemm["k"]) == ("64", "128", "256")
    assert float(gemm["tflops"]) == pytest.approx(2 * 64 * 128 * 256 / 1e-3 / 1e12)
    assert gemm["accelerator"] == "box_calibrated" and gemm["source"] == "mosaic calibrate on box at 2026-12-01T00:00:00+00:00"
    assert gemm["hardware"] == "Test CPU, 1 thread per rank" and gemm["software"] == "torch 2.13.0"
    assert float(gemm["time_us"]) == pytest.approx(1000.0) and gemm["repeats"] == "9" and gemm["outliers"] == "1"
    grouped, = rows["grouped_gemm"]  # the forward shape of the expert GEMM, the phase timed
    assert (grouped["phase"], grouped["groups"], grouped["m_per_group"], grouped["n"], grouped["k"]) == \
        ("wgrad", "8", "16", "32", "64")
    assert float(grouped["tflops"]) == pytest.approx(2 * 128 * 64 * 32 / 2e-3 / 1e12)
    attention, = rows["attention"]  # executed FLOPs: backward 2.5x the causal forward
    assert attention["phase"] == "bwd" and attention["causal"] == "true"
    assert float(attention["tflops"]) == pytest.approx(2.5 * 2 * 2 * 4 * 128 ** 2 * 64 / 4e-3 / 1e12)
    assert "2.5x forward" in attention["flop_convention"]
    memory, = rows["memory_kernels"]
    assert memory["kernel"] == "rmsnorm" and float(memory["gbps"]) == pytest.approx(2 * 65536 / 1e-5 / 1e9)
    back, after = rows["collectives"]
    assert back["collective"] == "all_reduce" and back["span"] == "node" and back["nodes"] == "1"
    assert float(back["busbw_gbps"]) == pytest.approx(4096 / 1e-4 / 1e9)
    assert back["timing"] == "back_to_back" and back["excluded"] == GLOO_EXCLUDED
    assert after["collective"] == "send_recv" and after["timing"] == "after_compute"
    assert after["excluded"] == AFTER_COMPUTE_EXCLUDED and after["algorithm"] == "gloo"
    assert set(rows) == {"gemm", "grouped_gemm", "attention", "memory_kernels", "collectives"}  # launch: host.csv


def test_a_memory_row_timed_below_the_fixed_cost_resolves_no_bandwidth():
    """The fixed-cost call's median may exceed a larger call's on a noisy core (36.9 us against
    32.6 us once in CI): that row is kept out with a nan rate, not a bandwidth of 1e-12 s's."""
    fixed = _m("mem_rmsnorm", 3.7e-5, {"bytes": 256}, nbytes=512, phase="fixed")
    rows = table_rows([fixed, _m("mem_rmsnorm", 3.3e-5, {"bytes": 65536}, nbytes=2 * 65536),
                       _m("mem_rmsnorm", 1.5e-4, {"bytes": 2**20}, nbytes=2 * 2**20)], PROVENANCE, "box_calibrated", ["host"])
    _, below, above = rows["memory_kernels"]
    assert math.isnan(float(below["gbps"])) and below["excluded"].startswith("within twice the call's fixed cost")
    assert float(above["gbps"]) == pytest.approx(2 * 2**20 / (1.5e-4 - 3.7e-5) / 1e9) and above["excluded"] == ""


def test_a_folder_is_one_run_read_back_whole(tmp_path):
    folder = write_folder(tmp_path / "cal.kernels", ROWS, PROVENANCE, "box_calibrated", ["host"])
    measured = read_folder(folder)
    assert measured.accelerator == "box_calibrated" and measured.device == "cpu"
    assert measured.host["launch_latency_s"].seconds == pytest.approx(5e-6)
    assert len(measured.rows("gemm")) == 1 and measured.rows("gemm")["m"][0] == 64
    assert len(measured.rows("ep_dispatch")) == 0  # a kind not measured is empty
    # a second run replaces the folder whole: no table of the first is left beside it
    write_folder(folder, ROWS[:1], PROVENANCE, "box_calibrated", ["host"])
    assert sorted(p.name for p in folder.iterdir()) == ["gemm.csv", "provenance.yaml"]
    assert not [p for p in tmp_path.iterdir() if p.name != "cal.kernels"]  # no staging folder left


def test_one_machine_per_folder_and_copies_are_relabelled(tmp_path):
    folder = write_folder(tmp_path / "a", ROWS, PROVENANCE, "box_calibrated", ["host"])
    copied = read_folder(copy_folder(folder, tmp_path / "b", "other_calibrated"))
    assert copied.accelerator == "other_calibrated" and copied.provenance["accelerator"] == "other_calibrated"
    assert set(copied.rows("gemm")["source"]) == {PROVENANCE.source}  # where the rows came from is kept
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "gemm.csv").write_text((folder / "gemm.csv").read_text())
    (mixed / "attention.csv").write_text((tmp_path / "b" / "attention.csv").read_text())
    with pytest.raises(InputError, match="several accelerators"):
        read_folder(mixed)
    with pytest.raises(InputError, match="not a folder"):
        read_folder(tmp_path / "nope")


def test_bundling_replaces_only_that_accelerators_rows(tmp_path):
    import shutil

    from perfmodel.kernels.tables import read_table, tables_dir

    target = tmp_path / "kernels"
    target.mkdir()
    shutil.copy(tables_dir() / "gemm.csv", target / "gemm.csv")
    before = read_table("gemm", target / "gemm.csv")
    others = int((before["accelerator"] != "cpu_local").sum())
    folder = write_folder(tmp_path / "cal.kernels", ROWS, PROVENANCE, "box_calibrated", ["host"])
    bundle(folder, "cpu_local", target)
    after = read_table("gemm", target / "gemm.csv")
    assert int((after["accelerator"] != "cpu_local").sum()) == others
    mine = after.rows_of("cpu_local")
    assert len(mine) == 1 and mine["source"][0] == PROVENANCE.source
    assert sorted(p.name for p in target.iterdir()) == sorted(
        ["gemm.csv", "grouped_gemm.csv", "attention.csv", "memory_kernels.csv", "collectives.csv"])


def test_bundled_cpu_local_is_fitted_to_its_own_rows_per_precision():
    """cpu_local's rows are a calibration of the test machine: every kernel figure is fitted to
    them (fp32 and bf16 with halves of their own, a CPU's two engines); no GPU figure carries over."""
    from perfmodel.clusters import load_cluster

    kernels = load_cluster("cpu_local").accelerator.kernels
    for precision in ("fp32", "bf16"):
        assert kernels.gemm[precision].rows > 0 and not kernels.gemm[precision].derived
        assert kernels.grouped_gemm[precision].wgrad.rows > 0 and kernels.attention[precision].rows > 0
    assert (kernels.gemm["fp32"].m_half, kernels.gemm["fp32"].k_half) != (kernels.gemm["bf16"].m_half,
                                                                          kernels.gemm["bf16"].k_half)
    assert kernels.memory.rows > 0 and set(kernels.memory.derived) <= {"cast"}


def test_no_accelerator_draws_on_the_cpu_rows():
    from perfmodel.clusters import bundled_cluster_paths

    for name, path in bundled_cluster_paths().items():
        if name != "cpu_local":
            assert "cpu_local" not in path.read_text(), name


def test_a_gpu_calibration_is_fitted_to_its_rows_and_derives_the_rest_from_its_base(tmp_path):
    """Rows as `mosaic calibrate --device cuda` writes them (bf16 GEMMs made by the GEMM form at
    known figures, NCCL all-reduces inside the node) on base h100: the datasheet peak stays, the
    bf16 figure is the rows', fp8 and attention come from the base's accelerator and say so, the
    node level is fitted to its rows by the build, the scale-out level keeps the base's."""
    import itertools

    from calibration.profile import calibrated_mapping
    from perfmodel.clusters import load_cluster
    from perfmodel.kernels.forms import gemm_efficiency
    from perfmodel.specs.cluster import ClusterSpec
    from perfmodel.specs.strict import spec_from_dict

    peak, e_max, halves = 989e12, 0.7, (120.0, 300.0, 400.0)
    rows = []
    for m, n, k in itertools.product((256, 2048, 8192), repeat=3):
        flops = 2.0 * m * n * k
        rows.append(_m("gemm", flops / (peak * gemm_efficiency(m, n, k, e_max, *halves)), {"M": m, "N": n, "K": k},
                       flops=flops, precision="bf16"))
    for size in 4096.0 * 4.0 ** np.arange(7):  # all-reduce over 8 NVLink ranks: 10 us per step, 80% of 450 GB/s
        time_s = 6 * 10e-6 + size * 2 * 7 / 8 / (0.8 * 450e9)
        rows.append(_m("all_reduce", time_s, {"ranks": 8, "bytes": size}, nbytes=size, level="node", ranks=8, impl="nccl",
                       busbw_bytes_per_s=size / time_s * 2 * 7 / 8))
    provenance = Provenance(device="cuda", device_name="NVIDIA H100 80GB HBM3", ranks=8, torch_version="2.13.0",
                            driver="cuda 12.8", threads_per_rank=None, quick=True, date="2026-12-01T00:00:00+00:00",
                            host="node")
    base = load_cluster("h100")
    folder = write_folder(tmp_path / "h100.kernels", rows, provenance, "h100_calibrated", [lv.name for lv in base.levels])
    spec = spec_from_dict(ClusterSpec, calibrated_mapping("h100", read_folder(folder), folder.name), source="test")
    acc = spec.accelerator
    assert acc.peak_flops_per_s == base.accelerator.peak_flops_per_s  # cuda: the datasheet peak stays
    bf16 = acc.kernels.gemm["bf16"]
    assert bf16.rows == 27 and not bf16.derived and bf16.e_max == pytest.approx(e_max, rel=0.02)
    assert (bf16.m_half, bf16.n_half, bf16.k_half) == pytest.approx(halves, rel=0.05)
    assert acc.kernels.gemm["fp8"].rows == 0 and acc.kernels.gemm["fp8"].derived
    attention = acc.kernels.attention["bf16"]
    assert attention.rows == 0 and "from h100: not measured by this calibration" in attention.derived
    assert attention.fwd_e_max == base.accelerator.kernels.attention["bf16"].fwd_e_max  # same peak: the same figure
    node, scale_out = spec.levels
    assert node.collective_fit.rows == 7  # the other collectives from this one by the build's stated ratio
    assert "all_gather: all_reduce x" in node.collective_fit.derived
    assert node.collective_efficiency["all_reduce"] == pytest.approx(0.8, rel=0.05)
    assert node.latency_s == pytest.approx(10e-6, rel=0.1)
    assert scale_out.latency_s == base.levels[1].latency_s
    assert "not measured by this calibration" in scale_out.collective_fit.derived


def test_a_refit_from_tables_needs_no_torch(tmp_path):
    import subprocess
    import sys

    folder = write_folder(tmp_path / "cal.kernels", ROWS, PROVENANCE, "cpu_local_calibrated", ["host"])
    code = ("import sys; from pathlib import Path; from calibration.run import calibrate; "
            f"r = calibrate('cpu_local', output=Path({str(tmp_path / 'again.yaml')!r}), measurements=Path({str(folder)!r})); "
            "print(r.spec.name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu_local_calibrated", "False"]

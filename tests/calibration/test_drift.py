"""calibration.drift: a calibrated cluster re-fitted to probes taken between runs, or merged from
two calibrations; the probes themselves on this machine (positive, in range)."""

from __future__ import annotations

from pathlib import Path

import pytest

from calibration import drift
from calibration.drift import HostProbe
from perfmodel.errors import MosaicRuntimeError


def test_drift_probes_replace_the_host_figures_and_scale_the_rest(tmp_path: Path) -> None:
    from perfmodel.clusters import load_cluster

    cluster = load_cluster("cpu_local")
    base = cluster.accelerator
    calibrated_rate = drift.calibrated_gemm_flops_per_s(cluster)
    n = drift.PROBE_GEMM_SIZE
    g = base.kernels.gemm["fp32"]
    assert calibrated_rate == pytest.approx(base.peak("fp32") * g.e_max * (n / (n + g.m_half)) * (n / (n + g.n_half))
                                            * (n / (n + g.k_half)))
    # the means: per-op costs twice the calibrated, GEMM rate half (the medians: 1.5x and 1/4)
    probes = [HostProbe(launch_latency_s=base.launch_latency_s * r, dtensor_op_latency_s=1e-4 * r,
                        gemm_flops_per_s=calibrated_rate * g) for r, g in ((1.0, 0.25), (1.5, 0.25), (3.5, 1.0))]
    out = tmp_path / "interleaved.yaml"
    assert drift.interleaved_cluster(Path("cpu_local"), probes, out) == out
    used = load_cluster(str(out)).accelerator
    assert used.launch_latency_s == pytest.approx(2 * base.launch_latency_s, rel=1e-3)
    assert used.dtensor_op_latency_s == pytest.approx(2e-4, rel=1e-3)
    assert used.checkpoint_region_latency_s == pytest.approx(2 * base.checkpoint_region_latency_s, rel=1e-3)
    assert used.checkpoint_saved_tensor_latency_s == pytest.approx(2 * base.checkpoint_saved_tensor_latency_s, rel=1e-3)
    # the fp32 compute figures follow the GEMM's drift (half the rate), halves unchanged; bf16 was not probed
    fp32, bf16 = used.kernels, base.kernels
    assert fp32.gemm["fp32"].e_max == pytest.approx(bf16.gemm["fp32"].e_max / 2, rel=1e-3)
    assert fp32.gemm["fp32"].m_half == bf16.gemm["fp32"].m_half
    for phase in ("fwd", "dgrad", "wgrad"):
        assert fp32.grouped_gemm["fp32"].phase(phase).e_max == pytest.approx(
            bf16.grouped_gemm["fp32"].phase(phase).e_max / 2, rel=1e-3)
    assert fp32.attention["fp32"].fwd_e_max == pytest.approx(bf16.attention["fp32"].fwd_e_max / 2, rel=1e-3)
    assert fp32.attention["fp32"].bwd_e_max == pytest.approx(bf16.attention["fp32"].bwd_e_max / 2, rel=1e-3)
    assert fp32.gemm["bf16"] == bf16.gemm["bf16"] and fp32.attention["bf16"] == bf16.attention["bf16"]
    assert "drift" in fp32.gemm["fp32"].source
    assert drift.calibrated_gemm_flops_per_s(load_cluster(str(out))) == pytest.approx(calibrated_rate / 2, rel=1e-3)
    assert "drift probes" in used.sources["dtensor_op_latency_s"]


def test_collective_probes_scale_the_fabric_latencies_to_what_they_timed(tmp_path: Path) -> None:
    """The probes' mean, k times the model's own time for the probed all-reduce, makes the model
    price that all-reduce at k times (latencies and sync scaled, bandwidth kept)."""
    from perfmodel.clusters import load_cluster
    from perfmodel.comm import collective_time

    base = load_cluster("cpu_local")
    size = drift.PROBE_COLLECTIVE_BYTES
    modelled = float(collective_time(base, "all_reduce", size, 2, 1))
    probes = (1.5 * modelled, 2.5 * modelled)  # mean: twice the modelled time
    host = [HostProbe(launch_latency_s=base.accelerator.launch_latency_s, dtensor_op_latency_s=1e-4,
                      gemm_flops_per_s=base.accelerator.peak("fp32"))]
    used = load_cluster(str(drift.interleaved_cluster(Path("cpu_local"), host, tmp_path / "a.yaml", probes)))
    assert float(collective_time(used, "all_reduce", size, 2, 1)) == pytest.approx(2 * modelled, rel=2e-3)
    ratio = drift.collective_latency_ratio(base, 2 * modelled)
    for before, after in zip(base.levels, used.levels):
        assert after.latency_s == pytest.approx(before.latency_s * ratio, rel=1e-3)
        assert after.sync_latency_s == pytest.approx(before.sync_latency_s * ratio, rel=1e-3)
        assert after.bandwidth_bytes_per_s == before.bandwidth_bytes_per_s
        assert "collective probes" in after.source
    # a probe faster than the bytes alone allow is floored at the refit's lower bound, not negative
    assert drift.collective_latency_ratio(base, 1e-9) == pytest.approx(0.1)
    no_probe = load_cluster(str(drift.interleaved_cluster(Path("cpu_local"), host, tmp_path / "b.yaml")))
    assert [lv.latency_s for lv in no_probe.levels] == [lv.latency_s for lv in base.levels]


def test_collective_probe_times_a_two_rank_all_reduce(tmp_path: Path) -> None:
    seconds = drift.collective_probe(tmp_path)
    assert seconds is not None and 1e-6 < seconds < 1.0
    rows = (tmp_path / "collectives.partial.csv").read_text().splitlines()
    assert len(rows) == 3  # header, back to back, after compute: one kind, one size
    assert all(f",{drift.PROBE_COLLECTIVE_BYTES}.0," in row for row in rows[1:])


def test_calibrations_before_and_after_the_runs_merge_by_geometric_mean(tmp_path: Path) -> None:
    import yaml

    from perfmodel.clusters import load_cluster, resolve_cluster_path

    merge = drift.geometric_mean_figures
    assert merge(2.0, 8.0) == 4.0 and merge(0.0, 2.0) == 1.0 and merge(3, 3) == 3
    assert merge([1.0, 4.0], [4.0, 1.0]) == [2.0, 2.0]
    assert merge("a", "b") == "a" and merge(True, False) is True
    curve = {"sizes": [1.0, 2.0], "values": [0.2, 0.8]}
    assert merge(curve, {"sizes": [1.0, 3.0], "values": [0.8, 0.2]}) == curve  # other knots: kept, not mixed
    before = yaml.safe_load(resolve_cluster_path("cpu_local").read_text())
    after = yaml.safe_load(resolve_cluster_path("cpu_local").read_text())
    after["accelerator"]["launch_latency_s"] = before["accelerator"]["launch_latency_s"] * 4
    after["levels"][0]["latency_s"] = before["levels"][0]["latency_s"] / 4
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(before))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(after))
    merged = load_cluster(str(drift.bracketed_cluster(tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "m.yaml")))
    assert merged.accelerator.launch_latency_s == pytest.approx(2 * before["accelerator"]["launch_latency_s"], rel=1e-3)
    assert merged.levels[0].latency_s == pytest.approx(before["levels"][0]["latency_s"] / 2, rel=1e-3)
    assert merged.accelerator.kernels == load_cluster("cpu_local").accelerator.kernels  # the same figures: kept
    assert merge({"rows": 29, "e_max": 0.5}, {"rows": 27, "e_max": 0.8})["rows"] == 29  # counts are not figures
    assert "geometric mean" in merged.calibration["bracketed"]


def test_no_probes_or_a_failed_collective_probe_is_an_error_not_a_silent_default(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="probes"):
        drift.interleaved_cluster(Path("cpu_local"), [], tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()
    import calibration.collectives
    from calibration.collectives import LaunchResult

    def failed_launch(*args, **kwargs):
        return LaunchResult(rows=[], error="rank 1 exited with code 1", log_path=tmp_path / "log")

    monkeypatch.setattr(calibration.collectives, "run_collectives_subprocess", failed_launch)
    with pytest.raises(MosaicRuntimeError, match="collective probe failed: rank 1 exited"):
        drift.collective_probe(tmp_path)


def test_drift_probe_measures_this_machine() -> None:
    pytest.importorskip("torch", reason="the probes time torch ops")
    probe = drift.drift_probe()
    assert 0 < probe.launch_latency_s < 1e-3 and 0 < probe.dtensor_op_latency_s < 1e-2
    assert probe.gemm_flops_per_s > 1e8

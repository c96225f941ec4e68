"""Robust statistics and fits: outliers do not move results beyond their noise; alpha-beta and the
ceilings recover known figures."""

from __future__ import annotations

import numpy as np
import pytest

from calibration.fit import AlphaBetaFit, fit_alpha_beta_arrays, gemm_ceilings, memory_ceiling
from calibration.profile import ceil_6g, level_figures
from calibration.stats import outlier_mask, summarize


def test_injected_sample_outliers_stay_within_noise():
    rng = np.random.default_rng(0)
    clean_samples = list(1e-3 * (1 + 0.03 * rng.standard_normal(25)))
    clean = summarize(clean_samples)
    assert clean.outliers <= 1
    dirty = summarize(clean_samples + [20e-3, 15e-3, 1e-5])
    assert dirty.outliers >= 3
    assert abs(dirty.median_s - clean.median_s) <= clean.iqr_s
    assert dirty.repeats == clean.repeats + 3


def test_scheduler_stalls_on_a_busy_host_are_filtered():
    """Up to ~half the repeats delayed by a few ms (another job holds the core): the median stays on the
    undisturbed mode, where a filter centred on the median would follow the stalls."""
    rng = np.random.default_rng(1)
    fast = 2e-4 * (1 + 0.05 * rng.standard_normal(40))
    stalled = fast + rng.uniform(2e-3, 4e-3, 40)
    samples = np.where(rng.random(40) < 0.45, stalled, fast)
    stats = summarize(samples)
    assert stats.median_s == pytest.approx(2e-4, rel=0.05)
    assert stats.outliers == int(np.sum(samples > 1e-3))


def test_real_timings_are_summarised():
    import torch

    from calibration.timing import Budget, time_samples

    a = torch.randn(128, 128)
    samples = time_samples(lambda: a @ a, torch.device("cpu"), Budget(warmup=2, min_repeats=9, max_repeats=9, max_seconds=0))
    stats = summarize(samples)
    assert len(samples) == 9 and stats.repeats == 9
    assert min(samples) <= stats.median_s <= max(samples) and stats.noise >= 0


def test_outlier_mask_keeps_steady_samples():
    x = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 5.0]
    assert outlier_mask(x).tolist() == [True] * 6 + [False]
    assert summarize([2.0] * 5).noise == 0.0


def _synthetic(seed: int, noise: float = 0.05):
    rng = np.random.default_rng(seed)
    sizes = 4096.0 * 4.0 ** np.arange(8)
    alpha, beta = 200e-6, 1 / 1.5e9
    times = (alpha + beta * sizes) * (1 + noise * rng.standard_normal(sizes.size))
    return sizes, times, alpha, beta


def test_alpha_beta_recovers_known_figures():
    sizes, times, alpha, beta = _synthetic(0)
    a, b, a_se, b_se, r2 = fit_alpha_beta_arrays(sizes, times)
    assert r2 > 0.99
    assert abs(a - alpha) / alpha < 0.15 and abs(b - beta) / beta < 0.1
    assert a_se > 0 and b_se > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("where", [1, 4, 6])
def test_injected_outlier_does_not_move_alpha_beta_beyond_noise(seed, where):
    sizes, times, _, _ = _synthetic(seed)
    a, b, a_se, b_se, _ = fit_alpha_beta_arrays(sizes, times)
    dirty = times.copy()
    dirty[where] *= 5.0
    a2, b2, *_ = fit_alpha_beta_arrays(sizes, dirty)
    assert abs(a2 - a) <= 2 * a_se + 1e-12, (a, a2, a_se)
    assert abs(b2 - b) <= 2 * b_se, (b, b2, b_se)
    # ordinary least squares would be dragged far away: the robust loss is doing the work
    slope_ols = np.polyfit(sizes, dirty, 1)[0]
    if where == 6:
        assert abs(slope_ols - b) > 2 * b_se


def _table(tmp_path, kind, header, rows):
    from perfmodel.kernels.tables import read_table

    path = tmp_path / f"{kind}.csv"
    common = "source,hardware,software,note,excluded"
    path.write_text(",".join(header) + "," + common + "\n" + "".join(
        ",".join(str(v) for v in row) + ",test,x,y,synthetic,\n" for row in rows))
    return read_table(kind, path)


def test_gemm_ceilings_recover_the_form_that_made_the_rows(tmp_path):
    """Rows made by the GEMM form at a known ceiling and halves (2% noise): the ceiling is found
    again whatever trial peak it starts from (the peak is a free scale of the fit)."""
    import itertools

    from perfmodel.kernels.forms import gemm_efficiency

    rng = np.random.default_rng(0)
    ceiling, halves = 150e9, (30.0, 50.0, 40.0)
    rows = []
    for m, n, k in itertools.product((16, 64, 256), (16, 64, 256), (16, 64, 256)):
        rate = ceiling * gemm_efficiency(m, n, k, 1.0, *halves) * (1 + 0.02 * rng.standard_normal())
        rows.append(("acc", "fp32", m, n, k, rate / 1e12))
    table = _table(tmp_path, "gemm", ("accelerator", "precision", "m", "n", "k", "tflops"), rows)
    found = gemm_ceilings(table, "acc", hbm_bytes_per_s=1e15, copy_fraction=1.0)
    assert set(found) == {"fp32"} and found["fp32"] == pytest.approx(ceiling, rel=0.05)
    assert found["fp32"] > max(r[-1] for r in rows) * 1e12  # above every measured rate: e_max is 1 there


def test_gemm_ceiling_is_no_lower_than_a_lone_fast_row(tmp_path):
    """One small shape far above the form's curve (as emulated bf16 on a cpu runs): the robust fit
    follows the others, and the ceiling is still at least that row's rate."""
    import itertools

    from perfmodel.kernels.forms import gemm_efficiency

    ceiling, halves = 150e9, (30.0, 50.0, 40.0)
    rows = [("acc", "bf16", m, n, k, ceiling * gemm_efficiency(m, n, k, 1.0, *halves) / 1e12)
            for m, n, k in itertools.product((16, 64, 256), (16, 64, 256), (16, 64, 256))]
    fast = 3 * ceiling
    rows[0] = rows[0][:-1] + (fast / 1e12,)  # the 16^3 shape, 3x the ceiling
    table = _table(tmp_path, "gemm", ("accelerator", "precision", "m", "n", "k", "tflops"), rows)
    found = gemm_ceilings(table, "acc", hbm_bytes_per_s=1e15, copy_fraction=1.0)
    assert found["bf16"] >= fast


def test_memory_ceiling_is_the_copy_asymptote(tmp_path):
    from perfmodel.kernels.forms import memory_efficiency

    sizes = 4096.0 * 4.0 ** np.arange(6)
    rows = [("acc", "copy", b, 80.0 * memory_efficiency(b, 1.0, 3e4)) for b in sizes]
    rows += [("acc", "rmsnorm", b, 80.0 * memory_efficiency(b, 0.3, 3e4)) for b in sizes[::2]]
    table = _table(tmp_path, "memory_kernels", ("accelerator", "kernel", "bytes_moved", "gbps"), rows)
    assert memory_ceiling(table, "acc") == pytest.approx(80e9, rel=0.02)


def test_level_figures_are_fractions_and_respect_the_datasheet():
    fits = [AlphaBetaFit("all_reduce", "node", 8, 10e-6, 200e9, 1e-6, 0.01, 0.99, 8),
            AlphaBetaFit("all_to_all", "node", 8, 20e-6, 150e9, 1e-6, 0.01, 0.99, 8)]
    wire = level_figures(fits, 450e9)
    assert wire["bandwidth_bytes_per_s"] == 450e9 and wire["bandwidth_from"] == "datasheet"
    assert wire["collective_efficiency"]["all_reduce"] == pytest.approx(200e9 * 2 * 7 / 8 / 450e9, rel=1e-3)
    measured = level_figures(fits, None)
    assert measured["bandwidth_bytes_per_s"] == pytest.approx(350e9, rel=1e-3)
    assert all(0 < v <= 1 for v in measured["collective_efficiency"].values())
    assert level_figures(fits, 100e9)["bandwidth_from"] == "measured"  # datasheet exceeded: trust the measurement
    # each collective keeps its own fitted alpha per latency step (3 tree steps over 8 ranks, two
    # phases for all-reduce); the level's latency_s is their median, for collectives not measured
    assert measured["collective_latency_s"] == pytest.approx({"all_reduce": 10e-6 / 6, "all_to_all": 20e-6 / 3}, rel=1e-3)
    assert measured["latency_s"] == pytest.approx((10e-6 / 6 + 20e-6 / 3) / 2, rel=1e-3)


def test_group_specs_cover_inside_and_across_nodes():
    from calibration.collectives import bus_factor, group_specs

    specs = group_specs(16, 8, ["node", "scale_out"], [8, 1024])
    assert [s.level for s in specs] == ["node", "scale_out"]
    inside, across = specs
    assert inside.ranks_of == [list(range(8)), list(range(8, 16))]
    assert across.ranks_of == [[r, r + 8] for r in range(8)]  # one rank per node, every rank in one group
    assert group_specs(2, 2, ["host"], [8])[0].ranks_of == [[0, 1]] and len(group_specs(2, 2, ["host"], [8])) == 1
    assert group_specs(4, 1, ["node", "scale_out"], [8, 64])[0].level == "node"  # 4 single-rank nodes fit one node level
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75) and bus_factor("all_to_all", 8) == pytest.approx(0.875)
    assert bus_factor("p2p", 8) == 1.0


def test_latency_steps_match_perfmodel_comm():
    """Dividing a measured alpha by latency_steps and pricing it with perfmodel.comm gives alpha back."""
    import dataclasses

    from calibration.profile import latency_steps
    from perfmodel.clusters import load_cluster
    from perfmodel.comm import collective_time

    cluster = load_cluster("h100")
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        for n in (2, 4, 8):
            # the level's one step latency (no per-collective or low-latency-protocol figures)
            level = dataclasses.replace(cluster.levels[0], latency_s=1e-3 / latency_steps(kind, n), collective_latency_s={},
                                        ll_collective_latency_s={}, ll_collective_efficiency={})
            spec = dataclasses.replace(cluster, levels=(level, *cluster.levels[1:]))
            assert float(collective_time(spec, kind, 1.0, n, 1)) == pytest.approx(1e-3, rel=1e-3), (kind, n)


def test_a_written_peak_is_rounded_up_to_six_digits():
    """The profile's peak (6 significant digits) never falls below the ceiling it is written from:
    2115224463 FLOP/s, the best bf16 row of a CI run, was written as 2.11522e9 before."""
    assert ceil_6g(2115224463.2476266) == 2.11523e9 and ceil_6g(2.11522e9) == 2.11522e9
    assert ceil_6g(0.00123456789) == 0.00123457 and ceil_6g(999999.5) == 1e6
    xs = 10 ** np.random.default_rng(1).uniform(-6, 16, 10000)
    assert all(x <= ceil_6g(x) <= x * (1 + 1e-5) for x in xs)

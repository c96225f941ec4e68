"""Kernel benchmarks: grouped GEMM fast paths equal the readable references; grids and points are well formed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calibration.kernels import (
    COLD_MAX_COPIES,
    COLD_SPAN_BYTES,
    MEMORY_KERNELS,
    KernelPoint,
    _cold_operand_copies,
    _gemm_fn,
    cold_copies,
    cpu_has_native_bf16,
    expert_token_counts,
    gemm_shapes,
    grouped_impl,
    grouped_mm_bmm,
    grouped_mm_fast,
    grouped_mm_reference,
    grouped_wgrad_bmm,
    grouped_wgrad_fast,
    grouped_wgrad_reference,
    kernel_plan,
    run_point,
    supported_precisions,
)
from calibration.measurements import KERNEL_KINDS, read_csv, write_csv
from calibration.timing import Budget


@pytest.mark.parametrize(("experts", "tokens", "imbalance"), [(4, 32, 1.0), (8, 20, 2.0), (3, 7, 3.0), (1, 5, 1.0)])
def test_expert_token_counts(experts, tokens, imbalance):
    counts = expert_token_counts(experts, tokens, imbalance)
    assert sum(counts) == experts * tokens and min(counts) >= 0
    assert max(counts) == pytest.approx(imbalance * tokens, abs=experts)
    aligned = expert_token_counts(8, 64, 2.0, align=16)
    assert all(c % 16 == 0 for c in aligned) and sum(aligned) == 8 * 64


def test_grouped_gemm_paths_agree_with_the_reference():
    torch.manual_seed(0)
    counts = expert_token_counts(4, 24, 2.0)
    x = torch.randn(sum(counts), 16, dtype=torch.float64)
    w = torch.randn(4, 16, 8, dtype=torch.float64)
    reference = grouped_mm_reference(x, w, counts)
    torch.testing.assert_close(grouped_mm_bmm(x, w, counts), reference)
    impl, why = grouped_impl(torch.device("cpu"), torch.float32)
    if impl == "grouped_mm":
        offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
        fast = grouped_mm_fast(x.float(), w.float(), offsets)
        torch.testing.assert_close(fast, reference.float(), rtol=1e-4, atol=1e-4)
    else:
        assert "fallback" in why


def test_grouped_weight_gradient_paths_agree_with_the_reference_and_autograd():
    """The wgrad point times what autograd runs for the expert weights: dW[e] = X_e^T dY_e."""
    torch.manual_seed(0)
    counts = expert_token_counts(4, 24, 2.0)
    x = torch.randn(sum(counts), 16, dtype=torch.float64)
    dy = torch.randn(sum(counts), 8, dtype=torch.float64)
    reference = grouped_wgrad_reference(x, dy, counts)
    assert reference.shape == (4, 16, 8)
    torch.testing.assert_close(grouped_wgrad_bmm(x, dy, counts), reference)
    impl, _ = grouped_impl(torch.device("cpu"), torch.float32)
    if impl == "grouped_mm":
        offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
        torch.testing.assert_close(grouped_wgrad_fast(x.float(), dy.float(), offsets), reference.float(),
                                   rtol=1e-4, atol=1e-4)
        w = torch.randn(4, 16, 8, requires_grad=True)
        xg = x.float().requires_grad_()
        grouped_mm_fast(xg, w, offsets).backward(dy.float())
        torch.testing.assert_close(w.grad, reference.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(xg.grad, grouped_mm_fast(dy.float(), w.detach().transpose(1, 2), offsets),
                                   rtol=1e-4, atol=1e-4)


def test_gemm_grid_varies_each_dimension_with_the_others_held():
    """Every (M, N, K) of the levels: squares, tall-m, small-k and small-n at each pair of sizes."""
    shapes = gemm_shapes(torch.device("cpu"), True)
    assert (256, 256, 256) in shapes and (256, 16, 16) in shapes  # square, tall-m
    assert (256, 256, 16) in shapes and (256, 16, 256) in shapes  # small-k, small-n
    for m, n, k in [(64, 64, 64), (16, 256, 64)]:
        for i in range(3):  # along each dimension, the others held
            varied = {s[i] for s in shapes if all(s[j] == (m, n, k)[j] for j in range(3) if j != i)}
            assert len(varied) >= 3
    flops = [m * n * k for m, n, k in shapes]
    assert flops == sorted(flops) and len(shapes) < len(gemm_shapes(torch.device("cpu"), False))


def test_cold_copies_hold_every_operand_of_a_set_apart():
    copies = cold_copies([(8, 16), (2, 16, 4), (8, 4)], torch.float32, torch.device("cpu"))
    assert len(copies) >= 2 and all(len(c) == 3 for c in copies)
    assert [t.shape for t in copies[1]] == [(8, 16), (2, 16, 4), (8, 4)]
    starts = sorted(c[0].data_ptr() for c in copies)
    assert len(set(starts)) == len(copies) and np.diff(starts).min() >= (128 + 128 + 32) * 4
    assert all(torch.isfinite(t).all() for c in copies for t in c)


@pytest.mark.parametrize(("M", "N", "K", "dtype"), [(16, 16, 16, torch.float32), (96, 80, 64, torch.bfloat16),
                                                    (1024, 1024, 1024, torch.float32)])
def test_cpu_gemm_operands_are_spread_so_each_call_is_cold(M, N, K, dtype):
    copies = _cold_operand_copies(M, N, K, dtype, torch.device("cpu"))
    assert 2 <= len(copies) <= COLD_MAX_COPIES
    starts = sorted(a.data_ptr() for a, _, _ in copies)
    assert len(set(starts)) == len(copies)  # distinct memory, never the same copy twice in a cycle
    gaps = np.diff(starts)
    set_bytes = (M * K + K * N + M * N) * dtype.itemsize
    assert gaps.min() >= set_bytes  # copies do not overlap
    assert (starts[-1] - starts[0]) + set_bytes >= min(COLD_SPAN_BYTES, COLD_MAX_COPIES * set_bytes) * 0.99
    a, b, out = copies[1]
    assert a.shape == (M, K) and b.shape == (K, N) and out.shape == (M, N)
    assert out.data_ptr() >= b.data_ptr() + b.numel() * dtype.itemsize  # out does not alias an input


def test_cpu_gemm_call_cycles_through_its_copies():
    call = _gemm_fn(KernelPoint("gemm", "fp32", {"M": 8, "N": 4, "K": 6}), torch.device("cpu"))
    first, second = call(), call()
    assert first.data_ptr() != second.data_ptr()  # the next call used the next copy
    assert first.shape == (8, 4) and torch.isfinite(first).all()


def test_plan_covers_every_kernel_kind_and_points_time_positive():
    device = torch.device("cpu")
    precisions, skipped = supported_precisions(device)
    assert "fp32" in precisions and "fp8" in skipped
    plan = kernel_plan(device, True, precisions)
    assert {p.kind for p in plan} == set(KERNEL_KINDS)
    assert {p.phase for p in plan if p.kind == "grouped_gemm"} == {"fwd", "dgrad", "wgrad"}
    assert {p.phase for p in plan if p.kind == "sdpa"} == {"fwd", "bwd"}
    assert {p.precision for p in plan if p.kind in ("grouped_gemm", "sdpa")} == {"fp32", "bf16"} & set(precisions)
    assert len(plan) < len(kernel_plan(device, False, precisions))
    budget = Budget(warmup=1, min_repeats=3, max_repeats=3)
    grouped = {"E": 2, "T": 8, "K": 16, "N": 16, "imbalance": 2.0}
    rows = [run_point(KernelPoint("gemm", "fp32", {"M": 64, "N": 32, "K": 16}), device, budget),
            *(run_point(KernelPoint("grouped_gemm", "fp32", grouped, phase), device, budget)
              for phase in ("fwd", "dgrad", "wgrad")),
            run_point(KernelPoint("sdpa", "fp32", {"B": 1, "H": 2, "S": 32, "D": 16}, "fwd"), device, budget),
            run_point(KernelPoint("sdpa", "fp32", {"B": 1, "H": 2, "S": 32, "D": 16}, "bwd"), device, budget),
            run_point(KernelPoint("launch", "fp32", {"batch": 10}), device, budget)]
    assert rows[0].flops == 2 * 64 * 32 * 16
    assert all(r.flops == 2 * 16 * 16 * 16 for r in rows[1:4]) and {r.phase for r in rows[1:4]} == {"fwd", "dgrad", "wgrad"}
    assert rows[4].flops == 4 * 2 * 32 * 32 * 16 / 2 and rows[5].flops == 2.5 * rows[4].flops
    assert all(r.median_s > 0 and r.repeats == 3 for r in rows)
    assert all(r.impl in ("grouped_mm", "bmm") for r in rows[1:4])
    factors = {"mem_copy": 2, "mem_add": 3, "mem_rmsnorm": 2, "mem_swiglu": 3, "mem_permute": 2,
               "mem_cross_entropy": 3, "mem_adamw": 7}
    assert set(factors) == set(MEMORY_KERNELS)
    for kind, factor in factors.items():  # bytes moved per byte of the main tensor (whole rows of it)
        nbytes = 4 * 4096 * 4
        row = run_point(KernelPoint(kind, "fp32", {"bytes": nbytes}), device, budget)
        assert row.bytes == factor * nbytes and row.median_s > 0, kind


def test_grouped_points_cycle_cold_operands_on_cpu(monkeypatch):
    """On cpu a grouped point's x, W and dY come from `cold_copies` (as the dense GEMMs'), whose
    copies hold the same values: two calls agree."""
    import calibration.kernels as kernels

    asked = []
    real = kernels.cold_copies

    def spy(shapes, dtype, device):
        asked.append(list(shapes))
        return real(shapes, dtype, device)

    monkeypatch.setattr(kernels, "cold_copies", spy)
    point = KernelPoint("grouped_gemm", "fp32", {"E": 2, "T": 8, "K": 16, "N": 8, "imbalance": 1.0}, "dgrad")
    prepared = kernels.prepare_point(point, torch.device("cpu"))
    assert asked == [[(16, 16), (2, 16, 8), (16, 8)]]
    first, second = prepared.fn(), prepared.fn()
    assert first.shape == (16, 16) and torch.equal(first, second)


def test_measurements_csv_round_trip(tmp_path):
    budget = Budget(warmup=0, min_repeats=2, max_repeats=2)
    rows = [run_point(KernelPoint("gemm", "fp32", {"M": 8, "N": 8, "K": 8}), torch.device("cpu"), budget)]
    path = write_csv(tmp_path / "m.csv", rows)
    assert read_csv(path) == rows
    path.write_text(path.read_text().replace("gemm,cpu,fp32", "gemm,cpu,fp32").replace(",2,", ",two,", 1))
    from perfmodel.errors import InputError

    with pytest.raises(InputError, match="line 2"):
        read_csv(path)


@pytest.mark.parametrize(("flags", "native"), [
    ("fpu sse2 avx2 fma avx512f avx512_bf16", True),  # AMD Zen 4 / Intel Cooper Lake
    ("fpu sse2 avx2 fma avx512f amx_bf16 amx_tile", True),  # Intel Sapphire Rapids
    ("fpu sse2 avx2 fma", False),  # AMD Zen 3: bf16 is emulated
])
def test_native_bf16_is_told_from_the_cpu_flags(flags, native):
    cpuinfo = f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert cpu_has_native_bf16(cpuinfo) is native


def test_native_bf16_is_unknown_without_x86_flags():
    assert cpu_has_native_bf16("processor\t: 0\nFeatures\t: fp asimd bf16\n") is None


def test_launch_latency_is_sampled_across_the_whole_grid(monkeypatch):
    """The launch point is timed in a slice before each other group and after the last (the host's
    speed moves within seconds), and its row pools every slice's repeats."""
    import calibration.kernels as kernels

    device = torch.device("cpu")
    order: list[str] = []
    real = kernels._launch_samples

    def recording(point, device, budget):
        order.append("launch")
        return real(point, device, budget)

    monkeypatch.setattr(kernels, "_launch_samples", recording)
    real_prepare = kernels.prepare_point
    monkeypatch.setattr(kernels, "prepare_point", lambda point, device: (order.append(point.kind), real_prepare(point, device))[1])
    points = [KernelPoint("launch", "fp32", {"batch": 10}), KernelPoint("gemm", "fp32", {"M": 16, "N": 16, "K": 16}),
              KernelPoint("gemm", "fp32", {"M": 32, "N": 16, "K": 16}), KernelPoint("mem_copy", "fp32", {"bytes": 4096})]
    rows = kernels.run_points(points, device, Budget(warmup=1, min_repeats=3, max_repeats=3))
    assert order == ["launch", "gemm", "gemm", "launch", "mem_copy", "launch"]
    assert [r.kind for r in rows] == ["launch", "gemm", "gemm", "mem_copy"]  # the points' order
    assert rows[0].repeats == 3 * kernels.LAUNCH_SLICE_MIN_REPEATS and rows[0].median_s > 0
    assert rows[0].shape.startswith("batch=")  # on cpu: the eager ops per sample

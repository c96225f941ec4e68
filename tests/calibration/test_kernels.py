"""Kernel benchmarks: grouped GEMM fast path equals the readable reference; grids and points are well formed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calibration.kernels import (
    COLD_MAX_COPIES,
    COLD_SPAN_BYTES,
    KernelPoint,
    _cold_operand_copies,
    _gemm_fn,
    cpu_has_native_bf16,
    expert_token_counts,
    grouped_impl,
    grouped_mm_bmm,
    grouped_mm_fast,
    grouped_mm_reference,
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
    assert len(plan) < len(kernel_plan(device, False, precisions))
    budget = Budget(warmup=1, min_repeats=3, max_repeats=3)
    rows = [run_point(KernelPoint("gemm", "fp32", {"M": 64, "N": 32, "K": 16}), device, budget),
            run_point(KernelPoint("grouped_gemm", "fp32", {"E": 2, "T": 8, "K": 16, "N": 16, "imbalance": 2.0}), device, budget),
            run_point(KernelPoint("sdpa", "fp32", {"B": 1, "H": 2, "S": 32, "D": 16}), device, budget),
            run_point(KernelPoint("mem_copy", "fp32", {"bytes": 4096}), device, budget),
            run_point(KernelPoint("mem_add", "fp32", {"bytes": 4096}), device, budget),
            run_point(KernelPoint("launch", "fp32", {"batch": 10}), device, budget)]
    assert rows[0].flops == 2 * 64 * 32 * 16 and rows[2].flops == 4 * 2 * 32 * 32 * 16 / 2
    assert rows[3].bytes == 2 * 4096 and rows[4].bytes == 3 * 4096
    assert all(r.median_s > 0 and r.repeats == 3 for r in rows)
    assert rows[1].impl in ("grouped_mm", "bmm")


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

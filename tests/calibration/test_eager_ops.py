"""The host time of an eager op, of a DTensor op and of an activation-checkpointed region, as
calibration.eager_ops measures them for `mosaic calibrate` on cpu (positive, ordered; the values
are the machine's)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="timing eager ops needs torch")

from calibration.eager_ops import checkpoint_costs, dtensor_op_seconds, eager_op_seconds  # noqa: E402


def test_eager_op_cost_is_a_positive_per_op_time() -> None:
    seconds, noise, ops = eager_op_seconds(repeats=5, max_seconds=0.05)
    assert ops > 100  # four RMSNorm + SwiGLU blocks forward and backward
    assert 0 < seconds < 1e-3 and noise >= 0


def test_dtensor_op_cost_is_positive_and_above_a_plain_ops() -> None:
    seconds, noise, ops = dtensor_op_seconds(samples=3)
    assert ops > 50  # column-/row-wise linears of four blocks, forward and backward
    plain, _, _ = eager_op_seconds(repeats=5, max_seconds=0.05)
    assert plain < seconds < 1e-2 and noise >= 0  # sharding propagation costs more than a plain dispatch


def test_checkpoint_costs_are_positive_host_times() -> None:
    regions, per_saved, details = checkpoint_costs(samples=9)  # its default: up to 4 disturbed pairs leave the median
    assert details["saved"]["block"] > details["saved"]["core"] > 0
    assert len(regions) == len(per_saved) == 9
    region, saved = sorted(regions)[4], sorted(per_saved)[4]  # the medians (a loaded host skews single samples)
    # hooks, RNG state and recompute set-up cost host time; a region costs more than one of its tensors
    assert 0 < region < 5e-3 and 0 <= saved < 1e-3 and region > saved

"""Search the layouts of one model on one cluster (`mosaic predict --layout best`).

The grid is the usual Megatron-Core search space for a fixed job size:
tp in powers of two up to the node size (tensor parallel stays inside a
node), pp in powers of two, vpp 1/2/4, ep over the divisors of E, etp 1
(Megatron-Core's recommendation for fine-grained MoE), cp 1/2, every
data-parallel flavour, mbs 1/2/4/8, every recompute mode, sequence parallel
whenever tp > 1, at one precision and one global batch. Invalid
combinations are dropped by `perfmodel.validity.valid_mask`; the rest go
through `perfmodel.evaluate` and the feasible ones are ranked by tokens/s.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import numpy as np

from perfmodel.evaluate import REASONS, EvalResult, evaluate
from perfmodel.specs.layout import DP_FLAVORS, LAYOUT_FIELDS, PRECISIONS, RECOMPUTE_MODES, LayoutBatch
from perfmodel.validity import valid_mask

DEFAULT_BATCH_TOKENS = 4 * 2**20
"""Default global batch ~4M tokens (Llama 2 pre-training used 4M tokens per batch,
Touvron et al. 2023), rounded to a multiple of the device count."""

MAX_SEQUENCES_PER_DEVICE = 8
"""Cap of the default batch per device, so that small jobs (a CPU test cluster) do not
default to thousands of sequences per step."""


def default_gbs(arch: Any, devices: int) -> int:
    """About DEFAULT_BATCH_TOKENS sequences, a multiple of `devices`, 1 to 8 per device."""
    per_device = round(DEFAULT_BATCH_TOKENS / (arch.seq_len * devices))
    return int(devices * min(max(per_device, 1), MAX_SEQUENCES_PER_DEVICE))


def default_precision(cluster: Any) -> str:
    """bf16 where the accelerator has it, else fp32."""
    return "bf16" if "bf16" in cluster.accelerator.peak_flops_per_s else "fp32"


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def candidate_layouts(arch: Any, cluster: Any, devices: int, gbs: int, precision: str) -> LayoutBatch:
    """Every valid layout of the grid (module doc) for `devices` devices."""
    tps = _powers_of_two(min(cluster.node_devices, devices))
    pps = [p for p in _powers_of_two(min(arch.n_layers, devices)) if arch.n_layers % p == 0]
    eps = [e for e in range(1, max(arch.n_experts, 1) + 1) if max(arch.n_experts, 1) % e == 0 and e <= devices]
    rows = []
    for tp, pp, vpp, ep, cp in itertools.product(tps, pps, (1, 2, 4), eps, (1, 2)):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        for flavor, mbs, recompute in itertools.product(range(len(DP_FLAVORS)), (1, 2, 4, 8),
                                                        range(len(RECOMPUTE_MODES))):
            rows.append((tp, pp, vpp, ep, 1, cp, dp, flavor, mbs, gbs, recompute, tp > 1,
                         PRECISIONS.index(precision)))
    if not rows:
        return LayoutBatch(**{name: np.zeros(0, dtype=np.int64) for name in LAYOUT_FIELDS})
    cols = np.asarray(rows, dtype=np.int64).T
    batch = LayoutBatch(**{name: (cols[i].astype(bool) if name == "sequence_parallel" else cols[i])
                           for i, name in enumerate(LAYOUT_FIELDS)})
    keep = valid_mask(arch, batch, devices)
    return batch.take(np.flatnonzero(keep))


def best_layouts(arch: Any, cluster: Any, devices: int, gbs: Optional[int] = None, precision: Optional[str] = None,
                 top: int = 5) -> tuple[LayoutBatch, Optional[EvalResult], dict[str, Any]]:
    """The `top` feasible layouts by tokens/s, their results (None when the grid is
    empty), and search statistics: candidates, feasible, reasons (count per
    infeasibility reason), gbs, precision, devices."""
    gbs = default_gbs(arch, devices) if gbs is None else gbs
    precision = default_precision(cluster) if precision is None else precision
    grid = candidate_layouts(arch, cluster, devices, gbs, precision)
    stats: dict[str, Any] = {"candidates": len(grid), "feasible": 0, "reasons": {}, "gbs": gbs,
                             "precision": precision, "devices": devices}
    if len(grid) == 0:
        return grid, None, stats
    result = evaluate(arch, grid, cluster, devices)
    stats["feasible"] = int(result.feasible.sum())
    stats["reasons"] = {REASONS[c]: int((result.reason == c).sum()) for c in np.unique(result.reason) if c != 0}
    ok = np.flatnonzero(result.feasible)
    order = ok[np.argsort(-result.tokens_per_s[ok], kind="stable")][:top]
    return grid.take(order), result.take(order), stats

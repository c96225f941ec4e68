"""Search the layouts of one model on one cluster (`mosaic predict --layout best`).

The grid is the usual Megatron-Core search space for a fixed job size:
tp in powers of two up to the node size (tensor parallel stays inside a
node), pp in powers of two, vpp 1/2/4, ep over the divisors of E, etp 1
(Megatron-Core's recommendation for fine-grained MoE), cp 1/2, every
data-parallel flavour, mbs 1/2/4/8, every recompute mode, sequence parallel
whenever tp > 1, at one precision and one global batch (default
`perfmodel.specs.layout.default_gbs_of_job`). Invalid
combinations are dropped by `perfmodel.validity.valid_mask`; the rest go
through `perfmodel.evaluate` and the feasible ones are ranked by tokens/s.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from perfmodel.evaluate import REASONS, EvalResult, evaluate
from perfmodel.specs.layout import (
    CORE_LAYOUT_FIELDS,
    DP_FLAVORS,
    OVERLAP_FIELDS,
    PRECISIONS,
    RECOMPUTE_MODES,
    LayoutBatch,
    default_gbs_of_job,
)
from perfmodel.validity import valid_mask

GRID_FIELDS = CORE_LAYOUT_FIELDS + OVERLAP_FIELDS
"""The fields `layout_grid` crosses (the optional split and dispatch fields take their defaults)."""
BOOL_GRID = ("sequence_parallel",) + OVERLAP_FIELDS


def default_precision(cluster: Any) -> str:
    """bf16 where the accelerator has it, else fp32."""
    return "bf16" if "bf16" in cluster.accelerator.peak_flops_per_s else "fp32"


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`."""
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def layout_grid(devices: int, *, tp: Sequence[int], pp: Sequence[int], vpp: Sequence[int], ep: Sequence[int],
                etp: Sequence[int], cp: Sequence[int], dp_flavor: Sequence[str], mbs: Sequence[int],
                recompute: Sequence[str], precision: Sequence[str],
                sequence_parallel: Optional[Sequence[bool]] = None, gbs: int = 0,
                overlaps: Sequence[tuple[bool, bool, bool, bool]] = ((False, False, False, False),)) -> LayoutBatch:
    """Every combination of the lists (crossed tp outermost ... precision innermost, the order
    ties break in) with dp = devices / (tp * cp * pp). Left out: tp * cp * pp not dividing the
    devices, vpp > 1 without a pipeline, and with `sequence_parallel` None (auto) any row whose
    sequence parallel is not exactly tp > 1, and tp_comm_overlap without sequence parallel (it
    overlaps the sequence-parallel all-gathers). `overlaps`: (overlap_grad_reduce,
    overlap_param_gather, tp_comm_overlap, ep_comm_overlap) choices, crossed innermost. Every row
    gets `gbs` (0: filled later per pair).
    The one grid builder: `mosaic predict --layout best` (`candidate_layouts`) and the planner's
    search space (`mosaic.planner.space.layout_grid`) pass their lists."""
    sp_values = (False, True) if sequence_parallel is None else tuple(sequence_parallel)
    rows = []
    for t, p, v, e, et, c, flavor, m, rec, sp, prec, ov in itertools.product(
            tp, pp, vpp, ep, etp, cp, dp_flavor, mbs, recompute, sp_values, precision, overlaps):
        if devices % (t * c * p) != 0:
            continue
        if sequence_parallel is None and sp != (t > 1):
            continue
        if v > 1 and p == 1:
            continue
        if ov[2] and not sp:
            continue
        rows.append((t, p, v, e, et, c, devices // (t * c * p), DP_FLAVORS.index(flavor), m, gbs,
                     RECOMPUTE_MODES.index(rec), sp, PRECISIONS.index(prec), *ov))
    if not rows:
        return LayoutBatch(**{name: np.zeros(0, dtype=bool if name in BOOL_GRID else np.int64)
                              for name in GRID_FIELDS})
    table = np.asarray(rows, dtype=np.int64)
    cols = {name: table[:, i] for i, name in enumerate(GRID_FIELDS)}
    for name in BOOL_GRID:
        cols[name] = cols[name].astype(bool)
    return LayoutBatch(**cols)


def candidate_layouts(arch: Any, cluster: Any, devices: int, gbs: int, precision: str) -> LayoutBatch:
    """Every valid layout of the grid (module doc) for `devices` devices."""
    n_experts = max(arch.n_experts, 1)
    batch = layout_grid(
        devices, tp=powers_of_two(min(cluster.node_devices, devices)),
        pp=[p for p in powers_of_two(min(arch.n_layers, devices)) if arch.n_layers % p == 0], vpp=(1, 2, 4),
        ep=[e for e in range(1, n_experts + 1) if n_experts % e == 0 and e <= devices], etp=(1,), cp=(1, 2),
        dp_flavor=DP_FLAVORS, mbs=(1, 2, 4, 8), recompute=RECOMPUTE_MODES, precision=(precision,), gbs=gbs,
        overlaps=((True, True, False, False),))
    if len(batch) == 0:
        return batch
    return batch.take(np.flatnonzero(valid_mask(arch, batch, devices)))


def best_layouts(arch: Any, cluster: Any, devices: int, gbs: Optional[int] = None, precision: Optional[str] = None,
                 top: int = 5) -> tuple[LayoutBatch, Optional[EvalResult], dict[str, Any]]:
    """The `top` feasible layouts by tokens/s, their results (None when the grid is
    empty), and search statistics: candidates, feasible, reasons (count per
    infeasibility reason), gbs, precision, devices."""
    gbs = default_gbs_of_job(arch.seq_len, devices) if gbs is None else gbs
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

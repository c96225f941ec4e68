"""An exact upper bound on a (geometry, layout) pair's tokens/s, from perfmodel's own per-block tables.

`perfmodel.evaluate` prices a step as (`perfmodel.stage`, `perfmodel.schedule`)

  step = straggler x [ (m + (pp-1)/vpp) x micro_batch + DP sync + optimizer ]   (slower stage)
  micro_batch = compute (fwd + bwd, every category) + recompute + exposed communication
                + overlap slowdown + host dispatch

and every term after `compute + recompute` is >= 0, so

  step >= straggler x (m + (pp-1)/vpp) x max over {first, last} stage of
          sum_blocks count[stage, block] x (fwd + bwd compute)[block] + recompute
  recompute = full: the layers' forward again; selective: the attention core's forward

  tokens/s <= gbs x seq_len / that.

The per-block compute times are `perfmodel.tables.block_tables` of the geometry's layer shape
(every architecture field but n_layers and n_dense_layers, which only set the counts) and of the
layout's table fields (`TABLE_LAYOUT_FIELDS`: tp, cp, ep, etp, mbs, sequence parallel,
precision), computed once per distinct (shape, table fields) and cached: a planner grid has
thousands of pairs per distinct table row. They are priced as `perfmodel.evaluate` prices them
(`tables.shared_block_tables`: each attention, dense FFN and MoE block once per group of equal
block fields, the same figures as `block_tables` row by row), and only for the shapes asked for
(the search asks as geometries reach the front of its order). Nothing here prices a kernel: it
sums what perfmodel's tables hold, so the bound moves with the model (tests/mosaic/test_bounds.py holds it below
`evaluate` on every pair of the test spaces; the search re-checks it on every pair it times).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from perfmodel.comm import CollectivePricer
from perfmodel.grouping import row_groups
from perfmodel.hardware import HardwareView
from perfmodel.host import host_dispatch
from perfmodel.inputs import as_float
from perfmodel.operators import FULL, SELECTIVE, recompute_code
from perfmodel.schedule import bubble_slots, micro_batches, stage_layer_counts, straggler_factor
from perfmodel.specs.architecture import ARCH_FIELDS, ArchBatch, n_ffn_dense_layers
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import LayoutBatch
from perfmodel.tables import CATEGORIES, LAYER_BLOCKS, TABLE_LAYOUT_FIELDS, shared_block_tables

SHAPE_FIELDS = tuple(f for f in ARCH_FIELDS if f not in ("n_layers", "n_dense_layers"))
"""What a block's table depends on in the geometry (the layer counts only multiply it)."""
BLOCKS = ("attention", "dense_ffn", "moe", "embedding", "head")
_ENTRIES = ("compute", "fwd", "core_fwd")
"""Per block: fwd + bwd compute of every category, its forward part, the attention core's forward."""


class ComputeBound:
    """tokens/s upper bounds of (geometry, layout) pairs on one cluster and device count (module doc)."""

    def __init__(self, archs: ArchBatch, grid: LayoutBatch, cluster: ClusterSpec, devices: int) -> None:
        self.cluster, self.devices = cluster, int(devices)
        self.shape_first, self.shape_of_geometry = row_groups([np.asarray(getattr(archs, f)) for f in SHAPE_FIELDS])
        self.table_first, self.table_of_layout = row_groups([np.asarray(getattr(grid, f)) for f in TABLE_LAYOUT_FIELDS])
        self.archs, self.grid = archs, grid
        self.straggler = float(np.asarray(straggler_factor(cluster, np.asarray([float(devices)]))).ravel()[0])
        self._host = host_dispatch(cluster)
        n_s, n_t = len(self.shape_first), len(self.table_first)
        self._done = np.zeros((n_s, n_t), dtype=bool)
        self._store = {(b, e): np.zeros((n_s, n_t)) for b in BLOCKS for e in _ENTRIES}
        reps = grid.take(self.table_first)
        self._per_device = (np.asarray(reps.mbs, dtype=float) * self.devices
                            / (np.asarray(reps.tp, dtype=float) * np.asarray(reps.cp, dtype=float)))
        """mbs x devices / (tp x cp) of each table row."""

    def _fill(self, shape: np.ndarray, table: np.ndarray) -> None:
        """Block tables of the (shape, table-fields) cells not computed yet."""
        todo = ~self._done[shape, table]
        if not np.any(todo):
            return
        n_t = self._done.shape[1]
        cells = np.unique(shape[todo] * n_t + table[todo])
        s, t = cells // n_t, cells % n_t
        archs = self.archs.take(self.shape_first[s])
        lays = self.grid.take(self.table_first[t])
        lays = dataclasses.replace(lays, gbs=np.asarray(lays.mbs) * np.asarray(lays.dp))
        arch_f, lay_f = as_float(archs), as_float(lays)
        share = self._host.core_share(np.full(len(s), float(self.devices)))
        hw = HardwareView(self.cluster, lay_f, share)
        pricer = CollectivePricer(self.cluster, lay_f, hw.share)
        tables = shared_block_tables(arch_f, lay_f, self.cluster, self._host.block_comms, pricer, hw)
        for b in BLOCKS:
            tb = tables[b]
            fwd = sum(np.broadcast_to(np.asarray(tb[f"fwd_{c}"], dtype=float), s.shape) for c in CATEGORIES)
            bwd = sum(np.broadcast_to(np.asarray(tb[f"bwd_{c}"], dtype=float), s.shape) for c in CATEGORIES)
            self._store[(b, "compute")][s, t] = fwd + bwd
            self._store[(b, "fwd")][s, t] = fwd
            self._store[(b, "core_fwd")][s, t] = np.broadcast_to(np.asarray(tb["core_fwd"], dtype=float), s.shape)
        self._done[s, t] = True

    def step_lower_bound_s(self, geometry: np.ndarray, layout: np.ndarray, archs: ArchBatch,
                           lays: LayoutBatch) -> np.ndarray:
        """Seconds per step no layout can beat, per pair (`archs`, `lays`: the pairs, gbs filled)."""
        shape = self.shape_of_geometry[geometry]
        table = self.table_of_layout[layout]
        self._fill(shape, table)
        counts = stage_layer_counts(archs, lays)
        code = np.asarray(recompute_code(lays))
        full, selective = code == FULL, code == SELECTIVE
        worst = np.zeros(len(geometry))
        for stage in ("first", "last"):
            c = counts[stage]
            compute = sum(np.asarray(c[b], dtype=float) * self._store[(b, "compute")][shape, table] for b in BLOCKS)
            layer_fwd = sum(np.asarray(c[b], dtype=float) * self._store[(b, "fwd")][shape, table] for b in LAYER_BLOCKS)
            core = np.asarray(c["attention"], dtype=float) * self._store[("attention", "core_fwd")][shape, table]
            recompute = np.where(full, layer_fwd, np.where(selective, core, 0.0))
            worst = np.maximum(worst, compute + recompute)
        slots = np.asarray(micro_batches(lays), dtype=float) + np.asarray(bubble_slots(lays), dtype=float)
        return self.straggler * slots * worst

    def table_tokens_per_s(self, geometry: np.ndarray) -> np.ndarray:
        """An upper bound of tokens/s of each geometry under every layout of each table row, without
        building the pairs, (n_geometries, n_table_rows): the slower stage holds at least 1/pp of
        all blocks, and m = gbs / (mbs x dp), so
          tokens/s <= mbs x seq_len x devices / (tp x cp x straggler x C),
        C = sum over all blocks of their fwd + bwd compute at the row's table fields (recompute,
        bubbles, communication and host dispatch only add)."""
        geometry = np.asarray(geometry, dtype=np.int64)
        n_t = len(self.table_first)
        shapes = np.unique(self.shape_of_geometry[geometry])
        self._fill(np.repeat(shapes, n_t), np.tile(np.arange(n_t), len(shapes)))
        archs = self.archs.take(geometry)
        layers = np.asarray(archs.n_layers, dtype=float)
        dense = np.asarray(n_ffn_dense_layers(archs), dtype=float)
        count = {"attention": layers, "dense_ffn": dense, "moe": layers - dense,
                 "embedding": np.ones_like(layers), "head": np.ones_like(layers)}
        s = self.shape_of_geometry[geometry]
        total = sum(count[b][:, None] * self._store[(b, "compute")][s][:, :n_t] for b in BLOCKS)
        seq = np.asarray(archs.seq_len, dtype=float)[:, None]
        with np.errstate(divide="ignore"):
            return np.where(total > 0, seq * self._per_device[None, :] / (self.straggler * total), np.inf)

    @staticmethod
    def pipeline_share(lays: LayoutBatch) -> np.ndarray:
        """The factor by which a layout's pipeline lowers `table_tokens_per_s` (gbs filled): the
        step holds m + (pp - 1) / vpp slots of at least C / pp each, so
          tokens/s <= table bound x (gbs / (mbs x dp)) / (m + (pp - 1) / vpp)."""
        per_pipeline = np.asarray(lays.gbs, dtype=float) / (np.asarray(lays.mbs, dtype=float) * np.asarray(lays.dp, dtype=float))
        return per_pipeline / (np.asarray(micro_batches(lays), dtype=float) + np.asarray(bubble_slots(lays), dtype=float))

    def geometry_tokens_per_s(self, geometry: np.ndarray) -> np.ndarray:
        """An upper bound of each geometry's tokens/s over every layout of the grid: the largest
        `table_tokens_per_s` of its row."""
        bound = self.table_tokens_per_s(geometry)
        return bound.max(axis=1) if bound.shape[1] else np.zeros(len(bound))

    def tokens_per_s(self, geometry: np.ndarray, layout: np.ndarray, archs: ArchBatch, lays: LayoutBatch,
                     step_s: Optional[np.ndarray] = None) -> np.ndarray:
        """Upper bound of tokens/s per pair: gbs x seq_len / `step_lower_bound_s`."""
        step = self.step_lower_bound_s(geometry, layout, archs, lays) if step_s is None else step_s
        tokens = np.asarray(lays.gbs, dtype=float) * np.asarray(archs.seq_len, dtype=float)
        with np.errstate(divide="ignore"):
            return np.where(step > 0, tokens / step, np.inf)


__all__ = ["SHAPE_FIELDS", "ComputeBound"]

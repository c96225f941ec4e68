"""Best feasible layout of each geometry: (geometry x layout) pairs through `perfmodel.evaluate`.

Layout does not change loss, so a geometry is worth its best feasible layout:
the one with the highest model FLOP/s (= tokens/s x FLOPs per token; for one
geometry that is the highest tokens/s). Pairs are built in vectorised chunks,
filtered by the shared validity rules (`perfmodel.validity.valid_mask`), then:

  memory pruning      memory per device from `perfmodel.memory.stage_memory` (the
                      formula `evaluate` uses, without the timing half): pairs above
                      usable HBM are infeasible and never timed. First its static part
                      (weights, gradients, optimizer, buffers: independent of mbs,
                      recompute and sequence parallel) on the distinct sharding keys,
                      a lower bound that skips the full formula for hopeless pairs
  dominated layouts   a pair whose layout differs from a memory-feasible pair of the
                      same geometry only by more activation recompute (none <
                      selective < full) cannot be faster (recompute only adds work),
                      so it is not timed

Both prunings leave every geometry's best feasible layout unchanged (tested:
pruned and unpruned tables agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

import perfmodel
from perfmodel.memory import stage_memory
from perfmodel.schedule import pipeline_stages
from perfmodel.specs.architecture import ArchBatch
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import LAYOUT_FIELDS, RECOMPUTE_MODES, LayoutBatch, gbs_holding_tokens
from perfmodel.validity import valid_mask

REASONS = perfmodel.REASONS
MEMORY_REASON = REASONS.index("memory")

ProgressFn = Callable[[int], None]

STATIC_COMPONENTS = ("weights", "gradients", "optimizer", "fsdp_buffers", "framework")
"""Memory components that depend on the geometry and the sharding only."""
STATIC_FREE_FIELDS = ("mbs", "recompute", "sequence_parallel", "gbs")
"""Layout fields the static components do not depend on (tested)."""


def memory_per_device(archs: ArchBatch, lays: LayoutBatch, cluster: ClusterSpec) -> np.ndarray:
    """Bytes per device of the larger pipeline stage (`perfmodel.memory.memory_per_device`,
    what `evaluate` reports)."""
    return perfmodel.memory.memory_per_device(archs, lays, cluster).total_bytes


def recompute_siblings(grid: LayoutBatch) -> list[np.ndarray]:
    """For each layout, the indices of the same layout with less recompute (-1 where absent)."""
    key_fields = [f for f in LAYOUT_FIELDS if f not in ("recompute", "gbs")]
    keys = grid.key_columns(key_fields)
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.ravel()
    rec = np.asarray(grid.recompute)
    lookup = {(int(g), int(r)): i for i, (g, r) in enumerate(zip(group, rec))}
    out = []
    for level in range(len(RECOMPUTE_MODES)):
        sib = np.asarray([lookup.get((int(g), level), -1) if r > level else -1 for g, r in zip(group, rec)], dtype=np.int64)
        out.append(sib)
    return out


@dataclass
class GeometryResults:
    """Per-geometry outcome of the layout search (arrays over the geometries evaluated)."""

    index: np.ndarray
    """Geometry indices (into the GeometrySet)."""
    best_layout: np.ndarray
    """Index into the layout grid of the best feasible layout (-1: none feasible)."""
    best_gbs: np.ndarray
    tokens_per_s: np.ndarray
    """Of the best feasible layout (0 where none)."""
    mfu: np.ndarray
    step_time_s: np.ndarray
    memory_bytes: np.ndarray
    min_memory_bytes: np.ndarray
    """Smallest memory per device over the geometry's valid layouts (inf: none valid); with
    pruning a lower bound (the static part) where the full formula was skipped."""
    min_memory_layout: np.ndarray
    n_valid: np.ndarray
    n_memory_ok: np.ndarray
    n_timed: np.ndarray
    evaluation_row: np.ndarray
    """Row of `evaluations` with the best layout's whole prediction (-1: no feasible layout)."""
    evaluations: Optional[perfmodel.EvalResult] = None
    """`perfmodel.evaluate` of the best layouts, as the search computed them (carried out, not redone)."""

    def evaluation(self, i: int) -> dict[str, Any]:
        """The search's `EvalResult.row` of geometry position `i`'s best layout."""
        row = int(self.evaluation_row[i])
        if row < 0 or self.evaluations is None:
            raise ValueError(f"geometry position {i} has no feasible layout")
        return self.evaluations.row(row)

    @staticmethod
    def concat(parts: list[GeometryResults]) -> GeometryResults:
        arrays = {name: np.concatenate([getattr(p, name) for p in parts]) for name in _ARRAY_FIELDS}
        rows, stores, offset = [], [], 0
        for p in parts:
            rows.append(np.where(p.evaluation_row >= 0, p.evaluation_row + offset, -1))
            if p.evaluations is not None and len(p.evaluations):
                stores.append(p.evaluations)
                offset += len(p.evaluations)
        store = perfmodel.EvalResult.concat(stores) if stores else None
        return GeometryResults(**arrays, evaluation_row=np.concatenate(rows).astype(np.int64), evaluations=store)

    @staticmethod
    def empty() -> GeometryResults:
        return GeometryResults(**{name: np.zeros(0) for name in _ARRAY_FIELDS},
                               evaluation_row=np.zeros(0, dtype=np.int64))

    def take(self, index: np.ndarray) -> GeometryResults:
        """The geometries at positions `index` (an integer array); their evaluations go with them."""
        arrays = {name: np.asarray(getattr(self, name))[index] for name in _ARRAY_FIELDS}
        rows = np.asarray(self.evaluation_row)[index]
        has = rows >= 0
        store = self.evaluations.take(rows[has]) if self.evaluations is not None and np.any(has) else None
        new_rows = np.full(len(rows), -1, dtype=np.int64)
        new_rows[has] = np.arange(int(has.sum()))
        return GeometryResults(**arrays, evaluation_row=new_rows, evaluations=store)


_ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(GeometryResults)
                      if f.name not in ("evaluation_row", "evaluations"))


class PairEvaluator:
    """Evaluates chunks of geometries against a fixed layout grid on one cluster and device count."""

    def __init__(self, archs: ArchBatch, grid: LayoutBatch, cluster: ClusterSpec, devices: int, gbs_tokens: float,
                 prune: bool = True) -> None:
        self.archs, self.grid, self.cluster, self.devices = archs, grid, cluster, devices
        self.gbs_tokens, self.prune = gbs_tokens, prune
        self.hbm = cluster.accelerator.usable_hbm_bytes
        self.siblings = recompute_siblings(grid)
        key_fields = [f for f in LAYOUT_FIELDS if f not in STATIC_FREE_FIELDS]
        keys = grid.key_columns(key_fields)
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        self.key_grid = dataclasses.replace(grid.take(first), gbs=np.asarray(grid.mbs)[first] * np.asarray(grid.dp)[first])
        self.key_of_layout = inverse.ravel()
        self.max_mfu_seen = 0.0

    def static_memory(self, geo_index: np.ndarray) -> np.ndarray:
        """Lower bound of memory per device for each (geometry, layout): the parts that do not
        depend on mbs, recompute, sequence parallel or gbs (weights, gradients, optimizer, FSDP
        buffers, framework), from `perfmodel.memory.stage_memory` on the distinct layout keys."""
        n_g, n_k = len(geo_index), len(self.key_grid)
        g = np.repeat(geo_index, n_k)
        k = np.tile(np.arange(n_k), n_g)
        archs, lays = self.archs.take(g), self.key_grid.take(k)
        static = np.zeros(n_g * n_k)
        for stage in pipeline_stages(archs, lays):
            parts = stage_memory(archs, lays, self.cluster, stage)
            static = np.maximum(static, sum(parts[c] for c in STATIC_COMPONENTS))
        static = static.reshape(n_g, n_k)
        return static[:, self.key_of_layout]

    def pairs(self, geo_index: np.ndarray) -> tuple[ArchBatch, LayoutBatch, np.ndarray, np.ndarray]:
        n_l = len(self.grid)
        g = np.repeat(geo_index, n_l)
        lay_i = np.tile(np.arange(n_l), len(geo_index))
        archs = self.archs.take(g)
        lays = self.grid.take(lay_i)
        lays = dataclasses.replace(lays, gbs=gbs_holding_tokens(lays.mbs, lays.dp, archs.seq_len, self.gbs_tokens))
        return archs, lays, g, lay_i

    def run(self, geo_index: np.ndarray, progress: Optional[ProgressFn] = None) -> GeometryResults:
        geo_index = np.asarray(geo_index, dtype=np.int64)
        n_g, n_l = len(geo_index), len(self.grid)
        archs, lays, _, _ = self.pairs(geo_index)
        valid = valid_mask(archs, lays, self.devices)
        valid_m = valid.reshape(n_g, n_l)
        memory = np.full(n_g * n_l, np.inf)
        if self.prune:
            static = self.static_memory(geo_index)
            candidate = valid_m & (static <= self.hbm)
            fits = np.zeros_like(valid_m)
            dominated = np.zeros_like(valid_m)
            rec = np.asarray(self.grid.recompute)
            for level in range(len(RECOMPUTE_MODES)):
                # a sibling with less recompute that fits dominates (recompute only adds time)
                sib = self.siblings[level]
                has = sib >= 0
                dominated[:, has] |= fits[:, sib[has]]
                at_level = candidate & ~dominated & (rec == level)[None, :]
                idx = np.flatnonzero(at_level.ravel())
                if len(idx):
                    memory[idx] = memory_per_device(archs.take(idx), lays.take(idx), self.cluster)
                fits |= at_level & (memory.reshape(n_g, n_l) <= self.hbm)
            todo = fits & ~dominated
            skipped = valid & ~np.isfinite(memory)
            memory[skipped] = static.ravel()[skipped]  # a lower bound where the full formula was skipped
        else:
            v_idx = np.flatnonzero(valid)
            memory[v_idx] = memory_per_device(archs.take(v_idx), lays.take(v_idx), self.cluster)
            fits = valid_m & (memory.reshape(n_g, n_l) <= self.hbm)
            todo = valid_m.copy()
        mem_m = memory.reshape(n_g, n_l)
        t_idx = np.flatnonzero(todo.ravel())
        tokens = np.zeros(n_g * n_l)
        mfu = np.zeros(n_g * n_l)
        step = np.full(n_g * n_l, np.inf)
        res = None
        if len(t_idx):
            res = perfmodel.evaluate(archs.take(t_idx), lays.take(t_idx), self.cluster, self.devices)
            ok = res.feasible
            tokens[t_idx] = np.where(ok, res.tokens_per_s, 0.0)
            mfu[t_idx] = np.where(ok, res.mfu, 0.0)
            step[t_idx] = np.where(ok, res.step_time_s, np.inf)
            if np.any(ok):
                self.max_mfu_seen = max(self.max_mfu_seen, float(np.max(res.mfu[ok])))
        if progress is not None:
            progress(n_g * n_l)
        tok_m = tokens.reshape(n_g, n_l)
        best = np.argmax(tok_m, axis=1)
        rows = np.arange(n_g)
        has_best = tok_m[rows, best] > 0
        best_layout = np.where(has_best, best, -1)
        flat_best = rows * n_l + best
        min_mem_l = np.argmin(mem_m, axis=1)
        evaluation_row = np.full(n_g, -1, dtype=np.int64)
        evaluations = None
        if res is not None and np.any(has_best):
            position = np.full(n_g * n_l, -1, dtype=np.int64)
            position[t_idx] = np.arange(len(t_idx))
            evaluations = res.take(position[flat_best[has_best]])
            evaluation_row[has_best] = np.arange(int(has_best.sum()))
        return GeometryResults(
            index=geo_index,
            best_layout=best_layout,
            best_gbs=np.where(has_best, np.asarray(lays.gbs)[flat_best], 0),
            tokens_per_s=np.where(has_best, tokens[flat_best], 0.0),
            mfu=np.where(has_best, mfu[flat_best], 0.0),
            step_time_s=np.where(has_best, step[flat_best], np.inf),
            memory_bytes=np.where(has_best, memory[flat_best], np.inf),
            min_memory_bytes=mem_m[rows, min_mem_l],
            min_memory_layout=np.where(np.isfinite(mem_m[rows, min_mem_l]), min_mem_l, -1),
            n_valid=valid_m.sum(axis=1),
            n_memory_ok=fits.sum(axis=1),
            n_timed=todo.sum(axis=1),
            evaluation_row=evaluation_row,
            evaluations=evaluations,
        )

    def layout(self, layout_index: int, gbs: int) -> Any:
        """The resolved ParallelLayout of grid row `layout_index` with its gbs."""
        one = self.grid.take(np.asarray([int(layout_index)]))
        return dataclasses.replace(one, gbs=np.asarray([int(gbs)])).row(0)


__all__ = ["GeometryResults", "PairEvaluator", "memory_per_device", "recompute_siblings"]

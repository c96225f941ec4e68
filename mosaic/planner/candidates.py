"""Best feasible layout of each geometry: (geometry x layout) pairs through `perfmodel.evaluate`.

Layout does not change loss, so a geometry is worth its best feasible layout:
the one with the highest model FLOP/s (= tokens/s x FLOPs per token; for one
geometry that is the highest tokens/s). Pairs are built in vectorised chunks,
filtered by the shared validity rules (`perfmodel.validity.valid_mask`), then
pruned, exactly:

  unpriced dispatch   a grid row whose fused dispatcher the cluster has no figures for at
                      the level its EP group spans is dropped (`evaluate` prices it for no
                      geometry)
  overlap dominance   a grid row with an overlap switch off whose sibling with it on is
                      allowed and never slower is dropped (`overlap_dominated` states when)
  switch sets         validity, memory, recompute dominance and the compute bound read no
                      overlap switch (tested), so they are worked out once per set of rows
                      equal but for the switches (`PairEvaluator.rep_grid`); only timing
                      goes to each row
  memory pruning      memory per device from `perfmodel.memory.stage_memory` (the
                      formula `evaluate` uses, without the timing half): pairs above
                      usable HBM are infeasible and never timed. First its static part
                      (`perfmodel.memory.stage_static_memory`: independent of mbs,
                      recompute, sequence parallel, the switches and the dispatcher) on the
                      distinct sharding keys, a lower bound that skips the full formula
  recompute dominance a pair whose layout differs from a memory-feasible pair of the
                      same geometry only by more activation recompute (none <
                      selective < full) cannot be faster (recompute only adds work),
                      so it is not timed
  compute bound       tokens/s <= `bounds.ComputeBound` (perfmodel's own per-block
                      compute tables, cached per layer shape): the switch set with the
                      highest bound is timed first, then only rows whose bound beats the
                      best found; a geometry whose bound cannot reach the caller's floor is
                      left there (`exact` False)

All prunings leave every geometry's best feasible tokens/s unchanged (tested:
pruned and unpruned searches agree; a timed pair above its bound makes the search
rerun without the bounds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

import perfmodel
from mosaic.planner.bounds import ComputeBound
from perfmodel.grouping import row_groups
from perfmodel.memory import stage_static_memory
from perfmodel.operators import FSDP, dp_flavor_code
from perfmodel.schedule import pipeline_stages
from perfmodel.specs.architecture import ArchBatch
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import (
    DISPATCH_FIELDS,
    LAYOUT_FIELDS,
    OVERLAP_FIELDS,
    RECOMPUTE_MODES,
    LayoutBatch,
    gbs_holding_tokens,
)
from perfmodel.stage import hidden_ep_cost
from perfmodel.tables import fused_dispatch_figures
from perfmodel.validity import layout_rules_ok, valid_mask

REASONS = perfmodel.REASONS
MEMORY_REASON = REASONS.index("memory")

ProgressFn = Callable[[int], None]

STATIC_FREE_FIELDS = ("mbs", "recompute", "sequence_parallel", "gbs") + OVERLAP_FIELDS + DISPATCH_FIELDS
"""Layout fields `perfmodel.memory.STATIC_COMPONENTS` do not depend on (tested)."""


def memory_per_device(archs: ArchBatch, lays: LayoutBatch, cluster: ClusterSpec) -> np.ndarray:
    """Bytes per device of the larger pipeline stage (`perfmodel.memory.memory_per_device`,
    what `evaluate` reports)."""
    return perfmodel.memory.memory_per_device(archs, lays, cluster).total_bytes


OVERLAP_RULES = ("tp_overlap_needs_tp", "ep_overlap_needs_ep", "param_gather_overlap_needs_sharding")
"""The validity rules that read the overlap switches; each reads the layout only (tested), so
whether a switch may be on is a property of the layout row."""


def overlap_allowed(grid: LayoutBatch) -> np.ndarray:
    """Rows whose overlap switches the overlap rules allow (the others are valid for no geometry)."""
    return layout_rules_ok(grid, OVERLAP_RULES)


def overlap_dominated(grid: LayoutBatch, cluster: ClusterSpec) -> np.ndarray:
    """Rows of `grid` dominated by a sibling with one more overlap switch on, every other field
    equal, that the overlap rules allow: that sibling is valid for exactly the geometries the row
    is valid for and needs the same memory (memory does not read the switches). A phase costs
    compute + sum over classes of (comm_c - (1 - k_c) hidden_c), k_c the slowdown per hidden second
    (`Overlap.compute_slowdown` = cs; for EP `perfmodel.stage.hidden_ep_cost` = k_ep, sm / (1 - sm)
    for a fused dispatcher holding sm of the compute units), and a second of window a class takes
    is at most a second the classes after it (`perfmodel.stage.HIDE_ORDER`, then the step's
    gradient / parameter sync on what is left) lose. With cs <= 1 the sibling is never slower for
    the gradient and parameter switches (they take only the window left, and the host's
    max(launches, device time) does not grow when device time falls). tp_comm_overlap (where
    k_ep >= cs: it may displace EP hiding) and ep_comm_overlap (where k_ep <= cs; gb200_nvl72
    hybridep has k_ep > cs, EP overlap on is slower there) shorten the device time by at least
    (1 - cs) x the window they take from the step's DDP / ZeRO-1 sync, but a launch-bound
    micro-batch does not get shorter while that sync loses window (gb200_nvl72 tp 2 pp 2 zero1,
    L16 h2048: tp overlap on is 1.6e-4 slower), so they dominate only rows with no such sync to
    hide (FSDP, or both step-sync switches off)."""
    fields = list(LAYOUT_FIELDS)
    cols = grid.key_columns(fields)
    allowed = overlap_allowed(grid)
    _, group = row_groups(list(np.delete(cols, [fields.index(f) for f in OVERLAP_FIELDS], axis=1).T))
    flags = cols[:, [fields.index(f) for f in OVERLAP_FIELDS]]
    code = flags @ (1 << np.arange(len(OVERLAP_FIELDS)))
    key = group * (1 << len(OVERLAP_FIELDS)) + code
    order = np.argsort(key)
    cs = cluster.overlap.compute_slowdown
    k_ep = np.broadcast_to(hidden_ep_cost(fused_dispatch_figures(cluster, grid)[1], cluster.overlap), (len(cols),))
    no_step_window = ((np.asarray(dp_flavor_code(grid)) == FSDP)
                      | ~(np.asarray(grid.overlap_grad_reduce) | np.asarray(grid.overlap_param_gather)))
    applies = {"tp_comm_overlap": (k_ep >= cs) & no_step_window, "ep_comm_overlap": (k_ep <= cs) & no_step_window}
    dominated = np.zeros(len(cols), dtype=bool)
    for j, name in enumerate(OVERLAP_FIELDS):
        off = flags[:, j] == 0
        sib_key = key + (1 << j)
        pos = np.searchsorted(key[order], sib_key)
        pos = np.minimum(pos, len(order) - 1)
        found = key[order][pos] == sib_key
        sib = order[pos]
        dominated |= off & found & allowed[sib] & applies.get(name, True)
    return dominated


def recompute_siblings(grid: LayoutBatch) -> list[np.ndarray]:
    """For each layout, the indices of the same layout with less recompute (-1 where absent)."""
    key_fields = [f for f in LAYOUT_FIELDS if f not in ("recompute", "gbs")]
    _, group = row_groups(list(grid.key_columns(key_fields).T))
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
    """Pairs the validity rules accept, per geometry; of these:"""
    n_dominated: np.ndarray
    """... left out because a sibling layout with more overlap or less recompute is valid (and fits)"""
    n_memory_ok: np.ndarray
    """... within usable HBM (memory computed), not dominated"""
    n_bounded: np.ndarray
    """... not timed: their compute bound could not beat the geometry's best (or its floor)"""
    n_timed: np.ndarray
    """... timed by `perfmodel.evaluate`"""
    bound_ok: np.ndarray
    """False where a timed pair beat its compute bound (`bounds.ComputeBound`: the search then
    reruns without the bounds)."""
    exact: np.ndarray
    """False where the geometry was left at its floor (`PairEvaluator.run`): its best layout is
    not known, only that its tokens/s do not exceed the floor."""
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
        return GeometryResults(**{name: np.zeros(0, dtype=bool if name in ("exact", "bound_ok") else float) for name in _ARRAY_FIELDS},
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
    """Evaluates chunks of geometries against a fixed layout grid on one cluster and device count.

    With pruning, validity (but the overlap rules), memory, recompute dominance and the compute
    bound are worked out once per switch set: the grid's rows equal but for the overlap switches,
    which none of them reads (tested); only timing goes to each row."""

    def __init__(self, archs: ArchBatch, grid: LayoutBatch, cluster: ClusterSpec, devices: int, gbs_tokens: float,
                 prune: bool = True) -> None:
        self.archs, self.cluster, self.devices = archs, cluster, devices
        self.gbs_tokens, self.prune = gbs_tokens, prune
        self.hbm = cluster.accelerator.usable_hbm_bytes
        self.space_layouts = len(grid)
        """Layouts of the space's grid; `grid` keeps those no overlap sibling dominates (pruned)."""
        if prune:
            # a fused dispatcher over a level the cluster has no figures for is priced for no
            # geometry (`evaluate`'s reason "dispatcher" for MoE models, ep > 1 invalid for dense)
            grid = grid.take(np.flatnonzero(np.broadcast_to(fused_dispatch_figures(cluster, grid)[0], (len(grid),))))
        if prune and cluster.overlap.compute_slowdown <= 1.0:
            grid = grid.take(np.flatnonzero(overlap_allowed(grid) & ~overlap_dominated(grid, cluster)))
        self.grid = grid
        self.rep_grid, self.rep_of = grid, np.arange(len(grid))
        """One row per switch set (switches off: the overlap rules allow that everywhere), and the
        `rep_grid` row of each grid row (with pruning; without, the grid itself)."""
        self.valid_grid: Optional[LayoutBatch] = None
        """`rep_grid` with the dispatch fields at their defaults, one row per set of rows equal but
        for them, where that halves the pairs validity is checked on (else None)."""
        if prune:
            first, self.rep_of = row_groups(list(grid.key_columns([f for f in LAYOUT_FIELDS if f not in OVERLAP_FIELDS]).T))
            self.rep_grid = dataclasses.replace(grid.take(first), **{f: np.zeros(len(first), dtype=bool)
                                                                        for f in OVERLAP_FIELDS})
            # validity reads the dispatch fields only through layout-only rules (validity.LAYOUT_ONLY_RULES)
            dispatch_free = [f for f in LAYOUT_FIELDS if f not in OVERLAP_FIELDS + DISPATCH_FIELDS]
            first, valid_of = row_groups(list(self.rep_grid.key_columns(dispatch_free).T))
            if 2 * len(first) <= len(self.rep_grid):
                plain = {"dispatcher": np.zeros(len(first), dtype=np.int64), "capacity_factor": np.zeros(len(first)),
                         "pad_to_capacity": np.zeros(len(first), dtype=bool)}
                self.valid_grid = dataclasses.replace(self.rep_grid.take(first), **plain)
                self.valid_of = valid_of
                """`valid_grid` row of each `rep_grid` row."""
                self.layout_ok = layout_rules_ok(self.rep_grid)
                """The layout-only rules of each `rep_grid` row (those that read the dispatch fields)."""
        self.width = len(self.valid_grid if self.valid_grid is not None else self.rep_grid)
        """Pairs one geometry builds for validity: what a chunk of geometries is sized by."""
        self.siblings = recompute_siblings(self.rep_grid)
        key_fields = [f for f in LAYOUT_FIELDS if f not in STATIC_FREE_FIELDS]
        first, inverse = row_groups(list(self.rep_grid.key_columns(key_fields).T))
        reps = self.rep_grid
        self.key_grid = dataclasses.replace(reps.take(first), gbs=np.asarray(reps.mbs)[first] * np.asarray(reps.dp)[first])
        self.key_of_layout = inverse
        """Row of `key_grid` of each `rep_grid` row."""
        self.bound = ComputeBound(archs, self.rep_grid, cluster, devices) if prune else None
        self.counts = {"built": 0, "timed": 0}
        """Pairs built and pairs timed by this evaluator's runs (in this process)."""
        self.bound_violated = False
        """Set when a timed pair beat its compute bound (the search then reruns without it)."""
        self.max_mfu_seen = 0.0

    def static_memory(self, geo_index: np.ndarray) -> np.ndarray:
        """Lower bound of memory per device for each (geometry, `rep_grid` row): the parts that do
        not depend on mbs, recompute, sequence parallel, gbs or the switches (weights, gradients,
        optimizer, FSDP buffers, framework), from `perfmodel.memory.stage_static_memory` on the distinct
        layout keys."""
        n_g, n_k = len(geo_index), len(self.key_grid)
        g = np.repeat(geo_index, n_k)
        k = np.tile(np.arange(n_k), n_g)
        archs, lays = self.archs.take(g), self.key_grid.take(k)
        static = np.zeros(n_g * n_k)
        for stage in pipeline_stages(archs, lays):
            parts = stage_static_memory(archs, lays, self.cluster, stage.counts)
            static = np.maximum(static, sum(parts.values()))
        static = static.reshape(n_g, n_k)
        return static[:, self.key_of_layout]

    def pairs(self, geo_index: np.ndarray, grid: Optional[LayoutBatch] = None
              ) -> tuple[ArchBatch, LayoutBatch, np.ndarray, np.ndarray]:
        """(archs, layouts with their gbs, geometry index, layout row) of every (geometry, row of
        `grid`) pair, geometry-major (default grid: `self.grid`)."""
        grid = self.grid if grid is None else grid
        flat = np.arange(len(geo_index) * len(grid))
        archs, lays = self._grid_pairs(geo_index, flat, grid)
        return archs, lays, geo_index[flat // len(grid)], flat % len(grid)

    def rep_valid(self, geo_index: np.ndarray) -> tuple[np.ndarray, Optional[tuple[ArchBatch, LayoutBatch]]]:
        """((geometry, `rep_grid` row) validity, (n_g, n_rep); the rep_grid pairs where they were
        built for it, else None): on `valid_grid` gathered with the layout-only rules where that
        is smaller (tested equal to `valid_mask` on every pair)."""
        n_g = len(geo_index)
        if self.valid_grid is not None:
            archs, lays, _, _ = self.pairs(geo_index, self.valid_grid)
            valid = valid_mask(archs, lays, self.devices).reshape(n_g, -1)[:, self.valid_of]
            return valid & self.layout_ok[None, :], None
        archs, lays, _, _ = self.pairs(geo_index, self.rep_grid)
        return valid_mask(archs, lays, self.devices).reshape(n_g, -1), (archs, lays)

    def _grid_pairs(self, geo_index: np.ndarray, flat: np.ndarray, grid: Optional[LayoutBatch] = None
                    ) -> tuple[ArchBatch, LayoutBatch]:
        """The (geometry, row of `grid`) pairs at flat positions `flat` of the geometry-major pair
        matrix (default grid: `self.grid`)."""
        grid = self.grid if grid is None else grid
        n_l = len(grid)
        archs = self.archs.take(geo_index[flat // n_l])
        lays = grid.take(flat % n_l)
        return archs, dataclasses.replace(lays, gbs=gbs_holding_tokens(lays.mbs, lays.dp, archs.seq_len, self.gbs_tokens))

    def run(self, geo_index: np.ndarray, progress: Optional[ProgressFn] = None,
            floor: Optional[np.ndarray] = None) -> GeometryResults:
        """Best feasible layout of each geometry. `floor`: tokens/s each geometry must exceed to
        matter to the caller (None: all matter); a geometry whose bound stays at or below it is
        returned with `exact` False (its best is at most the floor, not searched further)."""
        geo_index = np.asarray(geo_index, dtype=np.int64)
        n_g, n_l, n_r = len(geo_index), len(self.grid), len(self.rep_grid)
        floor_g = np.zeros(n_g) if floor is None else np.asarray(floor, dtype=float)
        self.counts["built"] += n_g * n_l
        tokens = np.zeros(n_g * n_l)
        mfu = np.zeros(n_g * n_l)
        step = np.full(n_g * n_l, np.inf)
        gbs = np.zeros(n_g * n_l, dtype=np.int64)
        stats = {"dominated": np.zeros(n_g, dtype=np.int64), "bounded": np.zeros(n_g, dtype=np.int64)}
        exact = np.ones(n_g, dtype=bool)
        bound_ok = np.ones(n_g, dtype=bool)
        results: list[tuple[np.ndarray, perfmodel.EvalResult]] = []

        def time_pairs(idx: np.ndarray) -> None:
            if not len(idx):
                return
            archs, lays = self._grid_pairs(geo_index, idx)
            res = perfmodel.evaluate(archs, lays, self.cluster, self.devices)
            self.counts["timed"] += len(idx)
            ok = res.feasible
            tokens[idx] = np.where(ok, res.tokens_per_s, 0.0)
            mfu[idx] = np.where(ok, res.mfu, 0.0)
            step[idx] = np.where(ok, res.step_time_s, np.inf)
            gbs[idx] = np.asarray(lays.gbs)
            if np.any(ok):
                self.max_mfu_seen = max(self.max_mfu_seen, float(np.max(res.mfu[ok])))
            results.append((idx, res))

        if self.prune:
            valid_r, built = self.rep_valid(geo_index)

            def rep_pairs(flat: np.ndarray) -> tuple[ArchBatch, LayoutBatch]:
                if built is None:
                    return self._grid_pairs(geo_index, flat, self.rep_grid)
                return built[0].take(flat), built[1].take(flat)

            memory_r = np.full(n_g * n_r, np.inf)
            dominated_r = np.zeros_like(valid_r)
            static = self.static_memory(geo_index)
            candidate = valid_r & (static <= self.hbm)
            ub = np.zeros(n_g * n_r)
            c_idx = np.flatnonzero(candidate.ravel())
            if len(c_idx) and self.bound is None:
                ub[c_idx] = np.inf
            elif len(c_idx):
                ub[c_idx] = self.bound.tokens_per_s(geo_index[c_idx // n_r], c_idx % n_r, *rep_pairs(c_idx))
            ub_r = ub.reshape(n_g, n_r)
            above = candidate & (ub_r > floor_g[:, None])
            fits_r = np.zeros_like(valid_r)
            rec = np.asarray(self.rep_grid.recompute)
            for level in range(len(RECOMPUTE_MODES)):
                at_level = above & ~dominated_r & (rec == level)[None, :]
                idx = np.flatnonzero(at_level.ravel())
                if len(idx):
                    memory_r[idx] = memory_per_device(*rep_pairs(idx), self.cluster)
                fits_r |= at_level & (memory_r.reshape(n_g, n_r) <= self.hbm)
                # its twin at this recompute level fits: a layout with more recompute is dominated
                # (recompute adds R seconds and widens the overlap windows by at most R)
                sib = self.siblings[level]
                has = sib >= 0
                dominated_r[:, has] |= fits_r[:, sib[has]]
            skipped = valid_r.ravel() & ~np.isfinite(memory_r)
            memory_r[skipped] = static.ravel()[skipped]  # a lower bound where the full formula was skipped
            # to the grid's rows: every switch variant of a row shares its validity, memory and bound
            rep = self.rep_of
            valid_m, fits, dominated = valid_r[:, rep], fits_r[:, rep], dominated_r[:, rep]
            ub_m, mem_m = ub_r[:, rep], memory_r.reshape(n_g, n_r)[:, rep]
            candidate_m, above_m = candidate[:, rep], above[:, rep]
            exact &= ~np.any(candidate_m & ~above_m, axis=1)  # provisional: restored below where the best beats the floor
            stats["bounded"] += (candidate_m & ~above_m).sum(axis=1)
            todo = fits & ~dominated
            stats["dominated"] += (valid_m & dominated).sum(axis=1)
            # time the switch set with the highest bound first, then every row whose bound beats the best found
            masked = np.where(todo, ub_m, -np.inf)
            first = np.argmax(masked, axis=1)
            has = np.isfinite(masked[np.arange(n_g), first])
            timed = np.zeros_like(valid_m)
            timed[np.flatnonzero(has)] = todo[np.flatnonzero(has)] & (rep[None, :] == rep[first[has]][:, None])
            time_pairs(np.flatnonzero(timed.ravel()))
            best = tokens.reshape(n_g, n_l).max(axis=1)
            rest = todo & ~timed & (ub_m > best[:, None])
            time_pairs(np.flatnonzero(rest.ravel()))
            timed |= rest
            stats["bounded"] += (todo & ~timed).sum(axis=1)
            beat = (tokens > ub_m.ravel() * (1.0 + 1e-9)).reshape(n_g, n_l) & timed
            bound_ok = ~np.any(beat, axis=1)
            self.bound_violated |= not bool(np.all(bound_ok))
            best = tokens.reshape(n_g, n_l).max(axis=1)
            exact |= best > floor_g
        else:
            archs, lays, _, _ = self.pairs(geo_index)
            valid = valid_mask(archs, lays, self.devices)
            valid_m = valid.reshape(n_g, n_l)
            memory = np.full(n_g * n_l, np.inf)
            v_idx = np.flatnonzero(valid)
            memory[v_idx] = memory_per_device(archs.take(v_idx), lays.take(v_idx), self.cluster)
            mem_m = memory.reshape(n_g, n_l)
            fits = valid_m & (mem_m <= self.hbm)
            time_pairs(v_idx)
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
        if results and np.any(has_best):
            position = np.full(n_g * n_l, -1, dtype=np.int64)
            offset = 0
            for idx, _ in results:
                position[idx] = np.arange(len(idx)) + offset
                offset += len(idx)
            store = results[0][1] if len(results) == 1 else perfmodel.EvalResult.concat([r for _, r in results])
            evaluations = store.take(position[flat_best[has_best]])
            evaluation_row[has_best] = np.arange(int(has_best.sum()))
        return GeometryResults(
            index=geo_index,
            best_layout=best_layout,
            best_gbs=np.where(has_best, gbs[flat_best], 0),
            tokens_per_s=np.where(has_best, tokens[flat_best], 0.0),
            mfu=np.where(has_best, mfu[flat_best], 0.0),
            step_time_s=np.where(has_best, step[flat_best], np.inf),
            memory_bytes=np.where(has_best, mem_m[rows, best], np.inf),
            min_memory_bytes=mem_m[rows, min_mem_l],
            min_memory_layout=np.where(np.isfinite(mem_m[rows, min_mem_l]), min_mem_l, -1),
            n_valid=valid_m.sum(axis=1),
            n_dominated=stats["dominated"],
            n_memory_ok=fits.sum(axis=1),
            n_bounded=stats["bounded"],
            n_timed=_count_timed(results, n_g, n_l),
            bound_ok=bound_ok,
            exact=exact,
            evaluation_row=evaluation_row,
            evaluations=evaluations,
        )

    def layout(self, layout_index: int, gbs: int) -> Any:
        """The resolved ParallelLayout of grid row `layout_index` with its gbs."""
        one = self.grid.take(np.asarray([int(layout_index)]))
        return dataclasses.replace(one, gbs=np.asarray([int(gbs)])).row(0)


def _count_timed(results: list[tuple[np.ndarray, Any]], n_g: int, n_l: int) -> np.ndarray:
    """Pairs `evaluate` timed, per geometry position."""
    out = np.zeros(n_g, dtype=np.int64)
    for idx, _ in results:
        out += np.bincount(idx // n_l, minlength=n_g)
    return out


__all__ = ["GeometryResults", "PairEvaluator", "memory_per_device", "overlap_allowed", "overlap_dominated", "recompute_siblings"]

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
  layout-table bound  tokens/s <= `bounds.ComputeBound.table_tokens_per_s` of the pair's block-table
                      row (every layout with the same tp, cp, ep, etp, mbs, sequence parallel and
                      precision) x its pipeline share (`ComputeBound.pipeline_share`: m of the
                      m + (pp-1)/vpp slots): a pair it holds at the caller's floor is never
                      built, before validity and memory (counted as bounded)
  memory pruning      memory per device from `perfmodel.memory.stage_memory` (the
                      formula `evaluate` uses, without the timing half): pairs above
                      usable HBM are infeasible and never timed. First its static part
                      (`perfmodel.memory.stage_static_memory`: independent of mbs,
                      recompute, sequence parallel, the switches and the dispatcher) on the
                      distinct sharding keys, a lower bound that skips the full formula;
                      validity is checked where it fits (and, for a geometry with no valid pair
                      that fits and no floor, on its other pairs by increasing static memory,
                      until its smallest valid memory is known; with a floor it is left there)
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
    pruning a lower bound (the static part) where the full formula was skipped, over the layouts
    the layout-table bound left (all of them where no floor was given)."""
    min_memory_layout: np.ndarray
    n_valid: np.ndarray
    """Pairs the validity rules accept, per geometry, of those checked (with pruning: where the
    static memory fits, or the geometry has none that fits); of these:"""
    n_dominated: np.ndarray
    """... left out because a sibling layout with more overlap or less recompute is valid (and fits)"""
    n_memory_ok: np.ndarray
    """... within usable HBM (memory computed), not dominated"""
    n_bounded: np.ndarray
    """Pairs not timed because their compute bound could not beat the geometry's best (or its
    floor); those the layout-table bound held are counted unchecked, valid or not"""
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
        ints = ("index", "best_layout", "best_gbs", "min_memory_layout", "n_valid", "n_dominated", "n_memory_ok",
                "n_bounded", "n_timed")
        return GeometryResults(**{name: np.zeros(0, dtype=bool if name in ("exact", "bound_ok") else
                                             np.int64 if name in ints else float) for name in _ARRAY_FIELDS},
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
                self._valid_groups = ColumnGroups.of(valid_of, len(self.valid_grid))
                self.layout_ok = layout_rules_ok(self.rep_grid)
                """The layout-only rules of each `rep_grid` row (those that read the dispatch fields)."""
        self.width = len(self.valid_grid if self.valid_grid is not None else self.rep_grid)
        """Pairs one geometry builds for validity: what a chunk of geometries is sized by."""
        self.rep_mult = np.bincount(self.rep_of, minlength=len(self.rep_grid)).astype(np.int64)
        """Grid rows of each `rep_grid` row (its switch variants)."""
        self._rep_rows = np.argsort(self.rep_of, kind="stable")
        self._rep_start = np.cumsum(self.rep_mult) - self.rep_mult
        self.rep_first_row = self._rep_rows[self._rep_start] if len(grid) else np.zeros(0, dtype=np.int64)
        """The lowest grid row of each `rep_grid` row."""
        self.siblings = recompute_siblings(self.rep_grid)
        key_fields = [f for f in LAYOUT_FIELDS if f not in STATIC_FREE_FIELDS]
        first, inverse = row_groups(list(self.rep_grid.key_columns(key_fields).T))
        reps = self.rep_grid
        self.key_grid = dataclasses.replace(reps.take(first), gbs=np.asarray(reps.mbs)[first] * np.asarray(reps.dp)[first])
        self.key_of_layout = inverse
        """Row of `key_grid` of each `rep_grid` row."""
        self._key_groups = ColumnGroups.of(inverse, len(first))
        self.bound = ComputeBound(archs, self.rep_grid, cluster, devices) if prune else None
        self._share: dict[int, np.ndarray] = {}
        self.counts = {"built": 0, "held": 0, "timed": 0}
        """Pairs of the geometries searched, of these held by the layout-table bound (never built),
        and pairs timed, by this evaluator's runs (in this process)."""
        self.bound_violated = False
        """Set when a timed pair beat its compute bound (the search then reruns without it)."""

    def static_memory(self, geo_index: np.ndarray, wanted: Optional[np.ndarray] = None) -> np.ndarray:
        """Lower bound of memory per device for each (geometry, `rep_grid` row): the parts that do
        not depend on mbs, recompute, sequence parallel, gbs or the switches (weights, gradients,
        optimizer, FSDP buffers, framework), from `perfmodel.memory.stage_static_memory` on the distinct
        layout keys. `wanted` (n_g, n_rep): the pairs asked about (None: all; the others are inf)."""
        n_g, n_k = len(geo_index), len(self.key_grid)
        if wanted is None:
            flat = np.arange(n_g * n_k)
        else:
            flat = np.flatnonzero(self._key_groups.any_of(wanted))
        static = np.full(n_g * n_k, np.inf)
        static[flat] = self._key_static(geo_index[flat // n_k], flat % n_k)
        return static.reshape(n_g, n_k)[:, self.key_of_layout]

    def likely_fits(self, geo_index: np.ndarray, keys: int = 4) -> np.ndarray:
        """Whether each geometry's static memory fits at one of the `keys` layout keys of least
        static memory for the first geometry (the most sharded): a cheap guess at feasibility that
        orders work (the search's first threshold), never a pruning."""
        geo_index = np.asarray(geo_index, dtype=np.int64)
        n_k = len(self.key_grid)
        if not len(geo_index) or not n_k:
            return np.zeros(len(geo_index), dtype=bool)
        first = self._key_static(np.zeros(n_k, dtype=np.int64) + geo_index[0], np.arange(n_k))
        pick = np.argsort(first, kind="stable")[:keys]
        g = np.repeat(geo_index, len(pick))
        static = self._key_static(g, np.tile(pick, len(geo_index))).reshape(len(geo_index), -1)
        return static.min(axis=1) <= self.hbm

    def _key_static(self, geometry: np.ndarray, key: np.ndarray) -> np.ndarray:
        """Static memory per device of (geometry, `key_grid` row) pairs (the larger stage)."""
        archs, lays = self.archs.take(geometry), self.key_grid.take(key)
        part = np.zeros(len(geometry))
        for stage in pipeline_stages(archs, lays):
            part = np.maximum(part, sum(stage_static_memory(archs, lays, self.cluster, stage.counts).values()))
        return part

    def pairs(self, geo_index: np.ndarray, grid: Optional[LayoutBatch] = None
              ) -> tuple[ArchBatch, LayoutBatch, np.ndarray, np.ndarray]:
        """(archs, layouts with their gbs, geometry index, layout row) of every (geometry, row of
        `grid`) pair, geometry-major (default grid: `self.grid`)."""
        grid = self.grid if grid is None else grid
        flat = np.arange(len(geo_index) * len(grid))
        archs, lays = self._grid_pairs(geo_index, flat, grid)
        return archs, lays, geo_index[flat // len(grid)], flat % len(grid)

    def rep_valid(self, geo_index: np.ndarray, wanted: Optional[np.ndarray] = None
                  ) -> tuple[np.ndarray, Optional[tuple[ArchBatch, LayoutBatch]]]:
        """((geometry, `rep_grid` row) validity, (n_g, n_rep); the rep_grid pairs where they were
        built for it, else None): on `valid_grid` gathered with the layout-only rules where that
        is smaller (tested equal to `valid_mask` on every pair). `wanted` (n_g, n_rep): the pairs
        asked about (None: all); the others are False."""
        n_g = len(geo_index)
        if wanted is not None and bool(np.all(wanted)):
            wanted = None
        if self.valid_grid is not None:
            n_v = len(self.valid_grid)
            flat = None if wanted is None else np.flatnonzero(self._valid_groups.any_of(wanted))
            valid_v = np.zeros(n_g * n_v, dtype=bool)
            if flat is None:
                archs, lays, _, _ = self.pairs(geo_index, self.valid_grid)
                valid_v = valid_mask(archs, lays, self.devices)
            elif len(flat):
                valid_v[flat] = valid_mask(*self._grid_pairs(geo_index, flat, self.valid_grid), self.devices)
            valid = valid_v.reshape(n_g, n_v)[:, self.valid_of] & self.layout_ok[None, :]
            return (valid if wanted is None else valid & wanted), None
        if wanted is None:
            archs, lays, _, _ = self.pairs(geo_index, self.rep_grid)
            return valid_mask(archs, lays, self.devices).reshape(n_g, -1), (archs, lays)
        valid = np.zeros(wanted.size, dtype=bool)
        flat = np.flatnonzero(wanted.ravel())
        if len(flat):
            valid[flat] = valid_mask(*self._grid_pairs(geo_index, flat, self.rep_grid), self.devices)
        return valid.reshape(n_g, -1), None

    def smallest_valid(self, geo_index: np.ndarray, memory: np.ndarray, first: int = 128) -> np.ndarray:
        """Valid pairs among those of finite `memory` (n_g, n_rep), checked by increasing memory:
        the `first` smallest of each geometry, then, where none of those is valid, the rest. Every
        pair at the smallest memory a valid pair has is checked; pairs not checked are False."""
        n_g, n_r = memory.shape
        valid = np.zeros((n_g, n_r), dtype=bool)
        if not n_r:
            return valid
        k = min(first, n_r)
        head = np.argpartition(memory, k - 1, axis=1)[:, :k] if k < n_r else np.tile(np.arange(n_r), (n_g, 1))
        cutoff = np.take_along_axis(memory, head, axis=1).max(axis=1)
        ask = np.isfinite(memory) & (memory <= cutoff[:, None])  # ties at the cutoff go with it
        valid |= self.rep_valid(geo_index, ask)[0]
        found = np.where(valid, memory, np.inf).min(axis=1)
        # the smallest valid memory is known where one was found below the cutoff's untried rest
        more = np.isfinite(memory) & ~ask & ~(found[:, None] <= memory)
        if np.any(more):
            valid |= self.rep_valid(geo_index, more)[0]
        return valid

    def grid_pairs_of(self, g: np.ndarray, r: np.ndarray, n_l: int) -> np.ndarray:
        """Flat positions (geometry-major, `n_l` grid rows per geometry) of every grid row of
        `rep_grid` row r[k] for geometry position g[k]."""
        m = self.rep_mult[r]
        pair = np.repeat(np.arange(len(r)), m)
        within = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        return np.asarray(g, dtype=np.int64)[pair] * n_l + self._rep_rows[self._rep_start[r][pair] + within]

    def _grid_pairs(self, geo_index: np.ndarray, flat: np.ndarray, grid: Optional[LayoutBatch] = None
                    ) -> tuple[ArchBatch, LayoutBatch]:
        """The (geometry, row of `grid`) pairs at flat positions `flat` of the geometry-major pair
        matrix (default grid: `self.grid`)."""
        grid = self.grid if grid is None else grid
        n_l = len(grid)
        archs = self.archs.take(geo_index[flat // n_l])
        lays = grid.take(flat % n_l)
        return archs, dataclasses.replace(lays, gbs=gbs_holding_tokens(lays.mbs, lays.dp, archs.seq_len, self.gbs_tokens))

    def _pipeline_share(self, geo_index: np.ndarray) -> np.ndarray:
        """`ComputeBound.pipeline_share` of each (geometry, `rep_grid` row), (n_g, n_rep): it reads
        the layout and, through gbs, the geometry's sequence length (cached per length)."""
        seq = np.asarray(self.archs.seq_len)[geo_index]
        out = np.empty((len(geo_index), len(self.rep_grid)))
        for value in np.unique(seq):
            if int(value) not in self._share:
                lays = dataclasses.replace(self.rep_grid, gbs=gbs_holding_tokens(
                    self.rep_grid.mbs, self.rep_grid.dp, np.full(len(self.rep_grid), value), self.gbs_tokens))
                self._share[int(value)] = ComputeBound.pipeline_share(lays)
            out[seq == value] = self._share[int(value)]
        return out

    def _screen(self, geo_index: np.ndarray, floor_g: np.ndarray) -> tuple[
            np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, Optional[tuple[ArchBatch, LayoutBatch]],
            np.ndarray]:
        """The (geometry, `rep_grid` row) pairs worth building, (n_g, n_rep) each: the layout-table
        bound, the pairs it leaves above the floor (alive), their static memory and whether it
        fits, and validity where it fits (and, for a geometry with no valid pair that fits and no
        floor, on its other alive pairs by increasing static memory until its smallest valid one,
        what an infeasible plan reports, is known); with the rep_grid pairs where `rep_valid` built
        them, and the geometries (n_g) with no valid pair that fits whose smallest was not sought:
        with a floor the caller has a threshold, and such a geometry is left at it (not cached, so
        a later search without a floor, e.g. the compute-optimal choice's, sizes it)."""
        n_g, n_r = len(geo_index), len(self.rep_grid)
        table_ub = (self.bound.table_tokens_per_s(geo_index)[:, self.bound.table_of_layout] * self._pipeline_share(geo_index)
                    if self.bound is not None else np.full((n_g, n_r), np.inf))
        alive = table_ub > floor_g[:, None]
        static = self.static_memory(geo_index, alive)
        static_fits = alive & (static <= self.hbm)
        valid, built = self.rep_valid(geo_index, static_fits)
        none = ~np.any(valid, axis=1)
        unsized = none & (floor_g > 0)
        size = none & ~unsized
        if np.any(size):
            valid |= self.smallest_valid(geo_index, np.where(alive & ~static_fits & size[:, None], static, np.inf))
            built = None
        return table_ub, alive, static, static_fits, valid, built, unsized

    def run(self, geo_index: np.ndarray, progress: Optional[ProgressFn] = None,
            floor: Optional[np.ndarray] = None) -> GeometryResults:
        """Best feasible layout of each geometry. `floor`: tokens/s each geometry must exceed to
        matter to the caller (None: all matter); a geometry whose bound stays at or below it is
        returned with `exact` False (its best is at most the floor, not searched further)."""
        geo_index = np.asarray(geo_index, dtype=np.int64)
        n_g, n_l, n_r = len(geo_index), len(self.grid), len(self.rep_grid)
        floor_g = np.zeros(n_g) if floor is None else np.asarray(floor, dtype=float)
        n_pairs = n_g * n_l
        self.counts["built"] += n_pairs
        back: Optional[np.ndarray] = None
        """With geometries left at their floor by the screen (`dropped`; the search below runs on the
        others): the position in [searched, dropped] of each geometry of the chunk."""
        dropped = GeometryResults.empty()
        stats = {"dominated": np.zeros(n_g, dtype=np.int64), "bounded": np.zeros(n_g, dtype=np.int64)}
        exact = np.ones(n_g, dtype=bool)
        bound_ok = np.ones(n_g, dtype=bool)
        results: list[tuple[np.ndarray, perfmodel.EvalResult]] = []
        """(flat pair positions, their evaluation) of every timed batch: only timed pairs are held,
        never an array over the n_g x n_l pairs (most are never built)."""
        timed_tokens: list[np.ndarray] = []
        """tokens/s of each timed batch's pairs, 0 where infeasible."""
        timed_gbs: list[np.ndarray] = []

        def time_pairs(idx: np.ndarray) -> None:
            if not len(idx):
                return
            archs, lays = self._grid_pairs(geo_index, idx)
            res = perfmodel.evaluate(archs, lays, self.cluster, self.devices)
            self.counts["timed"] += len(idx)
            timed_tokens.append(np.where(res.feasible, res.tokens_per_s, 0.0))
            timed_gbs.append(np.asarray(lays.gbs, dtype=np.int64))
            results.append((idx, res))

        if self.prune:
            table_ub, alive, static, static_fits, valid_r, built, unsized = self._screen(geo_index, floor_g)
            if np.any(unsized):
                # no valid layout fits and a floor is given: at most the floor, nothing left to search
                # there (`_left_at_floor`); the rest of the search runs on the other geometries only
                kept = np.flatnonzero(~unsized)
                back = np.argsort(np.concatenate([kept, np.flatnonzero(unsized)]), kind="stable")
                dropped = _left_at_floor(geo_index[unsized], _weighted_count(~alive[unsized], self.rep_mult))
                self.counts["held"] += int(dropped.n_bounded.sum())
                if not len(kept):
                    return dropped
                if built is not None:
                    flat = (kept[:, None] * n_r + np.arange(n_r)[None, :]).ravel()
                    built = (built[0].take(flat), built[1].take(flat))
                table_ub, alive, static, static_fits, valid_r = (m[kept] for m in (table_ub, alive, static, static_fits,
                                                                                    valid_r))
                geo_index, floor_g, n_g = geo_index[kept], floor_g[kept], len(kept)
                exact, bound_ok = exact[kept], bound_ok[kept]
                stats = {key: value[kept] for key, value in stats.items()}

            def rep_pairs(flat: np.ndarray) -> tuple[ArchBatch, LayoutBatch]:
                if built is None:
                    return self._grid_pairs(geo_index, flat, self.rep_grid)
                return built[0].take(flat), built[1].take(flat)

            memory_r = np.full(n_g * n_r, np.inf)
            dominated_r = np.zeros_like(valid_r)
            candidate = valid_r & static_fits
            ub = np.zeros(n_g * n_r)
            c_idx = np.flatnonzero(candidate.ravel())
            if len(c_idx) and self.bound is None:
                ub[c_idx] = np.inf
            elif len(c_idx):
                ub[c_idx] = np.minimum(self.bound.tokens_per_s(geo_index[c_idx // n_r], c_idx % n_r, *rep_pairs(c_idx)),
                                       table_ub.ravel()[c_idx])
            ub_r = ub.reshape(n_g, n_r)
            above = candidate & (ub_r > floor_g[:, None])
            exact &= np.all(alive, axis=1)  # provisional, as for the bounded pairs below
            held = _weighted_count(~alive, self.rep_mult)
            stats["bounded"] += held
            self.counts["held"] += int(held.sum())
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
            # to the grid's rows only where timed: every switch variant of a row shares its
            # validity, memory and bound, so the counts weigh each rep_grid row by its variants
            mult = self.rep_mult
            memory_rm = memory_r.reshape(n_g, n_r)
            bounded_r = candidate & ~above
            exact &= ~np.any(bounded_r, axis=1)  # provisional: restored below where the best beats the floor
            todo_r = fits_r & ~dominated_r
            stats["bounded"] += _weighted_count(bounded_r, mult)
            stats["dominated"] += _weighted_count(valid_r & dominated_r, mult)
            # time the switch set with the highest bound first, then every set whose bound beats the best found
            masked = np.where(todo_r, ub_r, -np.inf)
            top_ub = masked.max(axis=1) if n_r else np.full(n_g, -np.inf)
            has = np.isfinite(top_ub)
            ties = np.where(masked == top_ub[:, None], self.rep_first_row[None, :], n_l)
            first = np.argmin(ties, axis=1)  # the lowest grid row among the highest bounds
            g_first = np.flatnonzero(has)
            time_pairs(self.grid_pairs_of(g_first, first[g_first], n_l))
            best = _best_timed(results, timed_tokens, n_g, n_l)[0]
            rest = todo_r & (ub_r > best[:, None])
            rest[g_first, first[g_first]] = False
            g_rest, r_rest = np.nonzero(rest)
            time_pairs(self.grid_pairs_of(g_rest, r_rest, n_l))
            timed_r = rest
            timed_r[g_first, first[g_first]] = True
            stats["bounded"] += _weighted_count(todo_r & ~timed_r, mult)
            bound_ok = np.ones(n_g, dtype=bool)
            for (idx, _), tok in zip(results, timed_tokens):
                g_of, r_of = idx // n_l, self.rep_of[idx % n_l]
                beat = tok > ub_r[g_of, r_of] * (1.0 + 1e-9)
                bound_ok[g_of[beat]] = False
            self.bound_violated |= not bool(np.all(bound_ok))
            best = _best_timed(results, timed_tokens, n_g, n_l)[0]
            exact |= best > floor_g
            n_valid, n_memory_ok = _weighted_count(valid_r, mult), _weighted_count(fits_r, mult)
            min_mem = memory_rm.min(axis=1) if n_r else np.full(n_g, np.inf)
            ties = np.where(memory_rm == min_mem[:, None], self.rep_first_row[None, :], n_l)
            min_mem_l = ties.min(axis=1) if n_r else np.zeros(n_g, dtype=np.int64)  # the lowest grid row at the minimum

            def memory_at(g_rows: np.ndarray, layouts: np.ndarray) -> np.ndarray:
                return memory_rm[g_rows, self.rep_of[layouts]]
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
            n_valid, n_memory_ok = valid_m.sum(axis=1), fits.sum(axis=1)
            min_mem_l = np.argmin(mem_m, axis=1)
            min_mem = mem_m[np.arange(n_g), min_mem_l]

            def memory_at(g_rows: np.ndarray, layouts: np.ndarray) -> np.ndarray:
                return mem_m[g_rows, layouts]
        if progress is not None:
            progress(n_pairs)
        best_tokens, at = _best_timed(results, timed_tokens, n_g, n_l)
        rows = np.arange(n_g)
        has_best = best_tokens > 0
        best = np.zeros(n_g, dtype=np.int64)  # the grid row of each geometry's best pair
        if np.any(has_best):
            best[has_best] = np.concatenate([idx for idx, _ in results])[at[has_best]] % n_l
        best_layout = np.where(has_best, best, -1)
        evaluation_row = np.full(n_g, -1, dtype=np.int64)
        evaluations = None
        best_gbs, mfu, step = np.zeros(n_g, dtype=np.int64), np.zeros(n_g), np.full(n_g, np.inf)
        if results and np.any(has_best):
            store = results[0][1] if len(results) == 1 else perfmodel.EvalResult.concat([r for _, r in results])
            evaluations = store.take(at[has_best])
            evaluation_row[has_best] = np.arange(int(has_best.sum()))
            best_gbs[has_best] = np.concatenate(timed_gbs)[at[has_best]]
            mfu[has_best] = evaluations.mfu
            step[has_best] = evaluations.step_time_s
        out = GeometryResults(
            index=geo_index,
            best_layout=best_layout,
            best_gbs=best_gbs,
            tokens_per_s=np.where(has_best, best_tokens, 0.0),
            mfu=mfu,
            step_time_s=step,
            memory_bytes=np.where(has_best, memory_at(rows, best), np.inf),
            min_memory_bytes=min_mem,
            min_memory_layout=np.where(np.isfinite(min_mem), min_mem_l, -1),
            n_valid=n_valid,
            n_dominated=stats["dominated"],
            n_memory_ok=n_memory_ok,
            n_bounded=stats["bounded"],
            n_timed=_count_timed(results, n_g, n_l),
            bound_ok=bound_ok,
            exact=exact,
            evaluation_row=evaluation_row,
            evaluations=evaluations,
        )
        return out if back is None else GeometryResults.concat([out, dropped]).take(back)

    def layout(self, layout_index: int, gbs: int) -> Any:
        """The resolved ParallelLayout of grid row `layout_index` with its gbs."""
        one = self.grid.take(np.asarray([int(layout_index)]))
        return dataclasses.replace(one, gbs=np.asarray([int(gbs)])).row(0)


def _left_at_floor(geo_index: np.ndarray, held: np.ndarray) -> GeometryResults:
    """`PairEvaluator.run`'s result for geometries with no valid layout that fits and a floor: none
    feasible, nothing valid or timed, `held` pairs held by the layout-table bound, not exact."""
    n = len(geo_index)
    return GeometryResults(index=np.asarray(geo_index, dtype=np.int64), best_layout=np.full(n, -1, dtype=np.int64),
                           best_gbs=np.zeros(n, dtype=np.int64), tokens_per_s=np.zeros(n), mfu=np.zeros(n),
                           step_time_s=np.full(n, np.inf), memory_bytes=np.full(n, np.inf), min_memory_bytes=np.full(n, np.inf),
                           min_memory_layout=np.full(n, -1, dtype=np.int64), n_valid=np.zeros(n, dtype=np.int64),
                           n_dominated=np.zeros(n, dtype=np.int64), n_memory_ok=np.zeros(n, dtype=np.int64),
                           n_bounded=np.asarray(held, dtype=np.int64), n_timed=np.zeros(n, dtype=np.int64),
                           bound_ok=np.ones(n, dtype=bool), exact=np.zeros(n, dtype=bool),
                           evaluation_row=np.full(n, -1, dtype=np.int64))


def _weighted_count(mask: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """sum over columns j of mask[:, j] x weight[j], per row (elementwise: a BLAS product would
    start threads that contend with the search's worker processes)."""
    return np.where(mask, weight[None, :], 0).sum(axis=1)


@dataclass(frozen=True)
class ColumnGroups:
    """Columns grouped by a label (group[j] of column j, n_groups labels), sorted once so that
    `any_of` is one reduceat."""

    order: np.ndarray
    starts: np.ndarray
    labels: np.ndarray
    n_groups: int

    @staticmethod
    def of(group: np.ndarray, n_groups: int) -> ColumnGroups:
        order = np.argsort(group, kind="stable")
        keys = np.asarray(group)[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, dtype=np.int64)
        return ColumnGroups(order, starts, keys[starts], int(n_groups))

    def any_of(self, mask: np.ndarray) -> np.ndarray:
        """(n_rows, n_groups): whether any column of each group is set in `mask` (n_rows, n_columns)."""
        out = np.zeros((mask.shape[0], self.n_groups), dtype=bool)
        if len(self.order):
            out[:, self.labels] = np.logical_or.reduceat(mask[:, self.order], self.starts, axis=1)
        return out


def _best_timed(results: list[tuple[np.ndarray, Any]], timed_tokens: list[np.ndarray], n_g: int, n_l: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(the best tokens/s timed per geometry position, 0 where none is feasible; the position of its
    pair among the timed ones in order, the lowest grid row among equal bests, -1 where none):
    the row argmax over the n_g x n_l pairs, from the timed pairs alone."""
    best = np.zeros(n_g)
    at = np.full(n_g, -1, dtype=np.int64)
    if not results:
        return best, at
    flat = np.concatenate([idx for idx, _ in results])
    tok = np.concatenate(timed_tokens)
    g = flat // n_l
    np.maximum.at(best, g, tok)
    top = np.flatnonzero((tok == best[g]) & (tok > 0))
    order = top[np.lexsort((flat[top], g[top]))]
    first = order[np.r_[True, g[order][1:] != g[order][:-1]]] if len(order) else order
    at[g[first]] = first
    return best, at


def _count_timed(results: list[tuple[np.ndarray, Any]], n_g: int, n_l: int) -> np.ndarray:
    """Pairs `evaluate` timed, per geometry position."""
    out = np.zeros(n_g, dtype=np.int64)
    for idx, _ in results:
        out += np.bincount(idx // n_l, minlength=n_g)
    return out


__all__ = ["GeometryResults", "PairEvaluator", "memory_per_device", "overlap_allowed", "overlap_dominated", "recompute_siblings"]

"""Exact enumeration: the reference answer every other solver is checked against.

Cluster-optimal (fixed wall time, deliverable compute):
  for each geometry g: best feasible layout l*(g) (candidates.PairEvaluator)
  D_g = tokens/s(g, l*) x eta_good x wall time     (= C_deliverable / FLOPs per token)
  loss_g = law(N_tot, S, D_g, G);  answer = argmin_g loss_g
Compute-optimal (fixed C_model, systems ignored):
  D_g = C_model / FLOPs per token(g);  answer = argmin_g law(N_tot, S, D_g, G)

Branch and bound over geometries (exact): MFU can never exceed the best
compute efficiency of the precision, except for the causal half of attention
that the model-FLOPs convention counts but kernels skip, so
  MFU_g <= cap_g = min(1, eff_max x F_g / (F_g - F_attn,g))
gives D_g <= D_ub,g and loss_g >= LB_g = law(..., D_ub,g). Geometries are taken
in increasing LB; once LB reaches the k-th best loss found (k = alternatives
kept), no later geometry can enter the top k, and the rest are skipped. Every
timed candidate is checked against its cap; a violation disables the bound and
the search reruns unpruned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mosaic.planner import law as lawmod
from mosaic.planner.budget import Budget, compute_optimal_flops, goodput
from mosaic.planner.candidates import GeometryResults, PairEvaluator
from mosaic.planner.space import GeometrySet, ResolvedSpace, SearchSpace, geometries, layout_grid, resolve_space
from perfmodel.errors import InputError
from perfmodel.specs.architecture import attention_flops_per_token, model_flops_per_token
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import PRECISIONS

CHUNK_PAIRS = 65536
"""(geometry x layout) pairs per vectorised chunk."""


@dataclass
class Problem:
    """Everything a search needs: cluster, budget, resolved space, candidates, law."""

    cluster: ClusterSpec
    budget: Budget
    space: SearchSpace
    law: Any
    resolved: ResolvedSpace = field(init=False)
    geoms: GeometrySet = field(init=False)
    evaluator: PairEvaluator = field(init=False)
    eta: float = field(init=False)
    c_model: float = field(init=False)
    flops_per_token: np.ndarray = field(init=False)
    prune: bool = True
    geometry_filter: Optional[Callable[[GeometrySet], np.ndarray]] = None
    cluster_file: Optional[str] = None
    """Absolute path of the cluster YAML when it is not a bundled one (recorded in the plan)."""
    _cache: dict[int, GeometryResults] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        co = self.space.compute_optimal
        self.eta = goodput(self.cluster, self.budget.devices)
        self.c_model = compute_optimal_flops(self.cluster, self.budget, co.nominal_mfu, co.precision)
        self.resolved = resolve_space(self.space, self.cluster.node_devices, self.c_model)
        geoms = geometries(self.resolved)
        if self.geometry_filter is not None:
            geoms = geoms.take(np.flatnonzero(self.geometry_filter(geoms)))
        self.geoms = geoms
        grid = layout_grid(self.resolved, self.budget.devices)
        self.evaluator = PairEvaluator(geoms.archs, grid, self.cluster, self.budget.devices,
                                       self.space.layout.gbs_tokens, prune=self.prune)
        self.flops_per_token = np.asarray(model_flops_per_token(geoms.archs), dtype=float)

    # -- figures shared by every solver -------------------------------------------------
    def tokens_in_budget(self, tokens_per_s: Any) -> np.ndarray:
        """D = tokens/s x eta_good x wall time (= C_deliverable / FLOPs per token)."""
        return np.asarray(tokens_per_s, dtype=float) * self.eta * self.budget.wall_time_s

    def mfu_cap(self) -> np.ndarray:
        acc = self.cluster.accelerator
        eff = max(acc.max_gemm_efficiency(self.space.layout.precision), 1e-12)
        fpt = self.flops_per_token
        attn = np.asarray(attention_flops_per_token(self.geoms.archs), dtype=float)
        return np.minimum(1.0, eff * fpt / np.maximum(fpt - attn, 1e-30))

    def max_peak(self) -> float:
        acc = self.cluster.accelerator
        peaks = []
        for p in self.space.layout.precision:
            try:
                peaks.append(acc.peak(p))
            except InputError:  # a precision the part lacks is infeasible for evaluate too
                continue
        return max(peaks) if peaks else 0.0

    def loss_lower_bound(self) -> np.ndarray:
        d_ub = self.budget.devices * self.max_peak() * self.mfu_cap() * self.eta * self.budget.wall_time_s / self.flops_per_token
        return lawmod.loss(self.law, self.geoms.archs, d_ub)

    def compute_optimal_tokens(self) -> np.ndarray:
        return self.c_model / self.flops_per_token

    # -- evaluation with a cache (sweeps reuse it) ---------------------------------------
    def evaluate(self, index: np.ndarray, progress: Optional[Callable[[int], None]] = None,
                 pool: Optional[ProcessPoolExecutor] = None) -> GeometryResults:
        index = np.asarray(index, dtype=np.int64)
        missing = np.asarray([i for i in index if int(i) not in self._cache], dtype=np.int64)
        if len(missing):
            per_chunk = max(1, CHUNK_PAIRS // max(len(self.evaluator.grid), 1))
            chunks = [missing[i:i + per_chunk] for i in range(0, len(missing), per_chunk)]
            if pool is not None and len(chunks) > 1:
                parts = list(pool.map(_run_chunk, chunks))
                if progress is not None:
                    progress(len(missing) * len(self.evaluator.grid))
            else:
                parts = [self.evaluator.run(c, progress) for c in chunks]
            for part in parts:
                for j, g in enumerate(part.index):
                    self._cache[int(g)] = _take(part, j)
        return GeometryResults.concat([self._cache[int(i)] for i in index]) if len(index) else _empty()


_WORKER: dict[str, PairEvaluator] = {}


def _init_worker(evaluator: PairEvaluator) -> None:
    _WORKER["evaluator"] = evaluator


def _run_chunk(chunk: np.ndarray) -> GeometryResults:
    return _WORKER["evaluator"].run(chunk)


def _take(res: GeometryResults, j: int) -> GeometryResults:
    return GeometryResults(**{k: np.asarray(v)[j:j + 1] for k, v in vars(res).items()})


def _empty() -> GeometryResults:
    return GeometryResults(**{k: np.zeros(0) for k in GeometryResults.__dataclass_fields__})


@dataclass
class Ranked:
    """Geometries ranked by predicted loss under one budget."""

    index: np.ndarray
    loss: np.ndarray
    tokens: np.ndarray
    results: Optional[GeometryResults]
    evaluated: int
    """Geometries whose layouts were timed (cluster-optimal)."""
    pairs_seen: int
    pruned_geometries: int


def rank_cluster_optimal(problem: Problem, top: int = 10, subset: Optional[np.ndarray] = None,
                         progress: Optional[Callable[[int], None]] = None, workers: int = 1,
                         bound: bool = True) -> Ranked:
    """Exact top-`top` geometries under the deliverable budget (branch and bound over geometries)."""
    n = len(problem.geoms)
    index = np.arange(n) if subset is None else np.asarray(subset, dtype=np.int64)
    lb = problem.loss_lower_bound()[index] if (bound and problem.prune) else np.full(len(index), -np.inf)
    order = index[np.argsort(lb, kind="stable")]
    lb_sorted = np.sort(lb, kind="stable")
    per_chunk = max(1, CHUNK_PAIRS // max(len(problem.evaluator.grid), 1)) * max(1, workers)
    collected: list[GeometryResults] = []
    losses: list[np.ndarray] = []
    threshold = math.inf
    i = 0
    pairs = 0
    pool = (ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(problem.evaluator,))
            if workers > 1 else None)
    try:
        while i < len(order):
            if lb_sorted[i] >= threshold:
                break
            stop = i + per_chunk
            chunk = order[i:stop]
            chunk = chunk[lb_sorted[i:stop] < threshold]
            res = problem.evaluate(chunk, progress, pool)
            pairs += len(chunk) * len(problem.evaluator.grid)
            tokens = problem.tokens_in_budget(res.tokens_per_s)
            loss = lawmod.loss(problem.law, problem.geoms.archs.take(res.index), tokens)
            collected.append(res)
            losses.append(loss)
            allloss = np.concatenate(losses)
            finite = allloss[np.isfinite(allloss)]
            if len(finite) >= top:
                threshold = float(np.partition(finite, top - 1)[top - 1])
            i = stop
    finally:
        if pool is not None:
            pool.shutdown()
    res = GeometryResults.concat(collected) if collected else _empty()
    loss = np.concatenate(losses) if losses else np.zeros(0)
    if bound and problem.prune and len(res.index):
        cap = problem.mfu_cap()[res.index]
        if np.any(res.mfu > cap * (1 + 1e-9)):  # the bound is not valid for this model: search everything
            return rank_cluster_optimal(problem, top, subset, progress, workers, bound=False)
    order2 = np.lexsort((res.index, loss))
    return Ranked(index=res.index[order2], loss=loss[order2], tokens=problem.tokens_in_budget(res.tokens_per_s)[order2],
                  results=_reorder(res, order2), evaluated=len(res.index), pairs_seen=pairs,
                  pruned_geometries=len(index) - len(res.index))


def _reorder(res: GeometryResults, order: np.ndarray) -> GeometryResults:
    return GeometryResults(**{k: np.asarray(v)[order] for k, v in vars(res).items()})


def rank_compute_optimal(problem: Problem, subset: Optional[np.ndarray] = None) -> Ranked:
    """Geometries ranked under fixed C_model (no systems): D = C_model / FLOPs per token."""
    index = np.arange(len(problem.geoms)) if subset is None else np.asarray(subset, dtype=np.int64)
    tokens = problem.compute_optimal_tokens()[index]
    loss = lawmod.loss(problem.law, problem.geoms.archs.take(index), tokens)
    order = np.lexsort((index, loss))
    return Ranked(index=index[order], loss=loss[order], tokens=tokens[order], results=None, evaluated=0,
                  pairs_seen=0, pruned_geometries=0)


__all__ = ["CHUNK_PAIRS", "PRECISIONS", "Problem", "Ranked", "rank_cluster_optimal", "rank_compute_optimal"]

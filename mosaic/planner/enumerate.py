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
kept), no later geometry can enter the top k, and the rest are skipped. The first
threshold comes from seeds: geometries near the front of that order that likely
fit in memory (`PairEvaluator.likely_fits`), searched first, so that the layout
search prunes from the first chunk on (the front of the order is mostly
geometries too large to fit, which otherwise all ran without a floor); this
changes the order of work only. Every
timed candidate is checked against its cap; a violation disables the bound and
the search reruns unpruned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mosaic.planner import law as lawmod
from mosaic.planner.candidates import GeometryResults
from mosaic.planner.problem import Problem, worker_pool

AUTO_WORKERS_PAIRS = 20_000_000
"""(geometry x layout) pairs of a space above which `auto_workers` uses every core: below it a
process pool's start costs more than it saves (the bundled spaces hold 10^8-10^9)."""


def auto_workers(problem: Problem, workers: int = 0) -> int:
    """`workers` processes for the enumeration; 0 = auto: the machine's cores (`os.sched_getaffinity`)
    for a space of more than AUTO_WORKERS_PAIRS pairs, else 1."""
    if workers > 0:
        return int(workers)
    pairs = len(problem.geoms) * len(problem.evaluator.grid)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores) if pairs > AUTO_WORKERS_PAIRS else 1


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
    """Geometries never searched (their loss bound could not beat the threshold) or searched
    only until their compute bound fell below the tokens the threshold needs (`bounded`)."""
    bounded_geometries: int = 0
    """Of the pruned: geometries whose pairs were built, then left at their floor."""
    exact_top: int = 0
    """The leading entries known to be the exact best (the `top` searched for; later entries are
    what else was evaluated, not necessarily the next best)."""


SEED_SCAN_GEOMETRIES = 4096
"""Geometries, from the front of the loss-bound order, among which the first threshold's seeds
are looked for (`PairEvaluator.likely_fits`)."""


TIGHTEN_GEOMETRIES = 4096
"""Loose loss bounds (the MFU cap's) tightened by the compute bound at a time, from the front of
the order (each call builds the block tables of the shapes among them)."""


def _threshold(losses: list[np.ndarray], top: int, within: Optional[float]) -> float:
    """The `top`-th best finite loss found (widened to the best + `within`), inf before `top` are found."""
    allloss = np.concatenate(losses) if losses else np.zeros(0)
    finite = allloss[np.isfinite(allloss)]
    if len(finite) < top:
        return math.inf
    threshold = float(np.partition(finite, top - 1)[top - 1])
    return max(threshold, float(finite.min()) + within) if within is not None else threshold


def bounds_failed(problem: Problem, res: GeometryResults) -> bool:
    """Whether a searched result beat a bound it was pruned by: the MFU cap of its geometry, or
    the compute bound of any pair timed so far (also in geometries left at their floor)."""
    cap = problem.mfu_cap()[res.index] if len(res.index) else np.zeros(0)
    return bool(np.any(res.mfu > cap * (1 + 1e-9)) or not np.all(res.bound_ok) or problem.evaluator.bound_violated)


def rank_cluster_optimal(problem: Problem, top: int = 10, subset: Optional[np.ndarray] = None,
                         progress: Optional[Callable[[int], None]] = None, workers: int = 1,
                         bound: bool = True, within: Optional[float] = None) -> Ranked:
    """Exact top-`top` geometries under the deliverable budget (branch and bound over geometries);
    with `within`, also every geometry whose loss is below the best + `within`."""
    n = len(problem.geoms)
    index = np.arange(n) if subset is None else np.asarray(subset, dtype=np.int64)
    use_bounds = bound and problem.prune
    # the loss bound, lazily: the peak bound of every geometry first (cheap, never above the full
    # one), tightened to `Problem.loss_lower_bound` (the compute bound's block tables) only where a
    # geometry reaches the front of the order, so the tables are built for the geometries the
    # threshold leaves open, not for the whole space
    lb = problem.loss_lower_bound(index, tables=False) if use_bounds else np.full(len(index), -np.inf)
    tight = np.full(len(index), not use_bounds)
    searched = np.zeros(len(index), dtype=bool)

    def tighten(pos: np.ndarray) -> None:
        lb[pos] = problem.loss_lower_bound(index[pos])
        tight[pos] = True

    per_chunk = problem.chunk_geometries() * max(1, workers)
    collected: list[GeometryResults] = []
    losses: list[np.ndarray] = []
    threshold = math.inf
    pairs = 0
    bounded = 0
    with worker_pool(problem, workers) as pool:
        if use_bounds:
            # a first threshold from geometries likely to fit, in loss-bound order: the search below
            # then prunes from its first chunk (the order of work only; every geometry whose bound
            # is below the final threshold is still searched)
            guess = np.argsort(lb, kind="stable")[:SEED_SCAN_GEOMETRIES]
            tighten(guess)
            guess = guess[np.argsort(lb[guess], kind="stable")]
            seeds = guess[problem.evaluator.likely_fits(index[guess])]
            at = 0
            while at < len(seeds) and not math.isfinite(_threshold(losses, top, None)):
                chunk = seeds[at:at + per_chunk]
                res = problem.evaluate(index[chunk], progress, pool)
                tokens = problem.tokens_in_budget(res.tokens_per_s)
                collected.append(res)
                losses.append(lawmod.loss(problem.law, problem.geoms.archs.take(res.index), tokens))
                searched[chunk] = True
                pairs += len(chunk) * len(problem.evaluator.grid)
                at += len(chunk)
            threshold = _threshold(losses, top, within)
        while True:
            open_ = np.flatnonzero(~searched & (lb < threshold))
            if not len(open_):
                break
            front = open_[np.argsort(lb[open_], kind="stable")[:per_chunk]]
            if not tight[front].all():
                # the loose bounds at the front of the order, TIGHTEN_GEOMETRIES at a time: once none
                # is left there, the front holds the smallest full bounds
                loose = open_[~tight[open_]]
                tighten(loose[np.argsort(lb[loose], kind="stable")[:max(1, TIGHTEN_GEOMETRIES)]])
                continue
            chunk = index[front]
            searched[front] = True
            floor = problem.tokens_floor(threshold, chunk) if use_bounds else None
            res = problem.evaluate(chunk, progress, pool, floor=floor)
            pairs += len(chunk) * len(problem.evaluator.grid)
            bounded += int((~res.exact).sum())
            res = res.take(np.flatnonzero(res.exact))  # the rest cannot reach the threshold
            tokens = problem.tokens_in_budget(res.tokens_per_s)
            loss = lawmod.loss(problem.law, problem.geoms.archs.take(res.index), tokens)
            collected.append(res)
            losses.append(loss)
            threshold = _threshold(losses, top, within)
    res = GeometryResults.concat(collected) if collected else GeometryResults.empty()
    loss = np.concatenate(losses) if losses else np.zeros(0)
    if use_bounds and bounds_failed(problem, res):
        # a bound is not valid for this model: search everything, every layout timed
        problem.drop_bounds()
        return rank_cluster_optimal(problem, top, subset, progress, workers, bound=False, within=within)
    order2 = np.lexsort((res.index, loss))
    return Ranked(index=res.index[order2], loss=loss[order2], tokens=problem.tokens_in_budget(res.tokens_per_s)[order2],
                  results=res.take(order2), evaluated=len(res.index), pairs_seen=pairs,
                  pruned_geometries=len(index) - len(res.index), bounded_geometries=bounded, exact_top=top)


def rank_compute_optimal(problem: Problem, subset: Optional[np.ndarray] = None) -> Ranked:
    """Geometries ranked under fixed C_model (no systems): D = C_model / FLOPs per token."""
    index = np.arange(len(problem.geoms)) if subset is None else np.asarray(subset, dtype=np.int64)
    tokens = problem.compute_optimal_tokens()[index]
    loss = lawmod.loss(problem.law, problem.geoms.archs.take(index), tokens)
    order = np.lexsort((index, loss))
    return Ranked(index=index[order], loss=loss[order], tokens=tokens[order], results=None, evaluated=0,
                  pairs_seen=0, pruned_geometries=0)


__all__ = ["AUTO_WORKERS_PAIRS", "Ranked", "auto_workers", "rank_cluster_optimal", "rank_compute_optimal"]

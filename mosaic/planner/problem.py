"""The planning problem: cluster, budget, resolved space, candidates and law, built by one function.

`make_problem(cluster, budget, space, law)` does the preparation once:
  eta_good = goodput(cluster, devices)
  C_model  = devices x peak x nominal MFU x eta_good x wall time   (budget.compute_optimal_flops)
  resolve the space's `auto` entries, expand its geometries and its layout grid,
  F_g = model FLOPs per token of every geometry
and returns a frozen `Problem` holding the results; `build_problem` does the same
from names and paths (what the CLI and `mosaic.planner.plan` pass). Every solver
reads the same `Problem`: its figures (D in budget, MFU cap, loss lower bound) and
its cached per-geometry layout search (`Problem.evaluate`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mosaic import frameworks
from mosaic.planner import law as lawmod
from mosaic.planner.budget import Budget, compute_optimal_flops, goodput, make_budget
from mosaic.planner.candidates import GeometryResults, PairEvaluator
from mosaic.planner.space import (
    GeometrySet,
    ResolvedSpace,
    SearchSpace,
    geometries,
    layout_grid,
    load_space,
    resolve_space,
    scale_up_devices,
    usable_tp,
)
from perfmodel.errors import InfeasibleError, InputError, SolverError
from perfmodel.specs.architecture import model_flops_per_token
from perfmodel.specs.cluster import ClusterSpec

CHUNK_PAIRS = 262144
"""(geometry x layout) pairs per vectorised chunk (the enumeration reads it too)."""
CHUNK_MIN_GEOMETRIES = 60
"""Geometries per chunk at least: a chunk's fixed costs (its `perfmodel.evaluate` and memory calls,
~15-35 ms each) are paid per chunk, and the search's threshold moves per chunk of geometries, so a
wide layout grid (the MLA space: 7,308 validity rows, 35 geometries in CHUNK_PAIRS) is searched in
as many geometries per chunk as the default spaces' 4,368-row grids get (60; measured in docs/design.md)."""


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything a search needs, prepared by `make_problem` (no work happens here)."""

    cluster: ClusterSpec
    budget: Budget
    space: SearchSpace
    law: lawmod.Law
    resolved: ResolvedSpace
    geoms: GeometrySet
    evaluator: PairEvaluator
    eta: float
    """Goodput eta_good of the job."""
    c_model: float
    """Compute-optimal budget C_model in FLOPs."""
    flops_per_token: np.ndarray
    """F_g: model FLOPs per token of each geometry."""
    prune: bool = True
    cluster_file: Optional[str] = None
    """Absolute path of the cluster YAML when it is not a bundled one (recorded in the plan)."""
    framework: Optional[str] = None
    """The framework the layouts were searched for (`mosaic.frameworks`; None: every layout priced)."""
    framework_excluded_layouts: int = 0
    """Layout rows of the space that framework cannot run (left out of the grid)."""
    _cache: dict[int, tuple[GeometryResults, int]] = field(default_factory=dict, repr=False, compare=False)
    """Geometry index -> (the search chunk's results, its position there); sweeps and both
    budgets reuse them."""
    _memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Figures computed once on demand (the law split of every geometry)."""

    def drop_bounds(self) -> None:
        """Search on without the compute bound and the loss bound built from it (and forget the
        results searched with them)."""
        self.evaluator.bound = None
        self._cache.clear()
        self._memo.pop("loss_lower_bound", None)

    # -- figures shared by every solver -------------------------------------------------
    def tokens_in_budget(self, tokens_per_s: Any) -> np.ndarray:
        """D = tokens/s x eta_good x wall time (= C_deliverable / FLOPs per token)."""
        return np.asarray(tokens_per_s, dtype=float) * self.eta * self.budget.wall_time_s

    def mfu_cap(self) -> np.ndarray:
        """MFU_g <= min(1, the largest e_max of any GEMM or attention kernel): MFU counts the FLOPs
        the kernels execute (causal attention halved), each at most its kernel's e_max of a peak
        no higher than the GEMMs' (see enumerate)."""
        acc = self.cluster.accelerator
        precisions = self.space.layout.precision
        eff = max(acc.max_gemm_efficiency(precisions), acc.max_attention_efficiency(precisions), 1e-12)
        return np.full(len(self.flops_per_token), min(1.0, eff))

    def max_peak(self) -> float:
        """Highest dense peak FLOP/s over the space's precisions the part has."""
        acc = self.cluster.accelerator
        peaks = []
        for p in self.space.layout.precision:
            try:
                peaks.append(acc.peak(p))
            except InputError:  # a precision the part lacks is infeasible for evaluate too
                continue
        return max(peaks) if peaks else 0.0

    def loss_lower_bound(self, index: Optional[np.ndarray] = None, tables: bool = True) -> np.ndarray:
        """LB_g = law(..., D_ub,g) of the geometries `index` (default: all), D_ub,g the smaller of two
        upper bounds of the tokens in budget: devices x peak x MFU cap x eta_good x wall time / F_g,
        and (with pruning and `tables`) the compute bound over every layout
        (`bounds.ComputeBound.geometry_tokens_per_s`) x eta_good x wall time. Without `tables` it is
        the first bound alone, no higher than the other (the law falls with D) and cheap: the
        compute bound's block tables are built only for the geometries asked for."""
        index = np.arange(len(self.geoms)) if index is None else np.asarray(index, dtype=np.int64)
        if "tokens_peak" not in self._memo:
            self._memo["tokens_peak"] = (self.budget.devices * self.max_peak() * self.mfu_cap() * self.eta
                                         * self.budget.wall_time_s / self.flops_per_token)
        bound = self.evaluator.bound
        if not (tables and self.prune and bound is not None):
            return lawmod.loss(self.law, self.geoms.archs.take(index), self._memo["tokens_peak"][index])
        lb = self._memo.setdefault("loss_lower_bound", np.full(len(self.geoms), np.nan))
        todo = index[np.isnan(lb[index])]
        if len(todo):
            d_ub = np.minimum(self._memo["tokens_peak"][todo], self.tokens_in_budget(bound.geometry_tokens_per_s(todo)))
            lb[todo] = lawmod.loss(self.law, self.geoms.archs.take(todo), d_ub)
        return lb[index]

    def compute_optimal_tokens(self) -> np.ndarray:
        """D_g = C_model / F_g."""
        return self.c_model / self.flops_per_token

    def tokens_floor(self, threshold: float, index: np.ndarray) -> np.ndarray:
        """tokens/s each geometry must exceed to reach a loss below `threshold`: the law split
        L = K_g + b / D^beta (`law.tokens_term`) inverted, D_g = (b / (threshold - K_g))^(1/beta),
        over eta_good x wall time (inf where K_g >= threshold; 0 for an infinite threshold or a
        law without that split)."""
        index = np.asarray(index, dtype=np.int64)
        if not np.isfinite(threshold):
            return np.zeros(len(index))
        if "term" not in self._memo:
            try:
                self._memo["term"] = lawmod.tokens_term(self.law, self.geoms.archs)
            except SolverError:
                self._memo["term"] = None
        term = self._memo["term"]
        if term is None:
            return np.zeros(len(index))
        room = threshold - term.constant[index]
        with np.errstate(divide="ignore", invalid="ignore"):
            tokens = np.where(room > 0, (term.coef / np.where(room > 0, room, 1.0)) ** (1.0 / term.exponent), np.inf)
        # a hair below, so that rounding never drops a geometry the threshold admits
        return tokens * (1.0 - 1e-9) / (self.eta * self.budget.wall_time_s)

    # -- the layout search, cached per geometry -----------------------------------------
    def chunk_geometries(self) -> int:
        """Geometries per vectorised chunk: CHUNK_PAIRS pairs of the evaluator's width, at least
        CHUNK_MIN_GEOMETRIES."""
        return max(CHUNK_MIN_GEOMETRIES, CHUNK_PAIRS // max(self.evaluator.width, 1))

    def evaluate(self, index: np.ndarray, progress: Optional[Callable[[int], None]] = None,
                 pool: Optional[ProcessPoolExecutor] = None, floor: Optional[np.ndarray] = None) -> GeometryResults:
        """Best feasible layout of each geometry in `index` (PairEvaluator), searched once per geometry.
        `floor`: tokens/s per geometry of `index` below which it does not matter (`PairEvaluator.run`);
        geometries left at their floor (`exact` False) are returned but not cached."""
        index = np.asarray(index, dtype=np.int64)
        floor_of = {} if floor is None else {int(g): float(f) for g, f in zip(index, np.asarray(floor, dtype=float))}
        missing = np.asarray([i for i in dict.fromkeys(index.tolist()) if int(i) not in self._cache], dtype=np.int64)
        fresh: dict[int, tuple[GeometryResults, int]] = {}
        if len(missing):
            per_chunk = self.chunk_geometries()
            chunks = [missing[i:i + per_chunk] for i in range(0, len(missing), per_chunk)]
            floors = [np.asarray([floor_of.get(int(g), 0.0) for g in c]) for c in chunks]
            if pool is not None and len(chunks) > 1:
                parts = []
                ev = self.evaluator
                for part, counts, violated in pool.map(_run_chunk, chunks, floors):
                    parts.append(part)  # and what the worker built, timed and saw of the bound
                    for key, value in counts.items():
                        ev.counts[key] += value
                    ev.bound_violated |= violated
                if progress is not None:
                    progress(len(missing) * len(ev.grid))
            else:
                parts = [self.evaluator.run(c, progress, f) for c, f in zip(chunks, floors)]
            for part in parts:
                for j, g in enumerate(part.index):
                    if bool(part.exact[j]):
                        self._cache[int(g)] = (part, j)
                    else:
                        fresh[int(g)] = (part, j)
        if not len(index):
            return GeometryResults.empty()
        entries = [self._cache.get(int(i)) or fresh[int(i)] for i in index]
        pieces = []
        for _, run in itertools.groupby(entries, key=lambda entry: id(entry[0])):  # runs from one chunk
            run = list(run)
            pieces.append(run[0][0].take(np.asarray([j for _, j in run], dtype=np.int64)))
        return pieces[0] if len(pieces) == 1 else GeometryResults.concat(pieces)


_WORKER: dict[str, PairEvaluator] = {}


def init_worker(evaluator: PairEvaluator) -> None:
    """Process-pool initializer: each worker holds the problem's evaluator once."""
    _WORKER["evaluator"] = evaluator


@contextlib.contextmanager
def worker_pool(problem: Problem, workers: int) -> Iterator[Optional[ProcessPoolExecutor]]:
    """A process pool of `workers` processes, each holding the problem's evaluator (None for one)."""
    if workers <= 1:
        yield None
        return
    pool = ProcessPoolExecutor(max_workers=workers, initializer=init_worker, initargs=(problem.evaluator,))
    try:
        yield pool
    finally:
        pool.shutdown()


def _run_chunk(chunk: np.ndarray, floor: np.ndarray) -> tuple[GeometryResults, dict[str, int], bool]:
    """One chunk searched in a worker, with what the parent's evaluator records of it: the pairs
    built and timed, and whether a timed pair beat its compute bound."""
    evaluator = _WORKER["evaluator"]
    before = dict(evaluator.counts)
    evaluator.bound_violated = False
    part = evaluator.run(chunk, None, floor)
    counts = {key: evaluator.counts[key] - before[key] for key in before}
    return part, counts, evaluator.bound_violated


def make_problem(cluster: ClusterSpec, budget: Budget, space: SearchSpace, law: lawmod.Law, prune: bool = True,
                 cluster_file: Optional[str] = None, framework: Optional[str] = None) -> Problem:
    """Prepare the problem (module doc): goodput, C_model, resolved space, geometries, layout grid
    (with `framework`, only the rows it runs: `mosaic.frameworks.supported`)."""
    co = space.compute_optimal
    eta = goodput(cluster, budget.devices)
    c_model = compute_optimal_flops(cluster, budget, co.nominal_mfu, co.precision)
    resolved = resolve_space(space, min(scale_up_devices(cluster), budget.devices), c_model)
    geoms = geometries(resolved)
    resolved = usable_tp(resolved, geoms)
    grid = layout_grid(resolved, budget.devices)
    excluded = 0
    if framework is not None:
        keep = frameworks.supported(framework, grid)
        if not keep.any():
            raise InfeasibleError(f"--framework {framework}: runs none of the {len(grid):,} layouts of the space; "
                                  "widen the space's layout lists or plan without --framework")
        excluded, grid = int((~keep).sum()), grid.take(np.flatnonzero(keep))
    evaluator = PairEvaluator(geoms.archs, grid, cluster, budget.devices, space.layout.gbs_tokens, prune=prune)
    return Problem(cluster=cluster, budget=budget, space=space, law=law, resolved=resolved, geoms=geoms,
                   evaluator=evaluator, eta=eta, c_model=c_model,
                   flops_per_token=np.asarray(model_flops_per_token(geoms.archs), dtype=float), prune=prune,
                   cluster_file=cluster_file, framework=framework, framework_excluded_layouts=excluded)


def build_problem(cluster: Any, devices: Optional[int] = None, days: Optional[float] = None,
                  hours: Optional[float] = None, fit: Any = None, space: Any = None, prune: bool = True,
                  framework: Optional[str] = None) -> Problem:
    """`make_problem` from names/paths or objects: a cluster name, file or ClusterSpec; a fit path, None
    (the bundled fit) or a law; a space path, None (the bundled space) or a SearchSpace."""
    from perfmodel.clusters import bundled_cluster_paths, load_cluster, resolve_cluster_path

    cluster_file = None
    if isinstance(cluster, ClusterSpec):
        spec = cluster
    else:
        spec = load_cluster(str(cluster))
        path = resolve_cluster_path(str(cluster)).resolve()
        if path not in {p.resolve() for p in bundled_cluster_paths().values()}:
            cluster_file = str(path)
    law = fit if (fit is not None and hasattr(fit, "predict")) else lawmod.load_law(fit)
    sp = space if isinstance(space, SearchSpace) else load_space(space)
    budget = make_budget(spec, devices=devices, days=days, hours=hours)
    return make_problem(spec, budget, sp, law, prune=prune, cluster_file=cluster_file, framework=framework)


__all__ = ["CHUNK_PAIRS", "Problem", "build_problem", "init_worker", "make_problem"]

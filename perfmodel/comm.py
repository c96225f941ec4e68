"""Collectives priced per fabric level with placement (alpha-beta, hierarchical).

Placement follows Megatron-Core's rank order: tp innermost, then cp, then dp,
then pp outermost; inside the tp*cp*dp ranks of a stage the expert groups
fold as etp innermost, then ep, then edp (Liu et al. 2025, "MoE Parallel
Folding"). A group of n ranks at stride k spans n*k consecutive ranks.

Cost of one collective (nccl-tests `doc/PERFORMANCE.md` bus-bandwidth factors;
alpha-beta as in Galvatron/SimAI/llm-analysis):
- Walk the levels innermost first. c_j = group members inside one level-j
  domain = min(n, max(1, D_j // k)) (D_j devices per domain; the outermost
  level holds them all), f_j = c_j / c_{j-1} members joined at level j.
- Bandwidth bytes per device at level j, for a buffer S:
    all-reduce                 2 (f_j - 1)/f_j * S / c_{j-1}   (reduce-scatter down, all-gather up)
    all-gather, reduce-scatter   (n - 1)/n * S / c_{j-1}       (f_j > 1; a ring over all n ranks: NCCL has no
                                                             hierarchical algorithm for them, so every
                                                             level's links carry the ring's traffic,
                                                             spread over the c_{j-1} devices' links)
    all-to-all                   (c_j - c_{j-1})/n * S          (the share of S leaving the inner domain)
    p2p                          S where the two ranks first meet
  On one level these are the ring factors 2(n-1)/n and (n-1)/n.
- The levels' links work at once (NCCL pipelines chunks through intra- and
  inter-node hops), so the bandwidth time is the max over levels of
  bytes_j / (bandwidth_j * efficiency_j[collective]); latency adds:
  alpha_j * ceil(log2 f_j) per phase (tree depth; NCCL's tuning model), two
  phases for all-reduce, one hop for p2p; alpha_j is the level's step latency of that
  collective (`FabricLevel.latency_of`: NCCL runs a different algorithm per collective, so its
  small-message cost differs: fitted per collective where measured). A step at an outer level is
  charged at least the largest alpha of the levels inside it (its message
  also crosses them), so spreading a group over more levels never makes it
  cheaper. Each call also pays once the largest `sync_latency_s` of the
  levels it spans (0 for NCCL/HCCL; on gloo the wake-up and rank skew of a
  collective issued between computations, calibrated on cpu); p2p does not:
  a pipeline posts its sends and receives ahead, and its waiting is the
  schedule's (bubble).
  Protocols: NCCL times each (algorithm, protocol) as latency + size / bandwidth and runs the
  fastest (`src/graph/tuning.cc`): its low-latency protocols (LL, LL128) win small messages at a
  fraction of the bandwidth, Simple wins large ones. A level may carry low-latency figures
  (`ll_collective_latency_s`, `ll_collective_efficiency`) beside its main ones; the time is then
  the smaller of the two hierarchical lines, each walked as above.
  Check against a measurement: 4 nodes x 8 B200, 4 GiB all-reduce, NVLink
  900 GB/s x 0.82 and NIC 50 GB/s x 0.74 gives busbw 0.38 TB/s; measured
  0.377-0.382 (hardware.md section 4, [S-net]).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from perfmodel.choice import select
from perfmodel.grouping import row_groups
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.protocols import LayoutLike, Values

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


LevelGeometry = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]
"""Per fabric level: (c_{j-1}, c_j, f_j, ceil(log2 f_j), alpha_j) of a group (`group_levels`)."""


def group_geometry(lay: LayoutLike, group: str) -> tuple[np.ndarray, np.ndarray]:
    """(size n, stride k) of a process group in Megatron-Core rank order.

    tp: (tp, 1); cp: (cp, tp); dp (dense gradients, synchronised over dp*cp): (dp*cp, tp);
    etp: (etp, 1); ep: (ep, etp); ep_etp (the allgather dispatcher's group): (ep*etp, 1);
    edp (expert gradients): (edp, etp*ep);
    pp (two neighbouring stages): (2, tp*cp*dp) when pp > 1, else a group of one;
    pp_all (all stages of a replica): (pp, tp*cp*dp); world: (tp*cp*dp*pp, 1).
    """
    f = np.asarray
    tp, cp, dp, pp = (f(getattr(lay, n), dtype=float) for n in ("tp", "cp", "dp", "pp"))
    ep, etp = f(lay.ep, dtype=float), f(lay.etp, dtype=float)
    if group == "tp":
        return tp, np.ones_like(tp)
    if group == "cp":
        return cp, tp
    if group == "dp":
        return dp * cp, tp
    if group == "etp":
        return etp, np.ones_like(etp)
    if group == "ep":
        return ep, etp
    if group == "ep_etp":
        return ep * etp, np.ones_like(ep)
    if group == "edp":
        return np.maximum(tp * cp * dp / (etp * ep), 1.0), etp * ep
    if group == "pp":
        return np.where(pp > 1, 2.0, 1.0), tp * cp * dp
    if group == "pp_all":
        return pp, tp * cp * dp
    if group == "world":
        return tp * cp * dp * pp, np.ones_like(tp)
    raise AssertionError(f"unknown group {group}")


def group_levels(cluster: ClusterSpec, n: Values, stride: Values) -> list[LevelGeometry]:
    """Per level: (members inside the inner domain c_{j-1}, inside this level's domain c_j,
    fan-out f_j, ceil(log2 f_j), alpha_j) of a group of n ranks at `stride`."""
    n = np.maximum(np.asarray(n, dtype=float), 1.0)
    stride = np.maximum(np.asarray(stride, dtype=float), 1.0)
    shape = np.broadcast(n, stride).shape
    out = []
    c_prev = np.ones(shape)
    last = len(cluster.levels) - 1
    alpha = 0.0
    for j, level in enumerate(cluster.levels):
        alpha = max(alpha, level.latency_s)  # an outer step also crosses the inner levels
        if j == last:
            c = n + 0.0 * c_prev
        else:
            c = np.maximum(np.minimum(n, np.maximum(1.0, np.floor(level.devices / stride))), c_prev)
        fan = c / c_prev
        out.append((c_prev, c, fan, np.maximum(np.ceil(np.log2(fan) - 1e-9), 0.0), alpha))
        c_prev = c
    return out


Line = tuple[np.ndarray, np.ndarray]
"""(seconds per byte, latency seconds) of one protocol's alpha-beta line."""


def collective_coefficients(cluster: ClusterSpec, kind: str, n: Values, stride: Values,
                            levels: Optional[list[LevelGeometry]] = None, low_latency: bool = False) -> Line:
    """(seconds per byte, latency seconds) of a `kind` collective over n ranks at `stride`, on the
    levels' bandwidth protocol (or, with `low_latency`, their low-latency protocol's figures,
    `FabricLevel.ll_latency_of` / `ll_efficiency_of`; a level without them uses its main ones).

    The bandwidth bytes at every level are proportional to the buffer, so the
    time of a buffer S is S * slope + latency (for S > 0): the geometry is
    walked once per group (`levels` = `group_levels(...)`), not once per message.
    """
    assert kind in COLLECTIVES, kind
    n = np.maximum(np.asarray(n, dtype=float), 1.0)
    shape = np.broadcast(n, np.asarray(stride, dtype=float)).shape
    slope = np.zeros(shape)
    latency = np.zeros(shape)
    if not np.any(n > 1.0):
        return slope, latency
    levels = group_levels(cluster, n, stride) if levels is None else levels
    sync = np.zeros(shape)  # once per call: the outermost spanned level's (FabricLevel.sync_latency_s)
    alpha = 0.0
    for level, (c_prev, c, fan, log_steps, _) in zip(cluster.levels, levels):
        step_s = level.ll_latency_of(kind) if low_latency else level.latency_of(kind)
        efficiency = level.ll_efficiency_of(kind) if low_latency else level.efficiency_of(kind)
        alpha = max(alpha, step_s)  # an outer step also crosses the inner levels
        if kind == "all_reduce":
            per_byte = 2.0 * (fan - 1.0) / fan / c_prev
            steps = 2.0 * log_steps
        elif kind in ("all_gather", "reduce_scatter"):
            # a ring over all n ranks (NCCL runs no hierarchical algorithm for them): every level the
            # group crosses carries the ring's traffic, spread over the c_{j-1} devices' links
            per_byte = np.where(fan > 1.0, (n - 1.0) / n / c_prev, 0.0)
            steps = log_steps
        elif kind == "all_to_all":
            per_byte = (c - c_prev) / n
            steps = log_steps
        else:  # p2p
            per_byte = np.where(fan > 1.0, 1.0, 0.0)
            steps = per_byte
        slope = np.maximum(slope, per_byte / (level.bandwidth_bytes_per_s * efficiency))
        latency = latency + steps * alpha
        if kind != "p2p":  # a pipeline posts its sends/receives ahead; its waiting is the schedule's
            sync = np.maximum(sync, np.where(c > c_prev, level.sync_latency_s, 0.0))
    return slope, latency + sync


def protocol_coefficients(cluster: ClusterSpec, kind: str, n: Values, stride: Values,
                          levels: Optional[list[LevelGeometry]] = None) -> tuple[Line, ...]:
    """The alpha-beta line of each protocol the levels describe: the bandwidth protocol, and the
    low-latency one where some level has low-latency figures (`collective_time` takes the faster)."""
    main = collective_coefficients(cluster, kind, n, stride, levels)
    if not any(level.has_low_latency(kind) for level in cluster.levels):
        return (main,)
    return main, collective_coefficients(cluster, kind, n, stride, levels, low_latency=True)


def collective_time(cluster: ClusterSpec, kind: str, size_bytes: Values, n: Optional[Values], stride: Optional[Values],
                    coefficients: Optional[tuple[Line, ...]] = None) -> np.ndarray:
    """Seconds for one `kind` collective of `size_bytes` over n ranks at `stride` (see module doc):
    the faster of its protocols' lines, as NCCL picks per call (its tuning model, `tuning.cc`).

    `coefficients`: a precomputed `protocol_coefficients(...)` for the same group.
    """
    size = np.asarray(size_bytes, dtype=float)
    if coefficients is None:
        assert n is not None and stride is not None, "collective_time needs n and stride or coefficients"
        coefficients = protocol_coefficients(cluster, kind, n, stride)
    seconds = None
    for slope, latency in coefficients:
        line = size * slope + latency
        seconds = line if seconds is None else np.minimum(seconds, line)
    return select(size > 0.0, seconds, 0.0)


class _Geometries:
    """The distinct layout shapes of a batch with their group geometries (`group_levels`) and
    protocol lines (`protocol_coefficients`), each walked once (shared by the batch's pricers)."""

    def __init__(self, cluster: ClusterSpec, shapes: Any) -> None:
        self.cluster, self.shapes = cluster, shapes
        self._levels: dict[str, Optional[list[LevelGeometry]]] = {}
        self._lines: dict[tuple[str, str], tuple[Line, ...]] = {}

    def lines(self, group: str, kind: str) -> tuple[Line, ...]:
        key = (group, kind)
        if key not in self._lines:
            n, stride = group_geometry(self.shapes, group)
            if group not in self._levels:
                self._levels[group] = group_levels(self.cluster, n, stride) if np.any(n > 1.0) else None
            self._lines[key] = protocol_coefficients(self.cluster, kind, n, stride, self._levels[group])
        return self._lines[key]


class CollectivePricer:
    """Collective prices for one batch of layouts on one cluster: each (group, kind)
    geometry is walked once per distinct layout shape (tp, cp, dp, pp, ep, etp) of the batch
    (`collective_coefficients` on those rows, gathered back: `perfmodel.grouping`; `take` gives
    the pricer of some of the candidates, on the same walks), and a repeated message (the same
    array object, e.g. the forward and backward all-to-alls of one buffer) is priced once. Every
    time is divided by the ranks' core share (`share`, 1 off-CPU: ranks beyond the cores move
    and reduce their messages in turns)."""

    SHAPE_FIELDS = ("tp", "cp", "dp", "pp", "ep", "etp")
    """The layout fields every group geometry is a function of (`group_geometry`)."""

    def __init__(self, cluster: ClusterSpec, lay: Optional[LayoutLike], share: Values = 1.0) -> None:
        self.cluster, self.lay = cluster, lay
        self.slowdown = 1.0 / np.asarray(share, dtype=float)
        self._slowed = bool(np.any(self.slowdown != 1.0))  # off-CPU every share is 1: no division
        self._coef: dict[tuple[str, str], tuple[Line, ...]] = {}
        self._times: dict[tuple[str, str, int], tuple[Values, np.ndarray]] = {}
        self._geometries: Optional[tuple[_Geometries, Optional[np.ndarray]]] = None

    def _distinct_shapes(self) -> tuple[_Geometries, Optional[np.ndarray]]:
        """(the geometries of the layout's distinct shapes, inverse), or (of lay, None) for one layout."""
        if self._geometries is None:
            columns = [np.asarray(getattr(self.lay, name)) for name in self.SHAPE_FIELDS]
            if columns[0].ndim != 1:
                self._geometries = (_Geometries(self.cluster, self.lay), None)
            else:
                first, inverse = row_groups(columns)
                shapes = SimpleNamespace(**{name: col[first] for name, col in zip(self.SHAPE_FIELDS, columns)})
                self._geometries = (_Geometries(self.cluster, shapes), inverse)
        return self._geometries

    def take(self, rows: np.ndarray, share: Values = 1.0) -> CollectivePricer:
        """The pricer of the candidates at `rows` (with their core `share`): the same walks."""
        geometries, inverse = self._distinct_shapes()
        assert inverse is not None, "take needs a batch"
        sub = CollectivePricer(self.cluster, None, share)
        sub._geometries = (geometries, inverse[rows])
        return sub

    def coefficients(self, group: str, kind: str) -> tuple[Line, ...]:
        """`protocol_coefficients` of a `kind` collective over process group `group`, per candidate."""
        key = (group, kind)
        if key not in self._coef:
            geometries, inverse = self._distinct_shapes()
            lines = geometries.lines(group, kind)
            self._coef[key] = lines if inverse is None else tuple((s[inverse], c[inverse]) for s, c in lines)
        return self._coef[key]

    def time(self, group: str, kind: str, size_bytes: Values) -> np.ndarray:
        """Seconds of one `kind` collective of `size_bytes` over process group `group`."""
        hit = self._times.get((group, kind, id(size_bytes)))
        if hit is not None and hit[0] is size_bytes:
            return hit[1]
        coefficients = self.coefficients(group, kind)
        seconds = collective_time(self.cluster, kind, size_bytes, None, None, coefficients=coefficients)
        if self._slowed:
            seconds = seconds * self.slowdown
        self._times[(group, kind, id(size_bytes))] = (size_bytes, seconds)  # holds the array: its id stays unique
        return seconds

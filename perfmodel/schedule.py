"""Pipeline schedule, stage contents, straggler and goodput.

- Stages (`pipeline_stages`): the layers of each of the pp*vpp virtual stages follow the
  layout's split (`perfmodel.specs.stages`: even, balanced, Megatron's first/last or
  account-for options, or its layout string); virtual stage j sits on pipeline rank j % pp.
  The leading `n_dense_layers` are dense-FFN layers; rank 0 also holds the embedding, rank
  pp-1 the LM head and the MTP modules (Megatron). Each rank's blocks are the sum over its
  chunks. A rank is priced unless an earlier rank (or rank 0) holds at least as many of every
  block: time and memory grow with every block count, and an earlier rank holds at least as
  many in-flight micro-batches, so such a rank is never the slowest or the largest. FSDP's
  gathered-layer buffers grow with a rank's MEAN parameters per layer instead (`perfmodel.memory`),
  so under FSDP the earlier rank must also hold the same share of dense layers (dense_q * L_r =
  dense_r * L_q: an equal mean per layer, plus rank 0's embedding) to drop a rank for memory. The
  survivors (rank 0, rank pp-1 and the undominated middle ranks) are the stages `evaluate`
  prices; the slowest sets the step, the largest the memory per device. With an even split
  the middle ranks are dominated (by rank 0, or by rank 1 when dense layers spill there).
- 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", sec. 2.2): a step is (m + (pp-1)/vpp)
  micro-batch slots of the slowest stage; the bubble is the (pp-1)/vpp extra
  slots; interleaving (vpp chunks per stage) sends vpp times the p2p messages.
- In-flight micro-batches (Megatron-LM `schedules.py` warm-up counts): plain
  1F1B holds pp - r micro-batches on stage r; interleaved holds
  ((pp-r-1)*2 + (vpp-1)*pp + 1)/vpp stage-equivalents, i.e. pp + (pp-1)/vpp on the
  first stage (Korthikanti et al. 2022's factor 1 + (pp-1)/(pp*vpp)); at most m.
- Straggler: the slowest of `nodes` nodes sets the step: 1 + cv*sqrt(2 ln nodes)
  (expected max of n Gaussians), `cluster.straggler.factor`.
- Goodput (Young 1974; Daly 2006): checkpoint every tau = sqrt(2*delta*M) with
  delta the blocking checkpoint time and M the job's MTBF = node MTBF / nodes;
  the fraction lost is delta/tau + (tau/2 + R)/M = sqrt(2*delta/M) + R/M.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from perfmodel.grouping import MIN_GROUPED_ROWS, row_groups
from perfmodel.memo import memoised
from perfmodel.specs.architecture import ArchBatch, n_ffn_dense_layers
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import DP_FLAVORS, LayoutBatch, ParallelLayout
from perfmodel.specs.protocols import ArchLike, LayoutLike, Values
from perfmodel.specs.stages import split_columns, stage_layer_table

STAGE_BLOCKS = ("attention", "dense_ffn", "moe", "embedding", "head", "mtp")
"""Block counts of a pipeline stage (`Stage.counts`); mtp counts MTP modules."""


@dataclass(frozen=True)
class Stage:
    """One priced pipeline stage of every candidate: its pipeline rank and block counts."""

    rank: Values
    """Pipeline rank (0 = first)."""
    counts: dict[str, Values]
    """Blocks it holds, by STAGE_BLOCKS (layers for attention/dense_ffn/moe)."""
    timed: bool = True
    """Whether its time is priced: False for a middle rank some later rank outweighs in every
    block (never the slowest, but it holds more in-flight micro-batches: its memory counts)."""


_LAYER_BLOCKS = ("attention", "dense_ffn", "moe")


def _even_rows(arch: ArchLike, batch: LayoutBatch, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(simple, all_dense): candidates with the default even split whose dense layers all sit in
    virtual stage 0, and those whose layers are all dense. Both have their ranks in closed form
    (rank 0: L/pp layers, its dense ones, the others L/pp MoE; all dense: L/pp dense each)."""
    n_layers = np.broadcast_to(np.atleast_1d(np.asarray(arch.n_layers, dtype=np.int64)), (n,))
    stages = np.broadcast_to(np.asarray(batch.pp, dtype=np.int64) * np.asarray(batch.vpp, dtype=np.int64), (n,))
    dense = np.broadcast_to(np.atleast_1d(np.asarray(n_ffn_dense_layers(arch), dtype=np.int64)), (n,))
    default = ((np.asarray(batch.stage_layers)[:, 0] < 0) & (np.asarray(batch.first_stage_layers) < 0)
               & (np.asarray(batch.last_stage_layers) < 0) & ~np.asarray(batch.account_embedding, dtype=bool)
               & ~np.asarray(batch.account_loss, dtype=bool) & ~np.asarray(batch.balanced_split, dtype=bool))
    even = np.broadcast_to(default, (n,)) & (n_layers % stages == 0)
    return even & (dense <= n_layers // stages), even & (dense >= n_layers)


def _simple_rows(arch: ArchLike, batch: LayoutBatch, n: int) -> np.ndarray:
    """Candidates with the default even split whose dense layers all sit in virtual stage 0."""
    return _even_rows(arch, batch, n)[0]


def rank_block_counts(arch: ArchLike, lay: LayoutLike) -> dict[str, np.ndarray]:
    """(n, max pp) arrays: the layers (attention, dense_ffn, moe) each pipeline rank holds (0 beyond
    a candidate's pp); rank 0 also holds the embedding, rank pp - 1 the head and the MTP modules."""
    batch = lay if isinstance(lay, LayoutBatch) else LayoutBatch.stack([lay])
    n_layers = np.atleast_1d(np.asarray(arch.n_layers)).astype(np.int64)
    n = max(len(batch), len(n_layers))
    n_layers = np.broadcast_to(n_layers, (n,))
    dense_total = np.broadcast_to(np.atleast_1d(np.asarray(n_ffn_dense_layers(arch), dtype=float)), (n,))
    pp = np.broadcast_to(np.asarray(batch.pp, dtype=np.int64), (n,))
    stages = pp * np.broadcast_to(np.asarray(batch.vpp, dtype=np.int64), (n,))
    width_ranks = int(pp.max()) if n else 1
    attention = np.zeros((n, width_ranks))
    dense = np.zeros((n, width_ranks))
    r = np.arange(width_ranks)[None, :]
    simple = _simple_rows(arch, batch, n)
    if simple.all():
        attention = np.where(r < pp[:, None], (n_layers // pp).astype(float)[:, None], 0.0)
        dense[:, 0] = dense_total
    elif simple.any():
        rows = np.flatnonzero(simple)
        per_rank = (n_layers[rows] // pp[rows]).astype(float)
        attention[rows] = np.where(r < pp[rows, None], per_rank[:, None], 0.0)
        dense[rows, 0] = dense_total[rows]
    rest = ~simple
    # (n, W) layers per virtual stage; a split that does not fit (invalid_layout) is clipped at 0
    table = np.maximum(stage_layer_table(n_layers[rest], batch.take(np.flatnonzero(rest))), 0.0) \
        if rest.any() else np.zeros((0, 1))
    at = np.flatnonzero(rest)
    for p in np.unique(pp[rest]):  # virtual stage j = c * pp + r: fold the chunks of each rank
        local = np.flatnonzero(pp[rest] == p)
        rows = at[local]
        width = int(stages[rows].max())
        t = table[local, :width]
        starts = np.cumsum(t, axis=1) - t
        d = np.clip(dense_total[rows, None] - starts, 0.0, t)
        chunks = -(-width // p)
        pad = ((0, 0), (0, chunks * p - width))
        attention[rows, :p] = np.pad(t, pad).reshape(len(rows), chunks, p).sum(axis=1)
        dense[rows, :p] = np.pad(d, pad).reshape(len(rows), chunks, p).sum(axis=1)
    return {"attention": attention, "dense_ffn": dense, "moe": attention - dense}


def pipeline_stages(arch: ArchLike, lay: LayoutLike) -> list[Stage]:
    """The stages `evaluate` prices (module doc): [rank 0, rank pp-1, the middle ranks no other
    rank outweighs (timed), the other middle ranks no earlier rank outweighs (memory only; under
    FSDP outweighs with the same dense share)],
    padded with rank 0 where a candidate has fewer. Equal ranks count once (the earliest in that
    order). One configuration gives floats."""
    single = isinstance(lay, ParallelLayout)
    batch = lay if isinstance(lay, LayoutBatch) else LayoutBatch.stack([lay])
    if not single and len(batch):
        simple, all_dense = _even_rows(arch, batch, len(batch))
        closed = simple | all_dense
        if closed.all():
            return _even_stages(arch, batch)
        if closed.any():
            return _merge_stages(arch, batch, closed)
    if not single and len(batch) >= MIN_GROUPED_ROWS:
        grouped = _grouped_stages(arch, batch)
        if grouped is not None:
            return grouped
    return _general_stages(arch, batch, single)


def _stage_columns(arch: ArchLike, batch: LayoutBatch) -> list[np.ndarray]:
    """Every input of the general rule, one column per field (the layer counts, pp, vpp, the split
    fields, FSDP or not)."""
    n = len(batch)
    cols = [np.broadcast_to(np.atleast_1d(np.asarray(v)), (n,)) for v in
            (arch.n_layers, n_ffn_dense_layers(arch), arch.n_mtp_layers)]
    return cols + [np.asarray(batch.dp_flavor)] + split_columns(batch)


def _grouped_stages(arch: ArchLike, batch: LayoutBatch) -> Optional[list[Stage]]:
    """The general rule on the distinct rows (`grouping.row_groups`), gathered back; None when
    more than half the rows differ."""
    first, inverse = row_groups(_stage_columns(arch, batch))
    if 2 * len(first) > len(batch):
        return None
    sub = arch.take(first) if isinstance(arch, ArchBatch) and np.size(arch.n_layers) == len(batch) else arch
    return [Stage(np.asarray(st.rank)[inverse], {b: np.asarray(v)[inverse] for b, v in st.counts.items()}, st.timed)
            for st in _general_stages(sub, batch.take(first), False)]


def _general_stages(arch: ArchLike, batch: LayoutBatch, single: bool) -> list[Stage]:
    """`pipeline_stages` by the general rule (module doc), every row on its own."""
    lay = batch
    per_rank = rank_block_counts(arch, batch)
    n, width = per_rank["attention"].shape
    pp = np.broadcast_to(np.asarray(lay.pp, dtype=np.int64), (n,))
    timed = np.zeros((n, width), dtype=bool)
    kept = np.zeros((n, width), dtype=bool)
    simple = _simple_rows(arch, batch, n)
    fsdp = np.broadcast_to(np.asarray(batch.dp_flavor) == DP_FLAVORS.index("fsdp"), (n,))
    if width > 2:
        # closed form: rank 1 (no dense layer, as many layers) is outweighed by the last rank in
        # time, and held apart in memory when rank 0 has dense layers; later middles equal rank 1
        kept[:, 1] = simple & (pp > 2) & (per_rank["dense_ffn"][:, 0] > 0)
    for p in np.unique(pp[~simple]):
        if p < 3:
            continue
        rows = np.flatnonzero((pp == p) & ~simple)
        blocks = [per_rank[b][rows, :p] for b in _LAYER_BLOCKS]
        fsdp_rows = fsdp[rows]
        for r in range(1, p - 1):
            earlier = np.zeros(len(rows), dtype=bool)   # outweighed by an earlier rank: memory too
            anyone = np.zeros(len(rows), dtype=bool)    # by any rank (equal: the earlier one wins): time
            for q in range(p):
                if q == r:
                    continue
                ge = blocks[0][:, q] >= blocks[0][:, r]
                gt = blocks[0][:, q] > blocks[0][:, r]
                for blk in blocks[1:]:
                    ge &= blk[:, q] >= blk[:, r]
                    gt |= blk[:, q] > blk[:, r]
                if q < r:  # FSDP: the same dense share too, so its mean layer is no lighter
                    same_mix = blocks[1][:, q] * blocks[0][:, r] == blocks[1][:, r] * blocks[0][:, q]
                    earlier |= ge & (~fsdp_rows | same_mix)
                anyone |= ge & (gt | (q < r) | (q == p - 1))
            kept[rows, r] = ~earlier
            timed[rows, r] = ~anyone
    memory_only = kept & ~timed
    rows_all = np.arange(n)
    ranks: list[tuple[np.ndarray, bool]] = [(np.zeros(n, dtype=np.int64), True), (pp - 1, True)]
    for mask, is_timed in ((timed, True), (memory_only, False)):
        order = np.cumsum(mask, axis=1) - 1
        for k in range(int(mask.sum(axis=1).max()) if n else 0):
            hit = mask & (order == k)
            ranks.append((np.where(hit.any(axis=1), hit.argmax(axis=1), 0), is_timed))
    stages = []
    flat = {b: per_rank[b].ravel() for b in _LAYER_BLOCKS}
    mtp = np.broadcast_to(np.atleast_1d(np.asarray(arch.n_mtp_layers, dtype=float)), (n,))
    for rank, is_timed in ranks:
        at = rows_all * width + rank
        counts = {b: flat[b].take(at) for b in _LAYER_BLOCKS}
        last = rank == pp - 1
        counts.update(embedding=np.where(rank == 0, 1.0, 0.0), head=np.where(last, 1.0, 0.0),
                      mtp=np.where(last, mtp, 0.0))
        if single:
            stages.append(Stage(float(rank[0]), {b: float(v[0]) for b, v in counts.items()}, is_timed))
        else:
            stages.append(Stage(rank.astype(float), counts, is_timed))
    return stages


def _even_stages(arch: ArchLike, batch: LayoutBatch) -> list[Stage]:
    """`pipeline_stages` of a batch whose candidates all have the even split with their dense
    layers in virtual stage 0 or all layers dense (`_even_rows`), in closed form: rank 0,
    rank pp - 1 and, where pp > 2 and rank 0 alone holds dense layers, rank 1 for memory only
    (the same arrays the general path builds)."""
    n = len(batch)
    pp = np.broadcast_to(np.asarray(batch.pp, dtype=np.int64), (n,))
    n_layers = np.broadcast_to(np.atleast_1d(np.asarray(arch.n_layers)).astype(np.int64), (n,))
    per_rank = (n_layers // pp).astype(float)
    dense = np.broadcast_to(np.atleast_1d(np.asarray(n_ffn_dense_layers(arch), dtype=float)), (n,)).copy()
    all_dense = dense >= n_layers
    dense = np.where(all_dense, per_rank, dense)  # every rank's layers are dense
    mtp = np.broadcast_to(np.atleast_1d(np.asarray(arch.n_mtp_layers, dtype=float)), (n,)).copy()
    one_rank = pp == 1
    ones = np.ones(n)
    first = {"attention": per_rank, "dense_ffn": dense, "moe": per_rank - dense, "embedding": ones,
             "head": np.where(one_rank, 1.0, 0.0), "mtp": np.where(one_rank, mtp, 0.0)}
    last_dense = np.where(one_rank | all_dense, dense, 0.0)
    last = {"attention": per_rank, "dense_ffn": last_dense, "moe": per_rank - last_dense,
            "embedding": np.where(one_rank, 1.0, 0.0), "head": ones, "mtp": mtp}
    stages = [Stage(np.zeros(n), first), Stage((pp - 1).astype(float), last)]
    second = (pp > 2) & (dense > 0) & ~all_dense
    if second.any():
        middle = {"attention": per_rank, "dense_ffn": np.where(second, 0.0, dense),
                  "moe": np.where(second, per_rank, per_rank - dense), "embedding": np.where(second, 0.0, 1.0),
                  "head": np.where(second | ~one_rank, 0.0, 1.0), "mtp": np.where(second | ~one_rank, 0.0, mtp)}
        stages.append(Stage(np.where(second, 1.0, 0.0), middle, False))
    return stages


def _merge_stages(arch: ArchLike, batch: LayoutBatch, closed: np.ndarray) -> list[Stage]:
    """`pipeline_stages` of a batch with both kinds of rows: the closed form (computed for every
    row, kept for the `closed` ones), the general rule for the others, assembled in its order
    (first, last, timed middles, memory-only middles), each row's missing stages padded with its
    first stage."""
    n = len(batch)
    rest = np.flatnonzero(~closed)
    sub = arch.take(rest) if isinstance(arch, ArchBatch) and np.size(arch.n_layers) == n else arch
    parts = [_even_stages(arch, batch), pipeline_stages(sub, batch.take(rest))]
    groups = [[[st for st in stages if st.timed], [st for st in stages if not st.timed]] for stages in parts]
    merged = []
    for kind, is_timed in ((0, True), (1, False)):
        for i in range(max(len(g[kind]) for g in groups)):
            mine, theirs = (g[kind][i] if i < len(g[kind]) else stages[0] for g, stages in zip(groups, parts))
            rank = np.array(mine.rank, dtype=float)
            rank[rest] = theirs.rank
            counts = {}
            for b in STAGE_BLOCKS:
                counts[b] = np.array(mine.counts[b], dtype=float)
                counts[b][rest] = theirs.counts[b]
            merged.append(Stage(rank, counts, is_timed))
    return merged


def stage_layer_counts(arch: ArchLike, lay: LayoutLike) -> dict[str, dict[str, Values]]:
    """Blocks held by the first and the last pipeline stage ({"first": counts, "last": counts},
    keys STAGE_BLOCKS); with pp = 1 both are the one stage (embedding and head)."""
    stages = pipeline_stages(arch, lay)
    return {"first": stages[0].counts, "last": stages[1].counts}


@memoised
def micro_batches(lay: LayoutLike) -> Values:
    """m = gbs / (mbs * dp): micro-batches per step per pipeline (at least 1)."""
    return np.maximum(np.asarray(lay.gbs, dtype=float) / (np.asarray(lay.mbs, dtype=float) * lay.dp), 1.0)


def in_flight(lay: LayoutLike, stage: Union[str, Values]) -> Values:
    """Micro-batches whose activations pipeline rank `stage` (a rank, or `first` = 0, `last` =
    pp - 1) holds at peak."""
    pp = np.asarray(lay.pp, dtype=float)
    vpp = np.asarray(lay.vpp, dtype=float)
    if isinstance(stage, str):
        rank = np.zeros_like(pp) if stage == "first" else pp - 1.0
    else:
        rank = np.asarray(stage, dtype=float) + 0.0 * pp
    plain = pp - rank
    interleaved = ((pp - rank - 1.0) * 2.0 + (vpp - 1.0) * pp + 1.0) / vpp
    held = np.where(vpp > 1, interleaved, plain)
    return np.minimum(held, micro_batches(lay))


def bubble_slots(lay: LayoutLike) -> Values:
    """Extra micro-batch slots of 1F1B: (pp - 1) / vpp (0 without a pipeline)."""
    return (np.asarray(lay.pp, dtype=float) - 1.0) / np.asarray(lay.vpp, dtype=float)


def nodes(cluster: ClusterSpec, devices: Values) -> Values:
    """Nodes a job of `devices` occupies (innermost fabric level = node)."""
    return np.ceil(np.asarray(devices, dtype=float) / cluster.node_devices)


def straggler_factor(cluster: ClusterSpec, devices: Values) -> Values:
    return cluster.straggler.factor(nodes(cluster, devices))


def checkpoint_interval_s(cluster: ClusterSpec, devices: Values) -> Values:
    """Young's optimal checkpoint interval sqrt(2 * delta * M) (inf without MTBF or delta)."""
    gp = cluster.goodput
    if gp.node_mtbf_hours is None or gp.checkpoint_s <= 0:
        return np.full(np.shape(devices), np.inf) if np.ndim(devices) else float("inf")
    mtbf_s = gp.node_mtbf_hours * 3600.0 / nodes(cluster, devices)
    return np.sqrt(2.0 * gp.checkpoint_s * mtbf_s)


def goodput(cluster: ClusterSpec, devices: Values) -> Values:
    """Fraction of wall time that trains, eta_good (the planner's C_deliverable factor).

    `eta` when the cluster file gives it; otherwise Young/Daly from the node MTBF:
    1 - sqrt(2*delta/M) - R/M with M = node MTBF / nodes, delta = checkpoint_s,
    R = restart_s, clipped to [0, 1].
    """
    gp = cluster.goodput
    if gp.eta is not None:
        out = np.full(np.shape(devices), float(gp.eta))
        return out if np.ndim(devices) else float(gp.eta)
    assert gp.node_mtbf_hours is not None  # Goodput holds exactly one of eta and node_mtbf_hours
    mtbf_s = gp.node_mtbf_hours * 3600.0 / nodes(cluster, devices)
    eta = 1.0 - np.sqrt(2.0 * gp.checkpoint_s / mtbf_s) - gp.restart_s / mtbf_s
    eta = np.clip(eta, 0.0, 1.0)
    return eta if np.ndim(devices) else float(eta)

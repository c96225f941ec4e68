"""Per-block tables of one micro-batch on one device, computed once per distinct block.

For each block (attention, dense FFN, MoE, embedding, LM head), per micro-batch
and per layer of the block:
- time per category (compute, attention, expert_gemm) and phase (fwd; bwd =
  dgrad + wgrad), each op priced by `op_times` (roofline with efficiencies);
- the overlappable time (GEMMs, attention: what communication may hide
  behind), the kernels launched, the attention core's forward, and what each selective
  recompute module repeats (`selective_{module}_*`, `operators.RECOMPUTE_MODULE_OPS`);
- communication seconds per class (tp, cp, ep; etp counts as ep) and phase, and
  the collective launches, from the host's collective list (`comms_of`:
  `perfmodel.host.HostDispatch.block_comms`) priced by `perfmodel.comm.CollectivePricer`;
  the fused dispatchers' calls by `perfmodel.dispatch.fused_dispatch_times` (their compute
  share `ep_sm_fraction`, and `dispatch_missing` where the cluster has no figures);
- the MTP block: its own ops plus one attention, FFN (MoE when the model has MoE layers),
  LM head and embedding block, summed entry by entry.

Each block's table is a function of a few fields (TOKEN_FIELDS and the block's GROUPED_BLOCKS
fields: the attention block of the model's width, heads and sequence, and of tp, cp, mbs,
sequence parallel and precision, but not of its experts or pipeline) and of the ranks' core
share: candidates equal in those share the block's table row (`block_groups`, exact), so a
batch prices each distinct attention, dense FFN and MoE block once (a planner grid: few
geometries x layouts; a random batch still repeats its attention and dense FFN blocks). `StageBlocks` sums a table entry over the blocks one pipeline stage
holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Optional

import numpy as np

from perfmodel.choice import select
from perfmodel.comm import CollectivePricer
from perfmodel.dispatch import FP8_DISPATCH_BYTES, fused_dispatch_times, fused_span_figures
from perfmodel.grouping import pack_columns, row_groups
from perfmodel.hardware import HardwareView
from perfmodel.operators import (
    DEEPEP,
    FP8,
    FULL,
    HYBRIDEP,
    PHASES,
    RECOMPUTE_MODULE_OPS,
    SELECTIVE,
    Comm,
    Op,
    activation_bytes,
    attention_ops,
    dense_ffn_ops,
    dispatcher_code,
    embedding_ops,
    head_ops,
    moe_ops,
    mtp_ops,
    op_sac,
    op_sac_share,
    precision_code,
    recompute_code,
    recomputes,
    shapes,
)
from perfmodel.specs.architecture import MLA_FIELDS, ArchBatch
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import LayoutBatch
from perfmodel.specs.protocols import ArchLike, LayoutLike, Values

BlockTable = dict[str, Values]
"""One block's entries (seconds, kernels) keyed phase_category, phase_overlap, ..."""
Tables = dict[str, BlockTable]
CommsOf = Callable[[ArchLike, LayoutLike], dict[str, list[Comm]]]
"""The collectives of each block the ranks issue (`HostDispatch.block_comms`)."""

BLOCK_BUILDERS = (("attention", attention_ops), ("dense_ffn", dense_ffn_ops), ("moe", moe_ops),
                  ("embedding", embedding_ops), ("head", head_ops))
LAYER_BLOCKS = ("attention", "dense_ffn", "moe")
"""The blocks every transformer layer has (attention) or one of (dense FFN, MoE)."""
CATEGORIES = ("compute", "attention", "expert_gemm")
KIND_CATEGORY = {"gemm": "compute", "gemm_hp": "compute", "memory": "compute", "attention": "attention",
                 "expert_gemm": "expert_gemm"}
COMM_CLASS = {"tp": "tp", "cp": "cp", "ep": "ep", "etp": "ep", "ep_etp": "ep"}
"""Process group -> the communication class it is reported under."""

TOKEN_FIELDS = (("d_model", "seq_len"), ("tp", "cp", "mbs", "sequence_parallel", "precision"))
"""(architecture fields, layout fields) every block's table depends on: the tokens and widths per
rank, the element sizes, the tp and cp groups; with the ranks' core share."""
GROUPED_BLOCKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "attention": (("n_heads", "n_kv_heads", "head_dim") + MLA_FIELDS, ()),
    "dense_ffn": (("d_ff_dense", "gated_ffn"), ()),
    "moe": (("n_experts", "top_k", "d_expert", "n_shared_experts", "gated_ffn"),
            ("ep", "etp", "dispatcher", "capacity_factor", "pad_to_capacity")),
}
"""The blocks priced once per group of equal rows (`block_groups`), with the (architecture,
layout) fields their table depends on beyond TOKEN_FIELDS. The embedding, head and MTP blocks
(a few ops each) cost less to price on every row than to group."""
TABLE_LAYOUT_FIELDS = tuple(dict.fromkeys(TOKEN_FIELDS[1] + tuple(f for _, lay in GROUPED_BLOCKS.values() for f in lay)))
"""Every layout field a block table reads (not pp, vpp, dp, the dp flavour, gbs, recompute, the
pipeline split or the overlap switches): layouts equal in these share their block tables."""
GROUP_SAMPLE = 8192
"""Rows `block_groups` samples first: sampled from n rows in G equal groups, about
G (1 - exp(-sample / G)) differ, so a block with G <= n / 2 (worth grouping) shows at most ~3/4
of them distinct once the sample is a fair share of n (n <= 64k rows: the chunk)."""


def op_times(op: Op, hw: HardwareView) -> tuple[Values, Values, Values]:
    """Seconds of one op per phase (fwd, dgrad, wgrad).

    memory-bound: `HardwareView.memory_seconds(bytes, kernels, class)` of each phase; GEMM:
    max(FLOPs / gemm_rate(phase dims), `operand_seconds` of its operand bytes), each phase at its own
    (m, n, k) (`kernels.forms.phase_dims`); attention core: max(FLOPs / attention_rate(phase),
    copy seconds), its backward in the dgrad slot."""
    out: list[Values] = []
    if op.kind == "memory":
        for j in range(3):
            nbytes = op.bytes[j]
            out.append(0.0 if (np.ndim(nbytes) == 0 and nbytes == 0)
                       else hw.memory_seconds(nbytes, op.kernels[j], op.memory_class))
        return out[0], out[1], out[2]
    for j, phase in enumerate(PHASES):
        nbytes, flops = op.bytes[j], op.flops[j]
        if np.ndim(flops) == 0 and flops == 0 and np.ndim(nbytes) == 0 and nbytes == 0:
            out.append(0.0)  # nothing in this phase (e.g. attention has no weight gradient)
            continue
        if op.kind == "attention":
            rate = hw.attention_rate("fwd" if j == 0 else "bwd", op.shape[0], op.shape[1])
        else:
            rate = hw.gemm_rate(op.kind, phase, op.shape[0], op.shape[1], op.shape[2])
        with np.errstate(invalid="ignore", divide="ignore"):
            compute_s = select(np.asarray(flops) > 0, flops / rate, 0.0)
        out.append(np.maximum(compute_s, hw.operand_seconds(nbytes)))
    return out[0], out[1], out[2]


def block_tables(arch: ArchLike, lay: LayoutLike, comms_of: CommsOf, pricer: CollectivePricer,
                 hw: HardwareView) -> Tables:
    """Per block, per micro-batch: time per category and phase, overlappable time,
    kernels, the forward totals (for full recompute) and the attention core's
    forward (for selective recompute); and communication per class and phase."""
    comms = comms_of(arch, lay)
    tables = {block: block_table(arch, lay, builder, comms[block], pricer, hw)
              for block, builder in _builders("mtp" in comms)}
    if "mtp" in tables:
        _add_mtp_layer(arch, tables)
    return tables


def _builders(mtp: bool) -> tuple[tuple[str, Callable[[ArchLike, LayoutLike], list[Op]]], ...]:
    """The blocks of a batch and their op lists: BLOCK_BUILDERS, and mtp where the batch has MTP modules."""
    return BLOCK_BUILDERS + ((("mtp", mtp_ops),) if mtp else ())


def block_table(arch: ArchLike, lay: LayoutLike, builder: Callable[[ArchLike, LayoutLike], list[Op]],
                comms: list[Comm], pricer: CollectivePricer, hw: HardwareView,
                op_policy: Optional[bool] = None) -> BlockTable:
    """One block's table (`block_tables`) from its ops (`builder`) and its collectives; the
    entries of torchtitan's per-op policy where `op_policy` (default: some row of `lay` uses it;
    a table shared by a group of rows is told whether any row of the batch does)."""
    table: BlockTable = {f"{ph}_{cat}": 0.0 for ph in ("fwd", "bwd") for cat in CATEGORIES}
    table.update(fwd_overlap=0.0, bwd_overlap=0.0, fwd_kernels=0.0, bwd_kernels=0.0, core_fwd=0.0)
    selective: dict[str, Values] = {f"selective_{m}_{key}": 0.0 for m in RECOMPUTE_MODULE_OPS
                                    for key in ("fwd", "fwd_overlap", "kernels")}
    module_of = {op_name: m for m, names in RECOMPUTE_MODULE_OPS.items() for op_name in names}
    ops = builder(arch, lay)
    # torchtitan's per-op policy, from an even and an odd matmul count at the block's start (a
    # dense FFN or MoE block follows an attention block of either parity: StageBlocks.recomputed)
    selective.update({f"selective_op_odd_{key}": 0.0 for key in ("fwd", "fwd_overlap", "kernels")})
    op_policy = bool(np.any(recomputes(lay, "op"))) if op_policy is None else op_policy
    op_shares = ({parity: op_sac(arch, lay, ops[0].block, start)[0] for parity, start in (("op", 0.0), ("op_odd", 1.0))}
                 if ops and op_policy else {})  # no row of the batch on that policy: its entries stay 0
    for op in ops:
        fwd_s, dgrad_s, wgrad_s = op_times(op, hw)
        cat = KIND_CATEGORY[op.kind]
        table[f"fwd_{cat}"] = table[f"fwd_{cat}"] + fwd_s
        table[f"bwd_{cat}"] = table[f"bwd_{cat}"] + dgrad_s + wgrad_s
        if op.overlappable:
            table["fwd_overlap"] = table["fwd_overlap"] + fwd_s
            table["bwd_overlap"] = table["bwd_overlap"] + dgrad_s + wgrad_s
        table["fwd_kernels"] = table["fwd_kernels"] + op.kernels[0]
        table["bwd_kernels"] = table["bwd_kernels"] + op.kernels[1] + op.kernels[2]
        if op.name == "core_attention":
            table["core_fwd"] = table["core_fwd"] + fwd_s  # a mixed MHA/MLA batch has both cores, each zero where unused
        m = module_of.get(op.name)
        if m is not None:
            _add_recomputed(selective, m, op, fwd_s, 1.0)
        for parity, shares in op_shares.items():
            _add_recomputed(selective, parity, op, fwd_s, op_sac_share(op, shares))
    table.update(selective)
    for cls in ("tp", "cp", "ep"):
        table[f"fwd_{cls}"] = 0.0
        table[f"bwd_{cls}"] = 0.0
    table["fwd_comm_kernels"] = 0.0
    table["bwd_comm_kernels"] = 0.0
    fused = None
    for comm in comms:
        if comm.kind == "fused":
            fused = _fused_times(arch, lay, pricer) if fused is None else fused
            seconds = getattr(fused, comm.name.removeprefix("ep_fused_")) * comm.bytes
            table["ep_sm_fraction"] = fused.sm_fraction
            table["dispatch_missing"] = ~fused.available
        else:
            seconds = pricer.time(comm.group, comm.kind, comm.bytes)
        key = f"{comm.phase}_{COMM_CLASS[comm.group]}"
        table[key] = table[key] + seconds
        table[f"{comm.phase}_comm_kernels"] = table[f"{comm.phase}_comm_kernels"] + (seconds > 0)
    return table


FUSED_NAMES = {DEEPEP: "deepep", HYBRIDEP: "hybridep"}
"""Dispatcher codes of the fused dispatchers -> their names in a cluster's `ep_dispatch`."""


def fused_dispatch_figures(cluster: ClusterSpec, lay: LayoutLike) -> tuple[np.ndarray, np.ndarray]:
    """Per layout row, (whether the cluster prices its dispatcher over the level its EP group
    spans, the compute-unit share it holds there: the MoE table's `dispatch_missing` negated and
    `ep_sm_fraction`): `perfmodel.dispatch.fused_span_figures`."""
    return fused_span_figures(cluster, lay, np.asarray(dispatcher_code(lay)), FUSED_NAMES)


def _fused_times(arch: ArchLike, lay: LayoutLike, pricer: CollectivePricer):  # -> FusedDispatchTimes
    """The fused dispatchers' four calls per MoE layer and micro-batch (`perfmodel.dispatch`)."""
    sh = shapes(arch, lay)
    b = activation_bytes(lay)
    dispatch_bytes = np.where(np.asarray(precision_code(lay)) >= FP8, FP8_DISPATCH_BYTES, b)
    return fused_dispatch_times(pricer.cluster, lay, np.asarray(dispatcher_code(lay)),
                                FUSED_NAMES, np.asarray(arch.n_experts, dtype=float),
                                np.asarray(arch.top_k, dtype=float), sh["T_moe"], sh["h"], sh["rows"], b,
                                dispatch_bytes, 1.0 / pricer.slowdown)


def _add_recomputed(selective: dict[str, Values], key: str, op: Op, fwd_s: Values, share: Values) -> None:
    """Add `share` of `op`'s forward to `selective_{key}_*`: its seconds, its overlappable seconds,
    its kernels (all of them where any share is run again)."""
    selective[f"selective_{key}_fwd"] = selective[f"selective_{key}_fwd"] + share * fwd_s
    if op.overlappable:
        selective[f"selective_{key}_fwd_overlap"] = selective[f"selective_{key}_fwd_overlap"] + share * fwd_s
    selective[f"selective_{key}_kernels"] = (selective[f"selective_{key}_kernels"]
                                             + np.where(np.asarray(share) > 0, op.kernels[0], 0.0))


def _add_mtp_layer(arch: ArchLike, tables: Tables) -> None:
    """The MTP block = its own ops + one attention, FFN (MoE when the model has MoE layers), head
    and embedding block (module doc); selective recompute is not applied to it."""
    from perfmodel.specs.architecture import n_moe_layers

    moe = np.asarray(n_moe_layers(arch)) > 0
    mtp = tables["mtp"]
    for key in list(mtp):
        if key.startswith("selective") or key in ("core_fwd", "ep_sm_fraction", "dispatch_missing"):
            continue
        ffn = np.where(moe, tables["moe"].get(key, 0.0), tables["dense_ffn"].get(key, 0.0))
        mtp[key] = (mtp[key] + tables["attention"].get(key, 0.0) + ffn + tables["head"].get(key, 0.0)
                    + tables["embedding"].get(key, 0.0))


def block_groups(block: str, arch: ArchBatch, lay: LayoutBatch, tokens: list[np.ndarray]
                 ) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(representatives, inverse) of the candidates by `block`'s table (`tokens`: TOKEN_FIELDS and
    the core share packed, `grouping.pack_columns`; and the block's GROUPED_BLOCKS fields) when at
    most half of them differ, else None. Exact (`grouping.row_groups`); skipped when the first
    GROUP_SAMPLE rows are mostly distinct (a random batch's MoE blocks)."""
    n = len(arch.n_layers)
    arch_fields, lay_fields = GROUPED_BLOCKS[block]
    columns = tokens + [getattr(arch, f) for f in arch_fields] + [getattr(lay, f) for f in lay_fields]
    sample = min(n, GROUP_SAMPLE)
    if 4 * len(row_groups([np.asarray(col)[:sample] for col in columns])[0]) > 3 * sample:
        return None
    first, inverse = row_groups(columns)
    return None if 2 * len(first) > n else (first, inverse)


def shared_block_tables(arch: ArchBatch, lay: LayoutBatch, cluster: ClusterSpec, comms_of: CommsOf,
                        pricer: CollectivePricer, hw: HardwareView) -> Tables:
    """`block_tables`, the GROUPED_BLOCKS computed once per group of `block_groups` and gathered."""
    comms = comms_of(arch, lay)
    tokens = None
    tables: Tables = {}
    op_policy = bool(np.any(recomputes(lay, "op")))  # a group's rows are not told apart by recompute
    for block, builder in _builders("mtp" in comms):
        groups = None
        if block in GROUPED_BLOCKS and len(hw.share) >= 256:
            if tokens is None:
                arch_fields, lay_fields = TOKEN_FIELDS
                tokens = pack_columns([getattr(arch, f) for f in arch_fields] + [getattr(lay, f) for f in lay_fields]
                                      + [hw.share])
            groups = block_groups(block, arch, lay, tokens)
        if groups is None:
            tables[block] = block_table(arch, lay, builder, comms[block], pricer, hw, op_policy)
            continue
        first, inverse = groups
        sub_hw = hw.take(first)
        sub = block_table(arch.take(first), lay.take(first), builder, _comms_at(comms[block], first),
                          pricer.take(first, sub_hw.share), sub_hw, op_policy)
        tables[block] = {k: (np.asarray(v)[inverse] if np.ndim(v) else v) for k, v in sub.items()}
    if "mtp" in tables:
        _add_mtp_layer(arch, tables)
    return tables


def _comms_at(comms: list[Comm], rows: np.ndarray) -> list[Comm]:
    """The collectives of the candidates at `rows` (a buffer several share stays one object)."""
    taken: dict[int, Values] = {}
    out = []
    for comm in comms:
        if np.ndim(comm.bytes) and id(comm.bytes) not in taken:
            taken[id(comm.bytes)] = np.asarray(comm.bytes)[rows]
        out.append(replace(comm, bytes=taken.get(id(comm.bytes), comm.bytes)))
    return out


class StageBlocks:
    """The blocks one pipeline stage holds (`counts` per block, from
    `schedule.stage_layer_counts`), their tables, and its candidates' recompute masks."""

    def __init__(self, arch: ArchLike, lay: LayoutLike, tables: Tables, counts: dict[str, Values]) -> None:
        self.arch, self.lay, self.tables, self.counts = arch, lay, tables, counts
        code = np.asarray(recompute_code(lay))
        self.full = code == FULL
        self.selective = code == SELECTIVE
        self.modules = {m: np.asarray(recomputes(lay, m)) for m in RECOMPUTE_MODULE_OPS}
        """Per selective recompute module, the rows that checkpoint it."""
        self.reruns_layers = self.full | self.modules["op"]
        """Rows whose host runs each layer's forward again in the backward pass: full recompute,
        and torchtitan's per-op policy (its saved ops are still dispatched, served from the cache;
        the MoE dispatcher's host synchronisation repeats)."""
        self._memo: dict[tuple[str, tuple[str, ...]], Values] = {}
        self._op_odd: Optional[np.ndarray] = None

    def op_odd(self) -> np.ndarray:
        """Rows whose attention block makes an odd number of aten.mm calls (`operators.op_sac`):
        their FFN / MoE blocks continue the count at odd parity. Computed once per stage."""
        if self._op_odd is None:
            self._op_odd = np.mod(op_sac(self.arch, self.lay, "attention")[2], 2.0) == 1.0
        return self._op_odd

    def recomputed(self, entry: str) -> Values:
        """Sum over the selective recompute modules each row checkpoints of the layer blocks'
        `selective_{module}_{entry}` (entry: fwd, fwd_overlap, kernels)."""
        acc: Values = 0.0
        for m, on in self.modules.items():
            if not on.any():
                continue
            if m == "op":  # the FFN / MoE blocks continue the attention block's matmul count
                ffn = ("dense_ffn", "moe")
                value = self.total(f"selective_op_{entry}", ("attention",)) + np.where(
                    self.op_odd(), self.total(f"selective_op_odd_{entry}", ffn), self.total(f"selective_op_{entry}", ffn))
            else:
                value = self.total(f"selective_{m}_{entry}", LAYER_BLOCKS)
            acc = acc + np.where(on, value, 0.0)
        return acc

    def total(self, key: str, blocks: Optional[tuple[str, ...]] = None) -> Values:
        """Sum over `blocks` (default: all, in table order) of (blocks on this stage) x
        (per-block entry `key`); zero entries are skipped. The sum over all blocks continues the
        sum over the LAYER_BLOCKS (the first in table order), which is kept: the same additions."""
        blocks = tuple(self.tables) if blocks is None else blocks
        if (key, blocks) not in self._memo:
            start, acc = 0, 0.0
            if len(blocks) > len(LAYER_BLOCKS) and blocks[:len(LAYER_BLOCKS)] == LAYER_BLOCKS:
                start, acc = len(LAYER_BLOCKS), self.total(key, LAYER_BLOCKS)
            for b in blocks[start:]:
                value = self.tables[b][key]
                if np.ndim(value) == 0 and value == 0:
                    continue
                acc = acc + self.counts[b] * value
            self._memo[(key, blocks)] = acc
        return self._memo[(key, blocks)]

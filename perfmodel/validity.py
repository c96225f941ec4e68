"""Validity rules of a (model, layout, devices) triple as named pure functions.

Each predicate takes architecture and layout attributes as numbers or numpy
arrays (an `MoEArchitecture`/`ArchBatch`, a `ParallelLayout`/`LayoutBatch`)
and returns a boolean (array). The performance model, the enumeration, the
MINLP and the trainer all call these same functions; `violations` turns them
into messages for one configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from perfmodel.errors import InputError
from perfmodel.grouping import MIN_GROUPED_ROWS, row_groups
from perfmodel.operators import DDP, dispatcher_code, dp_flavor_code
from perfmodel.specs.architecture import MoEArchitecture
from perfmodel.specs.layout import DISPATCHERS, FUSED_DISPATCHERS, LayoutBatch, ParallelLayout
from perfmodel.specs.protocols import ArchLike, Flag, LayoutLike
from perfmodel.specs.stages import split_columns, split_problem, stage_layer_table

FUSED_CODES = [DISPATCHERS.index(d) for d in FUSED_DISPATCHERS]


def _a(x: ArrayLike) -> np.ndarray:
    return np.asarray(x)


def tp_divides_heads(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Megatron splits heads over tp: tp | n_heads and tp | n_kv_heads."""
    return (_a(arch.n_heads) % lay.tp == 0) & (_a(arch.n_kv_heads) % lay.tp == 0)


def tp_divides_ffn(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Dense FFN and shared experts are split over tp: tp | their widths (when present)."""
    dense_ok = (_a(arch.d_ff_dense) % lay.tp == 0) | (_a(arch.d_ff_dense) == 0)
    shared_ok = (_a(arch.n_shared_experts) * arch.d_expert % lay.tp == 0)
    return dense_ok & shared_ok


def cp_divides_seq(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Context parallel splits the sequence into 2*cp chunks (load-balanced causal CP)."""
    return (_a(lay.cp) == 1) | (_a(arch.seq_len) % (2 * _a(lay.cp)) == 0)


def _batch(lay: LayoutLike) -> LayoutBatch:
    return LayoutBatch.stack([lay]) if isinstance(lay, ParallelLayout) else lay


def split_fits_layers(arch: ArchLike, lay: LayoutLike) -> Flag:
    """The pipeline split (`perfmodel.specs.stages`) gives every virtual stage >= 0 layers and
    adds up to n_layers (Megatron's divisibility rules fail this), and a layout string holds
    one 'm' per MTP module. Batches are worked out once per distinct input row (`row_groups`)."""
    batch = _batch(lay)
    n_layers = np.broadcast_to(np.atleast_1d(_a(arch.n_layers)).astype(np.int64), (max(len(batch), np.size(arch.n_layers)),))
    n = len(n_layers)
    if len(batch) != n:  # one layout for many architectures
        batch = batch.take(np.zeros(n, dtype=np.int64))
    mtp_layers = np.broadcast_to(np.atleast_1d(_a(arch.n_mtp_layers)), (n,))
    if n >= MIN_GROUPED_ROWS and not isinstance(lay, ParallelLayout):
        first, inverse = row_groups([n_layers, mtp_layers] + split_columns(batch))
        if 2 * len(first) <= n:
            return _split_fits(n_layers[first], mtp_layers[first], batch.take(first))[inverse]
    ok = _split_fits(n_layers, mtp_layers, batch)
    return ok if not isinstance(lay, ParallelLayout) else bool(ok[0])


def _split_fits(n_layers: np.ndarray, mtp_layers: np.ndarray, batch: LayoutBatch) -> np.ndarray:
    """`split_fits_layers` row by row."""
    n = len(n_layers)
    stages = np.broadcast_to(np.asarray(batch.pp, dtype=np.int64) * np.asarray(batch.vpp, dtype=np.int64), (n,))
    default = np.broadcast_to(
        (np.asarray(batch.stage_layers)[:, 0] < 0) & (np.asarray(batch.first_stage_layers) < 0)
        & (np.asarray(batch.last_stage_layers) < 0) & ~np.asarray(batch.account_embedding, dtype=bool)
        & ~np.asarray(batch.account_loss, dtype=bool) & ~np.asarray(batch.balanced_split, dtype=bool), (n,))
    ok = default & (n_layers % stages == 0)  # the even split always fits
    rest = np.flatnonzero(~ok)
    if len(rest):
        table = stage_layer_table(n_layers[rest], batch.take(rest))
        inside = np.arange(table.shape[1])[None, :] < stages[rest][:, None]
        ok = ok.copy()
        ok[rest] = (table.sum(axis=1) == n_layers[rest]) & np.all(np.where(inside, table, 0.0) >= 0, axis=1)
    mtp = np.broadcast_to(np.asarray(batch.stage_mtp), (n,))
    return ok & ((mtp < 0) | (mtp == mtp_layers))


def vpp_needs_pp(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Interleaving (vpp > 1) needs a pipeline (pp > 1)."""
    return (_a(lay.vpp) == 1) | (_a(lay.pp) > 1)


def ep_divides_experts(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Routed experts split evenly over ep; a dense model has ep = 1."""
    n_experts = _a(arch.n_experts)
    return np.where(n_experts > 0, n_experts % np.asarray(lay.ep) == 0, _a(lay.ep) == 1)


def expert_folding(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Parallel folding: etp * ep divides tp * cp * dp (edp = tp*cp*dp / (etp*ep) is whole)."""
    return (_a(lay.tp) * lay.cp * lay.dp) % (_a(lay.etp) * lay.ep) == 0


def etp_divides_expert(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Expert tensor parallel splits d_expert: etp | d_expert (etp = 1 for dense)."""
    return np.where(_a(arch.n_experts) > 0, _a(arch.d_expert) % _a(lay.etp) == 0, _a(lay.etp) == 1)


def fused_dispatch_etp(arch: ArchLike, lay: LayoutLike) -> Flag:
    """The fused dispatchers (deepep, hybridep) are modelled with etp = 1 (each token goes once
    to each expert-parallel rank)."""
    fused = np.isin(np.asarray(dispatcher_code(lay)), FUSED_CODES)
    return ~fused | (_a(lay.etp) == 1)


def batch_divides(arch: ArchLike, lay: LayoutLike) -> Flag:
    """gbs is a whole number of micro-batches per data-parallel rank."""
    return _a(lay.gbs) % (_a(lay.mbs) * lay.dp) == 0


def tp_overlap_needs_tp(arch: ArchLike, lay: LayoutLike) -> Flag:
    """TP communication overlap needs tensor parallelism. (Megatron's `--tp-comm-overlap` also
    needs sequence parallel; MindSpeed's CoC overlaps the plain all-reduces: the exporters check.)"""
    return ~_a(lay.tp_comm_overlap) | (_a(lay.tp) > 1)


def ep_overlap_needs_ep(arch: ArchLike, lay: LayoutLike) -> Flag:
    """EP all-to-all overlap needs expert parallelism. (Megatron-Core's own conditions: no full
    recompute, vpp under pp > 1, not the allgather dispatcher; MindSpeed's --moe-fb-overlap runs
    with full recompute: the exporters check theirs.)"""
    return ~_a(lay.ep_comm_overlap) | (_a(lay.ep) > 1)


def param_gather_overlap_needs_sharding(arch: ArchLike, lay: LayoutLike) -> Flag:
    """Only sharded optimizers gather parameters: overlap_param_gather needs zero1 or fsdp
    (Megatron-LM validate_args: distributed optimizer or Megatron-FSDP)."""
    return ~_a(lay.overlap_param_gather) | (dp_flavor_code(lay) != DDP)


def world_matches(arch: ArchLike, lay: LayoutLike, devices: ArrayLike) -> Flag:
    """tp * cp * pp * dp uses exactly the devices of the job."""
    return _a(lay.tp) * lay.cp * lay.pp * lay.dp == _a(devices)


RULES: tuple[tuple[str, Callable[[ArchLike, LayoutLike], Flag], str], ...] = (
    ("tp_divides_heads", tp_divides_heads, "tp={tp} must divide n_heads={n_heads} and n_kv_heads={n_kv_heads}; pick a common divisor"),
    ("tp_divides_ffn", tp_divides_ffn, "tp={tp} must divide d_ff_dense={d_ff_dense} and n_shared_experts*d_expert; pick a divisor"),
    ("cp_divides_seq", cp_divides_seq, "cp={cp}: seq_len={seq_len} must be a multiple of 2*cp; change cp or seq_len"),
    ("split_fits_layers", split_fits_layers, "{split_problem}"),
    ("vpp_needs_pp", vpp_needs_pp, "vpp={vpp} needs pp > 1; set vpp=1 or add pipeline stages"),
    ("ep_divides_experts", ep_divides_experts, "ep={ep} must divide n_experts={n_experts} (ep=1 for a dense model); pick a divisor"),
    ("expert_folding", expert_folding, "etp*ep={etp}*{ep} must divide tp*cp*dp={tp}*{cp}*{dp} (experts fold onto the data-parallel ranks); lower ep or etp"),
    ("etp_divides_expert", etp_divides_expert, "etp={etp} must divide d_expert={d_expert} (etp=1 for a dense model)"),
    ("batch_divides", batch_divides, "gbs={gbs} must be a multiple of mbs*dp={mbs}*{dp}; change gbs or mbs"),
    ("tp_overlap_needs_tp", tp_overlap_needs_tp, "tp_comm_overlap needs tp > 1 (tp={tp}); turn it off or raise tp"),
    ("ep_overlap_needs_ep", ep_overlap_needs_ep, "ep_comm_overlap needs ep > 1 (ep={ep}); turn it off or raise ep"),
    ("param_gather_overlap_needs_sharding", param_gather_overlap_needs_sharding, "overlap_param_gather needs dp_flavor zero1 or fsdp (got {dp_flavor}); turn it off or shard the optimizer"),
    ("fused_dispatch_etp", fused_dispatch_etp, "dispatcher={dispatcher} is modelled with etp=1, got etp={etp}; set etp=1 or dispatcher=alltoall"),
)


LAYOUT_ONLY_RULES = ("vpp_needs_pp", "tp_overlap_needs_tp", "ep_overlap_needs_ep", "param_gather_overlap_needs_sharding",
                     "fused_dispatch_etp")
"""The rules that read the layout alone (tested): true or false of a layout row for every model."""


def layout_rules_ok(lay: LayoutLike, names: Sequence[str] = LAYOUT_ONLY_RULES) -> np.ndarray:
    """Each layout row's verdict under the rules `names` (a subset of LAYOUT_ONLY_RULES)."""
    assert set(names) <= set(LAYOUT_ONLY_RULES), names
    ok = np.ones(len(_batch(lay)), dtype=bool)
    for name, rule, _ in RULES:
        if name in names:
            ok &= np.asarray(rule(None, lay), dtype=bool)
    return ok


def valid_mask(arch: ArchLike, lay: LayoutLike, devices: ArrayLike) -> np.ndarray:
    """All rules at once over arrays (what the search uses)."""
    ok = np.asarray(world_matches(arch, lay, devices), dtype=bool)
    for _, rule, _ in RULES:
        ok = ok & np.asarray(rule(arch, lay), dtype=bool)
    return ok


def violations(arch: MoEArchitecture, layout: ParallelLayout, devices: int) -> list[str]:
    """Every violated rule of one configuration, as a message naming fields and fix."""
    if layout.dp is None or layout.gbs is None:
        layout = layout.resolve(devices)
    fields = {**{k: getattr(arch, k) for k in vars(arch)}, **{k: getattr(layout, k) for k in vars(layout)},
              "split_problem": split_problem(arch.n_layers, arch.n_mtp_layers, layout)}
    messages = []
    if not world_matches(arch, layout, devices):
        messages.append(f"world_matches: tp*cp*pp*dp={layout.world()} must equal the device count {devices}; "
                        "change dp or the device count")
    for name, rule, template in RULES:
        if not bool(rule(arch, layout)):
            messages.append(f"{name}: " + template.format(**fields))
    return messages


def validate(arch: MoEArchitecture, layout: ParallelLayout, devices: int) -> None:
    """Raise one InputError listing every violated rule (none: return quietly)."""
    problems = violations(arch, layout, devices)
    if problems:
        raise InputError("invalid layout: " + "; ".join(problems))

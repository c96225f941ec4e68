"""The search space: a YAML a user can edit, resolved against a cluster and a budget.

`SearchSpace` is loaded strictly (unknown keys are errors). `auto` entries are
resolved by `resolve_space`:
  layout.tp           powers of two up to the scale-up domain (`scale_up_devices`: the
                      devices one scale-up fabric joins at the node's bandwidth: 8 on an
                      HGX node, 72 on NVL72, 768 dies on CloudMatrix384); the validity
                      rules then keep what the geometry allows (tp | heads and KV heads)
  layout.sequence_parallel   on exactly when tp > 1
  geometry.active_params     N_act with D/N_act in `tokens_per_param` under the
                             compute-optimal budget C (C = 6 N D -> N = sqrt(C / (6 r)))
`geometries` expands the geometry lists into an `ArchBatch` (vectorised);
`layout_grid` expands the layout lists into a `LayoutBatch` whose gbs is filled
per (geometry, layout) pair by `perfmodel.specs.layout.gbs_holding_tokens` (it
depends on seq_len).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional, Union

import numpy as np

from perfmodel import layouts as perfmodel_layouts
from perfmodel import validity as perfmodel_validity
from perfmodel.errors import InputError
from perfmodel.specs.architecture import ARCH_FIELDS, ArchBatch, MoEArchitecture, active_params
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import (
    DEFAULT_RECOMPUTE_MASK,
    DISPATCHERS,
    DP_FLAVORS,
    OVERLAP_FIELDS,
    PRECISIONS,
    RECOMPUTE_MODES,
    LayoutBatch,
    recompute_module_mask,
)
from perfmodel.specs.strict import check, load_spec, spec_from_dict

PIPELINE_SPLITS = ("default", "balanced")
ATTENTION_KINDS = ("gqa", "mla")

IntList = tuple[int, ...]
TP_RULES = ("tp_divides_heads", "tp_divides_ffn")
"""The validity rules that read only tp and the geometry (`usable_tp`; tested)."""


def _positive_list(values: tuple, key: str) -> None:
    check(len(values) > 0, key, "is empty", "give at least one value")
    check(all(v > 0 for v in values), key, f"values must be > 0, got {list(values)}", "use positive values")


@dataclass(frozen=True)
class MLARanks:
    """The latent ranks of the space's MLA geometries. Defaults: DeepSeek-V3's (arXiv 2412.19437
    sec. 4.2: d_c = 512, d'_c = 1536, d_h^R = 64), which DeepSeek-V2 (h 5120, arXiv 2405.04434
    sec. 3.1) and Kimi K2 (h 7168) share: the ranks stay fixed while the width changes."""

    q_lora_rank: int = 1536
    """Query compression rank r_q (0, and where r_q >= d_model: queries projected from h, as
    DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    def __post_init__(self) -> None:
        check(self.q_lora_rank >= 0, "q_lora_rank", "must be >= 0", "e.g. 1536, or 0 for no query compression")
        check(self.kv_lora_rank >= 1, "kv_lora_rank", "must be >= 1", "e.g. 512")
        check(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
              f"must be even and >= 2, got {self.qk_rope_head_dim}", "e.g. 64")


@dataclass(frozen=True)
class GeometrySpace:
    """Model geometries to search (lists are crossed; rules below filter the product)."""

    d_model: IntList
    n_layers: IntList
    aspect_ratio: tuple[float, ...] = (32.0, 256.0)
    """[min, max] of d_model / n_layers."""
    head_dim: int = 128
    """n_heads = d_model / head_dim."""
    kv_heads: int = 8
    """n_kv_heads = min(kv_heads, n_heads)."""
    n_experts: IntList = (0, 8, 16, 32, 64)
    """Routed experts; 0 = a dense model."""
    top_k: IntList = (1, 2)
    granularity: tuple[float, ...] = (1.0,)
    """G values; d_expert = ffn_ratio * d_model / G rounded to d_expert_multiple."""
    d_expert_multiple: int = 64
    n_shared_experts: IntList = (0,)
    n_dense_layers: IntList = (0,)
    ffn_ratio: float = 4.0
    gated_ffn: bool = True
    tie_embeddings: bool = False
    attention: tuple[str, ...] = ("gqa",)
    """Attention kinds to search: gqa (n_kv_heads = kv_heads) and mla (multi-head latent attention
    with the ranks of `mla`, where kv_lora_rank < d_model: n_kv_heads = n_heads, query/key heads
    head_dim + qk_rope_head_dim wide, value heads head_dim wide, n_heads = d_model / head_dim as
    DeepSeek-V2-Lite's 16 x 128)."""
    mla: MLARanks = field(default_factory=MLARanks)
    seq_len: IntList = (4096,)
    vocab_size: IntList = (131072,)
    active_params: Union[tuple[float, ...], str] = "auto"
    """[min, max] active (non-embedding) parameters, or auto (from tokens_per_param)."""
    tokens_per_param: tuple[float, ...] = (5.0, 2000.0)
    """[min, max] D / N_act under the compute-optimal budget (used by active_params: auto)."""

    def __post_init__(self) -> None:
        for key in ("d_model", "n_layers", "top_k", "granularity", "seq_len", "vocab_size"):
            _positive_list(getattr(self, key), key)
        check(len(self.n_experts) > 0 and all(e >= 0 for e in self.n_experts), "n_experts",
              "must list values >= 0", "use 0 for dense and positive expert counts")
        check(all(e >= 0 for e in self.n_shared_experts) and len(self.n_shared_experts) > 0, "n_shared_experts",
              "must list values >= 0", "e.g. [0, 1]")
        check(all(e >= 0 for e in self.n_dense_layers) and len(self.n_dense_layers) > 0, "n_dense_layers",
              "must list values >= 0", "e.g. [0, 1]")
        check(len(self.aspect_ratio) == 2 and 0 < self.aspect_ratio[0] <= self.aspect_ratio[1], "aspect_ratio",
              f"must be [min, max] with 0 < min <= max, got {list(self.aspect_ratio)}", "e.g. [32, 256]")
        check(self.head_dim >= 1 and self.kv_heads >= 1 and self.d_expert_multiple >= 1, "head_dim",
              "head_dim, kv_heads and d_expert_multiple must be >= 1", "give positive integers")
        check(self.ffn_ratio > 0, "ffn_ratio", "must be > 0", "e.g. 4.0")
        bad = [a for a in self.attention if a not in ATTENTION_KINDS]
        check(len(self.attention) > 0 and not bad, "attention", f"unknown or empty: {list(self.attention)}",
              f"use some of {', '.join(ATTENTION_KINDS)}")
        if isinstance(self.active_params, str):
            check(self.active_params == "auto", "active_params", f"{self.active_params!r} is not 'auto'",
                  "write auto or [min, max]")
        else:
            check(len(self.active_params) == 2 and 0 < self.active_params[0] <= self.active_params[1],
                  "active_params", "must be [min, max] with 0 < min <= max", "e.g. [1.0e9, 5.0e10]")
        check(len(self.tokens_per_param) == 2 and 0 < self.tokens_per_param[0] <= self.tokens_per_param[1],
              "tokens_per_param", "must be [min, max] with 0 < min <= max", "e.g. [5, 2000]")


@dataclass(frozen=True)
class LayoutSpace:
    """Parallel layouts to search for every geometry (crossed, then filtered by validity)."""

    tp: Union[IntList, str] = "auto"
    pp: IntList = (1, 2, 4, 8)
    vpp: IntList = (1,)
    ep: IntList = (1, 2, 4, 8)
    etp: IntList = (1,)
    cp: IntList = (1,)
    dp_flavor: tuple[str, ...] = ("zero1",)
    mbs: IntList = (1,)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: Union[tuple[bool, ...], str] = "auto"
    precision: tuple[str, ...] = ("bf16",)
    overlap_grad_reduce: tuple[bool, ...] = (True,)
    overlap_param_gather: tuple[bool, ...] = (True,)
    tp_comm_overlap: tuple[bool, ...] = (False,)
    ep_comm_overlap: tuple[bool, ...] = (False,)
    """The frameworks' overlap switches to search (`ParallelLayout`): list [false, true] to let
    the planner choose; each export sets the chosen ones' flags."""
    gbs_tokens: float = 8.0e6
    """Global batch: the smallest multiple of mbs*dp holding this many tokens (`gbs_holding_tokens`)."""
    pipeline_split: tuple[str, ...] = ("default",)
    """Pipeline splits to try with pp > 1 (`perfmodel.specs.stages`): default = even where pp*vpp
    divides the layers, else balanced; balanced = the embedding and the loss counted as a layer
    each, always. Listing both lets the search pick the split that balances the stages."""
    dispatcher: tuple[str, ...] = ("alltoall",)
    """MoE token dispatchers to try with ep > 1 (alltoall, allgather, deepep, hybridep; the fused
    ones only where the cluster has measured figures)."""
    recompute_modules: tuple[Optional[str], ...] = (None,)
    """Module lists to try with recompute=selective (`ParallelLayout.recompute_modules`, e.g.
    [null, layernorm+moe_act]; null = Megatron's default, core_attn)."""

    def __post_init__(self) -> None:
        if isinstance(self.tp, str):
            check(self.tp == "auto", "tp", f"{self.tp!r} is not 'auto'", "write auto or a list")
        else:
            _positive_list(self.tp, "tp")
        for key in ("pp", "vpp", "ep", "etp", "cp", "mbs"):
            _positive_list(getattr(self, key), key)
        for key, allowed in (("dp_flavor", DP_FLAVORS), ("recompute", RECOMPUTE_MODES), ("precision", PRECISIONS)):
            values = getattr(self, key)
            check(len(values) > 0, key, "is empty", f"use some of {', '.join(allowed)}")
            bad = [v for v in values if v not in allowed]
            check(not bad, key, f"unknown value(s) {bad}", f"use some of {', '.join(allowed)}")
        if isinstance(self.sequence_parallel, str):
            check(self.sequence_parallel == "auto", "sequence_parallel", f"{self.sequence_parallel!r} is not 'auto'",
                  "write auto or a list of true/false")
        for key in OVERLAP_FIELDS:
            values = getattr(self, key)
            check(len(values) > 0 and all(isinstance(v, bool) for v in values), key,
                  f"must be a non-empty list of true/false, got {list(values)}", "write e.g. [false, true]")
        check(self.gbs_tokens > 0, "gbs_tokens", "must be > 0", "e.g. 8.0e6")
        for key, allowed in (("pipeline_split", PIPELINE_SPLITS), ("dispatcher", DISPATCHERS)):
            values = getattr(self, key)
            check(len(values) > 0, key, "is empty", f"use some of {', '.join(allowed)}")
            bad = [v for v in values if v not in allowed]
            check(not bad, key, f"unknown value(s) {bad}", f"use some of {', '.join(allowed)}")
        check(len(self.recompute_modules) > 0, "recompute_modules", "is empty", "write [null] for the default")
        for modules in self.recompute_modules:
            recompute_module_mask(modules)  # names an unknown module


@dataclass(frozen=True)
class ComputeOptimalSpec:
    """The classic budget: C_model = devices x peak x nominal MFU x goodput x wall time."""

    nominal_mfu: float = 0.40
    precision: str = "bf16"
    source: str = ""

    def __post_init__(self) -> None:
        check(0 < self.nominal_mfu <= 1, "nominal_mfu", f"must be in (0, 1], got {self.nominal_mfu}", "e.g. 0.40")
        check(self.precision in PRECISIONS, "precision", f"{self.precision!r} is unknown", f"use one of {PRECISIONS}")


@dataclass(frozen=True)
class SearchSpace:
    geometry: GeometrySpace
    layout: LayoutSpace = field(default_factory=LayoutSpace)
    compute_optimal: ComputeOptimalSpec = field(default_factory=ComputeOptimalSpec)

    def replace_geometry(self, **changes: object) -> SearchSpace:
        return dataclasses.replace(self, geometry=dataclasses.replace(self.geometry, **changes))

    def replace_layout(self, **changes: object) -> SearchSpace:
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, **changes))


def default_space_path() -> Path:
    return Path(str(resources.files("mosaic") / "data" / "default_space.yaml"))


def load_space(path: Optional[str] = None) -> SearchSpace:
    """Load a search-space YAML strictly (None: the bundled default)."""
    return load_spec(SearchSpace, path if path is not None else default_space_path())


def space_from_dict(data: dict, source: str = "space") -> SearchSpace:
    return spec_from_dict(SearchSpace, data, source=source)


# ---------------------------------------------------------------------------
# Resolution against cluster + budget.

@dataclass(frozen=True)
class ResolvedSpace:
    """A space with every `auto` replaced by concrete values."""

    space: SearchSpace
    tp: IntList
    sequence_parallel: tuple[bool, ...] | None
    """None: auto (tp > 1)."""
    active_params_range: tuple[float, float]


def scale_up_devices(cluster: ClusterSpec) -> int:
    """Devices of the scale-up domain: the outermost fabric level whose per-device bandwidth is at
    least the innermost level's (NVLink / UB / Infinity Fabric; a scale-out NIC is slower)."""
    inner = cluster.levels[0]
    out = inner.devices
    for level in cluster.levels[1:]:
        if level.bandwidth_bytes_per_s >= inner.bandwidth_bytes_per_s:
            out = level.devices
    return int(out)


def resolve_space(space: SearchSpace, tp_domain_devices: int, compute_optimal_flops: float) -> ResolvedSpace:
    """`auto` entries resolved: tp up to `tp_domain_devices` (`scale_up_devices` of the cluster, or
    fewer for a smaller job), the active-parameter band from the compute-optimal budget."""
    lay = space.layout
    tp = (tuple(perfmodel_layouts.powers_of_two(tp_domain_devices)) if isinstance(lay.tp, str) else tuple(lay.tp))
    sp = None if isinstance(lay.sequence_parallel, str) else tuple(lay.sequence_parallel)
    geo = space.geometry
    if isinstance(geo.active_params, str):
        r_lo, r_hi = geo.tokens_per_param
        # C = 6 N D and D = r N  ->  N = sqrt(C / (6 r))
        band = (math.sqrt(compute_optimal_flops / (6.0 * r_hi)), math.sqrt(compute_optimal_flops / (6.0 * r_lo)))
    else:
        band = (float(geo.active_params[0]), float(geo.active_params[1]))
    return ResolvedSpace(space=space, tp=tp, sequence_parallel=sp, active_params_range=band)


# ---------------------------------------------------------------------------
# Geometry expansion (vectorised).

@dataclass(frozen=True)
class GeometrySet:
    """Candidate geometries plus the nominal G each was built from (sweeps group by it)."""

    archs: ArchBatch
    granularity_nominal: np.ndarray

    def __len__(self) -> int:
        return len(self.archs)

    def take(self, index: np.ndarray) -> GeometrySet:
        return GeometrySet(self.archs.take(index), self.granularity_nominal[index])


def _round_to(x: np.ndarray, multiple: int) -> np.ndarray:
    return np.maximum(multiple, np.round(x / multiple).astype(np.int64) * multiple)


def geometries(resolved: ResolvedSpace) -> GeometrySet:
    """All geometries of the space that pass the geometry rules and the active-parameter band."""
    geo = resolved.space.geometry
    grids = np.meshgrid(
        np.asarray(geo.d_model), np.asarray(geo.n_layers), np.asarray(geo.n_experts), np.asarray(geo.top_k),
        np.asarray(geo.granularity, dtype=float), np.asarray(geo.n_shared_experts), np.asarray(geo.n_dense_layers),
        np.asarray(geo.seq_len), np.asarray(geo.vocab_size), np.asarray([a == "mla" for a in geo.attention]),
        indexing="ij",
    )
    h, n_layers, n_experts, top_k, gran, shared, dense_layers, seq, vocab, mla = (g.ravel() for g in grids)
    dense = n_experts == 0
    # A dense model has no routing: collapse k, G, shared and dense-layer choices to one row.
    top_k = np.where(dense, 0, top_k)
    gran = np.where(dense, 1.0, gran)
    shared = np.where(dense, 0, shared)
    dense_layers = np.where(dense, 0, dense_layers)
    aspect = h / n_layers
    ok = (
        (h % geo.head_dim == 0)
        & (aspect >= geo.aspect_ratio[0]) & (aspect <= geo.aspect_ratio[1])
        & (dense | (top_k < n_experts))
        & (dense_layers < n_layers)
    )
    d_ff_ref = geo.ffn_ratio * h
    d_expert = np.where(dense, 0, _round_to(d_ff_ref / gran, geo.d_expert_multiple))
    needs_dense_ffn = dense | (dense_layers > 0)
    d_ff_dense = np.where(needs_dense_ffn, _round_to(d_ff_ref, geo.d_expert_multiple), 0)
    n_heads = h // geo.head_dim
    n_kv = np.where(mla, n_heads, np.minimum(geo.kv_heads, n_heads))
    ok &= (n_heads % np.maximum(n_kv, 1) == 0)
    rank = lambda value: np.where(mla, value, 0)  # noqa: E731
    ok &= ~mla | (geo.mla.kv_lora_rank < h)  # a latent compresses h
    cols = {
        "n_layers": n_layers, "d_model": h, "n_heads": n_heads, "n_kv_heads": n_kv,
        "head_dim": geo.head_dim + rank(geo.mla.qk_rope_head_dim), "vocab_size": vocab, "seq_len": seq,
        "n_experts": n_experts, "top_k": top_k, "n_shared_experts": shared, "d_expert": d_expert,
        "d_ff_dense": d_ff_dense, "n_dense_layers": dense_layers,
        "ffn_ratio": np.full(h.shape, float(geo.ffn_ratio)),
        "gated_ffn": np.full(h.shape, bool(geo.gated_ffn)), "tie_embeddings": np.full(h.shape, bool(geo.tie_embeddings)),
        "q_lora_rank": np.where(geo.mla.q_lora_rank < h, rank(geo.mla.q_lora_rank), 0), "kv_lora_rank": rank(geo.mla.kv_lora_rank),
        "qk_rope_head_dim": rank(geo.mla.qk_rope_head_dim), "v_head_dim": rank(geo.head_dim),
        "n_mtp_layers": np.zeros_like(h),  # MTP: not searched (the law has no term for it)
    }
    cols = {k: (v.astype(np.int64) if k not in ("ffn_ratio", "gated_ffn", "tie_embeddings") else v) for k, v in cols.items()}
    archs = ArchBatch(**{name: cols[name] for name in ARCH_FIELDS})
    n_act = active_params(archs)
    lo, hi = resolved.active_params_range
    ok &= (n_act >= lo) & (n_act <= hi)
    # Dense rows were collapsed: drop exact duplicates.
    keep = np.flatnonzero(ok)
    stacked = np.stack([np.asarray(cols[name], dtype=float)[keep] for name in ARCH_FIELDS], axis=1)
    _, first = np.unique(stacked, axis=0, return_index=True)
    keep = keep[np.sort(first)]
    return GeometrySet(archs.take(keep), gran[keep])


def geometry_label(arch: MoEArchitecture) -> str:
    """Short human form of a geometry, words split only at spaces: ``L32 h4096 E64 k2 d_expert1024 Es1``
    (Es when shared experts exist), ``L32 h4096 dense`` for a dense model; `` MLA`` ends an MLA one."""
    text = f"L{arch.n_layers} h{arch.d_model}"
    if not arch.n_experts:
        text += " dense"
    else:
        text += f" E{arch.n_experts} k{arch.top_k} d_expert{arch.d_expert}"
        text += f" Es{arch.n_shared_experts}" if arch.n_shared_experts else ""
    return text + (" MLA" if arch.kv_lora_rank else "")


def usable_tp(resolved: ResolvedSpace, geoms: GeometrySet) -> ResolvedSpace:
    """The resolved space without tp values that no geometry of the space accepts (the validity
    rules that read tp and the geometry only: heads, KV heads, dense and shared FFN widths), so
    that a large scale-up domain does not fill the grid with rows valid for nothing."""
    rules = [rule for name, rule, _ in perfmodel_validity.RULES if name in TP_RULES]
    keep = []
    for t in resolved.tp:
        lay = types.SimpleNamespace(tp=t)
        ok = np.ones(len(geoms), dtype=bool)
        for rule in rules:
            ok &= np.asarray(rule(geoms.archs, lay), dtype=bool)
        if np.any(ok) or not len(geoms):
            keep.append(t)
    return dataclasses.replace(resolved, tp=tuple(keep) or resolved.tp[:1])


# ---------------------------------------------------------------------------
# Layout grid.

def layout_grid(resolved: ResolvedSpace, devices: int) -> LayoutBatch:
    """The space's layout lists through `perfmodel.layouts.layout_grid`; gbs is 0 (`gbs_holding_tokens`)."""
    lay = resolved.space.layout
    grid = perfmodel_layouts.layout_grid(
        devices, tp=resolved.tp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, etp=lay.etp, cp=lay.cp, dp_flavor=lay.dp_flavor,
        mbs=lay.mbs, recompute=lay.recompute, precision=lay.precision, sequence_parallel=resolved.sequence_parallel,
        overlaps=tuple(itertools.product(*(getattr(lay, key) for key in OVERLAP_FIELDS))))
    if len(grid) == 0:
        raise InputError(f"search space: no layout of tp/cp/pp divides devices={devices}; "
                         "add 1 to layout.tp, layout.pp and layout.cp")
    grid = split_and_dispatch_variants(grid, lay.pipeline_split, lay.dispatcher)
    return recompute_module_variants(grid, lay.recompute_modules)


def recompute_module_variants(grid: LayoutBatch, module_lists: tuple[Optional[str], ...]) -> LayoutBatch:
    """The selective-recompute rows once per module list (the other rows once, with the default);
    the search keeps each geometry's fastest that fits."""
    masks = list(dict.fromkeys(recompute_module_mask(m) for m in module_lists))
    if masks == [DEFAULT_RECOMPUTE_MASK]:
        return grid
    selective = np.asarray(grid.recompute) == RECOMPUTE_MODES.index("selective")
    parts = [grid.take(np.flatnonzero(~selective))]
    chosen = grid.take(np.flatnonzero(selective))
    parts += [dataclasses.replace(chosen, recompute_modules=np.full(len(chosen), mask, dtype=np.int64)) for mask in masks]
    return _concat(parts)


def _concat(parts: list[LayoutBatch]) -> LayoutBatch:
    """Rows of several layout batches, in order (layout-string stage columns padded to one width)."""
    if len(parts) == 1:
        return parts[0]
    merged = {}
    for name in [f.name for f in dataclasses.fields(LayoutBatch)]:
        values = [np.asarray(getattr(p, name)) for p in parts]
        if name == "stage_layers":
            width = max(v.shape[1] for v in values)
            values = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=-1) for v in values]
        merged[name] = np.concatenate(values)
    return LayoutBatch(**merged)


def split_and_dispatch_variants(grid: LayoutBatch, splits: tuple[str, ...], dispatchers: tuple[str, ...]) -> LayoutBatch:
    """The grid once per pipeline split (the balanced copy only of rows with pp > 1) and per
    dispatcher (the non-alltoall copies only of rows with ep > 1): the search keeps each
    geometry's fastest, so it picks the split that balances the stages and the dispatcher. A
    row the listed choices do not apply to (pp = 1 under `balanced` alone, ep = 1 without
    `alltoall`) is kept once with the default (no split to choose, no tokens to dispatch)."""
    pp = np.asarray(grid.pp)
    parts = []
    for split in splits:
        if split == "balanced":
            balanced = grid.take(np.flatnonzero(pp > 1))
            parts.append(dataclasses.replace(balanced, balanced_split=np.ones(len(balanced), dtype=bool)))
        else:
            parts.append(grid)
    if "default" not in splits:
        parts.append(grid.take(np.flatnonzero(pp == 1)))
    out = []
    for dispatcher in dispatchers:
        for part in parts:
            sub = part if dispatcher == "alltoall" else part.take(np.flatnonzero(np.asarray(part.ep) > 1))
            out.append(dataclasses.replace(sub, dispatcher=np.full(len(sub), DISPATCHERS.index(dispatcher))))
    if "alltoall" not in dispatchers:
        for part in parts:
            single = part.take(np.flatnonzero(np.asarray(part.ep) == 1))
            out.append(dataclasses.replace(single, dispatcher=np.full(len(single), DISPATCHERS.index("alltoall"))))
    return _concat(out)


__all__ = [
    "ComputeOptimalSpec", "GeometrySet", "GeometrySpace", "LayoutSpace", "MLARanks", "ResolvedSpace", "SearchSpace",
    "default_space_path", "geometries", "geometry_label", "layout_grid", "load_space", "resolve_space", "scale_up_devices",
    "usable_tp",
    "space_from_dict",
]

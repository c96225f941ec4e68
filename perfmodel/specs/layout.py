"""How a model is laid out on devices: `ParallelLayout` (+ compact string form).

Experts fold onto the dense ranks as in Megatron-Core's MoE parallel folding
(Liu et al. 2025, "MoE Parallel Folding"): the dense part uses
world = tp * cp * pp * dp, and the expert part reuses the same tp * cp * dp
ranks of each pipeline stage as etp * ep * edp. So ep is carved out of the
data-parallel ranks, never multiplied onto them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import numpy as np

from perfmodel.errors import InputError
from perfmodel.specs.strict import check, from_mapping

DP_FLAVORS = ("ddp", "zero1", "fsdp")
RECOMPUTE_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "mxfp8")
OVERLAP_FIELDS = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap")
"""Communication overlaps the frameworks expose as switches (Megatron-Core names)."""
BOOL_FIELDS = ("sequence_parallel",) + OVERLAP_FIELDS
LAYOUT_FIELDS = (
    "tp", "pp", "vpp", "ep", "etp", "cp", "dp", "dp_flavor", "mbs", "gbs",
    "recompute", "sequence_parallel", "precision",
) + OVERLAP_FIELDS

DpFlavor = Literal["ddp", "zero1", "fsdp"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16", "fp16", "fp8", "mxfp8"]


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees, batch sizes and memory/precision policy of one run."""

    tp: int = 1
    """Tensor parallel degree (attention heads, dense and shared-expert FFN)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (interleaved 1F1B); 1 = plain 1F1B."""
    ep: int = 1
    """Expert parallel degree: routed experts are split over ep ranks."""
    etp: int = 1
    """Expert tensor parallel degree (Megatron-Core recommends 1 for fine-grained MoE)."""
    cp: int = 1
    """Context parallel degree (sequence split for attention)."""
    dp: Optional[int] = None
    """Data parallel degree; None = devices / (tp * cp * pp)."""
    dp_flavor: DpFlavor = "zero1"
    """ddp (replicated optimizer), zero1 (distributed optimizer) or fsdp (sharded weights)."""
    mbs: int = 1
    """Micro-batch size in sequences."""
    gbs: Optional[int] = None
    """Global batch in sequences; None = `default_gbs_of_layout` (mbs * dp * (4 * pp if pp > 1 else 1))."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (attention core) or full (whole layer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallel (norm/dropout activations split over tp)."""
    precision: Precision = "bf16"
    """Training compute precision (weights kept in master fp32 by the optimizer)."""
    overlap_grad_reduce: bool = False
    """DDP / ZeRO-1: reduce gradient buckets during the backward pass (Megatron-Core
    `--overlap-grad-reduce`, off by default); off: after it. FSDP always overlaps (prefetch)."""
    overlap_param_gather: bool = False
    """ZeRO-1: all-gather the updated parameters during the next forward (`--overlap-param-gather`,
    off by default)."""
    tp_comm_overlap: bool = False
    """Tensor-parallel all-gathers / reduce-scatters overlapped with their GEMMs (Transformer
    Engine userbuffers, `--tp-comm-overlap`; needs sequence parallel)."""
    ep_comm_overlap: bool = False
    """Expert-parallel all-to-alls overlapped with another micro-batch's compute
    (`--overlap-moe-expert-parallel-comm`)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "etp", "cp", "mbs"):
            value = getattr(self, name)
            check(value >= 1, name, f"must be >= 1, got {value}", "give a positive integer")
        for name in ("dp", "gbs"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, f"must be >= 1, got {value}", "give a positive integer or leave it out")
        check(self.dp_flavor in DP_FLAVORS, "dp_flavor", f"{self.dp_flavor!r} is unknown", f"use one of {', '.join(DP_FLAVORS)}")
        check(self.recompute in RECOMPUTE_MODES, "recompute", f"{self.recompute!r} is unknown", f"use one of {', '.join(RECOMPUTE_MODES)}")
        check(self.precision in PRECISIONS, "precision", f"{self.precision!r} is unknown", f"use one of {', '.join(PRECISIONS)}")

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    def world(self) -> int:
        check(self.dp is not None, "dp", "is not resolved", "call resolve(devices) first")
        return self.tp * self.cp * self.pp * int(self.dp)

    def edp(self) -> int:
        """Expert data parallel degree: tp * cp * dp / (etp * ep)."""
        check(self.dp is not None, "dp", "is not resolved", "call resolve(devices) first")
        return (self.tp * self.cp * int(self.dp)) // (self.etp * self.ep)

    def micro_batches(self) -> int:
        """m = gbs / (mbs * dp): micro-batches per step per pipeline."""
        layout = self if self.gbs is not None else self.resolve(self.world())
        return int(layout.gbs) // (layout.mbs * int(layout.dp))

    def resolve(self, devices: int) -> ParallelLayout:
        """Fill dp (from the device count) and gbs (default rule); other checks are `validate`."""
        dp = self.dp
        if dp is None:
            if devices % self.model_parallel != 0:
                raise InputError(
                    f"key 'dp': devices={devices} is not a multiple of tp*cp*pp={self.model_parallel}; "
                    "change tp/cp/pp or the device count"
                )
            dp = devices // self.model_parallel
        gbs = default_gbs_of_layout(self.mbs, dp, self.pp) if self.gbs is None else self.gbs
        return dataclasses.replace(self, dp=dp, gbs=gbs)

    def label(self) -> str:
        """Short human form for tables and plots, words split only at spaces:
        ``tp2 pp4x2 ep8 dp8 zero1 mbs1 gbs512 rc=selective sp bf16`` (x2: vpp; etp and cp when > 1,
        recompute and sequence parallel when on). `to_string` is the parseable form."""
        parts = [f"tp{self.tp}", f"pp{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else ""), f"ep{self.ep}"]
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.dp is not None:
            parts.append(f"dp{self.dp}")
        parts += [self.dp_flavor, f"mbs{self.mbs}"]
        if self.gbs is not None:
            parts.append(f"gbs{self.gbs}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(self.precision)
        overlaps = [short for name, short in zip(OVERLAP_FIELDS, ("grad", "param", "tp", "ep")) if getattr(self, name)]
        if overlaps:
            parts.append("ov=" + "+".join(overlaps))
        return " ".join(parts)

    def to_string(self) -> str:
        """Compact form, every field named (inverse of `parse_layout`)."""
        parts = []
        for name in LAYOUT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            parts.append(f"{name}={str(value).lower() if isinstance(value, bool) else value}")
        return ",".join(parts)


# ---------------------------------------------------------------------------
# Global batch: the three default rules, each named for where it applies.

DEFAULT_BATCH_TOKENS = 4 * 2**20
"""Default global batch of a job, ~4M tokens (Llama 2 pre-training used 4M tokens per batch,
Touvron et al. 2023)."""
MAX_SEQUENCES_PER_DEVICE = 8
"""Cap of a job's default batch per device, so that small jobs (a CPU test cluster) do not
default to thousands of sequences per step."""


def default_gbs_of_layout(mbs: int, dp: int, pp: int) -> int:
    """A layout given without gbs: gbs = mbs * dp * (4 * pp if pp > 1 else 1), one micro-batch per
    rank, or m = 4 * pp micro-batches with a pipeline (1F1B bubble (pp - 1) / (m + pp - 1) < 1/5)."""
    return mbs * dp * (4 * pp if pp > 1 else 1)


def default_gbs_of_job(seq_len: int, devices: int) -> int:
    """A job searched without gbs (`mosaic predict --layout best`): about DEFAULT_BATCH_TOKENS
    tokens, a multiple of `devices`, 1 to MAX_SEQUENCES_PER_DEVICE sequences per device."""
    per_device = round(DEFAULT_BATCH_TOKENS / (seq_len * devices))
    return int(devices * min(max(per_device, 1), MAX_SEQUENCES_PER_DEVICE))


def gbs_holding_tokens(mbs: Any, dp: Any, seq_len: Any, tokens: float) -> np.ndarray:
    """The planner's rule (search space `gbs_tokens`): the smallest multiple of mbs * dp holding
    at least `tokens` tokens, gbs = max(1, ceil(ceil(tokens / seq_len) / (mbs * dp))) * mbs * dp."""
    unit = np.asarray(mbs) * np.asarray(dp)
    want = np.ceil(tokens / np.asarray(seq_len))
    return (np.maximum(1, np.ceil(want / unit)) * unit).astype(np.int64)


_ALIASES = {"sp": "sequence_parallel", "dp_type": "dp_flavor", "flavor": "dp_flavor"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_layout(text: str, devices: Optional[int] = None) -> ParallelLayout:
    """Parse ``"tp=8,pp=8,vpp=3,mbs=1,gbs=64,recompute=full"``.

    Unnamed fields take their defaults; with `devices`, dp (and gbs) are resolved.
    """
    values: dict[str, Any] = {}
    text = text.strip()
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            raise InputError(f"layout '{text}': '{item}' is not key=value; write e.g. 'tp=8,pp=2'")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = _ALIASES.get(key, key)
        if key not in LAYOUT_FIELDS:
            close = difflib.get_close_matches(key, LAYOUT_FIELDS, n=1)
            fix = f"did you mean '{close[0]}'?" if close else "keys: " + ", ".join(LAYOUT_FIELDS)
            raise InputError(f"layout: unknown key '{key}'; {fix}")
        if key in BOOL_FIELDS:
            if raw.lower() not in _TRUE | _FALSE:
                raise InputError(f"layout: key '{key}': {raw!r} is not true/false")
            values[key] = raw.lower() in _TRUE
        else:
            values[key] = raw
    try:
        layout = from_mapping(ParallelLayout, values)
    except InputError as exc:
        raise InputError(f"layout: {exc}") from None
    return layout.resolve(devices) if devices is not None else layout


@dataclass(frozen=True)
class LayoutBatch:
    """Column-wise numpy arrays of resolved layouts; categorical fields as codes.

    dp_flavor indexes DP_FLAVORS, recompute RECOMPUTE_MODES, precision PRECISIONS.
    """

    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray
    dp_flavor: np.ndarray
    mbs: np.ndarray
    gbs: np.ndarray
    recompute: np.ndarray
    sequence_parallel: np.ndarray
    precision: np.ndarray
    overlap_grad_reduce: np.ndarray
    overlap_param_gather: np.ndarray
    tp_comm_overlap: np.ndarray
    ep_comm_overlap: np.ndarray

    @staticmethod
    def stack(layouts: Sequence[ParallelLayout]) -> LayoutBatch:
        cols: dict[str, np.ndarray] = {}
        for name in LAYOUT_FIELDS:
            values = [getattr(lay, name) for lay in layouts]
            if any(v is None for v in values):
                raise InputError(f"layout: key '{name}' is not resolved; call resolve(devices) first")
            if name == "dp_flavor":
                cols[name] = np.asarray([DP_FLAVORS.index(v) for v in values], dtype=np.int64)
            elif name == "recompute":
                cols[name] = np.asarray([RECOMPUTE_MODES.index(v) for v in values], dtype=np.int64)
            elif name == "precision":
                cols[name] = np.asarray([PRECISIONS.index(v) for v in values], dtype=np.int64)
            elif name in BOOL_FIELDS:
                cols[name] = np.asarray(values, dtype=bool)
            else:
                cols[name] = np.asarray(values, dtype=np.int64)
        return LayoutBatch(**cols)

    def __len__(self) -> int:
        return int(np.size(self.tp))

    def row(self, i: int) -> ParallelLayout:
        values: dict[str, Any] = {name: getattr(self, name)[i].item() for name in LAYOUT_FIELDS}
        values["dp_flavor"] = DP_FLAVORS[values["dp_flavor"]]
        values["recompute"] = RECOMPUTE_MODES[values["recompute"]]
        values["precision"] = PRECISIONS[values["precision"]]
        return ParallelLayout(**values)

    def take(self, index: Any) -> LayoutBatch:
        return LayoutBatch(**{name: np.asarray(getattr(self, name))[index] for name in LAYOUT_FIELDS})

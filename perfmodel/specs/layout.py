"""How a model is laid out on devices: `ParallelLayout` (+ compact string form).

Experts fold onto the dense ranks as in Megatron-Core's MoE parallel folding
(Liu et al. 2025, "MoE Parallel Folding"): the dense part uses
world = tp * cp * pp * dp, and the expert part reuses the same tp * cp * dp
ranks of each pipeline stage as etp * ep * edp. So ep is carved out of the
data-parallel ranks, never multiplied onto them.

Two optional groups of fields follow the core ones (`CORE_LAYOUT_FIELDS`):
- the pipeline split (`SPLIT_FIELDS`): which layers each stage holds, as Megatron-Core's
  options express it; the rules are `perfmodel.specs.stages`.
- expert dispatch (`DISPATCH_FIELDS`): the token dispatcher and capacity-factor routing.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import numpy as np

from perfmodel.errors import InputError
from perfmodel.specs.dispatch import FUSED_DISPATCHERS
from perfmodel.specs.protocols import rows_of
from perfmodel.specs.stages import parse_pp_layout
from perfmodel.specs.strict import check, from_mapping

DP_FLAVORS = ("ddp", "zero1", "fsdp")
RECOMPUTE_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "mxfp8")
OVERLAP_FIELDS = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap")
"""Communication overlaps the frameworks expose as switches (Megatron-Core names)."""
DISPATCHERS = ("alltoall", "allgather") + FUSED_DISPATCHERS
"""MoE token dispatchers: Megatron-Core's alltoall and allgather dispatchers, and its flex
dispatcher with the DeepEP or HybridEP fused dispatch/combine kernels."""
CORE_LAYOUT_FIELDS = (
    "tp", "pp", "vpp", "ep", "etp", "cp", "dp", "dp_flavor", "mbs", "gbs",
    "recompute", "sequence_parallel", "precision",
)
SPLIT_FIELDS = ("first_stage_layers", "last_stage_layers", "account_embedding", "account_loss", "pp_layout",
                "balanced_split")
DISPATCH_FIELDS = ("dispatcher", "capacity_factor", "pad_to_capacity")
RECOMPUTE_FIELDS = ("recompute_modules",)
LAYOUT_FIELDS = CORE_LAYOUT_FIELDS + OVERLAP_FIELDS + SPLIT_FIELDS + DISPATCH_FIELDS + RECOMPUTE_FIELDS
OPTIONAL_LAYOUT_FIELDS = OVERLAP_FIELDS + SPLIT_FIELDS + DISPATCH_FIELDS + RECOMPUTE_FIELDS
"""Fields with a default that a runs CSV, a layout string or a plan may leave out."""
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "moe_act", "mlp", "op")
"""Megatron-Core's `--recompute-modules` under `--recompute-granularity selective` that MOSAIC
prices (`perfmodel.operators.RECOMPUTE_MODULE_OPS`, `perfmodel.memory`; its `moe` and
`shared_experts` modules are not priced: refused by name), and `op`, torchtitan's per-op policy
(`selective_ac_option = "op"`, `perfmodel.operators.op_sac`), which stands alone."""
UNPRICED_RECOMPUTE_MODULES = ("moe", "shared_experts")
_MODULE_CHOICES = (f"Megatron's modules ({', '.join(m for m in RECOMPUTE_MODULES if m != 'op')}), '+'-joined, "
                   "or op (torchtitan's per-op policy) alone")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
"""Megatron-Core's default `--recompute-modules`."""
BOOL_FIELDS = ("sequence_parallel",) + OVERLAP_FIELDS + ("account_embedding", "account_loss", "balanced_split",
                                                       "pad_to_capacity")
"""The true/false layout fields."""

DpFlavor = Literal["ddp", "zero1", "fsdp"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16", "fp16", "fp8", "mxfp8"]
Dispatcher = Literal["alltoall", "allgather", "deepep", "hybridep"]


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
    # --- pipeline split (SPLIT_FIELDS; rules: perfmodel.specs.stages) ---
    first_stage_layers: Optional[int] = None
    """Layers of the first pipeline rank over all its vpp chunks (Megatron
    --decoder-first-pipeline-num-layers); None = as the middle ranks."""
    last_stage_layers: Optional[int] = None
    """Layers of the last pipeline rank (--decoder-last-pipeline-num-layers)."""
    account_embedding: bool = False
    """The embedding counts as one layer in the split (--account-for-embedding-in-pipeline-split)."""
    account_loss: bool = False
    """The loss counts as one layer in the split (--account-for-loss-in-pipeline-split)."""
    pp_layout: Optional[str] = None
    """Megatron's --pipeline-model-parallel-layout string, e.g. "Et*4|(t*4|)*14tmL" (pp*vpp stages)."""
    balanced_split: bool = False
    """The balanced split (embedding and loss a layer each) even where pp*vpp divides n_layers;
    a layer count pp*vpp does not divide gets it without asking."""
    # --- expert dispatch (DISPATCH_FIELDS) ---
    dispatcher: Dispatcher = "alltoall"
    """MoE token dispatcher: alltoall, allgather, or the fused deepep / hybridep kernels."""
    capacity_factor: Optional[float] = None
    """Expert capacity as a multiple of the mean load (tokens beyond it are dropped); None = dropless."""
    pad_to_capacity: bool = False
    """Pad every expert's input to its capacity (--moe-pad-expert-input-to-capacity)."""
    # --- selective recompute (RECOMPUTE_FIELDS) ---
    recompute_modules: Optional[str] = None
    """The modules selective recompute checkpoints, '+'-joined (Megatron-Core --recompute-modules):
    of RECOMPUTE_MODULES; None = Megatron-Core's default, core_attn."""

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
        self._check_split()
        check(self.dispatcher in DISPATCHERS, "dispatcher", f"{self.dispatcher!r} is unknown",
              f"use one of {', '.join(DISPATCHERS)}")
        check(self.capacity_factor is None or self.capacity_factor > 0, "capacity_factor",
              f"must be > 0, got {self.capacity_factor}", "give e.g. 1.25, or leave it out for dropless routing")
        check(not self.pad_to_capacity or self.capacity_factor is not None, "pad_to_capacity",
              "needs capacity_factor (the padding target)", "set capacity_factor, e.g. 1.0, or drop pad_to_capacity")
        check(not (self.pad_to_capacity and self.dispatcher == "deepep"), "pad_to_capacity",
              "is not supported by the deepep dispatcher (Megatron-Core's rule)", "use hybridep or alltoall to pad")
        if self.recompute_modules is not None:
            check(self.recompute == "selective", "recompute_modules",
                  f"is for recompute=selective, got recompute={self.recompute}",
                  "set recompute=selective (Megatron's --recompute-granularity selective) or drop recompute_modules")
            mask = recompute_module_mask(self.recompute_modules)  # names each unknown module
            # one spelling per set (RECOMPUTE_MODULES order; the default as None): equal sets, equal layouts
            object.__setattr__(self, "recompute_modules",
                               None if mask == DEFAULT_RECOMPUTE_MASK else recompute_module_names(mask))

    def _check_split(self) -> None:
        """The split options exclude each other as Megatron-Core's do, and need a pipeline."""
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            check(value is None or value >= 0, name, f"must be >= 0, got {value}", "give a layer count or leave it out")
        explicit = [name for name in SPLIT_FIELDS if getattr(self, name) not in (None, False)]
        check(not explicit or self.pp > 1, explicit[0] if explicit else "pp", "splits a pipeline but pp=1",
              "set pp > 1 or remove it")
        if self.pp_layout is not None:
            others = [name for name in explicit if name != "pp_layout"]
            check(not others, "pp_layout", f"excludes {', '.join(others)} (the string gives every stage)",
                  "keep one way of splitting")
            stages = len(parse_pp_layout(self.pp_layout))
            check(stages == self.pp * self.vpp, "pp_layout",
                  f"{self.pp_layout!r} has {stages} stages but pp*vpp={self.pp}*{self.vpp}={self.pp * self.vpp}",
                  "give one '|'-separated stage per virtual stage, or change pp/vpp")
        firstlast = [n for n in ("first_stage_layers", "last_stage_layers") if getattr(self, n) is not None]
        account = [n for n in ("account_embedding", "account_loss") if getattr(self, n)]
        check(not (firstlast and account), firstlast[0] if firstlast else "account_embedding",
              f"excludes {', '.join(account)} (Megatron-Core's rule)", "keep one way of splitting")
        check(not (self.balanced_split and (firstlast or account)), "balanced_split",
              f"excludes {', '.join(firstlast + account)}", "keep one way of splitting")

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
            parts.append(f"rc={self.recompute}" + (f"[{self.recompute_modules}]" if self.recompute_modules else ""))
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(self.precision)
        overlaps = [short for name, short in zip(OVERLAP_FIELDS, ("grad", "param", "tp", "ep")) if getattr(self, name)]
        if overlaps:
            parts.append("ov=" + "+".join(overlaps))
        if self.pp_layout:
            parts.append(f"split={self.pp_layout}")
        elif self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"split={self.first_stage_layers if self.first_stage_layers is not None else '-'}/"
                         f"{self.last_stage_layers if self.last_stage_layers is not None else '-'}")
        elif self.account_embedding or self.account_loss:
            parts.append("split=" + "+".join(x for x, on in (("E", self.account_embedding), ("L", self.account_loss))
                                             if on))
        elif self.balanced_split:
            parts.append("split=balanced")
        if self.dispatcher != "alltoall":
            parts.append(self.dispatcher)
        if self.capacity_factor is not None:
            parts.append(f"cf{self.capacity_factor:g}" + ("pad" if self.pad_to_capacity else ""))
        return " ".join(parts)

    def to_string(self) -> str:
        """Compact form, every core field named and the optional ones when not at their default
        (inverse of `parse_layout`)."""
        parts = []
        for name in LAYOUT_FIELDS:
            value = getattr(self, name)
            if value is None or (name in OPTIONAL_LAYOUT_FIELDS and value == _OPTIONAL_DEFAULTS[name]):
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


def recompute_module_mask(modules: Optional[str]) -> int:
    """Bit mask (bit i: RECOMPUTE_MODULES[i]) of a '+'-joined module list; None = the default."""
    names = DEFAULT_RECOMPUTE_MODULES if modules is None else tuple(filter(None, (m.strip() for m in
                                                                                  str(modules).split("+"))))
    check(len(names) > 0, "recompute_modules", "is empty", "name modules, e.g. core_attn+moe_act, or leave it out")
    mask = 0
    for name in names:
        check(name not in UNPRICED_RECOMPUTE_MODULES, "recompute_modules", f"module {name!r} is not priced",
              f"use full recompute, or {_MODULE_CHOICES}")
        check(name in RECOMPUTE_MODULES, "recompute_modules", f"module {name!r} is unknown", f"use {_MODULE_CHOICES}")
        mask |= 1 << RECOMPUTE_MODULES.index(name)
    check("op" not in names or len(set(names)) == 1, "recompute_modules",
          "'op' (torchtitan's per-op policy) excludes Megatron's modules", "give op alone, or Megatron modules")
    return mask


def recompute_module_names(mask: int) -> str:
    """The '+'-joined module list of a mask (RECOMPUTE_MODULES order)."""
    return "+".join(m for i, m in enumerate(RECOMPUTE_MODULES) if int(mask) >> i & 1)


DEFAULT_RECOMPUTE_MASK = recompute_module_mask(None)


_OPTIONAL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelLayout) if f.name in OPTIONAL_LAYOUT_FIELDS}
_ALIASES = {"sp": "sequence_parallel", "dp_type": "dp_flavor", "flavor": "dp_flavor"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_layout(text: str, devices: Optional[int] = None) -> ParallelLayout:
    """Parse ``"tp=8,pp=8,vpp=3,mbs=1,gbs=64,recompute=full"``.

    Unnamed fields take their defaults; with `devices`, dp (and gbs) are resolved. Items without
    "=" right after `pp_layout` continue it (Megatron's layout strings may hold commas).
    """
    values: dict[str, Any] = {}
    text = text.strip()
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item and "pp_layout" in values and list(values)[-1] == "pp_layout":
            values["pp_layout"] += "," + item  # Megatron's cosmetic commas inside a layout string
            continue
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

    dp_flavor indexes DP_FLAVORS, recompute RECOMPUTE_MODES, precision PRECISIONS, dispatcher
    DISPATCHERS; recompute_modules is a bit mask over RECOMPUTE_MODULES (default: core_attn).
    The optional fields (OPTIONAL_LAYOUT_FIELDS) may be left out (None: every row at its default); None entries are -1 (first/last_stage_layers) or 0 (capacity_factor).
    `pp_layout` keeps the strings (object array; None where not given), `stage_layers` their
    per-virtual-stage layer counts ((n, max stages), -1 padded) and `stage_mtp` their MTP
    count (-1 where no string) for the formulas (`perfmodel.specs.stages`).
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
    overlap_grad_reduce: Optional[np.ndarray] = None
    overlap_param_gather: Optional[np.ndarray] = None
    tp_comm_overlap: Optional[np.ndarray] = None
    ep_comm_overlap: Optional[np.ndarray] = None
    first_stage_layers: Optional[np.ndarray] = None
    last_stage_layers: Optional[np.ndarray] = None
    account_embedding: Optional[np.ndarray] = None
    account_loss: Optional[np.ndarray] = None
    pp_layout: Optional[np.ndarray] = None
    balanced_split: Optional[np.ndarray] = None
    dispatcher: Optional[np.ndarray] = None
    capacity_factor: Optional[np.ndarray] = None
    pad_to_capacity: Optional[np.ndarray] = None
    recompute_modules: Optional[np.ndarray] = None
    stage_layers: Optional[np.ndarray] = None
    stage_mtp: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        n = np.shape(self.tp)
        defaults = {**{name: (False, bool) for name in OVERLAP_FIELDS}, "first_stage_layers": (-1, np.int64), "last_stage_layers": (-1, np.int64),
                    "account_embedding": (False, bool), "account_loss": (False, bool),
                    "balanced_split": (False, bool), "dispatcher": (0, np.int64), "capacity_factor": (0.0, float),
                    "pad_to_capacity": (False, bool), "recompute_modules": (DEFAULT_RECOMPUTE_MASK, np.int64)}
        for name, (value, dtype) in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.full(n, value, dtype=dtype))
        if self.pp_layout is None:
            object.__setattr__(self, "pp_layout", np.full(n, None, dtype=object))
        if self.stage_layers is None or self.stage_mtp is None:
            layers, mtp = _layout_string_columns(np.asarray(self.pp_layout, dtype=object).reshape(-1))
            object.__setattr__(self, "stage_layers", layers.reshape(n + layers.shape[1:]))
            object.__setattr__(self, "stage_mtp", mtp.reshape(n))

    @staticmethod
    def stack(layouts: Sequence[ParallelLayout]) -> LayoutBatch:
        cols: dict[str, np.ndarray] = {}
        for name in LAYOUT_FIELDS:
            values = [getattr(lay, name) for lay in layouts]
            if name in CORE_LAYOUT_FIELDS and any(v is None for v in values):
                raise InputError(f"layout: key '{name}' is not resolved; call resolve(devices) first")
            if name == "dp_flavor":
                cols[name] = np.asarray([DP_FLAVORS.index(v) for v in values], dtype=np.int64)
            elif name == "recompute":
                cols[name] = np.asarray([RECOMPUTE_MODES.index(v) for v in values], dtype=np.int64)
            elif name == "precision":
                cols[name] = np.asarray([PRECISIONS.index(v) for v in values], dtype=np.int64)
            elif name == "dispatcher":
                cols[name] = np.asarray([DISPATCHERS.index(v) for v in values], dtype=np.int64)
            elif name == "recompute_modules":
                cols[name] = np.asarray([recompute_module_mask(v) for v in values], dtype=np.int64)
            elif name in BOOL_FIELDS:
                cols[name] = np.asarray(values, dtype=bool)
            elif name == "pp_layout":
                cols[name] = np.asarray(values + [None], dtype=object)[:-1]  # 1-D even when all are None
            elif name == "capacity_factor":
                cols[name] = np.asarray([0.0 if v is None else v for v in values], dtype=float)
            elif name in ("first_stage_layers", "last_stage_layers"):
                cols[name] = np.asarray([-1 if v is None else v for v in values], dtype=np.int64)
            else:
                cols[name] = np.asarray(values, dtype=np.int64)
        return LayoutBatch(**cols)

    def __len__(self) -> int:
        return int(np.size(self.tp))

    def row(self, i: int) -> ParallelLayout:
        values: dict[str, Any] = {}
        for name in LAYOUT_FIELDS:
            value = np.asarray(getattr(self, name))[i]
            values[name] = value.item() if isinstance(value, np.generic) else value
        values["dp_flavor"] = DP_FLAVORS[values["dp_flavor"]]
        values["recompute"] = RECOMPUTE_MODES[values["recompute"]]
        values["precision"] = PRECISIONS[values["precision"]]
        values["dispatcher"] = DISPATCHERS[values["dispatcher"]]
        values["recompute_modules"] = (None if values["recompute"] != "selective"
                                       or values["recompute_modules"] == DEFAULT_RECOMPUTE_MASK
                                       else recompute_module_names(values["recompute_modules"]))
        for name in ("first_stage_layers", "last_stage_layers"):
            values[name] = None if values[name] < 0 else values[name]
        values["capacity_factor"] = None if values["capacity_factor"] <= 0 else values["capacity_factor"]
        return ParallelLayout(**values)

    def key_columns(self, fields: Sequence[str]) -> np.ndarray:
        """(n, len(fields)) int64 keys of the rows (equal rows, equal keys): codes as they are,
        floats by their bits, layout strings by their index among the distinct strings."""
        cols = []
        for name in fields:
            values = np.asarray(getattr(self, name))
            if values.dtype == object:
                _, codes = np.unique(np.asarray([str(v) for v in values.ravel()]), return_inverse=True)
                cols.append(codes.ravel().astype(np.int64))
            elif values.dtype.kind == "f":
                cols.append(np.ascontiguousarray(values, dtype=float).view(np.int64))
            else:
                cols.append(values.astype(np.int64))
        return np.stack(cols, axis=1) if cols else np.zeros((len(self), 0), dtype=np.int64)

    def take(self, index: Any) -> LayoutBatch:
        return LayoutBatch(**{name: rows_of(getattr(self, name), index)
                              for name in LAYOUT_FIELDS + ("stage_layers", "stage_mtp")})


def _layout_string_columns(strings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per-virtual-stage layer counts, -1 padded; MTP count, -1 where no string) of layout strings."""
    from perfmodel.specs.stages import pp_layout_counts

    parsed = [None if s is None else pp_layout_counts(str(s)) for s in strings]
    width = max([len(p[0]) for p in parsed if p is not None], default=1)
    layers = np.full((len(strings), width), -1, dtype=np.int64)
    mtp = np.full(len(strings), -1, dtype=np.int64)
    for i, p in enumerate(parsed):
        if p is not None:
            layers[i, :len(p[0])] = p[0]
            mtp[i] = p[1]
    return layers, mtp

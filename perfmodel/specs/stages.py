"""Which transformer layers each pipeline stage holds: the split rules of `ParallelLayout`.

A layout with pp pipeline ranks and vpp model chunks per rank has S = pp*vpp virtual stages,
taken in layer order; virtual stage j lives on pipeline rank j % pp (Megatron-Core's looped
assignment of interleaved 1F1B), the embedding on stage 0, the loss (final norm, LM head) and
the multi-token-prediction modules on stage S - 1. The layer count of each virtual stage
(`virtual_stage_layers`) follows, in order of precedence, Megatron-Core's own options
(`megatron/core/transformer/transformer_block.py` `get_num_layers_to_build` and
`pipeline_parallel_layer_layout.py`, commit d98e8a6):

- `pp_layout`: Megatron's --pipeline-model-parallel-layout string, stages split by "|", E the
  embedding, t a transformer layer, m an MTP module, L the loss; "x*n" and "(...)*n" repeat,
  commas are cosmetic ("Et*4|(t*4|)*14tmL": DeepSeek-V3 on 16 virtual stages).
- `first_stage_layers` / `last_stage_layers` (--decoder-first/last-pipeline-num-layers): the
  layers of the first / last pipeline RANK, split evenly over its vpp chunks; the other ranks
  share the rest evenly (a rank whose count is not given is a middle rank).
- `account_embedding` / `account_loss` (--account-for-{embedding,loss}-in-pipeline-split): the
  embedding / the loss counts as one layer: (L + a + b) / S per virtual stage, one fewer on
  stage 0 / stage S - 1.
- neither, S dividing L: L / S each (Megatron's default).
- neither, S not dividing L, or `balanced_split`: the BALANCED split. The embedding and the
  loss count as one layer each (Megatron's account-for convention), U = L + 2 units go to the
  pp ranks as evenly as possible, the U mod pp extra units to the middle ranks first, then
  the last, then the first; each rank's units go to its vpp chunks as evenly as possible,
  extra units to its later chunks; a chunk's layers are its units minus the embedding (stage
  0) and the loss (stage S - 1). When S divides L + 2 this is exactly account-for-both.

`virtual_stage_layers` is the rule for one layout; `stage_layer_table` applies it to a batch
(vectorised for the closed-form rules, per distinct string for pp_layout).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Optional

import numpy as np

from perfmodel.errors import InputError
from perfmodel.grouping import row_groups

_LAYOUT_CHARS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}


@lru_cache(maxsize=256)
def parse_pp_layout(text: str) -> tuple[tuple[str, ...], ...]:
    """Megatron's layout string as its virtual stages, each a tuple of E/t/m/L (module doc).
    Raises InputError (key 'pp_layout') on a malformed string."""
    flat = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"([EtmL])\*(\d+)"):  # Megatron's unrolling, in its order
        flat = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), flat)
    stages = tuple(tuple(stage) for stage in flat.split("|"))
    bad = sorted({ch for stage in stages for ch in stage if ch not in _LAYOUT_CHARS})
    if bad:
        raise InputError(f"key 'pp_layout': {text!r} has the unknown character(s) {''.join(bad)!r}; use E "
                         "(embedding), t (layer), m (MTP), L (loss), | between stages, x*n to repeat")
    chars = [ch for stage in stages for ch in stage]
    if chars.count("E") != 1 or chars[0] != "E" or chars.count("L") != 1 or chars[-1] != "L":
        raise InputError(f"key 'pp_layout': {text!r} must start with the embedding E and end with the loss L, "
                         "once each (Megatron's rule), e.g. 'Et*4|t*4|t*4|t*3L'")
    if any("m" in stage for stage in stages[:-1]) or ("m" in stages[-1] and "t" in stages[-1][stages[-1].index("m"):]):
        raise InputError(f"key 'pp_layout': {text!r} places an MTP module 'm' before the last stage or before a "
                         "layer; MOSAIC models MTP on the last stage after the layers, as 'tmL'")
    return stages


def pp_layout_counts(text: str) -> tuple[tuple[int, ...], int]:
    """(transformer layers of each virtual stage, MTP modules) of a layout string."""
    stages = parse_pp_layout(text)
    return tuple(stage.count("t") for stage in stages), sum(stage.count("m") for stage in stages)


def format_pp_layout(counts: Sequence[int], mtp: int = 0) -> str:
    """A layout string for per-virtual-stage layer counts, runs of equal middle stages folded as
    Megatron writes them ("Et*4|(t*4|)*14tmL"); `parse_pp_layout` reads it back."""
    def layers(n: int) -> str:
        return "" if n == 0 else ("t" if n == 1 else f"t*{n}")

    counts = [int(c) for c in counts]
    tail = "m" * mtp + "L"
    if len(counts) == 1:
        return "E" + layers(counts[0]) + tail
    text = "E" + layers(counts[0]) + "|"
    middle = [layers(c) for c in counts[1:-1]]
    i = 0
    while i < len(middle):
        j = i
        while j < len(middle) and middle[j] == middle[i]:
            j += 1
        text += f"({middle[i]}|)*{j - i}" if j - i > 1 else middle[i] + "|"
        i = j
    return text + layers(counts[-1]) + tail


def _even(total: int, parts: int, extra_order: Sequence[int]) -> list[int]:
    """`total` split into `parts` near-equal integers, the remainder to `extra_order` first."""
    base, extra = divmod(total, parts)
    out = [base] * parts
    for i in list(extra_order)[:extra]:
        out[i] += 1
    return out


def balanced_stage_layers(n_layers: int, pp: int, vpp: int) -> tuple[int, ...]:
    """The balanced split (module doc): embedding and loss one unit each, U = L + 2 units."""
    units = n_layers + 2
    order = list(range(1, pp - 1)) + ([pp - 1] if pp > 1 else []) + [0]
    rank_units = _even(units, pp, order)
    stages = [0] * (pp * vpp)
    for r in range(pp):
        chunk_units = _even(rank_units[r], vpp, list(range(vpp - 1, -1, -1)))
        for c in range(vpp):
            stages[c * pp + r] = chunk_units[c]
    stages[0] -= 1
    stages[-1] -= 1
    return tuple(stages)


def virtual_stage_layers(n_layers: int, lay: Any) -> tuple[int, ...]:
    """Transformer layers of each of the pp*vpp virtual stages in layer order (module doc).
    Assumes a layout whose split is valid for n_layers (`perfmodel.validity.split_fits_layers`);
    an impossible split gives counts that do not add up to n_layers."""
    pp, vpp = int(lay.pp), int(lay.vpp)
    n = pp * vpp
    if lay.pp_layout:
        return pp_layout_counts(lay.pp_layout)[0]
    first, last = lay.first_stage_layers, lay.last_stage_layers
    if first is not None or last is not None:
        given = [x for x in (first, last) if x is not None]
        middle_ranks = pp - len(given)
        rest = n_layers - sum(given)
        per_middle = rest // middle_ranks if middle_ranks > 0 else 0
        rank_layers = [per_middle] * pp
        if first is not None:
            rank_layers[0] = int(first)
        if last is not None:
            rank_layers[-1] = int(last)
        return tuple(rank_layers[j % pp] // vpp for j in range(n))
    a, b = int(bool(lay.account_embedding)), int(bool(lay.account_loss))
    if a or b:
        per = (n_layers + a + b) // n
        stages = [per] * n
        stages[0] -= a
        stages[-1] -= b
        return tuple(stages)
    if not lay.balanced_split and n_layers % n == 0:
        return (n_layers // n,) * n
    return balanced_stage_layers(n_layers, pp, vpp)


def split_problem(n_layers: int, n_mtp: int, lay: Any) -> Optional[str]:
    """Why the layout's split does not fit a model of n_layers (and n_mtp MTP modules), as
    '<field>: <what>; <fix>', or None when it fits (Megatron's rules, module doc)."""
    pp, vpp = int(lay.pp), int(lay.vpp)
    n = pp * vpp
    if lay.pp_layout:
        counts, mtp = pp_layout_counts(lay.pp_layout)
        if sum(counts) != n_layers:
            return (f"pp_layout: {lay.pp_layout!r} holds {sum(counts)} layers, the model has n_layers={n_layers}; "
                    "give one 't' per layer")
        if mtp != n_mtp:
            return (f"pp_layout: {lay.pp_layout!r} has {mtp} MTP module(s) 'm', the model has n_mtp_layers={n_mtp}; "
                    "put one 'm' per module in the last stage")
        return None
    first, last = lay.first_stage_layers, lay.last_stage_layers
    if first is not None or last is not None:
        given = [x for x in (first, last) if x is not None]
        if any(x % vpp for x in given):
            return (f"first_stage_layers/last_stage_layers={first}/{last}: each must be a multiple of vpp={vpp} "
                    "(a rank's layers split evenly over its chunks); change them or vpp")
        middle_ranks = pp - len(given)
        rest = n_layers - sum(given)
        if rest < 0 or (middle_ranks == 0 and rest != 0):
            return (f"first_stage_layers+last_stage_layers={sum(given)} do not add up to n_layers={n_layers} with "
                    f"pp={pp}; make the given stages and the middle ones sum to {n_layers}")
        if middle_ranks > 0 and rest % (middle_ranks * vpp):
            return (f"first_stage_layers/last_stage_layers={first}/{last}: the other {rest} layers do not split evenly "
                    f"over {middle_ranks} middle rank(s) x vpp={vpp}; pick counts that leave a multiple of "
                    f"{middle_ranks * vpp}")
        return None
    a, b = int(bool(lay.account_embedding)), int(bool(lay.account_loss))
    if a or b:
        if (n_layers + a + b) % n:
            return (f"account_embedding/account_loss: n_layers={n_layers} + {a + b} must be a multiple of "
                    f"pp*vpp={n} (Megatron's rule); use balanced_split instead, or change pp/vpp")
        if (n_layers + a + b) // n < 1 + (a if n == 1 else 0) + (b if n == 1 else 0):
            return f"account_embedding/account_loss: too few layers ({n_layers}) for pp*vpp={n}; lower pp or vpp"
        return None
    if min(virtual_stage_layers(n_layers, lay)) < 0:
        return (f"pp*vpp={pp}*{vpp}: n_layers={n_layers} is too few for {n} virtual stages with the embedding and "
                "the loss counted as a layer each; lower pp or vpp")
    return None


def describe_split(n_layers: int, n_mtp: int, lay: Any) -> str:
    """The layers of each virtual stage as a Megatron layout string ('' without a pipeline),
    ending ' (balanced: pp*vpp does not divide n_layers)' where the layout gives no split of its
    own and the balanced default applies: the resolved split, stated in outputs."""
    if lay.pp == 1:
        return ""
    text = format_pp_layout(virtual_stage_layers(n_layers, lay), n_mtp)
    if uses_default_split(lay) and n_layers % (lay.pp * lay.vpp):
        text += f" (balanced: pp*vpp={lay.pp * lay.vpp} does not divide n_layers={n_layers})"
    return text


def uses_default_split(lay: Any) -> bool:
    """The layout gives no split of its own (even, or balanced when pp*vpp does not divide L)."""
    return (not lay.pp_layout and lay.first_stage_layers is None and lay.last_stage_layers is None
            and not lay.account_embedding and not lay.account_loss and not lay.balanced_split)


SPLIT_COLUMNS = ("pp", "vpp", "first_stage_layers", "last_stage_layers", "account_embedding", "account_loss",
                 "balanced_split", "stage_mtp")
"""The batch columns that, with every column of `stage_layers`, state a candidate's pipeline split."""


def split_columns(batch: Any) -> list[np.ndarray]:
    """The split of each candidate of a LayoutBatch as numeric columns (SPLIT_COLUMNS, then one per
    column of `stage_layers`): the key that groups the rows one split rule treats alike."""
    layout = np.asarray(batch.stage_layers)
    return [np.asarray(getattr(batch, f)) for f in SPLIT_COLUMNS] + [layout[:, j] for j in range(layout.shape[1])]


def stage_layer_table(n_layers: np.ndarray, batch: Any) -> np.ndarray:
    """(n, max pp*vpp) float array of each candidate's virtual-stage layer counts in layer order,
    0 beyond its own pp*vpp stages (the batch form of `virtual_stage_layers`). Each rule fills
    only its own rows, the balanced one once per distinct (L, pp, vpp)."""
    n_layers = np.asarray(n_layers, dtype=np.int64)
    pp = np.asarray(batch.pp, dtype=np.int64)
    vpp = np.asarray(batch.vpp, dtype=np.int64)
    stages = np.maximum(pp * vpp, 1)
    n = len(pp)
    width = int(stages.max()) if n else 1
    out = np.zeros((n, width), dtype=np.int64)
    first = np.asarray(batch.first_stage_layers, dtype=np.int64)
    last = np.asarray(batch.last_stage_layers, dtype=np.int64)
    acc_e = np.asarray(batch.account_embedding, dtype=bool).astype(np.int64)
    acc_l = np.asarray(batch.account_loss, dtype=bool).astype(np.int64)
    balanced = np.asarray(batch.balanced_split, dtype=bool)
    layout = np.asarray(batch.stage_layers)
    layout_rows = layout[:, 0] >= 0
    firstlast = ((first >= 0) | (last >= 0)) & ~layout_rows
    account = ((acc_e + acc_l) > 0) & ~layout_rows & ~firstlast
    plain = ~layout_rows & ~firstlast & ~account
    even = plain & ~balanced & (n_layers % stages == 0)
    j = np.arange(width)[None, :]
    for s_value in np.unique(stages[even]):
        rows = np.flatnonzero(even & (stages == s_value))
        out[rows, :s_value] = (n_layers[rows] // s_value)[:, None]
    rows = np.flatnonzero(account)
    if len(rows):
        per = (n_layers[rows] + acc_e[rows] + acc_l[rows]) // stages[rows]
        block = np.where(j < stages[rows][:, None], per[:, None], 0)
        block[:, 0] -= acc_e[rows]
        block[np.arange(len(rows)), stages[rows] - 1] -= acc_l[rows]
        out[rows] = block
    rows = np.flatnonzero(firstlast)
    if len(rows):
        p, v = pp[rows][:, None], vpp[rows][:, None]
        f, la = first[rows][:, None], last[rows][:, None]
        middle_ranks = p - (f >= 0) - (la >= 0)
        rest = n_layers[rows][:, None] - np.maximum(f, 0) - np.maximum(la, 0)
        per_middle = np.where(middle_ranks > 0, rest // np.maximum(middle_ranks, 1), 0)
        rank = j % p
        rank_layers = np.where((rank == 0) & (f >= 0), f, np.where((rank == p - 1) & (la >= 0), la, per_middle))
        out[rows] = np.where(j < stages[rows][:, None], rank_layers // v, 0)
    if layout_rows.any():
        w = min(layout.shape[1], width)
        out[layout_rows, :w] = np.maximum(layout[layout_rows, :w], 0)
    rest_rows = plain & ~even
    if rest_rows.any():
        L_r, p_r, v_r = n_layers[rest_rows], pp[rest_rows], vpp[rest_rows]
        first, inverse = row_groups([L_r, p_r, v_r])
        table = np.zeros((len(first), width), dtype=np.int64)
        for u, i in enumerate(first.tolist()):
            counts = balanced_stage_layers(int(L_r[i]), int(p_r[i]), int(v_r[i]))
            table[u, :len(counts)] = counts
        out[rest_rows] = table[inverse]
    return out.astype(float)


__all__ = ["SPLIT_COLUMNS", "balanced_stage_layers", "describe_split", "format_pp_layout", "parse_pp_layout", "pp_layout_counts", "split_columns", "split_problem",
           "stage_layer_table", "uses_default_split", "virtual_stage_layers"]

"""Exact grouping of equal rows, so that a formula runs once per distinct input and is gathered back.

`row_groups(columns)` -> (first, inverse): rows i and j are in one group iff every column holds
the same value at i and j (whole numbers as integers; other floats by their bit patterns, so
-0.0 and NaN group with themselves only); first[g] is one row of group g (its representative),
inverse[i] the group of row i. A formula of those columns alone, evaluated on the rows `first`
and indexed with `inverse`, then equals the formula on every row, bit for bit.

How: `pack_columns` packs the columns into as few int64 words as their value ranges allow
(column - its minimum, in the bits it needs; a constant column takes none), so that equal rows
are equal words and different rows differ in some word. One word is sorted and split where it
changes; several are first combined by a multiplicative hash, every word is compared against
its group's representative, and a hash collision falls back to the exact `np.unique` of the
stacked words.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_GROUPED_ROWS = 64
"""Batches from this size are worked out once per distinct row by the formulas that group
(`schedule.pipeline_stages`, `validity.split_fits_layers`); smaller ones row by row."""

_MULTIPLIERS = np.random.default_rng(20250101).integers(1, 2**62, size=64, dtype=np.int64) | 1
_FNV_PRIME = np.int64(1099511628211)
_WORD_BITS = 62


def key_column(values: np.ndarray) -> np.ndarray:
    """A column as int64 keys: integers and flags as they are, floats by their bits."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        return np.ascontiguousarray(values, dtype=np.float64).view(np.int64)
    return values.astype(np.int64, copy=False)


def _integer_keys(values: np.ndarray) -> np.ndarray:
    """int64 keys equal iff the values are: whole-number floats (all of them) as integers, else
    `key_column`."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):  # NaN and inf: no whole number, their bits below
            whole = values.astype(np.int64)
            if np.array_equal(whole, values) and not np.signbit(values).any():  # -0.0 keeps its own key
                return whole
    return key_column(values)


def pack_columns(columns: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The columns packed into int64 words, exactly (module doc); [] when every column is constant."""
    words: list[np.ndarray] = []
    word, used = None, _WORD_BITS
    for column in columns:
        keys = _integer_keys(column)
        if keys.size == 0:
            continue
        lo, hi = int(keys.min()), int(keys.max())
        if lo == hi:
            continue  # constant: tells no rows apart
        bits = (hi - lo).bit_length() if hi - lo < 2**_WORD_BITS else 64
        if bits > _WORD_BITS:
            words.append(keys)
            continue
        if used + bits > _WORD_BITS:
            word, used = None, 0
        shifted = keys - lo if lo else keys
        if word is None:
            word = shifted.copy() if shifted is keys else shifted
            words.append(word)
        else:
            word |= shifted << used
        used += bits
    return words


def row_hash(columns: Sequence[np.ndarray]) -> np.ndarray:
    """A 64-bit multiplicative hash of each row of the int64 key columns (equal rows, equal hashes).
    Each column is folded (x ^ x >> 29) before its multiplier, so that a float's exponent bits
    (its high bits, all a small whole number has) also reach the low bits of the product."""
    assert len(columns) <= len(_MULTIPLIERS), len(columns)
    with np.errstate(over="ignore"):
        key = np.zeros(len(columns[0]), dtype=np.int64)
        for col, mult in zip(columns, _MULTIPLIERS):
            key = (key ^ ((col ^ (col >> 29)) * mult)) * _FNV_PRIME
    return key


def row_groups(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the rows of the equal-length `columns` (module doc)."""
    n = len(np.asarray(columns[0])) if columns else 0
    words = pack_columns(columns)
    if not words:
        return np.zeros(min(n, 1), dtype=np.intp), np.zeros(n, dtype=np.intp)
    key = words[0] if len(words) == 1 else row_hash(words)
    order = np.argsort(key)
    ordered = key[order]
    starts = np.empty(n, dtype=bool)
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    inverse = np.empty(n, dtype=np.intp)
    inverse[order] = np.cumsum(starts) - 1
    first = order[starts]
    if len(words) == 1:
        return first, inverse
    rep = first[inverse]
    if all(np.array_equal(word[rep], word) for word in words):
        return first, inverse
    _, first, inverse = np.unique(np.stack(words, axis=1), axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()

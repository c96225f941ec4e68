"""Exact grouping of equal rows, so that a formula runs once per distinct input and is gathered back.

`row_groups(columns)` -> (first, inverse): rows i and j are in one group iff every column holds
the same bits at i and j (floats by their bit patterns, so -0.0 and NaN group with themselves
only); first[g] is one row of group g (its representative), inverse[i] the group of row i. A
formula of those columns alone, evaluated on the rows `first` and indexed with `inverse`, then
equals the formula on every row, bit for bit. A multiplicative hash proposes the groups (rows
sorted by hash) and every column is compared against its group's representative; a collision
falls back to the exact `np.unique` of the stacked columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MULTIPLIERS = np.random.default_rng(20250101).integers(1, 2**62, size=64, dtype=np.int64) | 1
_FNV_PRIME = np.int64(1099511628211)


def key_column(values: np.ndarray) -> np.ndarray:
    """A column as int64 keys: integers and flags as they are, floats by their bits."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        return np.ascontiguousarray(values, dtype=np.float64).view(np.int64)
    return values.astype(np.int64, copy=False)


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
    keys = [key_column(c) for c in columns]
    hashed = row_hash(keys)
    order = np.argsort(hashed)
    ordered = hashed[order]
    starts = np.empty(len(ordered), dtype=bool)
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    inverse = np.empty(len(ordered), dtype=np.intp)
    inverse[order] = np.cumsum(starts) - 1
    first = order[starts]
    rep = first[inverse]
    if all(np.array_equal(col[rep], col) for col in keys):
        return first, inverse
    _, first, inverse = np.unique(np.stack(keys, axis=1), axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()

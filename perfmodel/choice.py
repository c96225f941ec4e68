"""Per-candidate choices: between two values (`select`), among alternatives priced on subsets.

`select(cond, a, b)` is np.where(cond, a, b) for float values, bit for bit. np.where branches on
every element: cheap where the mask runs in long stretches (a planner grid's geometry flags),
several times the arithmetic around it where it flips every few candidates (a batch's mixed
recompute modes, precisions, flavours: the branch mispredicts). Where the mask flips in more
than 1/FLIPS of the candidates, select computes the result's bits without branches:
b ^ ((a ^ b) & mask), mask all ones where cond.

An alternative is (rows, values): `rows` None for values of every candidate, else the indices of
the candidates it holds values for (the others have it equal to alternative 0, which covers every
candidate). `largest` gives each candidate the index of its largest alternative (ties: the
earlier); `Chosen(index, rows).of(values)` the value of each candidate's chosen alternative.
Both equal the plain per-candidate np.where chain over the alternatives padded with
alternative 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from perfmodel.specs.protocols import Values

Rows = Optional[np.ndarray]


def largest(values: Sequence[Values], rows: Sequence[Rows]) -> tuple[np.ndarray, np.ndarray]:
    """(index of each candidate's largest alternative, that largest value); ties go to the earlier."""
    best = np.asarray(values[0], dtype=float)
    choice = np.zeros(best.shape, dtype=np.int64)
    copied = False
    for i in range(1, len(values)):
        if rows[i] is None:
            bigger = values[i] > best
            choice = np.where(bigger, i, choice)
            best = np.where(bigger, values[i], best)
            copied = True  # new arrays
            continue
        if not copied:
            best, choice, copied = best.copy(), choice.copy(), True
        at = rows[i]
        bigger = values[i] > best[at]
        choice[at] = np.where(bigger, i, choice[at])
        best[at] = np.where(bigger, values[i], best[at])
    return choice, best


class Chosen:
    """Each candidate's alternative `index` (of `largest`), ready to pick many values with."""

    def __init__(self, index: np.ndarray, rows: Sequence[Rows]) -> None:
        self.index, self.rows = index, rows
        self._at: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, dtype=np.intp),) * 2]
        for i in range(1, len(rows)):
            if rows[i] is None:
                at = np.flatnonzero(index == i)
                self._at.append((at, at))  # (candidates, their positions in the alternative)
            else:
                local = np.flatnonzero(index[rows[i]] == i)
                self._at.append((rows[i][local], local))

    def of(self, values: Sequence[Values]) -> np.ndarray:
        """The value of each candidate's alternative (values[i]: alternative i's, on its rows)."""
        out = np.array(np.broadcast_to(values[0], self.index.shape), dtype=float)
        for i in range(1, len(values)):
            at, local = self._at[i]
            if len(at):
                shape = self.index.shape if self.rows[i] is None else (len(self.rows[i]),)
                out[at] = np.broadcast_to(values[i], shape)[local]
        return out


FLIPS = 16
"""A mask that changes value between more than 1/FLIPS of neighbouring candidates is selected
without branches (`select`)."""


def select(cond: Values, a: Values, b: Values) -> np.ndarray:
    """np.where(cond, a, b) for float64 values, bit for bit (module doc)."""
    cond = np.asarray(cond, dtype=bool)
    if cond.ndim != 1 or FLIPS * np.count_nonzero(cond[1:] != cond[:-1]) <= len(cond):
        return np.where(cond, np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    mask = -cond.astype(np.int64)
    a_bits = np.asarray(a, dtype=np.float64).view(np.int64)
    b_bits = np.asarray(b, dtype=np.float64).view(np.int64)
    if not b_bits.any():  # b is +0.0: the bits of a where cond
        return (a_bits & mask).view(np.float64)
    return (b_bits ^ ((a_bits ^ b_bits) & mask)).view(np.float64)

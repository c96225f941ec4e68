"""Per-candidate choice among alternatives priced on subsets of the candidates.

An alternative is (rows, values): `rows` None for values of every candidate, else the indices of
the candidates it holds values for (the others have it equal to alternative 0, which covers every
candidate). `largest` gives each candidate the index of its largest alternative (ties: the
earlier); `chosen` the value of each candidate's chosen alternative. Both equal the plain
per-candidate np.where chain over the alternatives padded with alternative 0.
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


def chosen(choice: np.ndarray, values: Sequence[Values], rows: Sequence[Rows]) -> np.ndarray:
    """Each candidate's value of its alternative `choice`."""
    out = values[0]
    copied = False
    for i in range(1, len(values)):
        if rows[i] is None:
            out = np.where(choice == i, values[i], out)
            copied = out.shape == choice.shape  # a new array
            continue
        if not copied:
            out, copied = np.array(np.broadcast_to(out, choice.shape), dtype=float), True
        at = rows[i]
        out[at] = np.where(choice[at] == i, values[i], out[at])
    return out

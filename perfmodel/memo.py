"""Memoisation of pure formulas of live spec objects: `memo_pair`.

`memo_pair(fn)` computes fn(a, b) once per pair of objects (by identity) while both live: the
entry holds weak references and goes with either object. Specs and batches are frozen
dataclasses whose arrays no formula writes to, so a result stays valid while its inputs
exist; `evaluate` builds a batch per chunk (and per sub-batch), so entries last one chunk.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


def memo_pair(fn: Callable[[Any, Any], R]) -> Callable[[Any, Any], R]:
    """fn memoised per live (a, b) object pair (module doc); `.cache_clear()` empties it."""
    cache: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, R]] = {}

    def drop(key: tuple[int, int]) -> Callable[[weakref.ref], None]:
        return lambda _ref: cache.pop(key, None)

    def memoised(a: Any, b: Any) -> R:
        key = (id(a), id(b))
        hit = cache.get(key)
        if hit is not None and hit[0]() is a and hit[1]() is b:
            return hit[2]
        out = fn(a, b)
        cache[key] = (weakref.ref(a, drop(key)), weakref.ref(b, drop(key)), out)
        return out

    memoised.cache_clear = cache.clear  # type: ignore[attr-defined]
    memoised.__doc__ = fn.__doc__
    memoised.__name__ = fn.__name__
    memoised.__wrapped__ = fn  # type: ignore[attr-defined]
    return memoised

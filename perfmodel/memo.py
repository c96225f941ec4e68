"""Memoisation of pure formulas of spec objects inside one evaluation: `memoised`, `scope`.

A formula of specs or batches (`MoEArchitecture`, `ArchBatch`, `ParallelLayout`, `LayoutBatch`:
frozen dataclasses whose arrays no formula writes to) gives the same result for the same
objects, so `evaluate` computes each such formula once per batch instead of once per caller:
`memoised(fn)` caches fn(*specs) by the identity of its arguments while a `scope()` is open, and
the outermost scope's exit empties every cache (nothing outlives the evaluation, and a caller
that edits a batch in place between evaluations gets fresh results). Outside a scope the
formulas run uncached, except a `memoised_last` one, which keeps its last result there (a caller
pricing several stages of one batch, e.g. `memory.stage_memory` per stage).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

R = TypeVar("R")

_CACHES: list[dict[tuple[int, ...], tuple[tuple[Any, ...], Any]]] = []
_DEPTH = [0]


def memoised(fn: Callable[..., R], last: bool = False) -> Callable[..., R]:
    """fn(*args) computed once per tuple of argument objects (by identity) inside a `scope`
    (and, with `last`, kept for the last arguments outside one)."""
    cache: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}
    _CACHES.append(cache)
    outside: list[Any] = [(), None]  # the last (arguments, result) outside a scope

    @functools.wraps(fn)
    def wrapper(*args: Any) -> R:
        if not _DEPTH[0]:
            if not last:
                return fn(*args)
            if len(outside[0]) == len(args) and all(x is y for x, y in zip(outside[0], args)):
                return outside[1]
            out = fn(*args)
            outside[:] = [args, out]
            return out
        key = tuple(id(a) for a in args)
        hit = cache.get(key)
        if hit is not None and all(x is y for x, y in zip(hit[0], args)):
            return hit[1]
        out = fn(*args)
        cache[key] = (args, out)  # holds the arguments: their ids stay theirs until the scope ends
        return out

    return wrapper


def memoised_last(fn: Callable[..., R]) -> Callable[..., R]:
    """`memoised`, keeping its last result outside a scope too."""
    return memoised(fn, last=True)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Memoise the `memoised` formulas until the outermost scope exits (then empty the caches)."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if not _DEPTH[0]:
            for cache in _CACHES:
                cache.clear()

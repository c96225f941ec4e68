"""One exception root for MOSAIC (DESIGN.md "Errors and files").

`assert` is for our own bugs; these are for the user's input and the world:
the CLI prints ``error: <message>`` and exits 2 for `InputError`, 1 for
`InfeasibleError`.

A library function's message names its parameters, not the CLI's flags: a
message may be built from text and `Param` parts, e.g.
``InputError(Param("devices", 4096), " exceeds cluster 'h100' size 1024")``;
``str(error)`` reads ``devices=4096 exceeds ...`` for Python callers and
``error.message_for(flag)`` reads ``--devices 4096 exceeds ...`` for the CLI,
which maps parameter names to its flags (`mosaic.cli.common.flag_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

_NO_VALUE = object()


@dataclass(frozen=True)
class Param:
    """A parameter named in an error message, with the value it was given (or none, or a placeholder)."""

    name: str
    """The library parameter (Python keyword)."""
    value: Any = _NO_VALUE
    """What was passed; left out, the parameter is named alone."""
    placeholder: bool = False
    """`value` is a word standing for a value (``N``), written as is."""

    def text(self, flag: Optional[Callable[[str], str]] = None) -> str:
        """``name=value`` (Python), or ``--flag value`` with `flag` (CLI); the name or flag alone without a value."""
        if self.value is _NO_VALUE:
            return self.name if flag is None else flag(self.name)
        value = str(self.value) if self.placeholder else repr(self.value)
        return f"{self.name}={value}" if flag is None else f"{flag(self.name)} {value}"


Part = Union[str, Param]


class MosaicError(Exception):
    """Root of every error MOSAIC raises on purpose."""

    exit_code = 2

    def __init__(self, *parts: Part) -> None:
        self.parts = parts
        super().__init__(self.message_for(None))

    def message_for(self, flag: Optional[Callable[[str], str]]) -> str:
        """The message with each `Param` part named by `flag` (None: as Python keywords)."""
        return "".join(p.text(flag) if isinstance(p, Param) else str(p) for p in self.parts)


class InputError(MosaicError, ValueError):
    """Bad input: malformed file, unknown key, wrong type, impossible value."""

    exit_code = 2


class InfeasibleError(MosaicError):
    """The request is well formed but no configuration satisfies it."""

    exit_code = 1


class SolverError(MosaicError):
    """An optimisation back end failed or is missing."""

    exit_code = 1


class MosaicRuntimeError(MosaicError, RuntimeError):
    """A run (benchmark, trainer, collective) failed outside our control."""

    exit_code = 1

"""One exception root for MOSAIC (DESIGN.md "Errors and files").

`assert` is for our own bugs; these are for the user's input and the world:
the CLI prints ``error: <message>`` and exits 2 for `InputError`, 1 for
`InfeasibleError`.
"""

from __future__ import annotations


class MosaicError(Exception):
    """Root of every error MOSAIC raises on purpose."""

    exit_code = 2


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

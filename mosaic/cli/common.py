"""Shared CLI plumbing: the error convention, console, JSON output.

Bad input prints one line ``error: ...`` to stderr and exits 2; an
infeasible request exits 1; ``mosaic --debug ...`` shows the traceback.
Library errors name parameters (`perfmodel.errors.Param`); the CLI names
them by their flags (`flag_of`).
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from perfmodel.errors import MosaicError

F = TypeVar("F", bound=Callable[..., Any])

FLAGS = {"fmt": "--format"}
"""Library parameters whose flag is not `--` + the name with `-` for `_`."""

console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


def _flags_without_type(params: list[Any]) -> list[Any]:
    """A flag takes no value: show no `<bool>` type beside it in --help (typer shows one)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    """Every `mosaic` command: help lists flags without a value type."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))


class Group(TyperGroup):
    """The `mosaic` group: its help (--version, --debug, --help) lists flags without a value type."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))


def set_debug(enabled: bool) -> None:
    _state["debug"] = enabled


def fail(message: str, code: int = 2) -> None:
    """Print the one-line error and exit with `code`."""
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def flag_of(name: str) -> str:
    """The CLI flag of a library parameter: `gpus_per_node` -> `--gpus-per-node`, `fmt` -> `--format`."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def cli_errors(func: F) -> F:
    """Turn MosaicError (and its exit code) into the CLI's one-line error."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MosaicError as exc:
            if _state["debug"]:
                traceback.print_exc()
            fail(exc.message_for(flag_of), exc.exit_code)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            if _state["debug"]:
                traceback.print_exc()
            fail(f"{exc.filename}: {exc.strerror}", 2)

    return wrapper  # type: ignore[return-value]


def print_json(payload: Any) -> None:
    """One JSON object on stdout (numpy scalars converted)."""

    def default(obj: Any) -> Any:
        if hasattr(obj, "item"):
            return obj.item()
        if hasattr(obj, "tolist"):
            return obj.tolist()
        raise TypeError(f"not JSON serialisable: {type(obj).__name__}")

    sys.stdout.write(json.dumps(payload, default=default, allow_nan=False) + "\n")

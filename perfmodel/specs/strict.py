"""Strict YAML <-> frozen-dataclass conversion shared by every spec file.

Every YAML that MOSAIC reads goes through `from_mapping`: an unknown key, a
missing field, a wrong type or an impossible value (raised as `InputError`
from a dataclass's ``__post_init__``) becomes one `InputError` line naming the
file, the key path and the fix. Writing is `to_mapping` + `write_yaml_atomic`
(temp file + rename, so a crash never leaves half a file).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from perfmodel.errors import InputError

T = TypeVar("T")

SPEC_VERSION = 1


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin in (tuple, list):
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin in (dict, Mapping):
        return f"a mapping to {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert one YAML value to the annotated type or raise InputError naming `path`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except InputError as exc:
                errors.append(exc)
        raise InputError(f"key '{path}': expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise InputError(f"key '{path}': {value!r} is not {_type_name(tp)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise InputError(f"key '{path}': expected {_type_name(tp)}, got {value!r}")
        return from_mapping(tp, value, path=path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise InputError(f"key '{path}': expected {_type_name(tp)}, got {value!r}")
        item_tp = get_args(tp)[0]
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise InputError(f"key '{path}': expected {_type_name(tp)}, got {value!r}")
        key_tp, val_tp = get_args(tp)
        return {str(k): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise InputError(f"key '{path}': expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise InputError(f"key '{path}': expected an integer, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise InputError(f"key '{path}': expected an integer, got {value!r}") from None
        if not math.isfinite(number) or number != int(number):
            raise InputError(f"key '{path}': expected an integer, got {value!r}")
        return int(number)
    if tp is float:
        # PyYAML reads `989e12` (no dot) as a string: accept numeric strings.
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise InputError(f"key '{path}': expected a number, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise InputError(f"key '{path}': expected a number, got {value!r}") from None
        if math.isnan(number):
            raise InputError(f"key '{path}': is NaN; give a finite number")
        return number
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise InputError(f"key '{path}': expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported annotation {tp!r} at {path}")


def from_mapping(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown and missing keys."""
    if not isinstance(data, Mapping):
        where = f"key '{path}'" if path else "top level"
        raise InputError(f"{where}: expected {_type_name(cls)}, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        fix = f"did you mean '{close[0]}'?" if close else "allowed keys: " + ", ".join(fields)
        raise InputError(f"unknown key '{prefix}{key}'; {fix}")
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if no_default:
                raise InputError(f"missing key '{prefix}{name}'; add it ({_type_name(hints[name])})")
            continue
        kwargs[name] = _convert(data[name], hints[name], prefix + name)
    try:
        return cls(**kwargs)
    except InputError as exc:
        message = str(exc)
        if path and not message.startswith(f"key '{path}"):
            message = message.replace("key '", f"key '{prefix}", 1) if message.startswith("key '") else f"{path}: {message}"
        raise InputError(message) from None


def section_from_mapping(cls: type[T], data: Mapping[str, Any], key: str, source: str, fix: str) -> T:
    """The `key` section of a file's mapping as `cls`; errors name `source` and the key path.

    Plans, run files and exports all hold `model:` and `layout:` sections read this way;
    `fix` says what to do when the section is missing.
    """
    if key not in data:
        raise InputError(f"{source}: missing key '{key}'; {fix}")
    try:
        return from_mapping(cls, data[key], path=key)
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def to_mapping(obj: Any) -> Any:
    """Plain YAML-ready data for a dataclass (tuples become lists, floats stay floats)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_mapping(v) for k, v in obj.items()}
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        return obj.item()
    return obj


def plain(obj: Any, nonfinite_to_none: bool = True) -> Any:
    """YAML/JSON-safe builtins: mappings (keys as str) and lists recursively, numpy scalars as
    Python scalars, str subclasses (e.g. ``torch.__version__``) as str; with `nonfinite_to_none`,
    inf and NaN floats become None (JSON has neither)."""
    if isinstance(obj, Mapping):
        return {str(k): plain(v, nonfinite_to_none) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v, nonfinite_to_none) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        obj = obj.item()
    if isinstance(obj, str):
        return str(obj)
    if nonfinite_to_none and isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping; malformed YAML or a non-mapping is an InputError naming the file."""
    file = Path(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise InputError(f"{file}: file not found; check the path") from None
    except OSError as exc:
        raise InputError(f"{file}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - safe either way; libyaml when present
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid syntax"
        raise InputError(f"{file}: malformed YAML{where}: {problem}; fix the syntax") from None
    if not isinstance(data, dict):
        raise InputError(f"{file}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data


def load_spec(cls: type[T], path: str | os.PathLike[str], version: int = SPEC_VERSION) -> T:
    """Load a versioned spec file strictly; every error names the file."""
    data = read_yaml(path)
    return spec_from_dict(cls, data, source=str(path), version=version)


def spec_from_dict(cls: type[T], data: Mapping[str, Any], source: str, version: int = SPEC_VERSION) -> T:
    """Check the `version:` key, then `from_mapping`; prefix errors with `source`."""
    data = dict(data)
    if "version" not in data:
        raise InputError(f"{source}: missing key 'version'; add 'version: {version}' at the top")
    found = data.pop("version")
    if found != version:
        raise InputError(f"{source}: key 'version': {found!r} is not supported; this MOSAIC reads version {version}")
    try:
        return from_mapping(cls, data)
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def spec_to_dict(obj: Any, version: int = SPEC_VERSION) -> dict[str, Any]:
    return {"version": version, **to_mapping(obj)}


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` through a temp file in the same folder, fsync and a rename.

    The file gets the permissions a plain `open(path, "w")` would give (mkstemp makes 0600).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return write_bytes_atomic(path, text.encode())


def save_figure_atomic(fig: Any, path: str | os.PathLike[str], **savefig_kwargs: Any) -> Path:
    """Render a matplotlib figure as PNG in memory and write it atomically."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig_kwargs)
    return write_bytes_atomic(path, buffer.getvalue())


def write_yaml_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    return write_text_atomic(path, yaml.safe_dump(dict(data), sort_keys=False, width=100))


def check(condition: bool, key: str, problem: str, fix: str) -> None:
    """Raise the standard one-line InputError for an impossible value."""
    if not condition:
        raise InputError(f"key '{key}': {problem}; {fix}")


__all__ = [
    "SPEC_VERSION",
    "check",
    "from_mapping",
    "load_spec",
    "plain",
    "read_yaml",
    "save_figure_atomic",
    "section_from_mapping",
    "spec_from_dict",
    "spec_to_dict",
    "to_mapping",
    "write_bytes_atomic",
    "write_text_atomic",
    "write_yaml_atomic",
]

"""A real-text corpus every Python installation already holds: its documentation.

- ``pydoc_data.topics``: the Language Reference topics CPython ships for ``help()`` (79 documents,
  ~0.5 MB of English prose; PSF licence);
- the docstrings of the standard library's modules (one document per module: its module, class
  and function docstrings joined by blank lines; test packages left out), and optionally of
  installed packages (``--package numpy`` ...; each under its own licence).

Used by the tests (a corpus without a download) and by `benchmarks/ladder_cpu.py`; written as JSON
lines (`{"text": ..., "source": ...}`) that `mosaic data prepare` reads.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from perfmodel.errors import InputError
from perfmodel.specs.strict import write_text_atomic

SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "testing"})


def pydoc_topics() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc:{name}", topics[name]


def module_docstrings(root: Path, label: str, min_chars: int = 200) -> Iterator[tuple[str, str]]:
    """One document per module under `root`: its docstrings joined by blank lines."""
    for path in sorted(root.rglob("*.py")):
        if SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d)
        if len(text) >= min_chars:
            yield f"{label}:{path.relative_to(root)}", text


def python_docs(packages: Sequence[str] = (), stdlib: bool = True) -> Iterator[tuple[str, str]]:
    yield from pydoc_topics()
    if stdlib:
        yield from module_docstrings(Path(sysconfig.get_paths()["stdlib"]), "stdlib")
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise InputError(f"--package {name}: not an installed package here; pip install it or leave it out")
        for location in spec.submodule_search_locations:
            yield from module_docstrings(Path(location), name)


def write_jsonl(path: str | Path, docs: Iterator[tuple[str, str]]) -> dict[str, int]:
    """Write {"text", "source"} lines atomically; returns document and character counts."""
    lines, chars = [], 0
    for key, text in docs:
        lines.append(json.dumps({"text": text, "source": key}, ensure_ascii=False))
        chars += len(text)
    write_text_atomic(path, "\n".join(lines) + "\n")
    return {"documents": len(lines), "characters": chars}


__all__ = ["module_docstrings", "pydoc_topics", "python_docs", "write_jsonl"]

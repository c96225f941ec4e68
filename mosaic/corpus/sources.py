"""Documents from local text: folders, globs, plain files (one document each) and JSON lines (one per line).

Inputs are expanded in order and each file is read once per pass:
- a folder: every file below it whose suffix is in TEXT_SUFFIXES or JSONL_SUFFIXES (sorted paths);
- a glob (``data/*.txt``, ``**/*.md``): the matching files (sorted);
- a file: ``*.jsonl`` / ``*.jsonl.gz``-free ``*.ndjson`` are JSON lines, each an object whose
  `text_field` holds the document; anything else is one UTF-8 document.
Whitespace-only documents are skipped (counted). A document's key (file, line) decides its split.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from perfmodel.errors import InputError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".tex", ".html", ".py")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Document:
    key: str
    """Stable identity: 'path' or 'path:line' (decides the train/validation split)."""
    text: str


def expand(inputs: Sequence[str]) -> list[Path]:
    """The files named by folders, globs and paths, in order, each once."""
    if not inputs:
        raise InputError("data prepare: no inputs; give folders, files or globs of text (or .jsonl)")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES)
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not found:
                raise InputError(f"data prepare: {item}: no such file or folder, and no file matches it as a glob")
        files.extend(p for p in found if p not in files)
    if not files:
        raise InputError(f"data prepare: {', '.join(inputs)}: no text files found (suffixes "
                         f"{', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}); name the files or a glob")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"data prepare: {path}: not UTF-8 text (byte {exc.start}); convert it or leave it out") from None


def documents(path: Path, text_field: str = "text") -> Iterator[Document]:
    """The documents of one file (whitespace-only ones skipped)."""
    if path.suffix.lower() not in JSONL_SUFFIXES:
        text = _read_text(path)
        if text.strip():
            yield Document(str(path), text)
        return
    for line_no, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"data prepare: {path}: line {line_no}: not JSON ({exc.msg}); one object per line") from None
        if not isinstance(row, dict) or text_field not in row:
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise InputError(f"data prepare: {path}: line {line_no}: no field '{text_field}' (has {keys}); "
                             "pass --text-field NAME")
        text = row[text_field]
        if not isinstance(text, str):
            raise InputError(f"data prepare: {path}: line {line_no}: field '{text_field}' is "
                             f"{type(text).__name__}, not text")
        if text.strip():
            yield Document(f"{path}:{line_no}", text)


__all__ = ["JSONL_SUFFIXES", "TEXT_SUFFIXES", "Document", "documents", "expand"]

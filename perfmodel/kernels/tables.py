"""The measured kernel tables (`perfmodel/data/kernels/*.csv`): reading and checking them.

One CSV per kind, one row per measured point copied from a public source (paper table,
repository benchmark file, issue thread, released profile) or written by `mosaic calibrate`.
Every row names its `accelerator`, its `source`, the `hardware` and `software` it ran on and a
`note` on how the number was read (conversions show their arithmetic). `excluded`, when not
empty, says why the fit leaves the row out (e.g. a peak microbenchmark, a whole fused MLP timed
as one, a kernel the training frameworks do not run on that part); the row stays in the table
so the choice can be checked. Columns per kind: `KIND_COLUMNS`; conventions in
`perfmodel/data/kernels/README.md`.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional, Union

import numpy as np

from perfmodel.errors import InputError

KINDS = ("gemm", "grouped_gemm", "attention", "memory_kernels", "collectives", "ep_dispatch")
COMMON_COLUMNS = ("accelerator", "source", "hardware", "software", "note", "excluded")
KIND_COLUMNS: dict[str, tuple[str, ...]] = {
    "gemm": ("precision", "m", "n", "k", "tflops"),
    "grouped_gemm": ("precision", "phase", "groups", "m_per_group", "n", "k", "tflops"),
    "attention": ("precision", "phase", "causal", "seq_len", "head_dim", "tflops"),
    "memory_kernels": ("kernel", "bytes_moved", "gbps"),
    "collectives": ("collective", "ranks", "nodes", "span", "size_bytes", "busbw_gbps"),
    "ep_dispatch": ("library", "mode", "op", "ep", "span", "bandwidth_gbps"),
}
"""Required columns per kind beside COMMON_COLUMNS (more are allowed: algbw, time_us, ...)."""

NUMERIC = {"m", "n", "k", "tflops", "groups", "m_per_group", "seq_len", "head_dim", "n_heads", "batch",
           "bytes_moved", "gbps", "fraction_of_peak", "peak_gbps_used", "ranks", "nodes", "size_bytes",
           "algbw_gbps", "busbw_gbps", "time_us", "ep", "tokens", "hidden", "topk", "bandwidth_gbps"}

PathLike = Union[str, Path]


def tables_dir() -> Path:
    """The bundled tables' folder (package data)."""
    return Path(str(resources.files("perfmodel") / "data" / "kernels"))


@dataclass(frozen=True)
class KernelTable:
    """One kind's rows, column -> array (numbers as float with NaN where empty, text as str)."""

    kind: str
    path: Path
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.columns["accelerator"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def get(self, name: str) -> Optional[np.ndarray]:
        return self.columns.get(name)

    def select(self, mask: np.ndarray) -> KernelTable:
        return KernelTable(self.kind, self.path, {k: v[mask] for k, v in self.columns.items()})

    def rows_of(self, accelerator: str, used_only: bool = True) -> KernelTable:
        """The rows of one accelerator (without the excluded ones unless `used_only` is False)."""
        mask = self.columns["accelerator"] == accelerator
        if used_only:
            mask &= self.columns["excluded"] == ""
        return self.select(mask)

    @property
    def line(self) -> np.ndarray:
        """File line of each row (header = line 1)."""
        return self.columns["_line"]


def read_table(kind: str, path: Optional[PathLike] = None) -> KernelTable:
    """Read and check one kind's CSV (default: the bundled table). An unknown kind, a missing
    column, an empty source or a number that is not one is an InputError naming file and line."""
    if kind not in KINDS:
        raise InputError(f"kernel table kind '{kind}' is unknown; use one of {', '.join(KINDS)}")
    file = Path(path) if path is not None else tables_dir() / f"{kind}.csv"
    try:
        with open(file, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
            header = rows[0].keys() if rows else []
    except OSError as exc:
        raise InputError(f"{file}: cannot read the {kind} table ({exc.strerror})") from None
    needed = COMMON_COLUMNS + KIND_COLUMNS[kind]
    if rows:
        missing = [c for c in needed if c not in header]
        if missing:
            raise InputError(f"{file}: missing column(s) {', '.join(missing)}; the {kind} table needs "
                             f"{', '.join(needed)}")
    columns: dict[str, list] = {c: [] for c in (list(header) if rows else list(needed))}
    columns["_line"] = []
    for i, row in enumerate(rows, start=2):
        if not (row.get("source") or "").strip():
            raise InputError(f"{file}:{i}: empty 'source'; every measured row names where it comes from")
        if not (row.get("accelerator") or "").strip():
            raise InputError(f"{file}:{i}: empty 'accelerator'")
        for name in columns:
            if name == "_line":
                continue
            raw = (row.get(name) or "").strip()
            if name in NUMERIC:
                try:
                    value = float(raw) if raw else math.nan
                except ValueError:
                    raise InputError(f"{file}:{i}: column '{name}': {raw!r} is not a number") from None
                columns[name].append(value)
            else:
                columns[name].append(raw)
        columns["_line"].append(i)
    arrays = {name: np.asarray(values, dtype=float if name in NUMERIC else (np.int64 if name == "_line" else object))
              for name, values in columns.items()}
    for name, arr in arrays.items():
        if arr.dtype == object:
            arrays[name] = arr.astype(str)
    return KernelTable(kind, file, arrays)


def read_tables(folder: Optional[PathLike] = None) -> dict[str, KernelTable]:
    """Every kind's table from `folder` (default: the bundled tables); a kind without a file is empty."""
    base = Path(folder) if folder is not None else tables_dir()
    out = {}
    for kind in KINDS:
        path = base / f"{kind}.csv"
        if path.exists():
            out[kind] = read_table(kind, path)
        else:
            out[kind] = KernelTable(kind, path, {c: np.asarray([], dtype=float if c in NUMERIC else str)
                                                 for c in COMMON_COLUMNS + KIND_COLUMNS[kind]}
                                    | {"_line": np.asarray([], dtype=np.int64)})
    return out


def merge_tables(*parts: dict[str, KernelTable]) -> dict[str, KernelTable]:
    """Concatenate tables kind by kind (columns missing from a part are empty there)."""
    out: dict[str, KernelTable] = {}
    for kind in KINDS:
        pieces = [p[kind] for p in parts if kind in p and len(p[kind])]
        if not pieces:
            out[kind] = next((p[kind] for p in parts if kind in p), read_tables("/nonexistent")[kind])
            continue
        names = sorted({n for piece in pieces for n in piece.columns})
        cols = {}
        for name in names:
            chunks = []
            for piece in pieces:
                if name in piece.columns:
                    chunks.append(piece.columns[name])
                else:
                    fill = np.full(len(piece), np.nan) if name in NUMERIC else np.full(len(piece), "")
                    chunks.append(fill)
            cols[name] = np.concatenate(chunks)
        out[kind] = KernelTable(kind, pieces[0].path, cols)
    return out

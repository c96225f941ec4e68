"""One calibration's measurements as kernel-table rows: the folder beside the calibrated cluster.

`mosaic calibrate -o NAME.yaml` writes `NAME.kernels/` (`folder_of`): the kinds it measured in
the format of the bundled tables (`perfmodel/data/kernels/*.csv`, columns
`perfmodel.kernels.tables.KIND_COLUMNS`, one row per timed point): gemm.csv,
grouped_gemm.csv, attention.csv, memory_kernels.csv, collectives.csv; beside them host.csv (the
host figures: seconds per eager op, DTensor op, checkpointed region and saved tensor) and
provenance.yaml. Every row names `accelerator` = the calibrated cluster's name (`accelerator_of`),
`source` = "mosaic calibrate on HOST at DATE", and the hardware and software it ran on; `note`
says how the point was timed. Conventions per kind:

- gemm: tflops = 2MNK / median time; m, n, k of C[m, n] = A[m, k] B[k, n];
- grouped_gemm: m_per_group = tokens per expert, (n, k) = the expert's (out, in): the forward
  shape, `phase` says which of its three GEMMs ran (fwd, dgrad, wgrad); tflops = 2 T K N E / time;
- attention: causal; tflops on executed FLOPs: forward 2 b h s^2 d (half of 4 b h s^2 d), backward
  2.5x that (`flop_convention`);
- memory_kernels: gbps = bytes moved / time, bytes by the class's convention (`bytes_convention`);
  on cpu the time is net of the call's fixed cost (`fixed_us`: the same call on a 256-byte tensor,
  its aten ops' dispatch, which the CPU model prices per op: `calibration.kernels.FIXED_COST_BYTES`),
  and a row whose time is within twice that fixed cost is kept out of the fit (`excluded`);
- collectives: nccl-tests' size (the all-reduce buffer, the all-gather output, the reduce-scatter
  input, the all-to-all send buffer, the send/recv message) and busbw = size / time x factor
  (2(n-1)/n all-reduce, (n-1)/n all-gather, reduce-scatter, all-to-all, 1 send/recv); `timing` is
  back_to_back or after_compute (cpu, `calibration.collectives.CPU_GAP_BLOCKS`), `level` the
  cluster level. gloo rows are kept out of the table fit (`excluded`): a gloo level's figures are
  the alpha-beta fits of `calibration.fit` (what the trainer's synchronous collectives pay,
  `calibration.profile.level_figures`).

Numbers are written at full precision, so a refit from the folder (`mosaic calibrate
--measurements NAME.kernels`) gives the same cluster as the run that wrote it.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import os
import platform
import shutil
import socket
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from calibration.measurements import COLLECTIVE_KINDS, HOST_KINDS, MEMORY_KERNELS, Measurement
from perfmodel.errors import InputError
from perfmodel.kernels.derive import span_of_level
from perfmodel.kernels.tables import COMMON_COLUMNS, KIND_COLUMNS, KINDS, KernelTable, read_table, read_tables, tables_dir
from perfmodel.operators import FLASH_BWD_FACTOR
from perfmodel.specs.strict import plain, write_text_atomic

FOLDER_SUFFIX = ".kernels"
HOST_FILE = "host.csv"
PROVENANCE_FILE = "provenance.yaml"
MEASURED_KINDS = ("gemm", "grouped_gemm", "attention", "memory_kernels", "collectives")
"""The table kinds `mosaic calibrate` measures (EP dispatch libraries it does not time)."""

HOST_FIGURES = {"launch": "launch_latency_s", "dtensor_op": "dtensor_op_latency_s",
                "checkpoint_region": "checkpoint_region_latency_s",
                "checkpoint_saved_tensor": "checkpoint_saved_tensor_latency_s"}
"""Host kind -> the accelerator field it measures."""
HOST_COLUMNS = ("figure", "seconds", "repeats", "outliers", "noise", "detail", "source", "hardware", "software", "note")

COLLECTIVE_TABLE_NAME = {"p2p": "send_recv"}
"""calibration's collective names -> the table's (nccl-tests' sendrecv)."""
GLOO_EXCLUDED = ("gloo: this level's figures are calibrate's alpha-beta fits of these rows (calibration.fit), "
                 "not the table fit")
AFTER_COMPUTE_EXCLUDED = ("timed after an eager compute gap: gives the level's sync_latency_s "
                          "(calibration.profile.sync_latency), not its per-step latency")

EXTRA_COLUMNS = ("time_us", "repeats", "outliers", "noise")
"""Written beside each kind's columns: the median time of one call and how it was summarised."""
KIND_EXTRA = {"gemm": ("layout", "role"), "attention": ("n_heads", "batch", "flop_convention"),
              "memory_kernels": ("bytes_convention", "fixed_us"), "collectives": ("algbw_gbps", "algorithm", "level", "timing")}


@dataclass
class Provenance:
    """Where and how the measurements were taken."""

    device: str
    device_name: str
    ranks: int
    torch_version: str
    driver: str
    threads_per_rank: Optional[int]
    quick: bool
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    host: str = field(default_factory=socket.gethostname)
    notes: dict[str, str] = field(default_factory=dict)
    """Skipped precisions, grouped-GEMM fallback, collective failures."""
    load_average: Optional[list[Optional[float]]] = None
    """1-minute host load average before and after measuring (other jobs disturb timings)."""

    def mapping(self) -> dict[str, Any]:
        return {
            "date": self.date, "host": self.host, "platform": platform.platform(), "device": self.device,
            "device_name": self.device_name, "ranks": self.ranks, "torch_version": self.torch_version,
            "driver": self.driver, "threads_per_rank": self.threads_per_rank, "quick": self.quick,
            "load_average_1min": self.load_average, "host_cpus": _cpus(), "notes": dict(self.notes),
        }

    @property
    def source(self) -> str:
        return f"mosaic calibrate on {self.host} at {self.date}"

    @property
    def hardware(self) -> str:
        if self.device == "cpu":
            return f"{self.device_name}, {self.threads_per_rank or 1} thread per rank"
        return self.device_name

    @property
    def software(self) -> str:
        return f"torch {self.torch_version}" + ("" if self.device == "cpu" else f", {self.driver}")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def folder_of(output: Path) -> Path:
    """The tables folder of a calibrated cluster file: NAME.yaml -> NAME.kernels/."""
    return Path(output).with_name(f"{Path(output).stem}{FOLDER_SUFFIX}")


def accelerator_of(base_name: str) -> str:
    """The calibrated cluster's name, which its rows' `accelerator` column carries."""
    return f"{base_name}_calibrated"


# --------------------------------------------------------------------------- rows

def _num(value: float) -> str:
    """Full precision (repr), integers without a fraction."""
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def _timing_note(m: Measurement, device: str) -> str:
    how = "device-timed" if device != "cpu" else "host-timed, one thread"
    return (f"median of {m.repeats} {how} calls ({m.outliers} dropped as stalls, IQR/median {m.noise:.3f})")


def _stats(m: Measurement) -> dict[str, str]:
    return {"time_us": _num(m.median_s * 1e6), "repeats": str(m.repeats), "outliers": str(m.outliers),
            "noise": f"{m.noise:.4g}"}


def table_rows(rows: Iterable[Measurement], provenance: Provenance, accelerator: str,
               level_names: Sequence[str]) -> dict[str, list[dict[str, str]]]:
    """The kernel-table rows of the measurements, by kind (host kinds are `host_rows`')."""
    from calibration.collectives import AFTER_COMPUTE

    common = {"accelerator": accelerator, "source": provenance.source, "hardware": provenance.hardware,
              "software": provenance.software, "excluded": ""}
    out: dict[str, list[dict[str, str]]] = {kind: [] for kind in MEASURED_KINDS}
    cpu = provenance.device == "cpu"
    rows = list(rows)
    fixed_s = {m.kind: m.median_s for m in rows if m.kind in MEMORY_KERNELS and m.phase == "fixed"}
    for m in rows:
        shape = m.shape_dict()
        note = _timing_note(m, m.device)
        if m.kind == "gemm":
            cold = "; operands cycled over 64 MiB (cold, as in a training step)" if cpu else ""
            out["gemm"].append({**common, "precision": m.precision, "m": _num(shape["M"]), "n": _num(shape["N"]),
                                "k": _num(shape["K"]), "layout": "NN", "role": "", "tflops": _num(m.rate / 1e12),
                                "note": f"torch.mm; {note}{cold}", **_stats(m)})
        elif m.kind == "grouped_gemm":
            groups, tokens = shape["E"], shape["T"]
            imbalance = f"; imbalance {shape['imbalance']:g} (one expert at that multiple of the mean)" \
                if shape.get("imbalance", 1.0) != 1.0 else ""
            out["grouped_gemm"].append({**common, "precision": m.precision, "phase": m.phase or "fwd",
                                        "groups": _num(groups), "m_per_group": _num(tokens), "n": _num(shape["N"]),
                                        "k": _num(shape["K"]), "tflops": _num(m.rate / 1e12),
                                        "note": f"{m.impl or 'grouped'}; {note}{imbalance}", **_stats(m)})
        elif m.kind == "sdpa":
            out["attention"].append({**common, "precision": m.precision, "phase": m.phase or "fwd", "causal": "true",
                                     "seq_len": _num(shape["S"]), "head_dim": _num(shape["D"]),
                                     "n_heads": _num(shape["H"]), "batch": _num(shape["B"]),
                                     "tflops": _num(m.rate / 1e12),
                                     "flop_convention": f"executed: forward 4*b*h*s^2*d/2 (causal half), backward "
                                                        f"{FLASH_BWD_FACTOR:g}x forward",
                                     "note": f"torch scaled_dot_product_attention(is_causal=True)"
                                             f"{', backward alone (autograd.grad on a retained graph)' if m.phase == 'bwd' else ''}"
                                             f"; {note}", **_stats(m)})
        elif m.kind in MEMORY_KERNELS:
            spec = MEMORY_KERNELS[m.kind]
            fixed = fixed_s.get(m.kind, 0.0)
            net_s = m.median_s if m.phase == "fixed" else m.median_s - fixed
            excluded = ""
            if m.phase == "fixed":
                excluded = "the call's fixed cost (its aten ops' dispatch): subtracted from this kernel's other rows"
            elif net_s < 0.5 * m.median_s:
                excluded = (f"within twice the call's fixed cost ({fixed * 1e6:.3g} us): its bytes' time is not "
                            "resolved")
            row = {**common, "kernel": spec.kernel, "bytes_moved": _num(m.bytes),
                   # a median at or below the fixed cost resolves no bandwidth (nan, kept out as above)
                   "gbps": _num(m.bytes / net_s / 1e9 if net_s > 0 else math.nan), "bytes_convention": spec.convention,
                   "fixed_us": _num(fixed * 1e6) if fixed and m.phase != "fixed" else "", "excluded": excluded,
                   "note": f"fp32; {note}" + (f"; time net of the call's fixed cost, {fixed * 1e6:.4g} us (fixed_us)"
                                              if fixed and m.phase != "fixed" else ""),
                   **_stats(m)}
            out["memory_kernels"].append(row)
        elif m.kind in COLLECTIVE_KINDS:
            after = m.impl.endswith(AFTER_COMPUTE)
            backend = m.impl[:-len(AFTER_COMPUTE)] if after else m.impl
            index = list(level_names).index(m.level) if m.level in level_names else 0
            span = span_of_level(index, m.level, len(level_names))
            excluded = AFTER_COMPUTE_EXCLUDED if after else (GLOO_EXCLUDED if backend == "gloo" else "")
            out["collectives"].append({
                **common, "collective": COLLECTIVE_TABLE_NAME.get(m.kind, m.kind), "ranks": str(m.ranks),
                "nodes": str(1 if span == "node" else m.ranks), "span": span, "size_bytes": _num(m.bytes),
                "algbw_gbps": _num(m.rate / 1e9), "busbw_gbps": _num(m.busbw_bytes_per_s / 1e9),
                "algorithm": backend, "level": m.level, "timing": "after_compute" if after else "back_to_back",
                "excluded": excluded,
                "note": (f"{m.precision}; {'each call after an eager compute gap, the gap subtracted; ' if after else ''}"
                         f"{note}"), **_stats(m)})
    return {kind: rows_ for kind, rows_ in out.items() if rows_}


def host_rows(rows: Iterable[Measurement], provenance: Provenance) -> list[dict[str, str]]:
    """host.csv rows: one per host figure measured."""
    what = {"launch": ("an eager op with autograd: RMSNorm + SwiGLU blocks forward + backward, per dispatched op "
                       "(calibration.eager_ops)") if provenance.device == "cpu" else "host dispatch of a 1-element add",
            "dtensor_op": ("host time a DTensor op adds: the blocks with column-/row-wise tensor-parallel linears on a "
                           "fake 2-rank mesh against the same blocks on one device (calibration.eager_ops)"),
            "checkpoint_region": ("per checkpointed region, solved from RMSNorm + SwiGLU block and causal SDPA stacks "
                                  "with and without non-reentrant torch.utils.checkpoint (calibration.eager_ops)"),
            "checkpoint_saved_tensor": "per tensor a checkpointed region saves, solved with the region cost"}
    out = []
    for m in rows:
        if m.kind not in HOST_KINDS:
            continue
        out.append({"figure": HOST_FIGURES[m.kind], "seconds": _num(m.median_s), "repeats": str(m.repeats),
                    "outliers": str(m.outliers), "noise": f"{m.noise:.4g}", "detail": m.shape, "source": provenance.source,
                    "hardware": provenance.hardware, "software": provenance.software,
                    "note": f"median {what[m.kind]} ({m.device})"})
    return out


def _columns(kind: str, rows: Sequence[dict[str, str]]) -> list[str]:
    first = ["accelerator", *KIND_COLUMNS[kind], *KIND_EXTRA.get(kind, ()), *EXTRA_COLUMNS]
    rest = [c for c in COMMON_COLUMNS if c not in first]
    seen = dict.fromkeys(first + rest)
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _csv_text(columns: Sequence[str], rows: Iterable[dict[str, str]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c, "") for c in columns})
    return buffer.getvalue()


def write_folder(folder: Path, rows: Sequence[Measurement], provenance: Provenance, accelerator: str,
                 level_names: Sequence[str]) -> Path:
    """Write the tables, host.csv and provenance.yaml of `rows` as `folder` (replacing it whole,
    so no mix of two runs is ever left)."""
    files = {f"{kind}.csv": _csv_text(_columns(kind, kind_rows), kind_rows)
             for kind, kind_rows in table_rows(rows, provenance, accelerator, level_names).items()}
    host = host_rows(rows, provenance)
    if host:
        files[HOST_FILE] = _csv_text(HOST_COLUMNS, host)
    files[PROVENANCE_FILE] = yaml.safe_dump(plain({"accelerator": accelerator, **provenance.mapping()},
                                                  nonfinite_to_none=False), sort_keys=False, width=100)
    return _replace_folder(Path(folder), files)


def _replace_folder(folder: Path, files: dict[str, str]) -> Path:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old.{os.getpid()}")
            folder.rename(old)
            staging.rename(folder)
            shutil.rmtree(old)
        else:
            staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


# --------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class HostFigure:
    seconds: float
    noise: float
    repeats: int
    source: str
    note: str


@dataclass(frozen=True)
class MeasuredTables:
    """A tables folder read back: the measured accelerator's rows per kind, its host figures and
    provenance (a mapping; empty where the folder has no provenance.yaml)."""

    folder: Path
    accelerator: str
    tables: dict[str, KernelTable]
    host: dict[str, HostFigure]
    provenance: dict[str, Any]

    def rows(self, kind: str) -> KernelTable:
        return self.tables[kind]

    @property
    def device(self) -> str:
        return str(self.provenance.get("device", ""))


def _read_csv_dicts(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def read_folder(folder: Path) -> MeasuredTables:
    """Read a tables folder (`write_folder`'s, or tables of one machine in the bundled format);
    one accelerator per folder, else an InputError naming them."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"--measurements {folder}: not a folder of kernel tables; give the NAME.kernels folder "
                         "`mosaic calibrate` wrote")
    tables = read_tables(folder)
    present = [kind for kind in KINDS if (folder / f"{kind}.csv").exists()]
    host_path = folder / HOST_FILE
    if not present and not host_path.exists():
        raise InputError(f"--measurements {folder}: no kernel tables ({', '.join(f'{k}.csv' for k in MEASURED_KINDS)}) "
                         "in it; give the NAME.kernels folder `mosaic calibrate` wrote")
    names = sorted({str(a) for kind in present for a in tables[kind]["accelerator"]})
    provenance: dict[str, Any] = {}
    if (folder / PROVENANCE_FILE).exists():
        provenance = yaml.safe_load((folder / PROVENANCE_FILE).read_text()) or {}
    if len(names) > 1:
        raise InputError(f"--measurements {folder}: its tables name several accelerators ({', '.join(names)}); keep one "
                         "machine's rows per folder")
    accelerator = names[0] if names else str(provenance.get("accelerator", ""))
    host: dict[str, HostFigure] = {}
    if host_path.exists():
        for i, row in enumerate(_read_csv_dicts(host_path), start=2):
            figure = (row.get("figure") or "").strip()
            if figure not in HOST_FIGURES.values():
                raise InputError(f"{host_path}:{i}: figure {figure!r} is not one of {', '.join(HOST_FIGURES.values())}")
            try:
                seconds = float(row["seconds"])
                noise = float(row.get("noise") or 0.0)
                repeats = int(float(row.get("repeats") or 0))
            except (TypeError, ValueError):
                raise InputError(f"{host_path}:{i}: 'seconds', 'noise' and 'repeats' must be numbers") from None
            if not (math.isfinite(seconds) and seconds >= 0):
                raise InputError(f"{host_path}:{i}: seconds must be >= 0, got {row['seconds']!r}")
            host[figure] = HostFigure(seconds, noise, repeats, row.get("source", ""), row.get("note", ""))
    return MeasuredTables(folder=folder, accelerator=accelerator, tables=tables, host=host, provenance=provenance)


def copy_folder(source: Path, target: Path, accelerator: str) -> Path:
    """Copy a tables folder to `target` with every row's accelerator set to `accelerator` (the
    calibrated cluster these rows now describe); the rows' sources keep where they came from."""
    source, target = Path(source), Path(target)
    if source.resolve() == target.resolve():
        return target
    files: dict[str, str] = {}
    for path in sorted(source.iterdir()):
        if path.suffix == ".csv":
            rows = _read_csv_dicts(path)
            columns = list(rows[0]) if rows else next(csv.reader(path.open()), [])
            if "accelerator" in columns:
                rows = [{**row, "accelerator": accelerator} for row in rows]
            files[path.name] = _csv_text(columns, rows)
        elif path.name == PROVENANCE_FILE:
            data = yaml.safe_load(path.read_text()) or {}
            data["accelerator"] = accelerator
            files[path.name] = yaml.safe_dump(data, sort_keys=False, width=100)
    return _replace_folder(target, files)


def single_table_folder(table_csv: Path, target: Path, accelerator: str) -> Path:
    """A folder holding one kernel table (KIND.csv, checked as the bundled tables are), its rows
    relabelled `accelerator`: `--measurements gemm.csv`."""
    table_csv = Path(table_csv)
    kind = table_csv.stem
    if kind not in KINDS:
        raise InputError(f"--measurements {table_csv}: a single table must be named after its kind "
                         f"({', '.join(f'{k}.csv' for k in KINDS)}), or give the NAME.kernels folder")
    read_table(kind, table_csv)  # checks columns, sources and numbers, naming file and line
    rows = [{**row, "accelerator": accelerator} for row in _read_csv_dicts(table_csv)]
    return _replace_folder(Path(target), {table_csv.name: _csv_text(list(rows[0]) if rows else [], rows)})


# --------------------------------------------------------------------------- the bundled tables

def bundle(folder: Path, accelerator: str, target: Optional[Path] = None) -> list[Path]:
    """Put a calibration's rows into the bundled tables as `accelerator` (replacing that
    accelerator's rows there): how cpu_local's rows were made. Columns the bundled table lacks
    are dropped; its others stay empty. Returns the files written."""
    target = Path(target) if target is not None else tables_dir()
    written = []
    for kind in MEASURED_KINDS:
        source = Path(folder) / f"{kind}.csv"
        if not source.exists():
            continue
        path = target / f"{kind}.csv"
        current = _read_csv_dicts(path) if path.exists() else []
        columns = list(current[0]) if current else _columns(kind, [])
        kept = [row for row in current if row.get("accelerator") != accelerator]
        new = [{**row, "accelerator": accelerator} for row in _read_csv_dicts(source)]
        write_text_atomic(path, _csv_text(columns, kept + new))
        read_table(kind, path)
        written.append(path)
    return written


def noise_summary(measured: MeasuredTables) -> tuple[float, float]:
    """(median, 90th percentile) IQR/median over every timed row of the folder."""
    values: list[float] = []
    for kind in MEASURED_KINDS:
        table = measured.tables[kind]
        if "noise" in table.columns:
            values += [float(v) for v in table["noise"] if str(v).strip()]
    values += [h.noise for h in measured.host.values()]
    arr = np.asarray(values or [0.0], dtype=float)
    return float(np.median(arr)), float(np.percentile(arr, 90))


def _main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Put a calibration's rows into the bundled kernel tables")
    parser.add_argument("folder", type=Path, help="NAME.kernels folder written by `mosaic calibrate`")
    parser.add_argument("--as", dest="accelerator", required=True, help="accelerator name in the bundled tables")
    args = parser.parse_args(argv)
    for path in bundle(args.folder, args.accelerator):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())


__all__ = ["FOLDER_SUFFIX", "HOST_FIGURES", "MEASURED_KINDS", "HostFigure", "MeasuredTables", "Provenance",
           "accelerator_of", "bundle", "copy_folder", "folder_of", "host_rows", "noise_summary", "read_folder",
           "single_table_folder", "table_rows", "write_folder"]

"""`mosaic calibrate` end to end: measure, write the tables, build, write (the CLI is a thin shell over `calibrate`).

Order: kernel microbenchmarks in this process (one thread per rank on cpu,
as torchrun runs ranks), then the collectives, either in this process when
already under torchrun or in a `python -m torch.distributed.run` subprocess
with `nproc` ranks. The measurements are written as kernel tables
(`calibration.tables`, NAME.kernels/ beside -o NAME.yaml) even when a rank fails
(then a `MosaicRuntimeError` names it and the folder); the cluster is built from
that folder (`calibration.profile`) and written only from a complete run.
`--measurements` builds from a folder written before (or one table, or the raw
CSV of an older version) without measuring.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from calibration.measurements import Measurement, read_csv
from calibration.profile import load_average, write_calibrated
from calibration.tables import (
    Provenance,
    accelerator_of,
    copy_folder,
    folder_of,
    read_folder,
    single_table_folder,
    write_folder,
)
from perfmodel.clusters import load_cluster
from perfmodel.errors import InputError, MosaicRuntimeError
from perfmodel.specs.cluster import ClusterSpec


@dataclass(frozen=True)
class CalibrationResult:
    output: Path
    tables: Path
    """The folder of kernel tables the cluster was built from (beside `output`)."""
    spec: ClusterSpec
    report: Optional[Path]


Progress = Callable[[str, int, int], None]
"""progress(phase, advance, total): called as points complete."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def driver_version(device_kind: str) -> str:
    import torch

    if device_kind == "cuda":
        return f"cuda {torch.version.cuda}"
    if device_kind == "npu":
        return f"torch_npu {getattr(__import__('torch_npu'), '__version__', '?')}"
    return "none (cpu)"


def run_kernels(device_kind: str, quick: bool, threads: Optional[int], progress: Optional[Progress] = None,
                local_rank: int = 0) -> tuple[list[Measurement], dict[str, str], str]:
    """Time the kernel grid; returns (rows, notes, device name)."""
    import torch

    from calibration.kernels import (
        cpu_has_native_bf16,
        grouped_impl,
        kernel_plan,
        main_precision,
        run_points,
        supported_precisions,
    )
    from calibration.timing import Budget, device_name, resolve_device

    device = resolve_device(device_kind, local_rank)
    previous_threads = torch.get_num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        precisions, skipped = supported_precisions(device)
        notes = {f"skipped_{p}": why for p, why in skipped.items()}
        if device.type == "cpu" and "bf16" in precisions and cpu_has_native_bf16() is False:
            notes["bf16_emulated"] = ("this CPU has no bf16 GEMM units (no avx512_bf16 / amx_bf16 flag): torch emulates "
                                      "bf16 at a few GFLOP/s, far below fp32, and not monotone in shape: its rows are measured "
                                      "and fitted, but the GEMM form follows them loosely. Plan and train in fp32 here")
        impl, why = grouped_impl(device, {"fp32": torch.float32, "bf16": torch.bfloat16}[main_precision(precisions)])
        notes["grouped_gemm_impl"] = impl if not why else f"{impl}: {why}"
        budget = Budget(warmup=1, min_repeats=9, max_repeats=25, max_seconds=0.2) if quick else Budget()
        plan = kernel_plan(device, quick, precisions)
        rows = run_points(plan, device, budget, (lambda n: progress("kernels", n, len(plan))) if progress else None)
        return rows, notes, device_name(device)
    finally:
        torch.set_num_threads(previous_threads)


def calibrate(base: str, device_kind: str = "cpu", quick: bool = False, nproc: int = 2,
              output: Path = Path("calibrated.yaml"), report_dir: Optional[Path] = None,
              threads: Optional[int] = 1, stall_s: float = 120.0, total_timeout_s: float = 3600.0,
              measurements: Optional[Path] = None, progress: Optional[Progress] = None) -> CalibrationResult:
    """Measure (or read `measurements`), write the tables, build and write the calibrated cluster file."""
    if device_kind not in ("cpu", "cuda", "npu"):
        raise InputError(f"--device {device_kind!r} is not one of cpu, cuda, npu")
    spec = load_cluster(base)  # fail on a bad base before measuring anything
    if nproc < 1:
        raise InputError(f"--nproc {nproc}: must be >= 1 (2 or more to measure collectives)")
    output = Path(output)
    if output.suffix not in (".yaml", ".yml"):
        raise InputError(f"-o {output}: the calibrated cluster must be a .yaml file")
    folder = folder_of(output)
    accelerator = accelerator_of(spec.name)
    level_names = [lvl.name for lvl in spec.levels]
    if measurements is not None:
        _tables_from(Path(measurements), folder, accelerator, level_names)
    else:
        measured = _measure(device_kind, quick, nproc, threads, spec, stall_s, total_timeout_s, output, progress)
        if measured is None:
            return None  # type: ignore[return-value]  # ranks other than 0 write nothing
        rows, provenance, error = measured
        write_folder(folder, rows, provenance, accelerator, level_names)
        if error is not None:
            raise MosaicRuntimeError(f"{error}; {len(rows)} measurements kept in {folder} (refit later with `mosaic "
                                     f"calibrate --measurements {folder}`); no profile written")
    out, calibrated = write_calibrated(base, read_folder(folder), output)
    report = None
    if report_dir is not None:
        from calibration.report import write_report

        report = write_report(Path(report_dir), read_folder(folder), calibrated, out)
    return CalibrationResult(output=out, tables=folder, spec=calibrated, report=report)


def _tables_from(measurements: Path, folder: Path, accelerator: str, level_names: list[str]) -> None:
    """`--measurements`: a tables folder (copied beside the output, its rows labelled as the
    calibrated cluster), one table KIND.csv, or the raw measurements CSV of an older version."""
    if measurements.is_dir():
        read_folder(measurements)  # one machine's tables, checked before anything is written
        copy_folder(measurements, folder, accelerator)
        return
    if not measurements.exists():
        raise InputError(f"--measurements {measurements}: not found; give the NAME.kernels folder `mosaic calibrate` "
                         "wrote")
    header = measurements.read_text(errors="replace").split("\n", 1)[0].split(",")
    if "median_s" in header and "kind" in header:  # raw Measurement rows (calibration.measurements)
        rows = read_csv(measurements)
        provenance = Provenance(device=rows[0].device if rows else "cpu", device_name="unknown (refit from CSV)",
                                ranks=max([r.ranks for r in rows] + [1]), torch_version="unknown (refit from CSV)",
                                driver="unknown", threads_per_rank=None, quick=False,
                                notes={"refit_from": str(measurements)})
        write_folder(folder, rows, provenance, accelerator, level_names)
        return
    single_table_folder(measurements, folder, accelerator)


def _measure(device_kind: str, quick: bool, nproc: int, threads: Optional[int], spec: ClusterSpec, stall_s: float,
             total_timeout_s: float, output: Path, progress: Optional[Progress]
             ) -> Optional[tuple[list[Measurement], Provenance, Optional[str]]]:
    """(rows, provenance, the collectives' error or None); None on a torchrun rank other than 0."""
    load_before = load_average()
    level_names = [lvl.name for lvl in spec.levels]
    level_devices = [lvl.devices for lvl in spec.levels]
    error = None
    if under_torchrun():
        rows, notes, name, ranks = _calibrate_in_torchrun(device_kind, quick, threads, level_names, level_devices,
                                                          output, progress)
        if rows is None:
            return None
    else:
        rows, notes, name = run_kernels(device_kind, quick, threads, progress)
        ranks = nproc
        if nproc >= 2:
            from calibration.collectives import plan_size, run_collectives_subprocess

            total = plan_size(nproc, nproc, quick, device_kind)
            with tempfile.TemporaryDirectory(prefix="mosaic-calibrate-") as work:
                launched = run_collectives_subprocess(
                    nproc, device_kind, quick, level_names, level_devices, Path(work), stall_s=stall_s,
                    total_timeout_s=total_timeout_s,
                    progress=(lambda n: progress("collectives", n, total)) if progress else None)
                rows += launched.rows
                if launched.error is not None:
                    log_copy = output.with_name(f"{output.stem}.collectives.log")
                    log_copy.parent.mkdir(parents=True, exist_ok=True)
                    log_copy.write_text(launched.log_path.read_text(errors="replace"))
                    error = launched.error.replace(str(launched.log_path), str(log_copy))
        else:
            notes["collectives"] = "not measured (--nproc 1); fabric levels keep their base figures"
    import torch

    provenance = Provenance(device=device_kind, device_name=name, ranks=ranks, torch_version=str(torch.__version__),
                            driver=driver_version(device_kind), threads_per_rank=threads if device_kind == "cpu" else None,
                            quick=quick, notes=notes, load_average=[load_before, load_average()])
    busy = [x for x in (provenance.load_average or []) if x is not None and x > max(1, os.cpu_count() or 1)]
    if busy:
        notes["busy_host"] = (f"load average {max(busy)} exceeded the {os.cpu_count()} cpus while measuring: "
                              "timings include other jobs' interference; rerun on a quiet machine for cleaner figures")
    return rows, provenance, error


def _calibrate_in_torchrun(device_kind: str, quick: bool, threads: Optional[int], level_names: list[str],
                           level_devices: list[int], output: Path,
                           progress: Optional[Progress]) -> tuple[Any, dict[str, str], str, int]:
    """Already under torchrun: every rank times kernels on its device, then the collectives; rank 0 keeps rows."""
    from calibration.collectives import worker

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows, notes, name = run_kernels(device_kind, quick, threads, progress if rank == 0 else None,
                                    local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    partial = output.with_name(f"{output.stem}.collectives.partial.csv")
    if rank == 0:
        partial.unlink(missing_ok=True)
    if world >= 2:
        collective_rows = worker(partial, device_kind, quick, level_names, level_devices)
        rows = rows + collective_rows
    if rank != 0:
        return None, notes, name, world
    partial.unlink(missing_ok=True)
    return rows, notes, name, world


__all__ = ["CalibrationResult", "calibrate", "run_kernels", "under_torchrun"]

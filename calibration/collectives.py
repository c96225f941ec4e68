"""Collective benchmarks under torchrun, and the launcher that runs them as a subprocess.

Worker (every rank, under torchrun): `python -m calibration.collectives --out rows.csv ...`.
It times all_reduce, all_gather_into_tensor, reduce_scatter_tensor (named
all_gather_single / reduce_scatter_single from torch 2.13),
all_to_all_single and send/recv (each rank sends to the next and receives from
the previous, as nccl-tests' sendrecv) over message sizes, for a group inside a
node and, when the job spans nodes, a group with one rank per node. A repeat's
time is the slowest rank's (max over the group), device-timed on cuda/npu. On cpu a
repeat is a batch of operations lasting about one trainer step
(`CPU_REPEAT_SECONDS`), so the figure is the mean cost per operation, scheduler
stalls included; each point is timed back to back and with an eager compute gap
before each operation (`CPU_GAP_BLOCKS`), as a synchronous gloo trainer issues it.
Rank 0 appends each point to the CSV as soon as it is measured, so a run that
dies or hangs keeps what it measured.

Launcher (`run_collectives_subprocess`): starts `python -m torch.distributed.run`
in its own process group, watches the CSV grow, and kills the whole group when
a rank dies or nothing new is measured for `stall_s` seconds.

Message size S follows nccl-tests (doc/PERFORMANCE.md): the all-reduce buffer,
the all-gather output, the reduce-scatter input, the all-to-all send buffer, the
send/recv message; bus bandwidth = S/t * factor with factor 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for p2p.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from calibration.measurements import COLLECTIVE_KINDS, FIELDS, Measurement, read_csv, to_csv_text

FAULT_ENV = "MOSAIC_CALIBRATION_FAULT"
"""Test hook: `die:<rank>:<points>` or `hang:<rank>:<points>` makes that rank (not 0) exit / sleep
once <points> points are measured (used by the tests of the timeout path)."""


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests bus-bandwidth factor: busbw = algbw * factor."""
    if collective == "all_reduce":
        return 2.0 * (ranks - 1) / ranks
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    return 1.0


def message_sizes(device_type: str, quick: bool) -> list[int]:
    """Message sizes in bytes: 4 KiB upward by 4x (to 16 MiB quick / 64 MiB on cpu, 256 MiB on accelerators)."""
    top = (16 if quick else 64) * 2**20 if device_type == "cpu" else (64 if quick else 256) * 2**20
    sizes, size = [], 4 * 2**10
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def repeats_for(quick: bool, device_type: str = "cuda") -> tuple[int, int]:
    """(warm-up calls, timed repeats) per message size; fixed so every rank agrees. On cpu a
    repeat is a batch of ~CPU_REPEAT_SECONDS (see `ops_per_repeat`), so fewer are needed."""
    if device_type == "cpu":
        return (2, 9) if quick else (3, 15)
    return (2, 41) if quick else (5, 51)


CPU_REPEAT_SECONDS = 0.03
"""On cpu one timed repeat lasts about one CPU trainer step (10-100 ms; the same length as
`calibration.eager_ops.SAMPLE_SECONDS`). gloo on a host whose cores also compute pays
scheduler wake-ups and stalls on some operations; a trainer step issues its collectives back to
back with its compute and pays their mean, which the median of isolated calls after a barrier
underestimates several times over (docs/validation.md, "Measurements behind the calibration's settings")."""


def ops_per_repeat(seconds_per_op: float, device_type: str) -> int:
    """Operations in one timed repeat: one on accelerators (device events time it); on cpu as
    many as last about CPU_REPEAT_SECONDS at `seconds_per_op` (the slowest rank's warm-up figure,
    so every rank of the group runs the same count)."""
    if device_type != "cpu":
        return 1
    return int(min(256, max(1, round(CPU_REPEAT_SECONDS / max(seconds_per_op, 1e-7)))))


CPU_GAP_BLOCKS = 2
"""On cpu every point is timed twice: back to back, and with each collective after an eager
compute gap (forward + backward of this many RMSNorm + SwiGLU blocks, calibration.eager_ops:
about the compute the CPU trainer's tiny models run between two collectives), the gap's own
time (measured alone in the same repeat) subtracted. A synchronous trainer's collective pays
what a tight loop does not: the peer's gloo threads have gone to sleep and the ranks arrive
apart (the after-compute alpha came out well above the back-to-back one and near the trainer's
own profile: docs/validation.md, "Measurements behind the calibration's settings"). The
alpha-beta fits use the back-to-back rows; the after-compute rows (impl suffixed AFTER_COMPUTE)
give the fabric level's `sync_latency_s` = median over collectives of alpha(after compute) -
alpha(back to back), the extra per call (calibration.profile.sync_latency)."""
AFTER_COMPUTE = "+after-compute"


def cpu_gap() -> Callable[[], None]:
    """The eager compute gap (see CPU_GAP_BLOCKS)."""
    import torch

    from calibration.eager_ops import EAGER_BLOCK_TOKENS, EAGER_BLOCK_WIDTH, EagerBlock, stack_step

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[EagerBlock(EAGER_BLOCK_WIDTH) for _ in range(CPU_GAP_BLOCKS)])
    return stack_step(blocks, torch.randn(EAGER_BLOCK_TOKENS, EAGER_BLOCK_WIDTH, requires_grad=True))


def _time_repeat(op: Callable[[], object], inner: int, group: object, device: object,
                 gap: Optional[Callable[[], None]] = None) -> float:
    """Seconds per operation of `inner` back-to-back calls after a barrier (device events on cuda/npu);
    with `gap` (cpu), each call follows the gap and the gap's own time (timed alone) is subtracted."""
    import torch
    import torch.distributed as dist

    if gap is not None:
        t0 = time.perf_counter()
        for _ in range(inner):
            gap()
        gap_s = (time.perf_counter() - t0) / inner
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(inner):
            gap()
            op()
        return max((time.perf_counter() - t0) / inner - gap_s, 1e-9)
    dist.barrier(group=group)
    if device.type != "cpu":  # type: ignore[attr-defined]
        backend = getattr(torch, device.type)  # type: ignore[attr-defined]
        begin, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
        begin.record()
        for _ in range(inner):
            op()
        end.record()
        end.synchronize()  # NOTE: host-device sync per repeat
        return begin.elapsed_time(end) * 1e-3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        op()
    return (time.perf_counter() - t0) / inner


@dataclass(frozen=True)
class GroupSpec:
    level: str
    """Cluster level this group exercises."""
    ranks_of: list[list[int]]
    """Partition of all ranks into groups of this kind (every rank is in exactly one)."""


def group_specs(world: int, local: int, level_names: list[str], level_devices: list[int]) -> list[GroupSpec]:
    """Groups inside a node (when local >= 2) and one-rank-per-node groups (when nodes >= 2)."""

    def level_for(span: int) -> str:
        for name, devices in zip(level_names, level_devices):
            if span <= devices:
                return name
        return level_names[-1]

    nodes = world // local
    specs = []
    if local >= 2:
        specs.append(GroupSpec(level_for(local), [list(range(n * local, (n + 1) * local)) for n in range(nodes)]))
    if nodes >= 2:
        # A rail group spans every node: it exercises the level that holds the whole job.
        specs.append(GroupSpec(level_for(world), [list(range(r, world, local)) for r in range(local)]))
    return specs


def plan_size(world: int, local: int, quick: bool, device_type: str) -> int:
    """Number of points rank 0 will record (for the progress bar): on cpu each point twice, back to
    back and after a compute gap (CPU_GAP_BLOCKS)."""
    groups = group_specs(world, local, ["a", "b"], [local, world])
    variants = 2 if device_type == "cpu" else 1
    return len(groups) * len(COLLECTIVE_KINDS) * len(message_sizes(device_type, quick)) * variants


# --------------------------------------------------------------------------- worker

def _fault() -> tuple[str, int, int]:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return "", -1, -1
    mode, rank, points = spec.split(":")
    return mode, int(rank), int(points)


def worker(out: Path, device_kind: str, quick: bool, level_names: list[str], level_devices: list[int],
           on_row: Optional[Callable[[Measurement], None]] = None, kinds: Optional[Sequence[str]] = None,
           sizes_bytes: Optional[Sequence[int]] = None) -> list[Measurement]:
    """Run every collective point on this rank (all ranks call it); rank 0 returns and appends the rows.

    `kinds` / `sizes_bytes` restrict the points (default: COLLECTIVE_KINDS over `message_sizes`):
    benchmarks/fidelity.py re-times one small all-reduce between its trainer runs so."""
    import datetime

    import torch
    import torch.distributed as dist

    from calibration.stats import summarize
    from calibration.timing import resolve_device, synchronize

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_kind, local_rank)
    initialised_here = False
    if not dist.is_initialized():
        backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device_kind]
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=600))
        initialised_here = True
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    impl = dist.get_backend()
    dtype = torch.float32 if device_kind == "cpu" else torch.bfloat16
    elem = torch.tensor([], dtype=dtype).element_size()
    precision = "fp32" if dtype == torch.float32 else "bf16"
    fault_mode, fault_rank, fault_points = _fault()
    rows: list[Measurement] = []
    points_done = 0
    if rank == 0 and not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(",".join(FIELDS) + "\n")

    for spec in group_specs(world, local, level_names, level_devices):
        mine = None
        for members in spec.ranks_of:  # every rank creates every group, in the same order
            group = dist.new_group(members)
            if rank in members:
                mine, my_members = group, members
        assert mine is not None
        n = len(my_members)
        for collective in kinds or COLLECTIVE_KINDS:
            if fault_mode and rank == fault_rank and rank != 0 and points_done >= fault_points:
                if fault_mode == "die":
                    os._exit(3)
                time.sleep(3600)
            sizes = [max(n, (nbytes // elem) // n * n) * elem for nbytes in (sizes_bytes or message_sizes(device_kind, quick))]
            ops = [_make_op(collective, size // elem, my_members, rank, mine, device, dtype) for size in sizes]
            warmup, repeats = repeats_for(quick, device.type)
            per_op = torch.zeros(len(sizes), dtype=torch.float64)
            gap = cpu_gap() if device.type == "cpu" else None
            for j, op in enumerate(ops):
                for _ in range(warmup):
                    op()
                if gap is not None:  # batch sizes from a gap + operation pair
                    per_op[j] = _time_repeat(op, warmup, mine, device) + _time_repeat(gap, 1, mine, device)
            synchronize(device)
            if device.type == "cpu":  # every rank of the group must run the same batch sizes
                dist.all_reduce(per_op, op=dist.ReduceOp.MAX, group=mine)
            inners = [ops_per_repeat(float(t), device.type) for t in per_op]
            variants = [(impl, None)] + ([(impl + AFTER_COMPUTE, gap)] if gap is not None else [])
            times = torch.zeros(len(variants), len(sizes), repeats, dtype=torch.float64)
            # Rounds interleave the sizes, so a burst of foreign load slows every size a
            # little instead of one size a lot (the alpha-beta line stays consistent).
            for i in range(repeats):
                for j, (op, inner) in enumerate(zip(ops, inners)):
                    for v, (_, before) in enumerate(variants):
                        times[v, j, i] = _time_repeat(op, inner, mine, device, before)
            slowest = times.to(device=device, dtype=torch.float32 if device.type != "cpu" else torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=mine)  # a repeat ends when its slowest rank does
            points_done += len(sizes)
            if rank != 0:
                continue
            new_rows = []
            for v, (variant_impl, _) in enumerate(variants):
                for j, size in enumerate(sizes):
                    stats = summarize(slowest[v, j].double().cpu().tolist())
                    algbw = size / stats.median_s
                    new_rows.append(Measurement.from_stats(
                        collective, device_kind, precision, {"ranks": n, "bytes": size}, 0.0, size, stats,
                        level=spec.level, ranks=n, impl=variant_impl, busbw_bytes_per_s=algbw * bus_factor(collective, n)))
            rows.extend(new_rows)
            with out.open("a") as handle:
                handle.write(to_csv_text(new_rows).split("\n", 1)[1])
                handle.flush()
            for row in new_rows:
                if on_row is not None:
                    on_row(row)
    dist.barrier()
    if initialised_here:
        dist.destroy_process_group()
    return rows if rank == 0 else []


def _make_op(collective: str, count: int, members: list[int], rank: int, group: object, device: object,
             dtype: object) -> Callable[[], object]:
    """One call of `collective` on a buffer of `count` elements (nccl-tests sizing), as a closure."""
    import torch
    import torch.distributed as dist

    n = len(members)
    if collective == "all_reduce":
        buf = torch.ones(count, device=device, dtype=dtype)
        return lambda: dist.all_reduce(buf, group=group)
    # torch >= 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to *_single (same
    # arguments, the old names warn); use whichever this build has.
    if collective == "all_gather":
        shard = torch.ones(count // n, device=device, dtype=dtype)
        full = torch.empty(count, device=device, dtype=dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, shard, group=group)
    if collective == "reduce_scatter":
        full = torch.ones(count, device=device, dtype=dtype)
        shard = torch.empty(count // n, device=device, dtype=dtype)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full, group=group)
    if collective == "all_to_all":
        send = torch.ones(count, device=device, dtype=dtype)
        recv = torch.empty(count, device=device, dtype=dtype)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    assert collective == "p2p", collective
    send = torch.ones(count, device=device, dtype=dtype)
    recv = torch.empty_like(send)
    me = members.index(rank)
    peer_to, peer_from = members[(me + 1) % n], members[(me - 1) % n]

    def sendrecv() -> None:
        ops = [dist.P2POp(dist.isend, send, peer_to, group=group),
               dist.P2POp(dist.irecv, recv, peer_from, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return sendrecv



# --------------------------------------------------------------------------- launcher

@dataclass(frozen=True)
class LaunchResult:
    rows: list[Measurement]
    error: Optional[str]
    """None when every rank finished; otherwise what went wrong (rows measured before it are kept)."""
    log_path: Path


def _kill_group(proc: subprocess.Popen) -> None:
    """End torchrun and every rank it started (they share its process group)."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_error_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if "exitcode" in line or "Error" in line or "error" in line:
            return line[:200]
    return lines[-1][:200] if lines else ""


def run_collectives_subprocess(nproc: int, device_kind: str, quick: bool, level_names: list[str],
                               level_devices: list[int], workdir: Path, stall_s: float = 120.0,
                               total_timeout_s: float = 3600.0,
                               progress: Optional[Callable[[int], None]] = None,
                               startup_s: float = 120.0, kinds: Optional[Sequence[str]] = None,
                               sizes_bytes: Optional[Sequence[int]] = None) -> LaunchResult:
    """Run the worker on `nproc` local ranks via `python -m torch.distributed.run`; never raises on rank failure.

    Hang detection: no new measurement for `stall_s` seconds, except that the
    first measurement may take `startup_s` (starting torch on every rank and the
    rendezvous are slow on a busy host).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "collectives.partial.csv"
    out.unlink(missing_ok=True)
    log = workdir / "collectives.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "calibration.collectives", "--out", str(out), "--device", device_kind,
           "--levels", ",".join(f"{n}:{d}" for n, d in zip(level_names, level_devices))]
    if quick:
        cmd.append("--quick")
    if kinds:
        cmd += ["--kinds", ",".join(kinds)]
    if sizes_bytes:
        cmd += ["--sizes", ",".join(str(int(b)) for b in sizes_bytes)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]))
    with log.open("w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    started = last_change = time.monotonic()
    seen = 0
    error: Optional[str] = None
    try:
        while True:
            rc = proc.poll()
            count = _count_rows(out)
            if count != seen:
                if progress is not None:
                    progress(count - seen)
                seen, last_change = count, time.monotonic()
            if rc is not None:
                if rc != 0:
                    detail = _last_error_line(log)
                    error = (f"a rank of the collective benchmark failed (torchrun exit code {rc}"
                             f"{': ' + detail if detail else ''}); full log: {log}")
                break
            now = time.monotonic()
            if now - last_change > (stall_s if seen else max(stall_s, startup_s)):
                error = (f"the collective benchmark made no progress for {stall_s:.0f} s (a rank hung or died); "
                         f"killed it; log: {log}")
                break
            if now - started > total_timeout_s:
                error = f"the collective benchmark exceeded its {total_timeout_s:.0f} s limit; killed it; log: {log}"
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    rows = read_csv(out, required=False)
    if progress is not None and len(rows) > seen:
        progress(len(rows) - seen)
    return LaunchResult(rows=rows, error=error, log_path=log)


def _count_rows(path: Path) -> int:
    try:
        with path.open("rb") as handle:
            return max(0, sum(1 for _ in handle) - 1)
    except OSError:
        return 0


def _parse_levels(text: str) -> tuple[list[str], list[int]]:
    names, devices = [], []
    for item in text.split(","):
        name, _, count = item.partition(":")
        names.append(name)
        devices.append(int(count))
    return names, devices


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="MOSAIC collective benchmarks (run under torchrun)")
    parser.add_argument("--out", required=True, type=Path, help="CSV that rank 0 appends measurements to")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--levels", default="host:1024", help="cluster levels innermost first, name:devices,...")
    parser.add_argument("--kinds", default="", help=f"collectives to time, comma-separated (default: all of {','.join(COLLECTIVE_KINDS)})")
    parser.add_argument("--sizes", default="", help="message sizes in bytes, comma-separated (default: message_sizes)")
    args = parser.parse_args(argv)
    names, devices = _parse_levels(args.levels)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(COLLECTIVE_KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(COLLECTIVE_KINDS)}")
    try:
        sizes = [int(b) for b in args.sizes.split(",") if b]
    except ValueError:
        sizes = [0]
    if any(b <= 0 for b in sizes):
        parser.error("--sizes: message sizes must be positive byte counts")
    worker(args.out, args.device, args.quick, names, devices, kinds=kinds or None, sizes_bytes=sizes or None)


if __name__ == "__main__":
    main()

"""Running a ladder: one `mosaic train` per rung, resumable, with a live table.

Folder layout (`--out DIR`):
  DIR/ladder.yaml          the design (space, budget, corpus hashes, device, runs); a rerun with other
                           arguments is refused, a rerun with the same ones continues
  DIR/runs/NAME/           the trainer's run folder (run.yaml, metrics.jsonl, summary.json, checkpoints/)
  DIR/runs/NAME/train.log  the trainer's output
  DIR/results.csv          one row per finished run (scaling_fits runs columns), rewritten atomically

A run is finished when its metrics end at its last step with a validation loss; it is never
redone. A run that has a run.yaml but is not finished (a killed ladder) continues with
`mosaic train --resume` from its newest checkpoint (checkpoints every quarter of the run);
others start fresh. Runs go in order of compute, at most `jobs` at a time, each launched with
`python -m mosaic.cli.app train` (which runs torchrun for ranks > 1; cpu, cuda or npu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from mosaic.ladder.design import LadderRun, LadderSpace
from perfmodel.errors import InputError, MosaicRuntimeError
from perfmodel.specs.strict import from_mapping, read_yaml, to_mapping, write_text_atomic, write_yaml_atomic

LADDER_VERSION = 1
RESULT_COLUMNS = ("run_id", "source", "n_total", "n_active", "sparsity", "granularity", "tokens", "loss",
                  "note_heldout", "note_kind", "note_d_model", "note_n_layers", "note_n_experts", "note_top_k",
                  "note_train_loss", "note_flops", "note_seconds")


@dataclass(frozen=True)
class LadderSetup:
    """Everything a ladder's runs depend on (the content of DIR/ladder.yaml)."""

    space: LadderSpace
    budget_flops: float
    train_data: str
    val_data: str
    data_sha256: str
    """sha256 of train.bin and val.bin (from the corpus manifest, or computed)."""
    device: str = "cpu"
    nproc: int = 1
    seed: int = 0
    runs: tuple[LadderRun, ...] = field(default_factory=tuple)

    def identity(self) -> dict[str, Any]:
        """What must not change when a ladder is resumed."""
        return {"space": to_mapping(self.space), "budget_flops": self.budget_flops, "data_sha256": self.data_sha256,
                "device": self.device, "nproc": self.nproc, "seed": self.seed}


def setup_to_dict(setup: LadderSetup) -> dict[str, Any]:
    return {"version": LADDER_VERSION, **setup.identity(), "train_data": setup.train_data, "val_data": setup.val_data,
            "runs": [{"name": r.name, "kind": r.kind, "heldout": r.heldout, "steps": r.steps, "tokens": r.tokens,
                      "model": to_mapping(r.model)} for r in setup.runs]}


def open_ladder(out: Path, setup: LadderSetup) -> LadderSetup:
    """Write DIR/ladder.yaml, or check that the one there is this ladder (then keep its runs)."""
    path = out / "ladder.yaml"
    if path.is_file():
        stored = read_yaml(path)
        ours = setup.identity()
        changed = [k for k in ours if json.dumps(stored.get(k), sort_keys=True) != json.dumps(ours[k], sort_keys=True)]
        if changed:
            raise InputError(f"--out {out}: holds a ladder with another {', '.join(changed)}; rerun with the same "
                             "arguments to continue it, or choose another --out")
        return setup
    write_yaml_atomic(path, setup_to_dict(setup))
    return setup


def run_dir(out: Path, run: LadderRun) -> Path:
    return out / "runs" / run.name


def _last_row(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:   # a line cut short by a kill
            continue
    return None


def state(out: Path, run: LadderRun) -> str:
    """'done', 'partial' (started, not finished) or 'new'."""
    folder = run_dir(out, run)
    row = _last_row(folder / "metrics.jsonl")
    if row is not None and row.get("step") == run.steps and row.get("val_loss") is not None \
            and (folder / "summary.json").is_file():
        return "done"
    return "partial" if (folder / "run.yaml").is_file() else "new"


def train_command(setup: LadderSetup, run: LadderRun, folder: Path, resume: bool) -> list[str]:
    space = setup.space
    layout = f"dp={setup.nproc},mbs={space.mbs},gbs={space.gbs}"
    cmd = [sys.executable, "-m", "mosaic.cli.app", "train", "--model", str(folder / "model.yaml"), "--layout", layout,
           "--nproc", str(setup.nproc), "--device", setup.device, "--data", setup.train_data,
           "--val-data", setup.val_data, "--eval-batches", str(space.eval_batches), "--steps", str(run.steps),
           "--lr", repr(space.lr), "--warmup", str(int(space.warmup_fraction * run.steps)),
           "--checkpoint-every", str(max(1, run.steps // 4)), "--seed", str(setup.seed), "--out", str(folder),
           "--no-progress"]
    return cmd + (["--resume"] if resume else [])


class Process(Protocol):
    def poll(self) -> Optional[int]: ...

    def kill(self) -> None: ...


Launcher = Callable[[LadderSetup, LadderRun, Path, bool], Process]


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM it when the ladder process dies (even by SIGKILL), so a
    killed ladder never leaves a trainer writing into a run folder that the next ladder resumes."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):   # not Linux: the ladder's own cleanup still kills its children
        pass


def subprocess_launcher(jobs: int) -> Launcher:
    """Start the trainer as a child process (OMP threads: cores / jobs), output to DIR/runs/NAME/train.log."""
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))

    def launch(setup: LadderSetup, run: LadderRun, folder: Path, resume: bool) -> Process:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
        env.setdefault("OMP_NUM_THREADS", str(threads))
        log = open(folder / "train.log", "a")
        try:
            return subprocess.Popen(train_command(setup, run, folder, resume), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        finally:
            log.close()

    return launch


@dataclass
class Slot:
    run: LadderRun
    proc: Process
    started: float


def execute(out: Path, setup: LadderSetup, launcher: Launcher, jobs: int = 1,
            on_update: Optional[Callable[[dict[str, dict[str, Any]]], None]] = None, poll_s: float = 0.5) -> None:
    """Run every unfinished run (order of compute), at most `jobs` at once; raises if any failed."""
    order = sorted(setup.runs, key=lambda r: (r.heldout, r.flops))
    status: dict[str, dict[str, Any]] = {}
    pending = []
    for run in order:
        s = state(out, run)
        status[run.name] = {"state": "done (earlier)" if s == "done" else "pending", "run": run}
        if s != "done":
            pending.append((run, s == "partial"))
    running: list[Slot] = []
    failed: list[str] = []
    try:
        while pending or running:
            while pending and len(running) < max(1, jobs):
                run, resume = pending.pop(0)
                folder = run_dir(out, run)
                folder.mkdir(parents=True, exist_ok=True)
                write_yaml_atomic(folder / "model.yaml", {"version": 1, **to_mapping(run.model)})
                running.append(Slot(run, launcher(setup, run, folder, resume), time.time()))
                status[run.name]["state"] = "resumed" if resume else "running"
            for slot in list(running):
                code = slot.proc.poll()
                entry = status[slot.run.name]
                entry["seconds"] = time.time() - slot.started
                if code is None:
                    continue
                running.remove(slot)
                if code == 0 and state(out, slot.run) == "done":
                    entry["state"] = "done"
                else:
                    entry["state"] = f"failed (exit {code})"
                    failed.append(slot.run.name)
            if on_update is not None:
                on_update(status)
            if pending or running:
                time.sleep(poll_s)
    except BaseException:
        for slot in running:
            slot.proc.kill()
            wait = getattr(slot.proc, "wait", None)
            if wait is not None:
                wait()
        raise
    if on_update is not None:
        on_update(status)
    if failed:
        logs = ", ".join(str(run_dir(out, r) / "train.log") for r in setup.runs if r.name in failed)
        raise MosaicRuntimeError(f"ladder: {len(failed)} run(s) failed ({', '.join(failed)}); see {logs}; rerun the "
                                 "same `mosaic ladder` command to retry them (finished runs are kept)")


def progress_of(out: Path, run: LadderRun) -> dict[str, Any]:
    """Latest step, training loss, validation loss and tokens/s of a run (from its metrics.jsonl)."""
    row = _last_row(run_dir(out, run) / "metrics.jsonl") or {}
    val = None
    metrics = run_dir(out, run) / "metrics.jsonl"
    if metrics.is_file():
        for line in reversed(metrics.read_text().splitlines()):
            try:
                v = json.loads(line).get("val_loss")
            except json.JSONDecodeError:
                continue
            if v is not None:
                val = v
                break
    return {"step": row.get("step", 0), "loss": row.get("loss"), "val_loss": val, "tokens_per_s": row.get("tokens_per_s")}


def collect(out: Path, setup: LadderSetup) -> Any:
    """DIR/results.csv from the finished runs (final validation loss); returns the frame."""
    import pandas as pd

    rows = []
    for run in setup.runs:
        if state(out, run) != "done":
            continue
        folder = run_dir(out, run)
        summary = json.loads((folder / "summary.json").read_text())
        last = _last_row(folder / "metrics.jsonl") or {}
        seconds = sum(json.loads(line)["step_time_s"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                      if line.strip())
        rows.append({"run_id": run.name, "source": "ladder", "n_total": run.n_total,
                     "n_active": float(run.model.active_params()), "sparsity": run.sparsity,
                     "granularity": run.granularity, "tokens": float(run.tokens), "loss": float(last["val_loss"]),
                     "note_heldout": run.heldout, "note_kind": run.kind, "note_d_model": run.model.d_model,
                     "note_n_layers": run.model.n_layers, "note_n_experts": run.model.n_experts,
                     "note_top_k": run.model.top_k, "note_train_loss": float(summary["final_loss"]),
                     "note_flops": run.flops, "note_seconds": seconds})
    frame = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
    write_text_atomic(out / "results.csv", frame.to_csv(index=False, float_format="%.10g"))
    return frame


def load_setup(path: Path) -> LadderSetup:
    """DIR/ladder.yaml back into a LadderSetup (what `mosaic ladder --refit` reads)."""
    from perfmodel.specs.architecture import MoEArchitecture

    data = read_yaml(path)
    if data.get("version") != LADDER_VERSION:
        raise InputError(f"{path}: key 'version': {data.get('version')!r} is not supported; this MOSAIC reads "
                         f"version {LADDER_VERSION}")
    space = from_mapping(LadderSpace, data["space"], "space")
    runs = tuple(LadderRun(name=r["name"], model=from_mapping(MoEArchitecture, r["model"], "model"), steps=int(r["steps"]),
                           tokens=int(r["tokens"]), heldout=bool(r["heldout"]), kind=str(r["kind"])) for r in data["runs"])
    return LadderSetup(space=space, budget_flops=float(data["budget_flops"]), train_data=str(data["train_data"]),
                       val_data=str(data["val_data"]), data_sha256=str(data["data_sha256"]), device=str(data["device"]),
                       nproc=int(data["nproc"]), seed=int(data["seed"]), runs=runs)


__all__ = ["LADDER_VERSION", "RESULT_COLUMNS", "LadderSetup", "Launcher", "collect", "execute", "load_setup",
           "open_ladder", "progress_of", "run_dir", "setup_to_dict", "state", "subprocess_launcher", "train_command"]

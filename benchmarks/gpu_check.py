"""The accelerator path on one GPU: calibrate, train, predict, refit, in one command (issue 22).

    python benchmarks/gpu_check.py --out OUT                 # one H200 (cuda): at most --budget-s, 400 s
    python benchmarks/gpu_check.py --dry-run --out OUT       # the same orchestration on cpu, tiny sizes

Every step is a public `mosaic` command in a subprocess, read through its documented outputs
(`--json`, run.yaml, metrics.jsonl, the calibration's kernel tables), each with a timeout inside one overall
deadline (`--budget-s`); a phase that runs over is killed with its process group and what it
left (metrics lines are written step by step) is used. Phases and their caps (GPU / dry run):

  0. environment  python, torch, CUDA, device, compute capability, memory, torchao   (60 s)
  1. calibrate    `mosaic calibrate --device cuda --quick --nproc 1 --report`: GEMM by shape and
                  precision, grouped GEMM, attention, memory-bound kernels, host figures (150 s),
                  written as kernel-table rows in calibrated.kernels/ (calibration.tables).
                  Base: the bundled cluster of the device (`h200` on an H200); where that rule
                  refuses the device, again with --cluster h200, the refusal kept.
  2. train        `mosaic train --no-checkpoint` of each configuration, `--steps` steps
                  (100 s / 60 s each): the ~1B-active MoE of examples/models/moe_1b_active.yaml
                  in bf16 at mbs 2, mbs 1, mbs 2 with full recompute, fp8 (torchao; the trainer's
                  own refusal is recorded where it cannot), and mbs 4 last (the most memory);
                  the dry run trains examples/tiny_moe.yaml in fp32 and leaves mbs 4 out.
  3. predict      `mosaic predict --json` of every configuration on the bundled cluster and on
                  the calibrated one, then `mosaic calibrate --from-runs` on the calibrated one
                  and `mosaic predict --json` on the refitted file (60 s each).
  4. report       OUT/summary.json (everything, written after every phase), step_time.png,
                  kernels.png, memory.png, calibrated.yaml + calibrated.kernels.tar.gz (the
                  folder `mosaic calibrate` wrote beside it: its measured rows as kernel tables,
                  host.csv, provenance.yaml; `tar xzf` it beside calibrated.yaml), refit.yaml and
                  gpu_check.tar.gz (run folders, the calibration report and tables, each
                  command's log and JSON): 8 files, a few MB, what the device tool brings back.

The kernel comparison scores every measured row the fit uses against the bundled cluster's
kernel figures and the calibrated cluster's, through `perfmodel.kernels.check.table_errors` (the
computation that holds the bundled clusters to their tables), one row at a time; per kind and
precision (memory: kernel class; collectives: collective) the medians.

The measured step time of a run is `mosaic calibrate --from-runs`' (the mean after warm-up);
tokens/s and MFU are the run's at that step time (MFU against the bundled cluster's datasheet
peak, the convention of `mosaic train`); memory is the largest `peak_memory_bytes` of its
metrics (torch.cuda.max_memory_allocated on cuda), compared with the prediction less its
`framework` term (CUDA context, NCCL buffers, allocator slack: what the allocator does not
count); on cpu with the whole prediction (peak RSS holds the interpreter). The issue's targets,
printed met or not: trainer MFU >= 35% in bf16; step time within 10% after calibrate, within
5% after --from-runs (every configuration, in sample; the leave-one-out figure beside it);
memory within 5%. Exit 0 when every phase ran (a refused fp8 run included), 1 when one failed or
ran out of time (partial results written), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # perfmodel and calibration are imported where used (--tables needs neither)
    sys.path.insert(0, str(REPO))

GPU_MODEL = REPO / "examples" / "models" / "moe_1b_active.yaml"
DRY_MODEL = REPO / "examples" / "tiny_moe.yaml"


@dataclass(frozen=True)
class Config:
    name: str
    layout: str
    """Layout string of `mosaic train` and `mosaic predict`, the precision the trainer computes in included."""
    gpu_only: bool = False
    """Left out of the dry run."""
    may_be_refused: bool = False
    """The trainer may refuse it here (fp8 without torchao or without an fp8 GPU): its one-line
    refusal is recorded, and is no failure of the check."""


GPU_CONFIGS = (
    Config("bf16_mbs2", "dp=1,mbs=2,gbs=8,precision=bf16"),
    Config("bf16_mbs1", "dp=1,mbs=1,gbs=8,precision=bf16"),
    Config("bf16_mbs2_full", "dp=1,mbs=2,gbs=8,recompute=full,precision=bf16"),
    Config("fp8_mbs2", "dp=1,mbs=2,gbs=8,precision=fp8", may_be_refused=True),
    Config("bf16_mbs4", "dp=1,mbs=4,gbs=8,precision=bf16", gpu_only=True),
)
"""One H200, 8 sequences of 4096 tokens a step (32k tokens). mbs 4 comes last: it holds the most
activations (about 107 GB predicted of 140 usable), and an out-of-memory there costs no other run."""
DRY_CONFIGS = (
    Config("bf16_mbs2", "dp=1,mbs=2,gbs=4,precision=fp32"),
    Config("bf16_mbs1", "dp=1,mbs=1,gbs=4,precision=fp32"),
    Config("bf16_mbs2_full", "dp=1,mbs=2,gbs=4,recompute=full,precision=fp32"),
    Config("fp8_mbs2", "dp=1,mbs=2,gbs=4,precision=fp8", may_be_refused=True),
)
"""The same names on cpu, where the trainer computes in fp32 (and refuses fp8: its message is recorded)."""


@dataclass(frozen=True)
class Mode:
    device: str
    model: Path
    configs: tuple[Config, ...]
    steps: int
    budget_s: float
    caps_s: dict[str, float]
    bundled_default: str
    """The bundled cluster when the calibration cannot say its base (cuda: h200)."""
    main_precision: str
    """The precision of the MFU target's runs: bf16 on the GPU; fp32 on cpu, where the trainer computes in it."""


GPU = Mode("cuda", GPU_MODEL, tuple(c for c in GPU_CONFIGS), 20, 400.0,
           {"environment": 60, "calibrate": 150, "train": 100, "predict": 60, "refit": 60}, "h200", "bf16")
DRY = Mode("cpu", DRY_MODEL, DRY_CONFIGS, 4, 300.0,
           {"environment": 60, "calibrate": 150, "train": 60, "predict": 60, "refit": 60}, "cpu_local", "fp32")

RESERVE_S = {"train": 45.0, "predict": 20.0, "refit": 20.0, "report": 10.0}
"""Seconds kept back, when a phase starts, for the phases after it: at least one training run;
the predictions (a few seconds on a 16-core host, 1-3 s each here); the refit and the refitted
predictions; the plots and the archive. A phase gets min(its cap, deadline - now - the reserve of
what follows)."""
MIN_RUN_S = {"cuda": 25.0, "cpu": 8.0}
"""A training run is not started with less time left: interpreter, torch and CUDA start-up alone
take about this long."""
TARGETS = {"mfu_bf16": 0.35, "step_time_after_calibrate": 0.10, "step_time_after_refit": 0.05, "memory": 0.05}
"""The issue's targets (issue 22): MFU at least, relative errors at most."""
RETURN_LIMITS = {"files": 8, "file_bytes": 16 * 2**20}
"""What the device tool brings back from its output folder (/work/.library/device/README.md)."""


# --------------------------------------------------------------------------- running commands

@dataclass
class Outcome:
    status: str
    """ok, refused (exit 2: the command's one-line input error), failed, timeout, skipped."""
    seconds: float = 0.0
    returncode: Optional[int] = None
    message: str = ""
    stdout: str = ""

    def record(self, command: list[str]) -> dict[str, Any]:
        return {"status": self.status, "seconds": round(self.seconds, 1), "returncode": self.returncode,
                "message": self.message, "command": " ".join(command)}


def _env(device: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # a shared machine: one thread, as benchmarks/fidelity.py runs
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def run_command(command: list[str], timeout_s: float, log: Path, device: str) -> Outcome:
    """Run `command` in its own process group; on timeout the whole group (torchrun's ranks too)
    is terminated, then killed. stdout is kept, stdout and stderr go to `log`."""
    if timeout_s <= 0:
        return Outcome("skipped", message="out of time before it started")
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=_env(device),
                                   cwd=REPO, start_new_session=True)
        try:
            stdout, _ = process.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop_group(process)
            stdout, _ = process.communicate()
            timed_out = True
        except BaseException:  # SIGTERM of this script: its command's group goes with it
            _stop_group(process)
            raise
    seconds = time.perf_counter() - started
    with open(log, "a") as out:
        out.write("\n--- stdout ---\n" + (stdout or ""))
    tail = _last_line(log.read_text(errors="replace").split("\n--- stdout ---\n")[0])
    if timed_out:
        return Outcome("timeout", seconds, process.returncode, f"stopped after {timeout_s:.0f} s", stdout or "")
    status = "ok" if process.returncode == 0 else ("refused" if process.returncode == 2 else "failed")
    return Outcome(status, seconds, process.returncode, "" if status == "ok" else tail, stdout or "")


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(text: str) -> str:
    """The line that says why: the CLI's `error: ...`, else the last non-empty line (a traceback's exception)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1][:500]


def mosaic(*args: str) -> list[str]:
    return [sys.executable, "-m", "mosaic.cli.app", *args]


def _json(text: str) -> Optional[Any]:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


# --------------------------------------------------------------------------- the check

ENVIRONMENT_PROBE = r"""
import importlib.metadata as md, json, os, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "host_cpus": os.cpu_count(),
       "load_average": list(os.getloadavg())}
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        out.update(device_count=torch.cuda.device_count(), device_name=p.name, capability=list(torch.cuda.get_device_capability(0)),
                   device_memory_bytes=total, device_free_bytes=free, multiprocessors=p.multi_processor_count)
except Exception as exc:
    out["torch_error"] = repr(exc)
for name in ("torchao", "numpy", "scipy", "typer", "matplotlib", "pyomo", "pyscipopt"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
try:  # read only: the card's state as found (clocks, power, temperature), never set
    import subprocess
    query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,memory.used"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=20)
    out["nvidia_smi"] = dict(zip(query.split(","), (v.strip() for v in done.stdout.split(",")))) if done.returncode == 0 else None
except (OSError, subprocess.SubprocessError):
    out["nvidia_smi"] = None
print(json.dumps(out))
"""


@dataclass
class Check:
    mode: Mode
    out: Path
    steps: int
    deadline: float
    dry_run: bool
    configs: tuple[Config, ...]
    calibrated_given: Optional[Path] = None
    work: Path = field(init=False)
    started: float = field(init=False, default=0.0)
    summary: dict[str, Any] = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)
    specs: dict[str, Optional[dict[str, Any]]] = field(default_factory=dict)
    """`mosaic show-cluster --json` of each cluster asked for, by name or path."""

    def __post_init__(self) -> None:
        self.work = self.out / "work"

    # -- bookkeeping

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log_lines.append(text)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, phase: str, after: tuple[str, ...]) -> float:
        """min(the phase's cap, what is left once the later phases' reserve is kept back)."""
        reserve = sum(RESERVE_S.get(p, 0.0) for p in after)
        return max(0.0, min(self.mode.caps_s[phase], self.remaining() - reserve))

    def phase(self, name: str, command: list[str], outcome: Outcome) -> Outcome:
        self.summary.setdefault("phases", {})[name] = outcome.record(command)
        detail = f": {outcome.message}" if outcome.message else ""
        self.say(f"[{name}] {outcome.status} in {outcome.seconds:.1f} s{detail}")
        self.write_summary()
        return outcome

    def write_summary(self) -> None:
        self.summary["wall_s"] = round(time.monotonic() - self.started, 1)
        _write_atomic(self.out / "summary.json", json.dumps(_finite(self.summary), indent=2) + "\n")

    def run(self) -> int:
        self.started = time.monotonic()
        self.work.mkdir(parents=True)
        self.summary = {"version": 1, "issue": 22, "dry_run": self.dry_run, "device": self.mode.device,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": round(self.remaining()),
                        "commit": _commit(), "steps": self.steps, "model_file": str(self.mode.model.relative_to(REPO)),
                        "configs": [c.__dict__ for c in self.configs], "targets_wanted": TARGETS}
        self.write_summary()
        try:
            for step in (self.environment, self.calibrate, self.train, self.predict, self.refit, self.compare):
                try:
                    step()
                except Exception as exc:  # a fault of this script must not cost the phases after it
                    import traceback

                    self.summary.setdefault("script_errors", []).append(
                        {"phase": step.__name__, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-3000:]})
                    self.say(f"[{step.__name__}] error in gpu_check itself: {type(exc).__name__}: {exc}")
        finally:
            self.pack()
        self.summary["incomplete_phases"] = self.incomplete()
        self.write_summary()
        return 1 if self.summary["incomplete_phases"] else 0

    def incomplete(self) -> list[str]:
        """Phases that did not do their part: not ok, except a refusal the configuration allows and
        a calibration the device -> cluster rule refused that then ran with --cluster; and any
        step in which this script itself failed."""
        allowed = {f"train {c.name}" for c in self.configs if c.may_be_refused}
        out = [f"{e['phase']} (gpu_check error)" for e in self.summary.get("script_errors", [])]
        for name, phase in self.summary.get("phases", {}).items():
            if phase["status"] == "ok" or (phase["status"] == "refused" and name in allowed):
                continue
            if name == "calibrate" and self.summary.get("calibrated_cluster"):
                continue
            out.append(name)
        return out

    # -- phases

    def environment(self) -> None:
        command = [sys.executable, "-c", ENVIRONMENT_PROBE]
        outcome = self.phase("environment", command, run_command(command, self.timeout("environment", ("train", "predict", "refit", "report")),
                                                                 self.work / "logs" / "environment.log", self.mode.device))
        env = _json(outcome.stdout) or {}
        self.summary["environment"] = env
        if env:
            name = env.get("device_name", "cpu")
            self.say(f"python {env.get('python')}, torch {env.get('torch')} (cuda {env.get('torch_cuda')}), device {name}"
                     + (f" sm_{''.join(map(str, env['capability']))}, {env['device_memory_bytes'] / 2**30:.0f} GiB"
                        if env.get("capability") else "") + f", torchao {env.get('torchao')}")
        model = _model_figures(self.mode.model)
        self.summary["model"] = model
        self.say(f"model {self.mode.model.name}: {model['active_params'] / 1e9:.3g}B active, "
                 f"{model['total_params_with_embeddings'] / 1e9:.3g}B in total")
        self.write_summary()

    def calibrate(self) -> None:
        later = ("train", "predict", "refit", "report")
        if self.calibrated_given is not None:
            target = self.work / "calibrated.yaml"
            shutil.copyfile(self.calibrated_given, target)
            _tables_given(self.calibrated_given, _tables_folder(target))
            self.summary.setdefault("phases", {})["calibrate"] = {
                "status": "ok", "seconds": 0.0, "returncode": None, "message": f"reused {self.calibrated_given}",
                "command": ""}
            self.after_calibration(target, {})
            return
        output = self.work / "calibrated.yaml"
        base = ["calibrate", "--device", self.mode.device, "--quick", "--nproc", "1", "-o", str(output),
                "--report", str(self.work / "report"), "--json"]
        command = mosaic(*base)
        outcome = self.phase("calibrate", command, run_command(command, self.timeout("calibrate", later),
                                                               self.work / "logs" / "calibrate.log", self.mode.device))
        if outcome.status == "refused" and "--cluster" in outcome.message:  # the device -> cluster rule refused it
            command = mosaic(*base, "--cluster", self.mode.bundled_default)
            outcome = self.phase(f"calibrate (--cluster {self.mode.bundled_default})", command,
                                 run_command(command, self.timeout("calibrate", later),
                                             self.work / "logs" / "calibrate_with_cluster.log", self.mode.device))
        if outcome.status == "ok" and output.is_file():
            self.after_calibration(output, _json(outcome.stdout) or {})

    def after_calibration(self, output: Path, printed: dict[str, Any]) -> None:
        self.summary["calibrated_cluster"] = str(output.relative_to(self.work))
        self.summary["calibration_printed"] = printed
        shutil.copyfile(output, self.out / "calibrated.yaml")
        folder, returned = _tables_folder(output), _tables_folder(self.out / "calibrated.yaml")
        if folder.is_dir():  # one file, which unpacks to the folder beside the returned calibrated.yaml
            _tar(folder, returned.with_name(f"{returned.name}.tar.gz"), returned.name)
        self.write_summary()

    def bundled(self) -> str:
        """The bundled cluster to compare with: the calibration's base, else the device's default."""
        spec = self.show_cluster(self.work / "calibrated.yaml") if self.summary.get("calibrated_cluster") else None
        base = ((spec or {}).get("calibration") or {}).get("base_cluster")
        if isinstance(base, dict):  # {name, file, content_hash}
            base = base.get("name")
        return str(base) if base else self.mode.bundled_default

    def show_cluster(self, cluster: Any) -> Optional[dict[str, Any]]:
        """The resolved cluster as `mosaic show-cluster --json` prints it (None where it fails)."""
        key = str(cluster)
        if key not in self.specs:
            command = mosaic("show-cluster", key, "--json")
            done = subprocess.run(command, capture_output=True, text=True, env=_env(self.mode.device), cwd=REPO,
                                  timeout=60)
            self.specs[key] = _json(done.stdout) if done.returncode == 0 else None
        return self.specs[key]

    def train(self) -> None:
        bundled = self.bundled()
        self.summary["bundled_cluster"] = bundled
        runs = self.work / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        self.summary["runs"] = {}
        for config in self.configs:
            name = f"train {config.name}"
            command = mosaic("train", "--model", str(self.mode.model), "--layout", config.layout, "--steps", str(self.steps),
                             "--device", self.mode.device, "--cluster", bundled, "--out", str(runs / config.name),
                             "--no-checkpoint", "--no-progress")
            left = self.timeout("train", ("predict", "refit", "report"))
            if left < MIN_RUN_S[self.mode.device]:
                self.phase(name, command, Outcome("skipped", message=f"{left:.0f} s left, under the "
                                                  f"{MIN_RUN_S[self.mode.device]:.0f} s a run needs to start"))
                continue
            outcome = self.phase(name, command, run_command(command, left, self.work / "logs" / f"train_{config.name}.log",
                                                            self.mode.device))
            self.summary["runs"][config.name] = _run_figures(runs / config.name, outcome)
            run = self.summary["runs"][config.name]
            if run.get("steps_run"):
                self.say(f"  {config.name}: {run['steps_run']} steps, {run['mean_step_time_s'] * 1e3:.1f} ms/step, "
                         f"{run['tokens_per_s']:,.0f} tokens/s, MFU {run['mfu']:.1%}, peak memory "
                         f"{run['peak_memory_bytes'] / 2**30:.2f} GiB")
            self.write_summary()
        # a run folder without two metrics lines cannot enter the refit (a refused or crashed start)
        for folder in list(runs.iterdir()):
            if folder.is_dir() and _metric_rows(folder) < 2:
                shutil.move(str(folder), str(self.work / f"unusable_{folder.name}"))

    def predict(self) -> None:
        clusters = {"bundled": self.summary.get("bundled_cluster", self.mode.bundled_default)}
        if self.summary.get("calibrated_cluster"):
            clusters["calibrated"] = str(self.work / "calibrated.yaml")
        self.summary["predictions"] = self._predict(clusters, "predict", ("refit", "report"))

    def _predict(self, clusters: dict[str, str], phase: str, after: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        timeout = self.timeout("predict", after)
        jobs = [(label, cluster, config) for label, cluster in clusters.items() for config in self.configs]
        out: dict[str, dict[str, Any]] = {}
        started = time.perf_counter()

        def one(job: tuple[str, str, Config]) -> tuple[str, str, Outcome, list[str]]:
            label, cluster, config = job
            command = mosaic("predict", "--cluster", cluster, "--model", str(self.mode.model), "--layout", config.layout,
                             "--json")
            log = self.work / "logs" / f"predict_{label}_{config.name}.log"
            return label, config.name, run_command(command, timeout, log, self.mode.device), command

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2)))) as pool:
            for label, config_name, outcome, _ in pool.map(one, jobs):
                printed = _json(outcome.stdout)
                # exit 1: predicted infeasible (memory); its figures are printed all the same
                row = printed if isinstance(printed, dict) else {"status": outcome.status, "message": outcome.message}
                out.setdefault(config_name, {})[label] = _prediction(row)
                _write_atomic(self.work / "predictions" / f"{label}_{config_name}.json", outcome.stdout or "{}\n")
        statuses = sorted({v.get("status", "ok") for rows in out.values() for v in rows.values()})
        self.summary.setdefault("phases", {})[phase] = {
            "status": statuses[0] if len(statuses) == 1 and statuses[0] in ("ok", "skipped") else "failed",
            "seconds": round(time.perf_counter() - started, 1),
            "returncode": None, "message": "" if statuses == ["ok"] else f"prediction statuses {statuses}",
            "command": f"mosaic predict --json x {len(jobs)} ({', '.join(clusters)})"}
        self.say(f"[{phase}] {len(jobs)} predictions on {', '.join(clusters)} in {time.perf_counter() - started:.1f} s")
        self.write_summary()
        return out

    def refit(self) -> None:
        runs = self.work / "runs"
        usable = [f for f in runs.iterdir() if f.is_dir()] if runs.is_dir() else []
        base = str(self.work / "calibrated.yaml") if self.summary.get("calibrated_cluster") else \
            self.summary.get("bundled_cluster", self.mode.bundled_default)
        output = self.work / "refit.yaml"
        command = mosaic("calibrate", "--from-runs", str(runs), "--cluster", base, "-o", str(output), "--json")
        if not usable:
            self.phase("refit", command, Outcome("skipped", message="no run to refit from"))
            return
        outcome = self.phase("refit", command, run_command(command, self.timeout("refit", ("report",)),
                                                           self.work / "logs" / "refit.log", self.mode.device))
        printed = _json(outcome.stdout)
        if outcome.status != "ok" or not isinstance(printed, dict):
            return
        self.summary["refit"] = {k: printed.get(k) for k in ("runs", "factors", "fitted", "fixed", "mape", "per_run")}
        for row in printed.get("per_run") or []:  # the refit's measured step time: its warm-up rule, one home
            run = self.summary.get("runs", {}).get(row["run"])
            if run and run.get("mean_step_time_s"):
                run.update(_run_figures_from_refit(run, row))
        self.summary["refit"]["base"] = "calibrated" if self.summary.get("calibrated_cluster") else "bundled"
        shutil.copyfile(output, self.out / "refit.yaml")
        refit_predictions = self._predict({"refit": str(output)}, "predict (refit)", ("report",))
        for name, rows in refit_predictions.items():
            self.summary.setdefault("predictions", {}).setdefault(name, {}).update(rows)
        self.write_summary()

    def compare(self) -> None:
        """Errors per configuration, the kernel comparison, the targets, the plots."""
        self.summary["errors"] = _errors(self.summary)
        self.summary["kernels"] = _kernels(self)
        self.summary["targets"] = _targets(self.summary, self.mode.main_precision)
        self.write_summary()
        self.plots()
        self.print_tables()

    def plots(self) -> None:
        errors = self.summary.get("errors") or {}
        try:  # each plot where it has figures to show
            if errors:
                _plot_step_times(self.summary, self.out / "step_time.png")
            if self.summary["kernels"].get("points"):
                _plot_kernels(self.summary["kernels"], self.out / "kernels.png", self.mode.device)
            if any(e.get("memory_measured_bytes") for e in errors.values()):
                _plot_memory(self.summary, self.out / "memory.png")
        except Exception as exc:  # a plot must not cost the figures: say why, keep going
            self.say(f"warning: a plot failed ({type(exc).__name__}: {exc})")
            self.summary["plot_error"] = f"{type(exc).__name__}: {exc}"

    def print_tables(self) -> None:
        errors = self.summary.get("errors") or {}
        runs = self.summary.get("runs") or {}
        self.say("")
        self.say(f"{'configuration':<16} {'measured ms':>12} {'bundled':>9} {'calibrated':>11} {'refit':>8} {'LOO':>8} "
                 f"{'tokens/s':>10} {'MFU':>6} {'memory GiB':>11} {'predicted':>10}")
        for config in self.configs:
            run = runs.get(config.name, {})
            e = errors.get(config.name, {})
            if not e:
                status = self.summary.get("phases", {}).get(f"train {config.name}", {})
                self.say(f"{config.name:<16} {status.get('status', '-')}: {status.get('message', '')}"[:160])
                continue

            def pct(key: str, e: dict[str, Any] = e) -> str:
                return f"{e[key]:+.1%}" if e.get(key) is not None else "-"

            memory = e.get("memory_predicted_bytes")
            self.say(f"{config.name:<16} {e['measured_step_time_s'] * 1e3:>12.1f} {pct('step_time_bundled'):>9} "
                     f"{pct('step_time_calibrated'):>11} {pct('step_time_refit'):>8} {pct('step_time_refit_loo'):>8} "
                     f"{run['tokens_per_s']:>10,.0f} {run['mfu']:>6.1%} {run['peak_memory_bytes'] / 2**30:>11.2f} "
                     f"{(memory / 2**30 if memory else float('nan')):>10.2f}")
        kernels = self.summary.get("kernels") or {}
        if kernels.get("table"):
            self.say("")
            self.say(f"kernel rows of {kernels['tables']}, median |predicted / measured - 1| (rows scored): "
                     f"bundled {kernels['bundled']}, calibrated")
        for key, row in (kernels.get("table") or {}).items():
            def cell(label: str, row: dict[str, Any] = row) -> str:
                value = row.get(f"median_abs_error_{label}")
                return "-" if value is None else f"{value:.1%} ({row[f'scored_{label}']})"

            self.say(f"  {key:<28} {row['rows']:>4} rows  {cell('bundled'):>14} {cell('calibrated'):>14}")
        self.say("")
        if self.dry_run:
            self.say("dry run: tiny model on cpu; the figures test the orchestration, not the targets")
        for target in self.summary["targets"]:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
            self.say(f"target {target['target']}: {target['value_text']} -> {verdict}")

    def pack(self) -> None:
        """Everything else into one archive; the working folder goes; at most RETURN_LIMITS files stay."""
        self.say(f"wrote {self.out} ({time.monotonic() - self.started:.0f} s)")
        _write_atomic(self.work / "logs" / "gpu_check.log", "\n".join(self.log_lines) + "\n")
        _tar(self.work, self.out / "gpu_check.tar.gz", "gpu_check")
        shutil.rmtree(self.work)
        self.write_summary()
        files = sorted(p for p in self.out.iterdir())
        too_big = [p.name for p in files if p.is_file() and p.stat().st_size > RETURN_LIMITS["file_bytes"]]
        if len(files) > RETURN_LIMITS["files"] or too_big or any(p.is_dir() for p in files):
            raise RuntimeError(f"{self.out} holds {len(files)} entries ({', '.join(p.name for p in files)}), "
                               f"over the {RETURN_LIMITS['files']} files of 16 MiB the device tool returns")


# --------------------------------------------------------------------------- reading outputs

def _tar(folder: Path, archive: Path, arcname: str) -> None:
    """`folder` as `archive` (gzip), its top folder named `arcname`; written to a temp file, then renamed."""
    tmp = archive.with_name(f".{archive.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(folder, arcname=arcname)
    os.replace(tmp, archive)


def _tables_folder(cluster_file: Path) -> Path:
    """The kernel-tables folder `mosaic calibrate -o cluster_file` writes beside it (X.yaml -> X.kernels/)."""
    from calibration.tables import folder_of

    return folder_of(cluster_file)


def _tables_given(calibrated: Path, target: Path) -> None:
    """The tables of a reused calibrated cluster X.yaml into `target`: the folder X.kernels/
    beside it (`mosaic calibrate`'s), else the archive X.kernels.tar.gz an earlier check returned
    (its one top folder); neither there: nothing (the kernel comparison says so)."""
    folder = _tables_folder(calibrated)
    archive = folder.with_name(f"{folder.name}.tar.gz")
    if folder.is_dir():
        shutil.copytree(folder, target)
    elif archive.is_file():
        staging = target.with_name(f".{target.name}.untar")
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        tops = list(staging.iterdir())
        if len(tops) == 1 and tops[0].is_dir():
            tops[0].rename(target)
        shutil.rmtree(staging, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a figure is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _commit() -> Optional[str]:
    """The checkout's commit, where git and the repository's history are there (a copied tree may lack them)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _model_figures(model_file: Path) -> dict[str, Any]:
    """Parameter counts of the model file (perfmodel's definitions: non-embedding unless named)."""
    from mosaic.trainer.config import load_model_file

    arch = load_model_file(model_file)
    return {"active_params": arch.active_params(), "active_params_with_embeddings": arch.active_params(True),
            "total_params_with_embeddings": arch.total_params(True), "model_flops_per_token": arch.model_flops_per_token}


def _metric_rows(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def _read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the timeout
                continue
    return rows


def _run_figures(folder: Path, outcome: Outcome, steps_used: Optional[int] = None) -> dict[str, Any]:
    """What a run measured: means over its last `steps_used` steps (from-runs' warm-up rule once the
    refit has run; before it the trainer's own, all but the first step)."""
    rows = _read_metrics(folder)
    figures: dict[str, Any] = {"status": outcome.status, "steps_run": len(rows)}
    if len(rows) < 2:
        return figures
    used = rows[-steps_used:] if steps_used else rows[1:]
    step = sum(r["step_time_s"] for r in used) / len(used)
    tokens = rows[0]["tokens_per_s"] * rows[0]["step_time_s"]  # tokens of one step
    run_yaml = folder / "run.yaml"
    precision = None
    if run_yaml.is_file():
        import yaml

        precision = yaml.safe_load(run_yaml.read_text()).get("precision")
    figures.update(steps_used=len(used), mean_step_time_s=step, tokens_per_s=tokens / step,
                   mfu=rows[0]["mfu"] * rows[0]["step_time_s"] / step,
                   tflops_per_device=rows[0]["tflops_per_device"] * rows[0]["step_time_s"] / step,
                   peak_memory_bytes=max(r["peak_memory_bytes"] for r in rows), precision=precision,
                   first_step_s=rows[0]["step_time_s"], loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"],
                   step_time_spread=max(r["step_time_s"] for r in used) / min(r["step_time_s"] for r in used))
    return figures


def _prediction(printed: dict[str, Any]) -> dict[str, Any]:
    if "step_time_s" not in printed:
        return printed
    keys = ("step_time_s", "tokens_per_s", "mfu", "memory_per_device_bytes", "feasible", "reason", "breakdown",
            "memory_breakdown")
    return {"status": "ok", **{k: printed.get(k) for k in keys}}


def _errors(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Relative errors (predicted / measured - 1) of step time per cluster and of memory."""
    cpu = summary["device"] == "cpu"
    refit_rows = {row["run"]: row for row in (summary.get("refit") or {}).get("per_run") or []}
    out: dict[str, dict[str, Any]] = {}
    for name, run in (summary.get("runs") or {}).items():
        if not run.get("mean_step_time_s"):
            continue
        fitted = refit_rows.get(name)
        measured = run["mean_step_time_s"]
        row: dict[str, Any] = {"measured_step_time_s": measured}
        for label in ("bundled", "calibrated", "refit"):
            p = (summary.get("predictions") or {}).get(name, {}).get(label) or {}
            row[f"predicted_{label}_s"] = p.get("step_time_s")
            row[f"step_time_{label}"] = p["step_time_s"] / measured - 1.0 if p.get("step_time_s") else None
        loo = (fitted or {}).get("predicted_leave_one_out_s")
        row["predicted_refit_loo_s"] = loo
        row["step_time_refit_loo"] = loo / measured - 1.0 if loo else None
        row["from_runs_predicted_before_s"] = (fitted or {}).get("predicted_before_s")
        memory_source = next((summary["predictions"][name][label] for label in ("calibrated", "bundled")
                              if (summary.get("predictions") or {}).get(name, {}).get(label, {}).get("memory_per_device_bytes")),
                             None)
        if memory_source:
            framework = (memory_source.get("memory_breakdown") or {}).get("framework") or 0.0
            total = memory_source["memory_per_device_bytes"]
            predicted = total if cpu else total - framework
            row.update(memory_predicted_bytes=predicted, memory_predicted_total_bytes=total,
                       memory_framework_bytes=framework, memory_measured_bytes=run["peak_memory_bytes"],
                       memory=predicted / run["peak_memory_bytes"] - 1.0,
                       memory_compared="total (peak RSS holds the interpreter)" if cpu else
                       "total less framework (what torch.cuda.max_memory_allocated counts)")
        out[name] = row
    return out


def _run_figures_from_refit(run: dict[str, Any], fitted: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s and MFU at the refit's measured step time (same tokens and FLOPs per step)."""
    step = float(fitted["measured_step_time_s"])
    scale = run["mean_step_time_s"] / step
    return {"mean_step_time_s": step, "steps_used": fitted.get("steps_used"), "tokens_per_s": run["tokens_per_s"] * scale,
            "mfu": run["mfu"] * scale, "tflops_per_device": run["tflops_per_device"] * scale,
            "step_time_source": "mosaic calibrate --from-runs (mean after warm-up)"}


def _targets(summary: dict[str, Any], precision: str) -> list[dict[str, Any]]:
    """The issue's targets, each with its figure and met / not met (None: no figure)."""
    runs = summary.get("runs") or {}
    errors = summary.get("errors") or {}
    main = {n: r for n, r in runs.items() if r.get("precision") == precision and r.get("mfu") is not None}
    targets = []
    best = max(main, key=lambda n: main[n]["mfu"]) if main else None
    label = "bf16" if precision == "bf16" else f"{precision}, a dry run"
    targets.append({"target": f"trainer MFU >= {TARGETS['mfu_bf16']:.0%} ({label})", "key": "mfu_bf16",
                    "value": main[best]["mfu"] if best else None, "config": best,
                    "met": (main[best]["mfu"] >= TARGETS["mfu_bf16"]) if best else None,
                    "value_text": f"best {main[best]['mfu']:.1%} ({best})" if best else f"no {precision} run"})
    for key, label, source in (("step_time_after_calibrate", "step time within 10% after mosaic calibrate", "step_time_calibrated"),
                               ("step_time_after_refit", "step time within 5% after --from-runs (in sample)", "step_time_refit")):
        values = {n: e[source] for n, e in errors.items() if e.get(source) is not None}
        worst = max(values, key=lambda n: abs(values[n])) if values else None
        mape = sum(abs(v) for v in values.values()) / len(values) if values else None
        text = (f"largest error {abs(values[worst]):.1%} ({worst}), MAPE {mape:.1%} over {len(values)}" if worst else "no figure")
        if key == "step_time_after_refit":
            loo = [abs(e["step_time_refit_loo"]) for e in errors.values() if e.get("step_time_refit_loo") is not None]
            text += f"; leave-one-out MAPE {sum(loo) / len(loo):.1%}" if loo else ""
        targets.append({"target": label, "key": key, "value": abs(values[worst]) if worst else None, "config": worst,
                        "mape": mape, "met": (abs(values[worst]) <= TARGETS[key]) if worst else None, "value_text": text})
    values = {n: e["memory"] for n, e in errors.items() if e.get("memory") is not None}
    worst = max(values, key=lambda n: abs(values[n])) if values else None
    targets.append({"target": "memory within 5% of the peak measured", "key": "memory",
                    "value": abs(values[worst]) if worst else None, "config": worst,
                    "met": (abs(values[worst]) <= TARGETS["memory"]) if worst else None,
                    "value_text": f"largest error {abs(values[worst]):.1%} ({worst})" if worst else "no figure"})
    return targets


KERNEL_UNITS = {"gemm": ("tflops", 1e12, "TFLOP/s"), "grouped_gemm": ("tflops", 1e12, "TFLOP/s"),
                "attention": ("tflops", 1e12, "TFLOP/s"), "memory_kernels": ("gbps", 1e9, "GB/s"),
                "collectives": ("busbw_gbps", 1e9, "GB/s bus")}
"""Kind -> (the table's rate column, its scale to per second, the unit printed)."""


def _group(kind: str, rows: Any, i: int) -> str:
    """A row's group in the comparison: its precision (GEMM, grouped GEMM, attention), its kernel
    class (memory-bound: the figure it is priced by) or its collective."""
    if kind == "memory_kernels":
        from perfmodel.kernels.fit import MEMORY_KERNEL_CLASS

        return MEMORY_KERNEL_CLASS.get(str(rows["kernel"][i]), str(rows["kernel"][i]))
    if kind == "collectives":
        return str(rows["collective"][i])
    return str(rows["precision"][i])


def _shape(kind: str, rows: Any, i: int) -> str:
    def n(column: str) -> str:
        value = rows.get(column)
        return "-" if value is None or not math.isfinite(float(value[i])) else f"{float(value[i]):g}"

    if kind == "gemm":
        return f"m={n('m')} n={n('n')} k={n('k')}"
    if kind == "grouped_gemm":
        return f"{rows['phase'][i]} groups={n('groups')} m_per_group={n('m_per_group')} n={n('n')} k={n('k')}"
    if kind == "attention":
        return f"{rows['phase'][i]} causal={rows['causal'][i]} seq={n('seq_len')} head_dim={n('head_dim')}"
    if kind == "memory_kernels":
        return f"{rows['kernel'][i]} {n('bytes_moved')} B"
    return f"{n('ranks')} ranks, {rows['span'][i]}, {n('size_bytes')} B"


def row_errors(cluster: Any, tables: dict[str, Any], accelerator: str) -> dict[str, list[Optional[float]]]:
    """Per kind, the relative error (predicted / measured - 1) of each used row of `accelerator`
    (`KernelTable.rows_of` order) on `cluster`: `perfmodel.kernels.check.table_errors` of that row
    alone; None where the check does not score it (a precision the cluster does not price, a
    collective below the size it is held to)."""
    import numpy as np

    from perfmodel.kernels.check import cluster_spans, table_errors

    spans = cluster_spans(cluster)
    empty = {kind: table.select(np.zeros(len(table), dtype=bool)) for kind, table in tables.items()}
    out: dict[str, list[Optional[float]]] = {}
    for kind, table in tables.items():
        rows = table.rows_of(accelerator)
        index = np.arange(len(rows))
        values: list[Optional[float]] = []
        for i in range(len(rows)):
            errors = table_errors(cluster, {**empty, kind: rows.select(index == i)}, accelerator, spans)[kind]
            values.append(float(errors[0]) if len(errors) else None)
        out[kind] = values
    return out


def _kernels(check: Check) -> dict[str, Any]:
    """Each measured row of the calibration (its kernel tables) against the bundled cluster's
    kernel figures and the calibrated cluster's (`row_errors`); per kind and group (`_group`), the
    rows, the median measured rate, its median and best fraction of the bundled peak (GEMM,
    attention: the datasheet FLOP/s of the precision; memory: HBM bandwidth) and the median
    signed and absolute errors per cluster. Host figures (host.csv) beside the bundled and the
    calibrated cluster's."""
    folder = _tables_folder(check.work / "calibrated.yaml")
    if not folder.is_dir():
        return {"status": "no measurements"}
    from calibration.tables import read_folder
    from perfmodel.clusters import load_cluster
    from perfmodel.errors import InputError

    measured = read_folder(folder)
    bundled_name = check.summary.get("bundled_cluster", check.mode.bundled_default)
    clusters = {"bundled": load_cluster(bundled_name)}
    if (check.work / "calibrated.yaml").is_file():
        clusters["calibrated"] = load_cluster(str(check.work / "calibrated.yaml"))
    tables = {kind: measured.rows(kind) for kind in KERNEL_UNITS}
    tables["ep_dispatch"] = measured.rows("ep_dispatch")  # table_errors reads every kind; calibrate times none
    errors = {label: row_errors(cluster, tables, measured.accelerator) for label, cluster in clusters.items()}
    bundled_acc = clusters["bundled"].accelerator
    points: list[dict[str, Any]] = []
    excluded: dict[str, int] = {}
    for kind, (column, scale, unit) in KERNEL_UNITS.items():
        every = tables[kind].rows_of(measured.accelerator, used_only=False)
        rows = tables[kind].rows_of(measured.accelerator)
        if len(every) > len(rows):
            excluded[kind] = len(every) - len(rows)
        for i in range(len(rows)):
            rate = float(rows[column][i]) * scale
            point: dict[str, Any] = {"kind": kind, "group": _group(kind, rows, i), "shape": _shape(kind, rows, i),
                                     "line": int(rows.line[i]), "measured": rate, "unit": unit}
            if kind in ("gemm", "grouped_gemm", "attention"):
                try:
                    point["fraction_of_peak"] = rate / bundled_acc.peak(point["group"])
                except InputError:  # a precision the bundled datasheet has no peak for
                    point["fraction_of_peak"] = None
            elif kind == "memory_kernels":
                point["fraction_of_peak"] = rate / bundled_acc.hbm_bandwidth_bytes_per_s
            for label in clusters:
                error = errors[label][kind][i]
                point[f"error_{label}"] = error
                point[f"predicted_{label}"] = rate * (1.0 + error) if error is not None else None
            points.append(point)
    table: dict[str, Any] = {}
    for key in dict.fromkeys(f"{p['kind']} {p['group']}" for p in points):
        group = [p for p in points if f"{p['kind']} {p['group']}" == key]
        fractions = [p["fraction_of_peak"] for p in group if p.get("fraction_of_peak") is not None]
        row: dict[str, Any] = {"rows": len(group), "unit": group[0]["unit"],
                               "median_measured": _median([p["measured"] for p in group]),
                               "median_fraction_of_peak": _median(fractions),
                               "max_fraction_of_peak": max(fractions) if fractions else None}
        for label in clusters:
            scored = [p[f"error_{label}"] for p in group if p[f"error_{label}"] is not None]
            row.update({f"scored_{label}": len(scored), f"median_error_{label}": _median(scored),
                        f"median_abs_error_{label}": _median([abs(e) for e in scored])})
        table[key] = row
    host = {}
    for figure, value in measured.host.items():
        host[figure] = {"measured_s": value.seconds, "noise": value.noise,
                        **{f"{label}_s": getattr(cluster.accelerator, figure, None) for label, cluster in clusters.items()}}
    return {"status": "ok", "bundled": bundled_name, "accelerator": measured.accelerator,
            "tables": str(folder.relative_to(check.work)), "clusters": list(clusters), "table": table,
            "excluded_rows": excluded, "host": host, "points": points}


def _median(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


# --------------------------------------------------------------------------- plots

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    plt = _pyplot()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def _plot_step_times(summary: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    errors = summary.get("errors") or {}
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    values = []
    for key, marker, label in (("predicted_bundled_s", "o", f"bundled {summary.get('bundled_cluster')}"),
                               ("predicted_calibrated_s", "s", "after mosaic calibrate"),
                               ("predicted_refit_s", "^", "after --from-runs (in sample)"),
                               ("predicted_refit_loo_s", "x", "after --from-runs (leave one out)")):
        xs = [e["measured_step_time_s"] for e in errors.values() if e.get(key)]
        ys = [e[key] for e in errors.values() if e.get(key)]
        if xs:
            ax.scatter(xs, ys, marker=marker, label=label)
            values += xs + ys
    for name, e in errors.items():
        ax.annotate(name, (e["measured_step_time_s"], e.get("predicted_calibrated_s") or e["measured_step_time_s"]),
                    fontsize=6, alpha=0.7)
    if values:
        lo, hi = min(values) * 0.8, max(values) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
        for band, alpha in ((0.10, 0.10), (0.05, 0.15)):
            ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)],
                            color="grey", alpha=alpha, label=f"±{band:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured step time (s, mean after warm-up)")
    ax.set_ylabel("predicted step time (s)")
    env = summary.get("environment") or {}
    ax.set_title(f"{env.get('device_name', summary['device'])}: step time, predicted vs measured", fontsize=9)
    if values:
        ax.legend(fontsize=7)
    _save(fig, path)


def _plot_kernels(kernels: dict[str, Any], path: Path, device: str) -> None:
    """One panel per kind: each measured row's rate against the rate the bundled (o) and the
    calibrated (x) cluster's figures give it, coloured by group; y = x and ±10%."""
    plt = _pyplot()
    points = kernels.get("points") or []
    kinds = [k for k in KERNEL_UNITS if any(p["kind"] == k and (p.get("predicted_bundled") or p.get("predicted_calibrated"))
                                            for p in points)]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(4.4 * max(1, len(kinds)), 4.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, kind in zip(axes[0], kinds):
        _, scale, unit = KERNEL_UNITS[kind]
        group = [p for p in points if p["kind"] == kind]
        names = list(dict.fromkeys(p["group"] for p in group))
        values = []
        for j, name in enumerate(names):
            colour = colours[j % len(colours)]
            for label, marker in (("bundled", "o"), ("calibrated", "x")):
                shown = [p for p in group if p["group"] == name and p.get(f"predicted_{label}")]
                if not shown:
                    continue
                xs = [p["measured"] / scale for p in shown]
                ys = [p[f"predicted_{label}"] / scale for p in shown]
                values += xs + ys
                ax.scatter(xs, ys, marker=marker, s=18, alpha=0.75, label=f"{name} {label}",
                           **({"facecolors": "none", "edgecolors": colour} if marker == "o" else {"color": colour}))
        if values:
            lo, hi = min(values) * 0.8, max(values) * 1.25
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15, label="±10%")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(fontsize=6)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"from the cluster's figures ({unit})")
        left_out = (kernels.get("excluded_rows") or {}).get(kind)
        ax.set_title(f"{device} {kind}: {len(group)} rows" + (f" ({left_out} excluded)" if left_out else ""), fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def _plot_memory(summary: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    errors = {n: e for n, e in (summary.get("errors") or {}).items() if e.get("memory_measured_bytes")}
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(errors) + 1.5), 4.0))
    names = list(errors)
    xs = range(len(names))
    measured = [errors[n]["memory_measured_bytes"] / 2**30 for n in names]
    predicted = [errors[n]["memory_predicted_bytes"] / 2**30 for n in names]
    total = [errors[n]["memory_predicted_total_bytes"] / 2**30 for n in names]
    ax.bar([x - 0.27 for x in xs], measured, 0.27, label="measured (peak)")
    ax.bar(list(xs), predicted, 0.27, label="predicted, as measured")
    ax.bar([x + 0.27 for x in xs], total, 0.27, label="predicted total")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=20, fontsize=7)
    ax.set_ylabel("GiB per device")
    compared = next((e["memory_compared"] for e in errors.values()), "")
    ax.set_title(f"memory: predicted vs measured ({compared})", fontsize=8)
    if names:
        ax.legend(fontsize=7)
    _save(fig, path)


# --------------------------------------------------------------------------- command line

def markdown_tables(summary: dict[str, Any]) -> str:
    """The figures of a summary.json as the markdown tables docs/validation.md keeps (kernels,
    trainer, step-time errors, memory, targets), headed by the run's environment."""
    env = summary.get("environment") or {}
    smi = env.get("nvidia_smi") or {}
    lines = [f"Commit {summary.get('commit') or '-'}, {summary.get('started')}: "
             f"{env.get('device_name', summary.get('device'))}, driver {smi.get('driver_version', '-')}, python "
             f"{env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), torchao {env.get('torchao')}; "
             f"{summary.get('steps')} steps per run, {summary.get('wall_s')} s in all; bundled cluster "
             f"`{summary.get('bundled_cluster')}`.", ""]

    def pct(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:+.1%}"

    kernels = summary.get("kernels") or {}
    lines += [f"Kernel rows of `{kernels.get('tables', '-')}` against the figures of the bundled cluster and of the "
              "calibrated one (`perfmodel.kernels.check`; error = predicted / measured - 1: its median, and "
              "the median of its absolute value):", "",
              "| kernel | rows | median measured | fraction of peak: median, best | bundled cluster | calibrated cluster |",
              "|---|---|---|---|---|---|"]

    def share(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1%}"

    def err(row: dict[str, Any], label: str) -> str:
        median, absolute = row.get(f"median_error_{label}"), row.get(f"median_abs_error_{label}")
        if median is None:
            return "-"
        return f"{median:+.1%} (abs {absolute:.1%}, {row[f'scored_{label}']} rows)"

    for key, row in (kernels.get("table") or {}).items():
        scale = 1e12 if row["unit"].startswith("TFLOP") else 1e9
        lines.append(f"| {key} | {row['rows']} | {row['median_measured'] / scale:.4g} {row['unit']} | "
                     f"{share(row.get('median_fraction_of_peak'))}, {share(row.get('max_fraction_of_peak'))} | "
                     f"{err(row, 'bundled')} | {err(row, 'calibrated')} |")
    for figure, row in (kernels.get("host") or {}).items():
        def us(v: Optional[float]) -> str:
            return "-" if v is None else f"{v * 1e6:.3g} us"

        lines.append(f"| host {figure} | 1 | {us(row['measured_s'])} | - | {us(row.get('bundled_s'))} | "
                     f"{us(row.get('calibrated_s'))} |")
    lines += ["", "| configuration | layout | steps used | step time (s) | tokens/s | MFU | peak memory (GiB) |",
              "|---|---|---|---|---|---|---|"]
    layouts = {c["name"]: c["layout"] for c in summary.get("configs") or []}
    for name, run in (summary.get("runs") or {}).items():
        if not run.get("mean_step_time_s"):
            phase = (summary.get("phases") or {}).get(f"train {name}", {})
            lines.append(f"| {name} | `{layouts.get(name, '')}` | {phase.get('status', '-')}: {phase.get('message', '')} | | | | |")
            continue
        lines.append(f"| {name} | `{layouts.get(name, '')}` | {run.get('steps_used')} | {run['mean_step_time_s']:.4g} | "
                     f"{run['tokens_per_s']:,.0f} | {run['mfu']:.1%} | {run['peak_memory_bytes'] / 2**30:.2f} |")
    lines += ["", "| configuration | measured (s) | bundled | after calibrate | after --from-runs | leave one out | "
              "memory predicted (GiB) | memory error |", "|---|---|---|---|---|---|---|---|"]
    for name, e in (summary.get("errors") or {}).items():
        memory = e.get("memory_predicted_bytes")
        lines.append(f"| {name} | {e['measured_step_time_s']:.4g} | {pct(e.get('step_time_bundled'))} | "
                     f"{pct(e.get('step_time_calibrated'))} | {pct(e.get('step_time_refit'))} | "
                     f"{pct(e.get('step_time_refit_loo'))} | {'-' if memory is None else f'{memory / 2**30:.2f}'} | "
                     f"{pct(e.get('memory'))} |")
    refit = summary.get("refit") or {}
    if refit:
        lines += ["", f"Refit (`mosaic calibrate --from-runs` on the {refit.get('base')} cluster): fitted "
                  + ", ".join(f"{k} = {v:.4g}" for k, v in (refit.get("factors") or {}).items())
                  + "; MAPE " + ", ".join(f"{k} {v:.1%}" for k, v in (refit.get("mape") or {}).items()) + "."]
    lines += ["", "| target | figure | met |", "|---|---|---|"]
    for target in summary.get("targets") or []:
        lines.append(f"| {target['target']} | {target['value_text']} | "
                     f"{ {True: 'yes', False: 'no', None: 'not measured'}[target['met']]} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--tables"]:  # print the tables of an earlier run's summary.json for docs/validation.md
        if len(argv) != 2 or not Path(argv[1]).is_file():
            print("usage: gpu_check.py --tables OUT/summary.json", file=sys.stderr)
            return 2
        print(markdown_tables(json.loads(Path(argv[1]).read_text())), end="")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="gpu_check.py --tables OUT/summary.json prints an earlier run's figures "
                                            "as the markdown tables of docs/validation.md")
    parser.add_argument("--out", type=Path, required=True, help="output folder (new or empty)")
    parser.add_argument("--dry-run", action="store_true", help="the same orchestration on cpu with the tiny MoE")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per configuration (20; dry run 4)")
    parser.add_argument("--budget-s", type=float, default=None, help="overall deadline in seconds (400; dry run 300)")
    parser.add_argument("--configs", default=None, help="comma-separated configuration names (default: all)")
    parser.add_argument("--calibrated", type=Path, default=None,
                        help="reuse this calibrated cluster (a first run's calibrated.yaml) instead of calibrating; "
                             "the kernel tables beside it (calibrated.kernels.tar.gz or the folder) are read too")
    args = parser.parse_args(argv)
    mode = DRY if args.dry_run else GPU
    steps = args.steps if args.steps is not None else mode.steps
    budget = args.budget_s if args.budget_s is not None else mode.budget_s
    if steps < 2:
        parser.error("--steps: need at least 2 (the first is warm-up)")
    if not budget > 0:
        parser.error("--budget-s: need a positive number of seconds")
    configs = tuple(c for c in mode.configs if not (args.dry_run and c.gpu_only))
    if args.configs:
        wanted = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {c.name for c in configs})
        if unknown:
            parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(c.name for c in configs)}")
        configs = tuple(c for c in configs if c.name in wanted)
    if args.calibrated is not None and not args.calibrated.is_file():
        parser.error(f"--calibrated: {args.calibrated} is not a file")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out: {args.out} is not an empty folder; give a new one (what is there would be mixed in)")
    if not args.dry_run:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            parser.error("--device cuda: torch sees no CUDA device here; run on the GPU machine, or --dry-run on cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(mode=mode, out=args.out.resolve(), steps=steps, deadline=time.monotonic() + budget,
                  dry_run=args.dry_run, configs=configs, calibrated_given=args.calibrated)
    signal.signal(signal.SIGTERM, _terminated)
    return check.run()


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (a device tool's timeout): unwind, so that the running command's group is stopped
    and what there is gets packed."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())

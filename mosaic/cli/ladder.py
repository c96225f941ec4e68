"""`mosaic ladder`: design a ladder of small runs for a budget, run it (resumable), fit the 4-D law to it."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from mosaic.cli.common import cli_errors, console, err_console
from perfmodel.errors import InputError


def _corpus(folder: Path) -> dict[str, Any]:
    """train.bin, val.bin, vocabulary and token count of a `mosaic data prepare` folder."""
    from perfmodel.specs.strict import read_yaml

    manifest = folder / "corpus.yaml"
    if not manifest.is_file():
        raise InputError(f"--data {folder}: no corpus.yaml; give the folder written by `mosaic data prepare`")
    m = read_yaml(manifest)
    for split in ("train", "val"):
        if not (folder / m[split]["file"]).is_file():
            raise InputError(f"--data {folder}: {m[split]['file']} is missing; rerun `mosaic data prepare`")
    sha = hashlib.sha256(f"{m['train']['sha256']}:{m['val']['sha256']}".encode()).hexdigest()
    return {"train": str(folder / m["train"]["file"]), "val": str(folder / m["val"]["file"]),
            "vocab_size": int(m["tokenizer"]["vocab_size"]), "train_tokens": int(m["train"]["tokens"]), "sha256": sha}


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _table(out: Path, status: dict[str, dict[str, Any]], started: float) -> Table:
    from mosaic.ladder.runner import progress_of

    done = sum(1 for s in status.values() if s["state"].startswith("done"))
    table = Table(title=f"ladder {out}: {done}/{len(status)} runs done, {time.time() - started:,.0f} s "
                        "(* = held out)", title_justify="left")
    for col in ("run", "N_tot", "S", "G", "D", "step", "loss", "val", "tok/s", "s", "state"):
        table.add_column(col, justify="left" if col in ("run", "state") else "right", no_wrap=True)
    for name, entry in status.items():
        run = entry["run"]
        p = progress_of(out, run)
        table.add_row(name + ("*" if run.heldout else ""), f"{run.n_total:.2g}", f"{run.sparsity:.2f}",
                      f"{run.granularity:g}", f"{run.tokens / 1e3:,.0f}k", f"{p['step']}/{run.steps}", _fmt(p["loss"], ".3f"),
                      _fmt(p["val_loss"], ".3f"), _fmt(p["tokens_per_s"], ",.0f"), _fmt(entry.get("seconds"), ",.0f"),
                      entry["state"])
    return table


@cli_errors
def ladder(
    data: Path = typer.Option(..., "--data", help="Corpus folder of `mosaic data prepare` (train.bin, val.bin, "
                                                  "corpus.yaml)."),
    budget_flops: float = typer.Option(..., "--budget-flops", help="Training FLOPs of the whole ladder (the "
                                       "trainer's model FLOPs x tokens, summed over runs), e.g. 3.5e13."),
    out: Path = typer.Option(Path("runs/ladder"), "--out", help="Ladder folder (resumable: rerun to continue)."),
    space: Optional[Path] = typer.Option(None, "--space", help="Ladder space YAML (default: "
                                         "mosaic/data/default_ladder.yaml, tiny CPU models)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or npu."),
    nproc: int = typer.Option(1, "--nproc", help="Ranks per run (torchrun when > 1)."),
    jobs: int = typer.Option(1, "--jobs", help="Runs at the same time (cpu: the cores are split between them)."),
    seed: int = typer.Option(0, "--seed", help="Seed of every run."),
    bootstrap: int = typer.Option(100, "--bootstrap", help="Bootstrap refits over runs for the intervals."),
    starts: int = typer.Option(64, "--starts", help="Start grid of the fits."),
    law: Optional[str] = typer.Option(None, "--law", help="mosaic4d or mosaic4d_lg2 (default: chosen by held-out "
                                      "error between the two granularity forms)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the design and stop."),
    live: bool = typer.Option(True, "--live/--no-live", help="Live table of runs."),
) -> None:
    """Design a ladder of small runs over N, S, G and D, train them, fit the 4-D law (fit YAML for `mosaic plan --fit`)."""
    from mosaic.ladder.design import design, load_ladder_space
    from mosaic.ladder.fit import LadderFitOptions, fit_ladder
    from mosaic.ladder.runner import LadderSetup, collect, execute, open_ladder, subprocess_launcher
    from mosaic.trainer.config import DEVICES
    from scaling_fits.errors import FitDataError
    from scaling_fits.fitfile import write_fit

    if device not in DEVICES:
        raise InputError(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    if nproc < 1 or jobs < 1:
        raise InputError("--nproc and --jobs must be >= 1")
    if law not in (None, "mosaic4d", "mosaic4d_lg2"):
        raise InputError(f"--law {law}: use mosaic4d or mosaic4d_lg2 (or leave it out to choose by held-out error)")
    corpus = _corpus(data)
    lspace = load_ladder_space(space)
    runs = design(lspace, budget_flops, corpus["vocab_size"], corpus["train_tokens"])
    setup = LadderSetup(space=lspace, budget_flops=budget_flops, train_data=corpus["train"], val_data=corpus["val"],
                        data_sha256=corpus["sha256"], device=device, nproc=nproc, seed=seed, runs=tuple(runs))
    total_tokens = sum(r.tokens for r in runs)
    console.print(f"ladder: {len(runs)} runs ({sum(r.heldout for r in runs)} held out), {total_tokens:,} tokens, "
                  f"{sum(r.flops for r in runs):.3g} FLOPs; separate runs per token budget (cosine each)",
                  highlight=False)
    if dry_run:
        console.print(_table(out, {r.name: {"state": "planned", "run": r} for r in runs}, time.time()))
        return
    out.mkdir(parents=True, exist_ok=True)
    open_ladder(out, setup)
    import signal

    def stop(signum: int, frame: Any) -> None:   # SIGTERM: stop the runs like Ctrl-C (they resume next time)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    started = time.time()
    from mosaic.ladder.runner import state

    first = {r.name: {"state": "done (earlier)" if state(out, r) == "done" else "pending", "run": r} for r in runs}
    # a terminal gets the live table; a log file one line per finished run and the table at the end, wide
    screen = err_console if err_console.is_terminal else Console(stderr=True, width=160)
    live = live and err_console.is_terminal
    reported: set[str] = set()
    with Live(_table(out, first, started) if live else "", console=screen, refresh_per_second=2,
              transient=False, auto_refresh=False) as view:
        def update(status: dict[str, dict[str, Any]]) -> None:
            if live:
                view.update(_table(out, status, started), refresh=True)
                return
            for name, entry in status.items():
                if entry["state"] != "pending" and not entry["state"].startswith(("running", "resumed")) \
                        and name not in reported:
                    reported.add(name)
                    screen.print(f"{name}: {entry['state']}" + (f" after {entry['seconds']:,.0f} s" if "seconds" in entry
                                                                else ""), highlight=False)

        execute(out, setup, subprocess_launcher(jobs), jobs=jobs, on_update=update)
    wall_s = time.time() - started
    if not live:
        screen.print(_table(out, {r.name: {"state": "done", "run": r} for r in runs}, started))
    frame = collect(out, setup)
    try:
        fitted, report = fit_ladder(frame, LadderFitOptions(n_boot=bootstrap, n_starts=starts, seed=seed, law=law))
    except FitDataError as exc:
        raise InputError(f"ladder fit: {exc}") from None
    fitted.metrics["ladder"]["wall_seconds"] = wall_s
    fitted.provenance["output"] = str(out / "fit.yaml")
    write_fit(fitted, out / "fit.yaml")
    _print_report(fitted, report, out, wall_s)


def _print_report(fitted: Any, report: dict[str, Any], out: Path, wall_s: float) -> None:
    from scaling_fits.fitter import describe_identifiability

    table = Table(title=f"{fitted.name} fitted to {report['n_runs']} ladder runs")
    table.add_column("parameter")
    table.add_column("value", justify="right")
    table.add_column(f"{100 * (fitted.ci_level or 0.95):.0f}% interval", justify="right")
    flagged = fitted.metrics["identifiability"]["flagged"]
    for name, value in fitted.params.items():
        lo_hi = fitted.ci.get(name)
        note = "not identified" if name in flagged else ""
        table.add_row(name, f"{value:.4g}", (f"[{lo_hi[0]:.4g}, {lo_hi[1]:.4g}]" if lo_hi else "-") + (f" {note}" if note else ""))
    console.print(table)
    form = report["granularity_form"]
    console.print(f"granularity form: {form['choice'] or 'not chosen'} ({form['reason']})", highlight=False)
    for run_id, item in report["extrapolation"].items():
        console.print(f"extrapolation to the held-out rung {run_id}: predicted {item['predicted']:.4f}, observed "
                      f"{item['observed']:.4f}, error {100 * item['ape']:.2f}%", highlight=False)
    console.print(f"leave-one-run-out MAPE {100 * (report['mape_loo'] or 0):.2f}%, in-sample "
                  f"{100 * report['mape_in_sample']:.2f}%; runs took {wall_s:,.0f} s", highlight=False)
    line = describe_identifiability(fitted.metrics["identifiability"])
    if line:
        console.print(f"not identified by this ladder: {line}", highlight=False)
    console.print(f"wrote {out / 'fit.yaml'} (use: mosaic plan --fit {out / 'fit.yaml'})", highlight=False)

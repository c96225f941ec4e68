"""`mosaic data`: prepare token files from local text for `mosaic train` / `mosaic ladder`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mosaic.cli.common import Command, Group, cli_errors, console, err_console

app = typer.Typer(help="Token files from local text (offline BPE tokenizer, held-out validation split).",
                  no_args_is_help=True, cls=Group)


@app.command("prepare", cls=Command)
@cli_errors
def prepare(
    inputs: list[str] = typer.Argument(..., help="Folders, files or globs of UTF-8 text; *.jsonl: one JSON object "
                                                 "per line, the document in --text-field."),
    out: Path = typer.Option(..., "-o", "--out", help="Output folder: train.bin, val.bin (+ .idx.npz), "
                                                      "tokenizer.json, corpus.yaml."),
    vocab_size: int = typer.Option(8192, "--vocab-size", help="BPE vocabulary learnt from the training documents."),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="Share of documents held out for validation."),
    text_field: str = typer.Option("text", "--text-field", help="JSON-lines field holding the document."),
    seed: int = typer.Option(0, "--seed", help="Seed of the train/validation split."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Reuse this tokenizer.json instead of "
                                             "learning one (e.g. to encode a second corpus the same way)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
) -> None:
    """Tokenize local text into the trainer's token files, one document per index entry, with a validation split."""
    from mosaic.corpus.prepare import PrepareOptions
    from mosaic.corpus.prepare import prepare as run_prepare

    options = PrepareOptions(vocab_size=vocab_size, val_fraction=val_fraction, text_field=text_field, seed=seed,
                             tokenizer=None if tokenizer is None else str(tokenizer))
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                  TimeElapsedColumn(), console=err_console, transient=True, disable=not progress) as bar:
        tasks: dict[str, Any] = {}

        def tick(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        manifest = run_prepare(inputs, out, options, tick)
    tr, va = manifest["train"], manifest["val"]
    console.print(f"{out}: train {tr['tokens']:,} tokens in {tr['documents']:,} documents, validation "
                  f"{va['tokens']:,} tokens in {va['documents']:,} documents; vocabulary "
                  f"{manifest['tokenizer']['vocab_size']:,} ({manifest['dtype']})", highlight=False)
    console.print(f"train with: mosaic train ... --data {out / 'train.bin'} --val-data {out / 'val.bin'} "
                  f"(model vocab_size >= {manifest['tokenizer']['vocab_size']})", highlight=False)


@app.command("python-docs", cls=Command)
@cli_errors
def python_docs(
    out: Path = typer.Argument(..., help="JSON-lines file to write (one document per line)."),
    package: list[str] = typer.Option([], "--package", help="Also the docstrings of this installed package "
                                                            "(repeatable), e.g. --package numpy."),
    stdlib: bool = typer.Option(True, "--stdlib/--no-stdlib", help="The standard library's docstrings."),
) -> None:
    """Write a real-text corpus from what this Python already holds: pydoc topics and module docstrings."""
    from mosaic.corpus.python_docs import python_docs as docs
    from mosaic.corpus.python_docs import write_jsonl

    counts = write_jsonl(out, docs(package, stdlib))
    console.print(f"{out}: {counts['documents']:,} documents, {counts['characters']:,} characters", highlight=False)

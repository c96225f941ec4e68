"""`mosaic data prepare`: local text -> DIR/train.bin, DIR/val.bin (+ .idx.npz), DIR/tokenizer.json, DIR/corpus.yaml.

Three passes over the inputs (`sources.expand`): (1) list the documents and split them, (2) learn
the BPE tokenizer from the training documents (`tokenizer.train_bpe`; or reuse --tokenizer),
(3) encode every document and stream it into its split's token file (`TokenFileWriter`), one
document per index entry, so document boundaries are kept exactly.

Split: a document is held out when u = sha256(seed, text) / 2^64 < val_fraction (first 8 bytes):
deterministic, independent of file names, paths and input order, stable when documents are added,
and a document that occurs twice lands on one side only (no copy of a held-out text in training).
At least one document goes to each side (the lowest-u document is held out when the fraction
rounds to none). The tokenizer never sees the held-out documents.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mosaic.corpus import tokenizer as bpe
from mosaic.corpus.sources import Document, documents, expand
from mosaic.trainer.data import TokenFileWriter
from perfmodel.errors import InputError
from perfmodel.specs.strict import write_yaml_atomic
from scaling_fits.data import file_sha256

Progress = Callable[[str, int, int], None]   # (stage, done, total)
MANIFEST = "corpus.yaml"
ENCODE_BATCH = 256


@dataclass(frozen=True)
class PrepareOptions:
    vocab_size: int = 8192
    """BPE vocabulary (ignored with `tokenizer`); the model's vocab_size must be at least this."""
    val_fraction: float = 0.05
    """Share of documents held out for the validation loss."""
    text_field: str = "text"
    """Field of a JSON-lines object that holds the document."""
    seed: int = 0
    """Seeds the split."""
    tokenizer: Optional[str] = None
    """An existing tokenizer.json to reuse instead of learning one."""

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction <= 0.5:
            raise InputError(f"--val-fraction {self.val_fraction}: must be in (0, 0.5]; e.g. 0.05")


def split_u(text: str, seed: int) -> float:
    """Uniform [0, 1) number of a document's text (sha256)."""
    digest = hashlib.sha256(f"{seed}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def prepare(inputs: Sequence[str], out_dir: str | Path, options: Optional[PrepareOptions] = None,
            progress: Optional[Progress] = None) -> dict[str, Any]:
    """Write the token files, tokenizer and manifest; returns the manifest."""
    options = options or PrepareOptions()
    out = Path(out_dir)
    files = expand(inputs)
    tick = progress or (lambda stage, done, total: None)

    def each(stage: str) -> Iterator[Document]:
        for i, path in enumerate(files):
            yield from documents(path, options.text_field)
            tick(stage, i + 1, len(files))

    # pass 1: which documents there are, and their split
    keys: list[str] = []
    u: list[float] = []
    chars = 0
    for doc in each("scan"):
        keys.append(doc.key)
        u.append(split_u(doc.text, options.seed))
        chars += len(doc.text)
    if not keys:
        raise InputError(f"data prepare: {len(files)} file(s) read, no text in any of them (empty or whitespace "
                         "only); give files that contain text")
    if len(keys) < 2:
        raise InputError(f"data prepare: one document in {len(files)} file(s); the validation split needs at least "
                         "two (split a long text into files, or use JSON lines)")
    u_arr = np.asarray(u)
    held = u_arr < options.val_fraction
    if not held.any():
        held[int(np.argmin(u_arr))] = True
    if held.all():
        held[int(np.argmax(u_arr))] = False
    val_keys = {k for k, h in zip(keys, held) if h}

    # pass 2: the tokenizer, from the training documents only
    if options.tokenizer:
        tok = bpe.load(options.tokenizer)
    else:
        train_texts = (d.text for d in each("tokenizer") if d.key not in val_keys)
        tok = bpe.train_bpe(train_texts, options.vocab_size, length=len(keys) - len(val_keys))
    vocab = int(tok.get_vocab_size())
    dtype = "uint16" if vocab <= 65536 else "uint32"
    out.mkdir(parents=True, exist_ok=True)

    # pass 3: encode into the two token files
    writers = {"train": TokenFileWriter(out / "train.bin", dtype), "val": TokenFileWriter(out / "val.bin", dtype)}
    try:
        batch: list[Document] = []

        def flush() -> None:
            for doc, enc in zip(batch, tok.encode_batch([d.text for d in batch])):
                writers["val" if doc.key in val_keys else "train"].add(enc.ids)
            batch.clear()

        for doc in each("encode"):
            batch.append(doc)
            if len(batch) >= ENCODE_BATCH:
                flush()
        flush()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    counts = {name: {"documents": w.n_documents, "tokens": w.n_tokens} for name, w in writers.items()}
    paths = {name: w.close() for name, w in writers.items()}
    tok_path = out / "tokenizer.json"
    tmp = out / ".tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(tok_path)
    manifest = {
        "version": 1,
        "inputs": [str(i) for i in inputs],
        "files": len(files),
        "characters": chars,
        "train": {**counts["train"], "file": paths["train"].name, "sha256": file_sha256(paths["train"])},
        "val": {**counts["val"], "file": paths["val"].name, "sha256": file_sha256(paths["val"])},
        "tokenizer": {"file": tok_path.name, "kind": "byte-level BPE (tokenizers)" if not options.tokenizer
                      else f"reused {options.tokenizer}", "vocab_size": vocab},
        "dtype": dtype,
        "split": {"val_fraction": options.val_fraction, "seed": options.seed, "by": "sha256(seed, document text)"},
        "text_field": options.text_field,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    write_yaml_atomic(out / MANIFEST, manifest)
    return manifest


__all__ = ["MANIFEST", "PrepareOptions", "prepare", "split_u"]

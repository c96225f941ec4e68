"""`mosaic data prepare` on real text this Python ships (pydoc topics): boundaries, split, tokenizer, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

pytest.importorskip("tokenizers", reason="data prepare needs the 'tokenizers' package (extra 'data')")

from mosaic.cli.app import app  # noqa: E402
from mosaic.corpus import tokenizer as bpe  # noqa: E402
from mosaic.corpus.python_docs import pydoc_topics  # noqa: E402
from mosaic.trainer.data import TokenFile, index_path  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 Language Reference topics as JSON lines, 6 more as a folder of .txt files."""
    root = tmp_path_factory.mktemp("text")
    topics = list(pydoc_topics())
    (root / "topics.jsonl").write_text("\n".join(json.dumps({"body": t, "id": k}) for k, t in topics[:40]) + "\n")
    folder = root / "more"
    folder.mkdir()
    for k, t in topics[40:46]:
        (folder / f"{k.split(':')[1]}.txt").write_text(t)
    (folder / "blank.txt").write_text("   \n\n")          # whitespace only: skipped
    return root, dict(topics[:46])


def _docs(bin_path):
    tf = TokenFile(bin_path, seq_len=64, seed=0)
    return [np.asarray(tf.tokens[a:b]) for a, b in zip(tf.offsets[:-1], tf.offsets[1:])]


def test_prepare_keeps_documents_and_holds_out_a_split(corpus, tmp_path):
    root, texts = corpus
    out = tmp_path / "tok"
    res = runner.invoke(app, ["data", "prepare", str(root / "topics.jsonl"), str(root / "more"), "-o", str(out),
                              "--vocab-size", "600", "--text-field", "body", "--val-fraction", "0.1", "--no-progress"])
    assert res.exit_code == 0, res.output
    manifest = yaml.safe_load((out / "corpus.yaml").read_text())
    assert manifest["train"]["documents"] + manifest["val"]["documents"] == 46
    assert manifest["train"]["documents"] >= 1 and manifest["val"]["documents"] >= 1
    assert manifest["tokenizer"]["vocab_size"] == 600 and manifest["dtype"] == "uint16"
    tok = bpe.load(out / "tokenizer.json")
    decoded = [tok.decode(d.tolist()) for name in ("train", "val") for d in _docs(out / f"{name}.bin")]
    assert sorted(decoded) == sorted(texts.values())        # every document, exactly, once: boundaries kept
    val = {tok.decode(d.tolist()) for d in _docs(out / "val.bin")}
    assert len(val) == manifest["val"]["documents"] and not val & {tok.decode(d.tolist()) for d in _docs(out / "train.bin")}
    assert index_path(out / "train.bin").is_file() and manifest["train"]["tokens"] == sum(map(len, _docs(out / "train.bin")))
    # same seed, same split; the tokenizer can be reused for another corpus
    again = tmp_path / "again"
    res = runner.invoke(app, ["data", "prepare", str(root / "more"), "-o", str(again), "--tokenizer",
                              str(out / "tokenizer.json"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load((again / "corpus.yaml").read_text())["tokenizer"]["vocab_size"] == 600


@pytest.mark.parametrize("make, args, match", [
    (lambda d: (d / "a.txt").write_text(" \n"), ["{d}/a.txt", "{d}/b.md"], "no text in any"),
    (lambda d: None, ["{d}/*.nothing"], "no such file or folder"),
    (lambda d: (d / "x.jsonl").write_text('{"content": "hello world"}\n'), ["{d}/x.jsonl"], "no field 'text'"),
    (lambda d: (d / "one.txt").write_text("just one document"), ["{d}/one.txt"], "one document"),
    (lambda d: (d / "a.txt").write_text("some text"), ["{d}/a.txt", "{d}/a.txt", "--val-fraction", "0.9"], "val-fraction"),
])
def test_bad_corpus_is_one_line_exit_2(tmp_path, make, args, match):
    (tmp_path / "b.md").write_text("")
    make(tmp_path)
    res = runner.invoke(app, ["data", "prepare", *[a.format(d=tmp_path) for a in args], "-o", str(tmp_path / "o"),
                              "--no-progress"])
    assert res.exit_code == 2 and match in res.output and res.output.count("\n") <= 3, res.output
    assert not (tmp_path / "o" / "train.bin").exists()


def test_python_docs_corpus_is_real_text(tmp_path):
    out = tmp_path / "docs.jsonl"
    res = runner.invoke(app, ["data", "python-docs", str(out), "--no-stdlib"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(list(pydoc_topics())) and all(r["text"].strip() for r in rows)

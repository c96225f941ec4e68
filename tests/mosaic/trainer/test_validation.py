"""Validation loss on a held-out token file: chunk assignment, metrics/summary, parity of dp x ep with one process."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")

from mosaic.trainer.data import write_token_file  # noqa: E402
from mosaic.trainer.validation import rank_chunks  # noqa: E402


@pytest.mark.parametrize("n_chunks, dp, mbs, cap", [(13, 2, 2, 0), (8, 4, 1, 0), (3, 2, 4, 0), (40, 2, 2, 3)])
def test_every_chunk_once_and_the_same_forwards_on_every_rank(n_chunks, dp, mbs, cap):
    per_rank = [rank_chunks(n_chunks, dp, r, mbs, cap) for r in range(dp)]
    assert len({len(b) for b in per_rank}) == 1 and all(len(mb) == mbs for b in per_rank for mb in b)
    real = sorted(j for b in per_rank for mb in b for j in mb if j >= 0)
    expect = min(n_chunks, cap * mbs * dp) if cap else n_chunks
    assert real == list(range(expect))


def _corpus(tmp_path):
    rng = np.random.default_rng(1)
    # a learnable stream (next = 3 * current mod 64 most of the time) in documents of varied length
    def doc(n):
        x = [int(rng.integers(64))]
        for _ in range(n - 1):
            x.append((3 * x[-1]) % 64 if rng.random() < 0.8 else int(rng.integers(64)))
        return x
    train = write_token_file(tmp_path / "train.bin", [doc(int(n)) for n in rng.integers(5, 60, size=60)])
    val = write_token_file(tmp_path / "val.bin", [doc(int(n)) for n in rng.integers(5, 60, size=12)])
    return train, val


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_val_loss_in_metrics_and_summary_and_dp_ep_parity(tmp_path, cli, tiny_model_file):
    train, val = _corpus(tmp_path)
    common = ["--model", str(tiny_model_file), "--data", str(train), "--val-data", str(val), "--steps", "4",
              "--eval-every", "2", "--lr", "1e-2"]
    one = tmp_path / "one"
    result = cli(*common, "--layout", "dp=1,mbs=2,gbs=8", "--out", str(one))
    rows = _rows(one)
    assert [r["val_loss"] is not None for r in rows] == [False, True, False, True]
    summary = json.loads((one / "summary.json").read_text())
    assert summary["final_val_loss"] == rows[-1]["val_loss"]
    assert 0 < summary["final_val_loss"] < math.log(64) + 1.0 and summary["val_tokens"] > 0
    assert "validation loss" in result.stdout
    two = tmp_path / "two"
    cli(*common, "--layout", "dp=2,ep=2,mbs=2,gbs=8", "--out", str(two))
    for a, b in zip(_rows(two), rows):     # same held-out loss for every layout, up to fp32 rounding
        assert (a["val_loss"] is None) == (b["val_loss"] is None)
        if b["val_loss"] is not None:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    assert json.loads((two / "summary.json").read_text())["val_tokens"] == summary["val_tokens"]


def test_val_data_is_refused_with_pipeline_and_eval_every_without_val(tmp_path, cli, tiny_model_file):
    train, val = _corpus(tmp_path)
    bad = cli("--model", str(tiny_model_file), "--layout", "dp=1,pp=2,mbs=1,gbs=4", "--data", str(train),
              "--val-data", str(val), "--steps", "1", "--out", str(tmp_path / "pp"), check=False)
    assert bad.returncode == 2 and "pp=2" in bad.stderr and "--val-data" in bad.stderr
    bad = cli("--model", str(tiny_model_file), "--layout", "dp=1,mbs=1,gbs=2", "--eval-every", "2", "--steps", "1",
              "--out", str(tmp_path / "ev"), check=False)
    assert bad.returncode == 2 and "val_data" in bad.stderr

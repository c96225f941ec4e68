"""One process on a packed token file, full recompute and the for-loop experts; resume checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")

from mosaic.trainer.data import write_token_file  # noqa: E402


def test_token_file_run_and_resume_rules(tmp_path, cli, tiny_model_file):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, size=n) for n in rng.integers(3, 50, size=40)]
    data = write_token_file(tmp_path / "corpus.bin", docs)
    out = tmp_path / "run"
    args = ["--model", str(tiny_model_file), "--layout", "dp=1,mbs=2,gbs=4,recompute=full", "--experts", "loop",
            "--data", str(data), "--steps", "3", "--out", str(out)]
    cli(*args)
    losses = cli.losses(out)
    assert len(losses) == 3 and all(math.isfinite(v) and 0 < v < 2 * math.log(64) for v in losses)
    assert (out / "checkpoints" / "step_00000003" / "COMPLETE").is_file()

    again = cli(*args, check=False)  # same folder without --resume
    assert again.returncode == 2 and "--resume" in again.stderr
    changed = cli(*[a if a != "dp=1,mbs=2,gbs=4,recompute=full" else "dp=1,mbs=1,gbs=4" for a in args], "--resume",
                  check=False)
    assert changed.returncode == 2 and "layout" in changed.stderr
    cli(*args[:-4], "--steps", "4", "--out", str(out), "--resume")  # one more step from the checkpoint
    resumed = cli.losses(out)
    assert resumed[:3] == losses and len(resumed) == 4

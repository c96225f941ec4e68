"""Shared pieces of the trainer tests: a tiny MoE, the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perfmodel.specs.architecture import MoEArchitecture

TINY = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, seq_len=16,
            n_experts=4, top_k=2, n_shared_experts=1, d_expert=16, d_ff_dense=64, n_dense_layers=1,
            ffn_ratio=4.0, gated_ffn=True, tie_embeddings=False)


@pytest.fixture(scope="session")
def tiny_arch() -> MoEArchitecture:
    return MoEArchitecture(**TINY)


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory) -> Path:
    import yaml

    path = tmp_path_factory.mktemp("model") / "tiny.yaml"
    path.write_text(yaml.safe_dump({"version": 1, **TINY}, sort_keys=False))
    return path


class CLI:
    """Runs `mosaic train ...` in a fresh interpreter, one thread per rank."""

    def __call__(self, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
        full_env["OMP_NUM_THREADS"] = "1"
        full_env.update(env or {})
        result = subprocess.run([sys.executable, "-m", "mosaic.cli.app", "train", "--no-progress", *args],
                                capture_output=True, text=True, env=full_env, timeout=300)
        if check and result.returncode != 0:
            raise AssertionError(f"mosaic train {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
        return result

    @staticmethod
    def losses(out: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def cli() -> CLI:
    return CLI()

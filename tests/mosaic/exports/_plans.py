"""Helpers for the exporter tests: the bundled example plan, variants of it, a script runner."""

from __future__ import annotations

import copy
import os
import stat
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "plans" / "mixtral_8x7b_h100_64.yaml"


def example_dict() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def variant(model: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
            **top: Any) -> dict[str, Any]:
    """The example plan with some model/layout keys (or top-level sections) changed."""
    data = copy.deepcopy(example_dict())
    data["model"].update(model or {})
    data["layout"].update(layout or {})
    data.update(top)
    return data


# A DeepSeek-MoE-like variant: dense first layer, shared experts, CP, FSDP, full recompute, fp8.
DEEPSEEK_LIKE = {
    "model": {"n_layers": 28, "n_experts": 64, "top_k": 6, "n_shared_experts": 2, "d_expert": 1408,
              "n_dense_layers": 1, "d_ff_dense": 10944},
    "layout": {"tp": 1, "pp": 2, "vpp": 2, "ep": 8, "etp": 1, "cp": 2, "dp": 16, "dp_flavor": "fsdp", "mbs": 2,
               "gbs": 256, "recompute": "full", "sequence_parallel": False, "precision": "fp8"},
}
# A dense model (no experts) with plain DDP and no pipeline.
DENSE = {
    "model": {"n_experts": 0, "top_k": 0, "d_expert": 0, "d_ff_dense": 14336},
    "layout": {"tp": 8, "pp": 1, "vpp": 1, "ep": 1, "dp": 8, "dp_flavor": "ddp", "overlap_param_gather": False, "mbs": 2, "gbs": 256,
               "recompute": "none", "precision": "bf16"},
}


def write_plan(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def make_fake_bin(tmp_path: Path) -> Path:
    """A folder of stand-ins for torchrun, srun and scontrol that record their argv (one word per line)."""
    folder = tmp_path / "fakebin"
    folder.mkdir()
    recorder = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGV_DIR/{name}.argv"\n'
    for name in ("torchrun", "srun"):
        (folder / name).write_text(recorder.format(name=name))
    # a long host list, so a reader that stops early would make scontrol die of SIGPIPE
    (folder / "scontrol").write_text("#!/usr/bin/env bash\necho node-a\nseq -f 'node-%g' 1 200000\n")
    for child in folder.iterdir():
        child.chmod(child.stat().st_mode | stat.S_IXUSR)
    return folder


def run_script(script: Path, fake_bin: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    """Run an exported bash script with the recorders first on PATH; returns (result, argv_dir)."""
    import subprocess

    argv_dir = fake_bin.parent / "argv"
    argv_dir.mkdir(exist_ok=True)
    full_env = {"PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}", "ARGV_DIR": str(argv_dir),
                **(env or {})}
    result = subprocess.run(["bash", str(script), *args], env=full_env, capture_output=True, text=True,
                            timeout=30)
    return result, argv_dir

"""Slurm export (run with recording srun/torchrun) and the `mosaic export` command: stdout, -o, errors."""

from __future__ import annotations

import math
import os
import re
import subprocess

import pytest
import typer.main
from typer.testing import CliRunner

from mosaic.cli.app import app
from mosaic.exports import render
from mosaic.planfile import plan_from_dict, read_plan
from perfmodel.errors import InputError
from tests.mosaic.exports._plans import EXAMPLE, example_dict, run_script, variant, write_plan
from tests.mosaic.exports.upstream_options import SBATCH_OPTIONS, SRUN_OPTIONS, TORCHRUN_OPTIONS


def train_options() -> set[str]:
    """Option names `mosaic train` accepts (from the Typer command itself)."""
    command = typer.main.get_command(app).commands["train"]
    return {opt for param in command.params for opt in param.opts if opt.startswith("--")}


def run_slurm(tmp_path, fake_bin, text, args=()):
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "mosaic-test"}
    result, argv_dir = run_script(script, fake_bin, env, args)
    assert result.returncode == 0, result.stderr
    return (argv_dir / "srun.argv").read_text().splitlines()


def test_slurm_script_runs_mosaic_train_on_the_plan_nodes(tmp_path, fake_bin):
    plan = read_plan(EXAMPLE)
    text = render(plan, "slurm")
    directives = dict(line[len("#SBATCH "):].split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH ") and "=" in line)
    assert set(directives) | {"--exclusive"} <= set(SBATCH_OPTIONS)
    assert int(directives["--nodes"]) * int(directives["--gpus-per-node"]) == plan.devices
    assert directives["--gpus-per-node"] == "8"  # h100 node level
    argv = run_slurm(tmp_path, fake_bin, text, ("--seed", "3"))
    torchrun_at = argv.index("torchrun")
    srun_opts = [w.split("=")[0] for w in argv[:torchrun_at]]
    assert set(srun_opts) <= set(SRUN_OPTIONS)
    module_at = argv.index("-m")
    launcher = argv[torchrun_at + 1:module_at]
    assert {w for w in launcher if w.startswith("-")} <= set(TORCHRUN_OPTIONS)
    assert launcher[launcher.index("--nnodes") + 1] == directives["--nodes"]
    assert launcher[launcher.index("--nproc_per_node") + 1] == directives["--gpus-per-node"]
    assert launcher[launcher.index("--rdzv_backend") + 1] == "c10d"
    assert launcher[launcher.index("--rdzv_endpoint") + 1] == "node-a:29500"  # first host of the job
    assert launcher[launcher.index("--rdzv_id") + 1] == "42"
    assert argv[module_at + 1:module_at + 3] == ["mosaic.cli.app", "train"]
    train = argv[module_at + 3:]
    assert {w for w in train if w.startswith("--")} <= train_options()
    assert train[train.index("--plan") + 1] == str(EXAMPLE.resolve())
    assert train[train.index("--device") + 1] == "cuda"
    assert int(train[train.index("--steps") + 1]) == math.ceil(plan.tokens / (plan.layout.gbs * plan.model.seq_len))
    assert train[train.index("--out") + 1] == "runs/mosaic-test-42"
    assert train[-2:] == ["--seed", "3"]  # extra sbatch arguments reach mosaic train


def test_slurm_gpus_per_node_option_and_npu_cluster():
    plan = read_plan(EXAMPLE)
    assert "#SBATCH --nodes=16" in render(plan, "slurm", gpus_per_node=4)
    npu = plan_from_dict(variant(cluster={"name": "ascend_910b"}))
    text = render(npu, "slurm")
    assert "--device npu" in text and "--gpus-per-node" not in text


@pytest.mark.parametrize("gpus,cluster,message", [
    (6, {"name": "h100"}, "budget.devices"),  # 64 devices do not fill nodes of 6
    (None, {"name": "no_such_cluster"}, "pass gpus_per_node=N"),
    (None, None, "pass gpus_per_node=N"),
    (0, {"name": "h100"}, "gpus_per_node=0: must be >= 1"),
])
def test_node_shape_errors(gpus, cluster, message):
    data = example_dict()
    if cluster is None:
        data.pop("cluster")
    else:
        data["cluster"] = cluster
    with pytest.raises(InputError, match=re.escape(message)):  # library errors name the parameter
        render(plan_from_dict(data), "slurm", gpus_per_node=gpus)


def test_small_jobs_use_one_node():
    data = variant(layout={"tp": 1, "pp": 1, "vpp": 1, "ep": 2, "dp": 4, "gbs": 64}, budget={"devices": 4})
    assert "#SBATCH --nodes=1\n" in render(plan_from_dict(data), "slurm")


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("fmt", ["megatron", "mindspeed", "torchtitan", "slurm"])
def test_cli_writes_atomically_with_o(tmp_path, fmt):
    out = tmp_path / "sub" / f"export.{fmt}"
    result = CliRunner().invoke(app, ["export", str(EXAMPLE), "--format", fmt, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == render(read_plan(EXAMPLE), fmt)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp file left behind
    executable = bool(out.stat().st_mode & 0o100)
    assert executable == (fmt != "torchtitan")
    if fmt != "torchtitan":
        assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def test_cli_prints_to_stdout():
    result = CliRunner().invoke(app, ["export", str(EXAMPLE), "--format", "torchtitan"])
    assert result.exit_code == 0
    assert "[parallelism]" in result.output


def test_cli_bad_plan_exits_2_and_keeps_the_old_file(tmp_path):
    plan = write_plan(tmp_path / "bad.yaml", variant(model={"n_expert": 8}))
    out = tmp_path / "launch.sh"
    out.write_text("old\n")
    result = CliRunner().invoke(app, ["export", str(plan), "--format", "megatron", "-o", str(out)])
    assert result.exit_code == 2
    assert result.output.count("error:") == 1 and "model.n_expert" in result.output
    assert out.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml", "launch.sh"]


@pytest.mark.parametrize("args,message", [
    (["--format", "deepspeed"], "--format"),
    (["--format", "slurm", "--gpus-per-node", "6"], "budget.devices"),
    (["--format", "slurm", "--gpus-per-node", "0"], "--gpus-per-node 0: must be >= 1"),  # the flag, not the parameter
    (["--format", "mindspeed"], None),  # fine: the example plan is zero1 + bf16
])
def test_cli_errors(args, message):
    result = CliRunner().invoke(app, ["export", str(EXAMPLE), *args])
    if message is None:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2 and message in result.output and result.output.count("error:") == 1


def test_cli_warns_about_model_differences(tmp_path):
    plan = write_plan(tmp_path / "p.yaml", variant(model={"n_layers": 32, "n_dense_layers": 1, "d_ff_dense": 14336}))
    result = CliRunner().invoke(app, ["export", str(plan), "--format", "torchtitan"])
    assert result.exit_code == 0
    assert "warning: torchtitan's Qwen3 has no dense first layers" in result.output


def test_cli_missing_plan_file(tmp_path):
    result = CliRunner().invoke(app, ["export", str(tmp_path / "none.yaml"), "--format", "slurm"])
    assert result.exit_code == 2 and "none.yaml" in result.output


def test_slurm_runs_uneven_stages_and_refuses_what_the_trainer_cannot_run():
    """The job is `mosaic train`: stages of unequal depth run (the trainer splits as the plan does);
    MTP or a fused dispatcher are refused with the trainer's reason."""
    from mosaic.exports import render
    from mosaic.planfile import plan_from_dict, read_plan
    from tests.mosaic.exports._plans import EXAMPLE, variant

    text = render(plan_from_dict(variant(model={"n_layers": 30}, layout={"pp": 4, "vpp": 1, "dp": 2, "tp": 8,
                                                                          "ep": 2})), "slurm")
    assert "mosaic.cli.app train --plan" in text
    with pytest.raises(InputError, match="n_mtp_layers=1"):
        render(read_plan(EXAMPLE.parent / "deepseek_v3_gb200_256.yaml"), "slurm")

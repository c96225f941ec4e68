"""`mosaic train` refuses bad plans before any process starts; `mosaic --help` needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from mosaic.cli import train as train_cmd
from mosaic.cli.app import app
from mosaic.planfile import read_plan


@pytest.fixture()
def no_launch(monkeypatch):
    """Any attempt to start a process or to train fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(train_cmd, "launch", refuse)
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


def _plan(tmp_path, layout, model=None, **extra):
    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout["dp"]
    data = {"version": 1, "cluster": {"name": "cpu_local"}, "budget": {"devices": world}, "model": model or dict(TINY_MODEL),
            "tokens": 1.0e6, "layout": layout, "predicted": {"mfu": 0.4}, "alternatives": [], **extra}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


TINY_MODEL = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, seq_len=16, n_experts=4,
                  top_k=2, n_shared_experts=1, d_expert=16, d_ff_dense=64, n_dense_layers=1)


@pytest.mark.parametrize("layout,nproc,message", [
    ({"dp": 3, "ep": 3, "mbs": 1, "gbs": 3}, None, "ep_divides_experts"),
    ({"dp": 2, "ep": 2, "mbs": 2, "gbs": 8}, 4, "world_matches"),
    ({"dp": 2, "mbs": 2, "gbs": 6}, None, "batch_divides"),
    ({"cp": 2, "dp": 1, "mbs": 1, "gbs": 1}, None, "context parallel is not implemented"),
    ({"dp": 2, "mbs": 1, "gbs": 2, "sequence_parallel": True}, None, "sequence_parallel=true needs tp > 1"),
    ({"pp": 2, "dp": 1, "mbs": 1, "gbs": 1}, None, "at least pp micro-batches"),
    ({"tp": 2, "dp": 1, "mbs": 1, "gbs": 1, "precision": "fp8"}, None, "fp8"),
    ({"dp": 1, "mbs": 1, "gbs": 1, "recompute": "selective", "recompute_modules": "layernorm+moe_act"}, None,
     "recompute_modules=layernorm+moe_act: the bundled trainer's selective recompute checkpoints core_attn or op"),
])
def test_bad_plans_are_refused_before_any_process_starts(tmp_path, no_launch, layout, nproc, message):
    out = tmp_path / "run"
    args = ["train", "--plan", str(_plan(tmp_path, layout)), "--out", str(out)]
    if nproc:
        args += ["--nproc", str(nproc)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.count("error:") == 1
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("model_change,message", [
    ({"n_experts": 4, "top_k": 5}, "top_k"),
    ({"n_expert": 4}, "unknown key 'model.n_expert'; did you mean 'n_experts'"),
])
def test_bad_model_sections_are_refused(tmp_path, no_launch, model_change, message):
    model = {**TINY_MODEL, **model_change}
    plan = _plan(tmp_path, {"dp": 1, "mbs": 1, "gbs": 1}, model=model)
    result = CliRunner().invoke(app, ["train", "--plan", str(plan), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and message in result.output, result.output


def test_model_and_layout_string_need_a_world_size(tmp_path, no_launch, tiny_model_file):
    result = CliRunner().invoke(app, ["train", "--model", str(tiny_model_file), "--layout", "ep=2,mbs=2,gbs=8",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "--nproc" in result.output


def test_plan_reads_model_layout_and_cluster_and_ignores_planner_sections(tmp_path):
    plan = read_plan(_plan(tmp_path, {"dp": 2, "ep": 2, "mbs": 2, "gbs": 8}, tokens=1e9))
    assert plan.model.n_experts == 4 and plan.layout.ep == 2 and plan.cluster.source() == "cpu_local"
    assert plan.report == {"predicted": {"mfu": 0.4}, "alternatives": []}


def test_a_changed_cluster_is_warned_about_once(tmp_path, no_launch, capsys):
    plan = _plan(tmp_path, {"dp": 1, "mbs": 1, "gbs": 1}, cluster={"name": "cpu_local", "hash": "0123456789abcdef"})
    config = train_cmd.build_config(plan=plan, model=None, layout=None, nproc=None, device="cpu", cluster=None,
                                    out=tmp_path / "run", options={"steps": 1})
    err = capsys.readouterr().err
    assert config.cluster == "cpu_local"
    assert "warning: cluster 'cpu_local' changed since the plan was made (hash 0123456789abcdef" in err
    assert err.count("warning:") == 1
    train_cmd.build_config(plan=plan, model=None, layout=None, nproc=None, device="cpu", cluster="cpu_local",
                           out=tmp_path / "run", options={"steps": 1})
    assert "warning" not in capsys.readouterr().err  # --cluster replaces the plan's cluster: nothing to compare


def test_resolved_config_for_cpu(tmp_path, no_launch):
    config = train_cmd.build_config(plan=_plan(tmp_path, {"dp": 2, "ep": 2, "mbs": 2, "gbs": 8, "precision": "bf16"}),
                                    model=None, layout=None, nproc=None, device="cpu", cluster=None,
                                    out=tmp_path / "run", options={"steps": 3})
    assert config.world_size == 2 and config.layout.edp() == 1
    assert config.precision == "fp32"  # cpu computes in fp32 whatever the plan's precision
    assert config.cluster == "cpu_local" and config.backend == "gloo"
    assert set(config.versions) >= {"mosaic", "torch", "python"}


def test_existing_run_folder_needs_resume(tmp_path, no_launch, tiny_model_file):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.yaml").write_text("version: 1\n")
    result = CliRunner().invoke(app, ["train", "--model", str(tiny_model_file), "--layout", "dp=1,mbs=1,gbs=1",
                                      "--out", str(out)])
    assert result.exit_code == 2 and "--resume" in result.output


def test_help_works_without_importing_torch():
    code = ("import sys; from typer.testing import CliRunner; from mosaic.cli.app import app; "
            "r = CliRunner().invoke(app, ['train', '--help']); assert r.exit_code == 0, r.output; "
            "assert '--plan' in r.output; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.check_call([sys.executable, "-c", code])


def test_missing_accelerator_is_refused_before_launch(tmp_path, no_launch, tiny_model_file):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = CliRunner().invoke(app, ["train", "--model", str(tiny_model_file), "--layout", "dp=1,mbs=1,gbs=1",
                                      "--device", "cuda", "--cluster", "h100", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "no cuda device" in result.output


@pytest.mark.parametrize(("name", "cluster"), [("NVIDIA H200", "h200"), ("NVIDIA L4", None)])
def test_cuda_without_cluster_takes_the_bundled_cluster_of_the_gpu_or_names_the_flag(tmp_path, no_launch,
                                                                                     tiny_model_file, monkeypatch,
                                                                                     name, cluster):
    from perfmodel.errors import InputError

    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    build = dict(plan=None, model=tiny_model_file, layout="dp=1,mbs=1,gbs=1", nproc=None, device="cuda", cluster=None,
                 out=tmp_path / "run", options={"steps": 3})
    if cluster is not None:
        assert train_cmd.build_config(**build).cluster == cluster
    else:
        with pytest.raises(InputError, match="^--cluster: not given, .*'NVIDIA L4'.* h100, h200"):
            train_cmd.build_config(**build)
    assert not (tmp_path / "run").exists()


def test_ddp_under_tensor_parallel_is_refused_where_torch_has_no_fsdp2_replicate(monkeypatch):
    """torch 2.6 (the oldest the project declares) has no FSDP2 replicate, which ddp with tp or pp runs through."""
    from mosaic.trainer import config as trainer_config
    from perfmodel.errors import InputError
    from perfmodel.specs.architecture import MoEArchitecture
    from perfmodel.specs.layout import parse_layout

    arch = MoEArchitecture(**TINY_MODEL)
    layout = parse_layout("dp=2,tp=2,mbs=2,gbs=8,dp_flavor=ddp")
    monkeypatch.setattr(trainer_config, "_has_module", lambda name: name != trainer_config.REPLICATE_MODULE)
    with pytest.raises(InputError, match="dp_flavor=ddp with tp or pp > 1 .* use dp_flavor=zero1"):
        trainer_config.check_runnable(arch, layout, 4)
    trainer_config.check_runnable(arch, parse_layout("dp=2,tp=2,mbs=2,gbs=8,dp_flavor=zero1"), 4)
    trainer_config.check_runnable(arch, parse_layout("dp=4,mbs=2,gbs=8,dp_flavor=ddp"), 4)  # plain DDP: any torch
    monkeypatch.setattr(trainer_config, "_has_module", lambda name: True)
    trainer_config.check_runnable(arch, layout, 4)

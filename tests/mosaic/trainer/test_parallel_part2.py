"""Trainer part 2: tensor, pipeline (1F1B, interleaved), recompute and precision.

Parity: every 4-rank layout of the issue (tp=2 x dp=2, pp=2 x dp=2, pp=2 x ep=2, tp=2 x ep=2,
plus interleaved pp=2 x vpp=2 x ep=2 with full recompute, pp=2 x tp=2 with sequence parallel,
expert-tensor parallel etp=2, pipeline stages of unequal depth (balanced, first/last, a layout
string) and multi-head latent attention) trains the first 5 steps to the losses of the
single-process run (fp32, rtol 1e-5).
To keep the launches few, one torchrun of 4 ranks trains all parallel layouts one after the
other in the same processes (`run(..., keep_process_group=True)`), then resumes two of them
from their step-3 checkpoints, and one torchrun of 1 rank trains the references (recompute
none, selective and full).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from perfmodel.errors import InputError
from perfmodel.specs.architecture import MoEArchitecture
from perfmodel.specs.layout import parse_layout

pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")

TINY = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, seq_len=16,
            n_experts=4, top_k=2, n_shared_experts=1, d_expert=16, d_ff_dense=64, n_dense_layers=1,
            ffn_ratio=4.0, gated_ffn=True, tie_embeddings=False)  # conftest.TINY: one dense layer, then MoE

STEPS = 5
TINY4 = {**TINY, "n_layers": 4}  # pp*vpp = 4 chunks need 4 layers
TINY5 = {**TINY, "n_layers": 5}  # no pp*vpp > 1 divides it: uneven stages
TINY_MLA = {**TINY, "n_kv_heads": 4, "head_dim": 12, "kv_lora_rank": 10, "q_lora_rank": 12, "qk_rope_head_dim": 4,
            "v_head_dim": 6}  # multi-head latent attention

REFERENCES = {
    # name: (model, layout)   one process
    "ref": (TINY, "dp=1,mbs=2,gbs=8"),
    "ref_full": (TINY, "dp=1,mbs=2,gbs=8,recompute=full"),
    "ref_selective": (TINY, "dp=1,mbs=2,gbs=8,recompute=selective"),
    "ref4_mbs1": (TINY4, "dp=1,mbs=1,gbs=8"),
    "ref5": (TINY5, "dp=1,mbs=2,gbs=8"),
    "ref5_mbs1": (TINY5, "dp=1,mbs=1,gbs=8"),
    "ref_mla": (TINY_MLA, "dp=1,mbs=2,gbs=8"),
}
PARALLEL = {
    # name: (model, layout, reference)   four ranks; ep carved out of tp*dp (parallel folding)
    "tp2_dp2": (TINY, "tp=2,dp=2,mbs=2,gbs=8,dp_flavor=zero1,recompute=selective", "ref"),
    "tp2_ep2_sp": (TINY, "tp=2,dp=2,ep=2,mbs=2,gbs=8,sequence_parallel=true,dp_flavor=ddp", "ref"),
    "pp2_dp2": (TINY, "pp=2,dp=2,mbs=2,gbs=8,dp_flavor=ddp", "ref"),
    "pp2_ep2": (TINY, "pp=2,dp=2,ep=2,mbs=2,gbs=8,dp_flavor=fsdp", "ref"),
    "pp2_tp2_sp": (TINY, "pp=2,tp=2,mbs=2,gbs=8,sequence_parallel=true", "ref"),
    "pp2_vpp2_ep2_full": (TINY4, "pp=2,vpp=2,dp=2,ep=2,mbs=1,gbs=8,recompute=full", "ref4_mbs1"),
    # expert-tensor parallel: d_expert split over etp (edp = 1, then edp = 2)
    "tp2_ep2_etp2_sp": (TINY, "tp=2,dp=2,ep=2,etp=2,mbs=2,gbs=8,sequence_parallel=true", "ref"),
    "dp4_etp2": (TINY, "dp=4,etp=2,mbs=2,gbs=8,dp_flavor=ddp", "ref"),
    # stages of unequal depth: the balanced default (2 + 3 layers), Megatron's first/last rank
    # counts (1 | 1 | 1 | 2), its layout string with interleaving (E t | t t | t | t L)
    "pp2_balanced_dp2": (TINY5, "pp=2,dp=2,mbs=2,gbs=8,dp_flavor=ddp", "ref5"),
    "pp4_first_last": (TINY5, "pp=4,first_stage_layers=1,last_stage_layers=2,mbs=2,gbs=8", "ref5"),
    "pp2_vpp2_layout_ep2": (TINY5, "pp=2,vpp=2,pp_layout=Et|tt|t|tL,dp=2,ep=2,mbs=1,gbs=8", "ref5_mbs1"),
    # multi-head latent attention through the pipeline and expert parallel
    "pp2_mla_ep2": (TINY_MLA, "pp=2,dp=2,ep=2,mbs=2,gbs=8,recompute=selective", "ref_mla"),
}

RESUMED = ("pp2_ep2", "tp2_ep2_etp2_sp")
"""Resumed from their step-3 checkpoint in the same launch: pipeline-stage and tensor-parallel state."""

WORKER = textwrap.dedent('''
    import json, shutil, sys
    import torch.distributed as dist
    from mosaic.trainer.config import RunConfig, TrainOptions, check_runnable, trainer_precision
    from mosaic.trainer.train import run
    from perfmodel.specs.architecture import MoEArchitecture
    from perfmodel.specs.layout import parse_layout

    jobs = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for job in jobs:
        arch = MoEArchitecture(**job["model"])
        layout = check_runnable(arch, parse_layout(job["layout"]), world)
        resume = job.get("resume_from")
        if resume and dist.get_rank() == 0:  # an earlier run as if it had died after its step-3 checkpoint
            shutil.copytree(resume, job["out"])
            shutil.rmtree(f"{job['out']}/checkpoints/step_{job['steps']:08d}")
        dist.barrier()
        precision = job.get("precision") or trainer_precision(layout, "cpu")
        config = RunConfig(model=arch, layout=layout, cluster="cpu_local", device="cpu", world_size=world,
                           precision=precision, out_dir=job["out"],
                           train=TrainOptions(steps=job["steps"], progress=False, checkpoint_every=3,
                                              resume=bool(resume), data=job.get("data", "synthetic")))
        run(config, keep_process_group=True)
    dist.destroy_process_group()
''')


def _launch(tmp: Path, name: str, nproc: int, jobs: list[dict]) -> None:
    script, spec = tmp / f"{name}.py", tmp / f"{name}.json"
    script.write_text(WORKER)
    spec.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), str(script), str(spec)], capture_output=True, text=True, timeout=600, env=env,
                            cwd=Path(__file__).resolve().parents[3])
    assert result.returncode == 0, result.stderr[-6000:]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from mosaic.trainer.data import write_token_file

    root = tmp_path_factory.mktemp("part2")
    outs = {name: root / name for name in [*REFERENCES, *PARALLEL, "packed_ref", "packed_pp2_tp2_sp"]}
    # packed documents: attention masks and RoPE positions must reach every pipeline stage
    rng = np.random.default_rng(0)
    corpus = str(write_token_file(root / "corpus.bin", [rng.integers(0, 64, size=int(n)).tolist()
                                                        for n in rng.integers(3, 40, size=200)]))
    refs = [{"model": m, "layout": lay, "out": str(outs[n]), "steps": STEPS} for n, (m, lay) in REFERENCES.items()]
    refs.append({**refs[0], "out": str(outs["packed_ref"]), "data": corpus})
    _launch(root, "references", 1, refs)
    jobs = [{"model": m, "layout": lay, "out": str(outs[n]), "steps": STEPS} for n, (m, lay, _) in PARALLEL.items()]
    jobs.append({**jobs[list(PARALLEL).index("pp2_tp2_sp")], "out": str(outs["packed_pp2_tp2_sp"]), "data": corpus})
    # bf16 autocast (cpu autocast, what cuda/npu runs use) through a pipeline with tensor parallel
    outs["pp2_tp2_sp_bf16"] = root / "pp2_tp2_sp_bf16"
    jobs.append({**jobs[list(PARALLEL).index("pp2_tp2_sp")], "out": str(outs["pp2_tp2_sp_bf16"]), "precision": "bf16"})
    for name in RESUMED:
        outs[f"{name}_resumed"] = root / f"{name}_resumed"
        jobs.append({**jobs[list(PARALLEL).index(name)], "out": str(outs[f"{name}_resumed"]),
                     "resume_from": str(outs[name])})
    _launch(root, "parallel", 4, jobs)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARALLEL))
def test_four_rank_layouts_match_the_single_process_run(runs, name):
    reference = PARALLEL[name][2]
    parallel, single = _losses(runs[name]), _losses(runs[reference])
    assert len(parallel) == len(single) == STEPS
    assert single[-1] < single[0]  # it trains
    np.testing.assert_allclose(parallel, single, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_packed_documents_match_through_pipeline_and_tensor_parallel(runs):
    np.testing.assert_allclose(_losses(runs["packed_pp2_tp2_sp"]), _losses(runs["packed_ref"]), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMED)
def test_resume_from_a_checkpoint_continues_the_same_losses(runs, name):
    resumed, uninterrupted = _losses(runs[f"{name}_resumed"]), _losses(runs[name])
    assert len(resumed) == STEPS
    np.testing.assert_allclose(resumed, uninterrupted, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_bf16_autocast_trains_through_the_pipeline_close_to_fp32(runs):
    bf16, fp32 = _losses(runs["pp2_tp2_sp_bf16"]), _losses(runs["ref"])
    assert len(bf16) == STEPS and bf16 != fp32  # autocast did change the arithmetic
    np.testing.assert_allclose(bf16, fp32, rtol=2e-2)


@pytest.mark.slow
def test_recompute_full_and_selective_give_the_losses_of_no_recompute(runs):
    none = _losses(runs["ref"])
    np.testing.assert_allclose(_losses(runs["ref_full"]), none, rtol=1e-6, atol=0)
    np.testing.assert_allclose(_losses(runs["ref_selective"]), none, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_pipeline_metrics_count_each_token_and_expert_once(runs):
    """The loss, aux loss and expert load are reduced over stages/tp ranks without double counting."""
    rows = [json.loads(line) for line in (runs["pp2_tp2_sp"] / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (runs["ref"] / "metrics.jsonl").read_text().splitlines()]
    for row, r in zip(rows, ref):
        assert row["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5)
        assert row["expert_imbalance"] == pytest.approx(r["expert_imbalance"], rel=1e-6)


# ---------------------------------------------------------------------------
# without processes: the split, the tensor-parallel plan's shapes, refusals

def test_pipeline_split_follows_the_performance_model():
    import torch

    from mosaic.trainer.model import Transformer
    from mosaic.trainer.pipeline import chunk_layers, split_model

    assert [list(r) for r in chunk_layers(8, 2, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    torch.manual_seed(0)
    model = Transformer(MoEArchitecture(**{**TINY, "n_layers": 8}))
    full = dict(model.named_parameters())
    rank1 = split_model(model, pp=2, vpp=2, pp_rank=1)  # chunks 1 and 3 (looped assignment)
    assert [index for index, _ in rank1] == [1, 3]
    (_, middle), (_, last) = rank1
    assert list(middle.layers) == ["2", "3"] and middle.tok_embeddings is None and middle.output is None
    assert list(last.layers) == ["6", "7"] and last.output is not None and last.norm is not None
    for name, p in last.named_parameters():  # single-device names and values
        assert torch.equal(p, full[name])
    (_, first), _ = split_model(model, pp=2, vpp=2, pp_rank=0)
    assert first.tok_embeddings is not None and first.output is None
    # uneven: the balanced default, Megatron's first/last ranks and its layout string
    assert [len(r) for r in chunk_layers(5, 2, 1)] == [2, 3]
    assert [len(r) for r in chunk_layers(5, 4, 1, parse_layout("pp=4,first_stage_layers=1,last_stage_layers=2"))] \
        == [1, 1, 1, 2]
    assert [list(r) for r in chunk_layers(5, 2, 2, parse_layout("pp=2,vpp=2,pp_layout=Et|tt|t|tL"))] \
        == [[0], [1, 2], [3], [4]]


def _arch(**changes) -> MoEArchitecture:
    return MoEArchitecture(**{**TINY, **changes})


@pytest.mark.parametrize("changes,layout,devices,message", [
    ({}, "cp=2,dp=1,mbs=1,gbs=1", 2, "context parallel is not implemented"),
    ({"tie_embeddings": True}, "tp=2,dp=1,mbs=1,gbs=1", 2, "tie_embeddings=true with tp > 1"),
    ({"tie_embeddings": True}, "pp=2,dp=1,mbs=1,gbs=4", 2, "tie_embeddings=true with pp > 1"),
    ({"seq_len": 15}, "tp=2,dp=1,mbs=1,gbs=1", 2, "must divide seq_len=15"),
    ({}, "pp=2,dp=1,mbs=1,gbs=1", 2, "at least pp micro-batches"),
    ({"n_layers": 4}, "pp=2,vpp=2,dp=1,mbs=1,gbs=5", 2, "interleaved 1F1B"),
    ({}, "dp=2,mbs=1,gbs=2,sequence_parallel=true", 2, "sequence_parallel=true needs tp > 1"),
])
def test_layouts_the_trainer_cannot_run_are_refused_with_the_reason(changes, layout, devices, message):
    from mosaic.trainer.config import check_runnable

    with pytest.raises(InputError, match=message.replace("*", r"\*")):
        check_runnable(_arch(**changes), parse_layout(layout), devices)


def test_supported_layouts_pass_the_checks():
    from mosaic.trainer.config import check_runnable

    for _, (model, layout, _) in PARALLEL.items():
        resolved = check_runnable(MoEArchitecture(**model), parse_layout(layout), 4)
        assert resolved.world() == 4


@pytest.mark.parametrize("device,precision,message", [
    ("cpu", "fp8", "computes in fp32"),
    ("npu", "fp8", "has no fp8 kernels"),
    ("cpu", "mxfp8", "mxfp8 is not implemented"),
])
def test_fp8_is_refused_where_the_device_cannot_run_it(device, precision, message):
    from mosaic.trainer.config import trainer_precision

    with pytest.raises(InputError, match=message):
        trainer_precision(parse_layout(f"dp=1,precision={precision}"), device)


def test_precision_per_device():
    from mosaic.trainer.config import trainer_precision

    assert trainer_precision(parse_layout("dp=1,precision=bf16"), "cpu") == "fp32"
    assert trainer_precision(parse_layout("dp=1,precision=bf16"), "cuda") == "bf16"
    assert trainer_precision(parse_layout("dp=1,precision=fp32"), "npu") == "fp32"


def test_fp8_needs_torchao_on_cuda():
    import importlib.util

    from mosaic.trainer.config import trainer_precision

    layout = parse_layout("dp=1,precision=fp8")
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(InputError, match="torchao, which is not installed"):
            trainer_precision(layout, "cuda")
    else:
        assert trainer_precision(layout, "cuda") == "fp8"

"""`mosaic ladder`: the design for a budget, resumable execution (mocked trainer), the fit, one real micro-ladder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mosaic.ladder.design import LadderSpace, design, load_ladder_space, min_budget_flops
from mosaic.ladder.fit import LadderFitOptions, fit_ladder
from mosaic.ladder.runner import LadderSetup, collect, execute, open_ladder, run_dir, state, subprocess_launcher
from perfmodel.errors import InputError, MosaicRuntimeError
from scaling_fits import load_fit
from scaling_fits.laws import Mosaic4DParams, get_law

VOCAB = 2048
LAW = get_law("mosaic4d")
# a planted law for the mocked trainer (the default fit's exponents, a corpus-like floor)
PLANTED = Mosaic4DParams(a=40.0, alpha=0.3, b=300.0, beta=0.3, c=0.2, lambda_=-0.4, j=60.0, delta=0.2, gamma=0.25,
                         eta=0.05, e=1.8)


def test_default_design_spends_the_budget_on_at_least_12_runs_and_holds_out_the_largest():
    space = load_ladder_space()
    runs = design(space, 3.5e13, VOCAB, corpus_tokens=5_000_000)
    assert len(runs) >= 12 == space.min_runs
    total = sum(r.flops for r in runs)
    assert abs(total / 3.5e13 - 1) < 0.02                          # whole steps round the budget
    held = [r for r in runs if r.heldout]
    assert len(held) == 1 and held[0].flops == max(r.flops for r in runs)
    assert held[0].n_total > max(r.n_total for r in runs if not r.heldout)
    assert len({round(r.sparsity, 2) for r in runs}) >= 3 and len({r.granularity for r in runs}) >= 3
    assert len({r.tokens for r in runs if r.kind == "dense"}) >= 2
    assert min(r.steps for r in runs) >= space.min_steps


@pytest.mark.parametrize("change, match", [
    (dict(budget=1e12), "too small for the 19 runs"),
    (dict(corpus=100_000), "more than the corpus"),
    (dict(space=dict(min_runs=40)), "fewer than min_runs=40"),
])
def test_bad_budgets_and_spaces_are_named(change, match):
    space = load_ladder_space()
    if "space" in change:
        from dataclasses import replace

        space = replace(space, **change["space"])
    with pytest.raises(InputError, match=match):
        design(space, change.get("budget", 3.5e13), VOCAB, corpus_tokens=change.get("corpus", 5_000_000))
    assert min_budget_flops(load_ladder_space(), VOCAB) < 3.5e13


class FakeRun:
    """Stands in for the trainer: writes metrics.jsonl/summary.json with the planted law's loss (+0.3% noise)."""

    def __init__(self, folder: Path, run, resume: bool, rng, stop_after: int | None = None):
        self.code = None
        loss = float(LAW.predict(PLANTED, run.n_total, run.sparsity, run.tokens, run.granularity))
        loss *= float(np.exp(0.003 * rng.standard_normal()))
        (folder / "run.yaml").write_text("version: 1\n")
        steps = run.steps if stop_after is None else stop_after
        rows = [{"step": s, "loss": loss + 0.01, "step_time_s": 0.01, "tokens_per_s": 1.0,
                 "val_loss": loss if s == run.steps else None} for s in range(1, steps + 1)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if stop_after is None:
            (folder / "summary.json").write_text(json.dumps({"final_loss": loss + 0.01, "final_val_loss": loss}))
        self.code = 0

    def poll(self):
        return self.code

    def kill(self):
        pass


def _setup(tmp_path, budget=3.5e13):
    space = load_ladder_space()
    runs = tuple(design(space, budget, VOCAB, corpus_tokens=5_000_000))
    return LadderSetup(space=space, budget_flops=budget, train_data=str(tmp_path / "train.bin"),
                       val_data=str(tmp_path / "val.bin"), data_sha256="0" * 64, runs=runs)


def test_killed_ladder_continues_without_redoing_finished_runs(tmp_path):
    setup = open_ladder(tmp_path, _setup(tmp_path))
    rng = np.random.default_rng(0)
    launched: list[tuple[str, bool]] = []

    def killed_at_fourth(setup_, run, folder, resume):
        launched.append((run.name, resume))
        if len(launched) == 4:
            FakeRun(folder, run, resume, rng, stop_after=run.steps // 2)   # half-way when the ladder dies
            raise KeyboardInterrupt
        return FakeRun(folder, run, resume, rng)

    with pytest.raises(KeyboardInterrupt):
        execute(tmp_path, setup, killed_at_fourth, poll_s=0)
    finished = [name for name, _ in launched[:3]]
    assert all(state(tmp_path, r) == "done" for r in setup.runs if r.name in finished)
    partial = next(r for r in setup.runs if r.name == launched[3][0])
    assert state(tmp_path, partial) == "partial"

    second: list[tuple[str, bool]] = []

    def counting(setup_, run, folder, resume):
        second.append((run.name, resume))
        return FakeRun(folder, run, resume, rng)

    statuses = []
    execute(tmp_path, open_ladder(tmp_path, setup), counting, poll_s=0, on_update=lambda s: statuses.append(dict(s)))
    assert not set(finished) & {name for name, _ in second}                 # no finished run redone
    assert (partial.name, True) in second                                   # the killed one resumes
    assert all(not resume for name, resume in second if name != partial.name)
    assert sum(st["state"].startswith("done") for st in statuses[-1].values()) == len(setup.runs)

    frame = collect(tmp_path, setup)
    assert len(frame) == len(setup.runs) and (tmp_path / "results.csv").is_file()
    fitted, report = fit_ladder(frame, LadderFitOptions(n_boot=8, n_starts=16))
    (held,) = report["extrapolation"].values()
    assert held["ape"] < 0.02                                               # planted law + 0.3% noise
    assert report["mape_loo"] < 0.02 and report["granularity_form"]["choice"] in ("power", "logquad")
    path = tmp_path / "fit.yaml"
    from scaling_fits.fitfile import write_fit

    write_fit(fitted, path)
    again = load_fit(path)                                                  # what `mosaic plan --fit` reads
    assert again.metrics["ladder"]["extrapolation_mape"] == pytest.approx(report["extrapolation_mape"])


def test_a_ladder_folder_refuses_other_arguments_and_failed_runs_are_named(tmp_path):
    open_ladder(tmp_path, _setup(tmp_path))
    with pytest.raises(InputError, match="another budget_flops"):
        open_ladder(tmp_path, _setup(tmp_path, budget=4e13))

    class Fails:
        def poll(self):
            return 3

        def kill(self):
            pass

    setup = _setup(tmp_path)
    with pytest.raises(MosaicRuntimeError, match="rerun the same"):
        execute(tmp_path, LadderSetup(**{**setup.__dict__, "runs": setup.runs[:1]}), lambda *a: Fails(), poll_s=0)


@pytest.mark.slow
def test_micro_ladder_with_the_real_trainer(tmp_path):
    pytest.importorskip("torch")
    from mosaic.trainer.data import write_token_file

    rng = np.random.default_rng(0)
    train = write_token_file(tmp_path / "train.bin", [rng.integers(0, 64, size=int(n)) for n in rng.integers(20, 80, 50)])
    val = write_token_file(tmp_path / "val.bin", [rng.integers(0, 64, size=int(n)) for n in rng.integers(20, 80, 8)])
    space = LadderSpace(sizes=((16, 1), (32, 1)), holdout_size=(48, 1), seq_len=16, moe=(4, 1), sparser_moe=(8, 1),
                        granularity=(1, 2), mbs=4, gbs=4, min_steps=4, min_runs=1, eval_batches=2)
    runs = tuple(r for r in design(space, 2e9, 64) if r.kind in ("dense", "moe"))[:2]
    setup = LadderSetup(space=space, budget_flops=2e9, train_data=str(train), val_data=str(val), data_sha256="x",
                        runs=runs)
    open_ladder(tmp_path / "lad", setup)
    execute(tmp_path / "lad", setup, subprocess_launcher(jobs=2), jobs=2, poll_s=0.2)
    frame = collect(tmp_path / "lad", setup)
    assert len(frame) == 2 and np.all(np.isfinite(frame["loss"])) and np.all(frame["loss"] > 0)
    for run in runs:
        rows = (run_dir(tmp_path / "lad", run) / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == run.steps and json.loads(rows[-1])["val_loss"] is not None


def test_laws_on_choice_reports_each_law_with_its_band():
    from types import SimpleNamespace

    from mosaic.ladder.compare import laws_on_choice
    from perfmodel.specs.architecture import MoEArchitecture

    arch = MoEArchitecture(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, vocab_size=1024, seq_len=128,
                           n_experts=8, top_k=2, d_expert=512)
    choice = SimpleNamespace(arch=arch, tokens=1e9)
    default = load_fit(None)
    frame = laws_on_choice(choice, {"default": default})
    row = frame.iloc[0]
    assert row["loss"] == pytest.approx(float(default.predict(arch.total_params(), arch.sparsity, 1e9, arch.granularity)))
    assert row["loss_lo"] <= row["loss"] <= row["loss_hi"]

"""benchmarks/gpu_check.py: its --dry-run (the GPU check's orchestration on cpu with the tiny MoE),
its budget (a phase over its time is stopped with its process group; what is there is packed), its
refusals before any work, and that what it leaves fits what the device tool brings back."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the GPU check trains with the bundled trainer (extra `train`)")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up
_spec.loader.exec_module(gpu_check)

PNG = b"\x89PNG\r\n\x1a\n"


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    return _run("--dry-run", "--out", str(out)), out


def test_dry_run_completes_and_prints_each_target(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["device"] == "cpu" and summary["incomplete_phases"] == []
    lines = done.stdout.splitlines()
    printed = [line for line in lines if line.startswith("target ")]
    assert [t["target"] for t in summary["targets"]] == [line[len("target "):].split(": ")[0] for line in printed]
    for target, line in zip(summary["targets"], printed):
        assert line.endswith({True: "-> met", False: "-> NOT met", None: "-> not measured"}[target["met"]])
        if target["value"] is not None:  # met follows from the figure and the threshold
            threshold = gpu_check.TARGETS[target["key"]]
            assert target["met"] == (target["value"] >= threshold if target["key"] == "mfu_bf16" else target["value"] <= threshold)
    assert all(t["value"] is not None for t in summary["targets"])  # the dry run reaches every figure


def test_dry_run_leaves_what_the_device_tool_brings_back(dry_run):
    _, out = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["summary.json", "step_time.png", "kernels.png", "memory.png", "calibrated.yaml",
                            "calibrated.kernels.tar.gz", "refit.yaml", "gpu_check.tar.gz"])
    assert len(files) <= gpu_check.RETURN_LIMITS["files"]
    assert all((out / f).stat().st_size < gpu_check.RETURN_LIMITS["file_bytes"] for f in files)
    for png in ("step_time.png", "kernels.png", "memory.png"):
        assert (out / png).read_bytes()[:8] == PNG
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
    for config in ("bf16_mbs2", "bf16_mbs1", "bf16_mbs2_full"):
        assert {f"gpu_check/runs/{config}/metrics.jsonl", f"gpu_check/runs/{config}/run.yaml"} <= names
        assert f"gpu_check/runs/{config}/checkpoints" not in names  # --no-checkpoint
        assert f"gpu_check/predictions/calibrated_{config}.json" in names
    assert {"gpu_check/report/report.md", "gpu_check/logs/calibrate.log", "gpu_check/logs/gpu_check.log"} <= names
    # the calibration's tables, in the archive and as one file that unpacks beside calibrated.yaml
    with tarfile.open(out / "calibrated.kernels.tar.gz") as tar:
        returned = {name: tar.extractfile(name).read() for name in tar.getnames() if tar.getmember(name).isfile()}
    kinds = {"gemm.csv", "grouped_gemm.csv", "attention.csv", "memory_kernels.csv", "host.csv", "provenance.yaml"}
    assert {f"calibrated.kernels/{name}" for name in kinds} <= set(returned)
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        for name, data in returned.items():
            assert tar.extractfile(f"gpu_check/{name}").read() == data


def test_dry_run_kernel_rows_are_scored_by_the_check_of_the_bundled_tables(dry_run, tmp_path):
    """Every used row of the calibration's tables, one at a time, against the bundled and the
    calibrated cluster: the errors perfmodel.kernels.check gives the whole tables, the medians of them."""
    import numpy as np

    from calibration.tables import read_folder
    from perfmodel.clusters import load_cluster
    from perfmodel.kernels.check import cluster_spans, table_errors

    _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    kernels = summary["kernels"]
    assert kernels["status"] == "ok" and kernels["bundled"] == "cpu_local" and kernels["clusters"] == ["bundled", "calibrated"]
    with tarfile.open(out / "calibrated.kernels.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    measured = read_folder(tmp_path / "calibrated.kernels")
    assert kernels["accelerator"] == measured.accelerator == "cpu_local_calibrated"
    clusters = {"bundled": load_cluster("cpu_local"), "calibrated": load_cluster(str(out / "calibrated.yaml"))}
    points = kernels["points"]
    for label, cluster in clusters.items():
        whole = table_errors(cluster, measured.tables, measured.accelerator, cluster_spans(cluster))
        for kind in ("gemm", "grouped_gemm", "attention", "memory_kernels"):
            assert len(whole[kind]) > 0, (label, kind)
            mine = [p[f"error_{label}"] for p in points if p["kind"] == kind and p[f"error_{label}"] is not None]
            assert sorted(mine) == pytest.approx(sorted(whole[kind].tolist()), rel=1e-12, abs=1e-12), (label, kind)
    for kind in ("gemm", "grouped_gemm", "attention", "memory_kernels"):  # every used row is a point
        rows = measured.rows(kind).rows_of(measured.accelerator)
        assert sorted(p["line"] for p in points if p["kind"] == kind) == sorted(rows.line.tolist())
    for key, row in kernels["table"].items():
        group = [p for p in points if f"{p['kind']} {p['group']}" == key]
        assert row["rows"] == len(group) > 0
        for label in clusters:
            errors = [p[f"error_{label}"] for p in group if p[f"error_{label}"] is not None]
            assert row[f"scored_{label}"] == len(errors)
            assert row[f"median_abs_error_{label}"] == pytest.approx(float(np.median(np.abs(errors))))
            for p in group:
                if p[f"error_{label}"] is not None:
                    assert p[f"predicted_{label}"] == pytest.approx(p["measured"] * (1 + p[f"error_{label}"]))
    assert kernels["table"]["gemm fp32"]["rows"] > 0
    peak_fp32 = clusters["bundled"].accelerator.peak("fp32")
    gemm = measured.rows("gemm").rows_of(measured.accelerator)
    tflops = dict(zip(gemm.line.tolist(), gemm["tflops"].tolist()))
    for point in (p for p in points if p["kind"] == "gemm" and p["group"] == "fp32"):
        assert point["measured"] == pytest.approx(tflops[point["line"]] * 1e12)
        assert point["fraction_of_peak"] == pytest.approx(point["measured"] / peak_fp32)
    # the host figures: the calibrated cluster takes what host.csv measured; the bundled one its own
    assert set(kernels["host"]) == set(measured.host) and "launch_latency_s" in measured.host
    for figure, row in kernels["host"].items():
        assert row["measured_s"] == measured.host[figure].seconds
        assert row["calibrated_s"] == pytest.approx(measured.host[figure].seconds, rel=1e-3)
        assert row["bundled_s"] == getattr(clusters["bundled"].accelerator, figure)


def test_dry_run_phases_and_the_fp8_refusal_come_from_the_commands(dry_run):
    _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    phases = summary["phases"]
    assert list(phases) == ["environment", "calibrate", "train bf16_mbs2", "train bf16_mbs1", "train bf16_mbs2_full",
                            "train fp8_mbs2", "predict", "refit", "predict (refit)"]
    assert {name: p["status"] for name, p in phases.items() if p["status"] != "ok"} == {"train fp8_mbs2": "refused"}
    # the trainer's own one-line refusal, not a copy of its rule
    assert phases["train fp8_mbs2"]["message"].startswith("error: layout: precision=fp8 needs a cuda GPU")
    assert "--no-checkpoint" in phases["train bf16_mbs2"]["command"] and "--device cpu" in phases["calibrate"]["command"]
    assert summary["bundled_cluster"] == "cpu_local"  # the calibration's base, read from the calibrated file


def test_dry_run_figures_are_the_runs_and_predictions_they_name(dry_run, tmp_path):
    _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    work = tmp_path / "gpu_check"
    refit_rows = {row["run"]: row for row in summary["refit"]["per_run"]}
    assert set(summary["errors"]) == set(refit_rows) == {"bf16_mbs2", "bf16_mbs1", "bf16_mbs2_full"}
    for name, e in summary["errors"].items():
        rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        run = summary["runs"][name]
        assert run["steps_run"] == len(rows) == summary["steps"] == 4
        used = [r["step_time_s"] for r in rows[-run["steps_used"]:]]
        assert run["steps_used"] == 3  # from-runs drops the first step of a short run
        assert e["measured_step_time_s"] == pytest.approx(sum(used) / len(used), rel=1e-4)  # from-runs rounds to 5 digits
        assert run["tokens_per_s"] * e["measured_step_time_s"] == pytest.approx(4 * 32)  # gbs x seq_len of the tiny MoE
        assert run["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in rows)
        for label in ("bundled", "calibrated", "refit"):
            printed = json.loads((work / "predictions" / f"{label}_{name}.json").read_text())
            assert e[f"predicted_{label}_s"] == printed["step_time_s"]
            assert e[f"step_time_{label}"] == pytest.approx(printed["step_time_s"] / e["measured_step_time_s"] - 1)
        # mosaic predict and calibrate --from-runs price a run alike on the calibrated cluster
        assert e["predicted_calibrated_s"] == pytest.approx(refit_rows[name]["predicted_before_s"], rel=1e-3)
        assert e["predicted_refit_s"] == pytest.approx(refit_rows[name]["predicted_after_s"], rel=1e-3)
        assert e["memory"] == pytest.approx(e["memory_predicted_bytes"] / run["peak_memory_bytes"] - 1)


def test_a_returned_calibration_is_reused_with_its_tables(dry_run, tmp_path):
    """--calibrated OUT/calibrated.yaml finds the tables in the archive beside it (or the folder
    mosaic calibrate wrote), so the kernel comparison of a rerun has its rows."""
    _, out = dry_run
    target = tmp_path / "work" / "calibrated.kernels"
    target.parent.mkdir()
    gpu_check._tables_given(out / "calibrated.yaml", target)
    with tarfile.open(out / "calibrated.kernels.tar.gz") as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert sorted(p.name for p in target.iterdir()) == sorted(names)
    again = tmp_path / "again" / "calibrated.kernels"
    again.parent.mkdir()
    gpu_check._tables_given(target.with_name("calibrated.yaml"), again)  # the folder beside it
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in target.iterdir()}
    gpu_check._tables_given(tmp_path / "none.yaml", tmp_path / "none.kernels")
    assert not (tmp_path / "none.kernels").exists()


def test_a_phase_over_its_time_is_stopped_with_its_process_group(tmp_path):
    marker = tmp_path / "child.pid"
    code = ("import os, subprocess, sys, time; "
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(marker)!r}, 'w').write(str(child.pid)); time.sleep(120)")
    outcome = gpu_check.run_command([sys.executable, "-c", code], 3.0, tmp_path / "log.txt", "cpu")
    assert outcome.status == "timeout" and "stopped after 3 s" in outcome.message
    child = int(marker.read_text())
    for _ in range(50):  # the grandchild went with the group (reaped, or a zombie at most)
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child} of the stopped group still runs")
    assert gpu_check.run_command(["true"], 0.0, tmp_path / "skipped.txt", "cpu").status == "skipped"


def test_a_run_stopped_mid_step_keeps_the_steps_it_logged(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [{"step": i + 1, "step_time_s": t, "tokens_per_s": 128 / t, "mfu": 0.01 * 0.1 / t,
             "tflops_per_device": 0.001 / t, "peak_memory_bytes": 100 + i, "loss": 5.0 - i} for i, t in
            enumerate([0.5, 0.1, 0.2, 0.3])]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "step_ti')
    figures = gpu_check._run_figures(folder, gpu_check.Outcome("timeout"))
    assert figures["status"] == "timeout" and figures["steps_run"] == 4
    assert figures["mean_step_time_s"] == pytest.approx(0.2)  # the first step is warm-up
    assert figures["tokens_per_s"] == pytest.approx(128 / 0.2)
    assert figures["mfu"] == pytest.approx(0.01 * 0.1 / 0.2)
    assert figures["peak_memory_bytes"] == 103


def test_no_time_left_skips_every_phase_and_still_packs(tmp_path):
    out = tmp_path / "out"
    done = _run("--dry-run", "--out", str(out), "--budget-s", "1", timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {p["status"] for p in summary["phases"].values()} == {"skipped"}
    assert "environment" in summary["incomplete_phases"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json"]


def _refused(capsys, *args: str) -> str:
    """main's exit code 2 and its one-line error (argparse's)."""
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--configs", "nope"], "--configs: unknown nope"),
    (["--dry-run", "--steps", "1"], "--steps: need at least 2"),
    (["--dry-run", "--calibrated", "missing.yaml"], "--calibrated: missing.yaml is not a file"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert message in _refused(capsys, *args, "--out", str(out))
    assert not out.exists()


def test_a_folder_with_files_is_refused(tmp_path, capsys):
    (tmp_path / "earlier.json").write_text("{}")
    assert "is not an empty folder" in _refused(capsys, "--dry-run", "--out", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json"]


def test_the_gpu_check_without_a_gpu_is_refused_before_any_work(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    err = _refused(capsys, "--out", str(tmp_path / "out"))
    assert "torch sees no CUDA device here" in err and "--dry-run" in err
    assert not (tmp_path / "out").exists()


def test_tables_print_the_summary_as_markdown_for_the_validation_page(dry_run, capsys):
    _, out = dry_run
    assert gpu_check.main(["--tables", str(out / "summary.json")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    tables = [block.splitlines() for block in capsys.readouterr().out.split("\n\n") if block.startswith("|")]
    assert len(tables) == 4  # kernels, trainer, errors, targets
    kernels = summary["kernels"]
    assert [row.split(" | ")[0][2:] for row in tables[0][2:]] == [*kernels["table"], *(f"host {f}" for f in kernels["host"])]
    for table in tables:  # every row has its header's columns (no stray '|' inside a cell)
        assert {row.count("|") for row in table} == {table[0].count("|")}, table
    for name, run in summary["runs"].items():
        expected = f"{run['mfu']:.1%}" if run.get("mean_step_time_s") else "refused: error: layout: precision=fp8"
        assert any(row.startswith(f"| {name} |") and expected in row for row in tables[1]), name
    assert [row.split(" | ")[0][2:] for row in tables[3][2:]] == [t["target"] for t in summary["targets"]]
    assert gpu_check.main(["--tables", str(out / "missing.json")]) == 2


def test_every_option_is_in_the_commands_page(capsys):
    import re

    with pytest.raises(SystemExit):
        gpu_check.main(["--help"])
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", capsys.readouterr().out)) - {"--help"}
    page = (REPO / "docs" / "commands.md").read_text()
    section = page.split("## The GPU check: `benchmarks/gpu_check.py`", 1)[1].split("\n## ", 1)[0]
    assert options and not sorted(o for o in options if o not in section)


def _gpu_check(tmp_path: Path) -> gpu_check.Check:
    check = gpu_check.Check(mode=gpu_check.GPU, out=tmp_path, steps=20, deadline=time.monotonic() + 400,
                            dry_run=False, configs=gpu_check.GPU_CONFIGS)
    check.started = time.monotonic()
    check.work.mkdir(parents=True)
    return check


def test_a_gpu_the_device_rule_refuses_is_calibrated_on_h200_and_the_refusal_kept(tmp_path, monkeypatch):
    """The device -> cluster rule refuses a GPU no bundled cluster matches, naming --cluster: the check
    calibrates again on the h200 file, keeps the refusal, and counts the calibration as done."""
    commands = []

    def fake(command, timeout_s, log, device):
        commands.append(command)
        if "--cluster" not in command:
            return gpu_check.Outcome("refused", 3.0, 2, "error: no bundled cluster for 'NVIDIA H200 NVL'; give --cluster")
        output = Path(command[command.index("-o") + 1])
        output.write_text("version: 1\n")
        tables = output.with_name(f"{output.stem}.kernels")
        tables.mkdir()
        (tables / "gemm.csv").write_text("accelerator\n")
        return gpu_check.Outcome("ok", 40.0, 0, "", json.dumps({"output": str(output)}))

    monkeypatch.setattr(gpu_check, "run_command", fake)
    check = _gpu_check(tmp_path)
    check.calibrate()
    assert [c[c.index("calibrate"):] for c in commands][1][-2:] == ["--cluster", "h200"]
    assert "--device" in commands[0] and commands[0][commands[0].index("--device") + 1] == "cuda"
    phases = check.summary["phases"]
    assert phases["calibrate"]["status"] == "refused" and phases["calibrate (--cluster h200)"]["status"] == "ok"
    assert (tmp_path / "calibrated.yaml").is_file()
    with tarfile.open(tmp_path / "calibrated.kernels.tar.gz") as tar:
        assert tar.getnames() == ["calibrated.kernels", "calibrated.kernels/gemm.csv"]
    assert check.incomplete() == []


def test_on_cuda_memory_is_compared_without_the_framework_term(tmp_path):
    """torch.cuda.max_memory_allocated counts tensors, not the CUDA context or allocator slack."""
    summary = {"device": "cuda", "runs": {"bf16_mbs2": {"mean_step_time_s": 1.0, "peak_memory_bytes": 80e9}},
               "predictions": {"bf16_mbs2": {"calibrated": {"step_time_s": 1.05, "memory_per_device_bytes": 88e9,
                                                            "memory_breakdown": {"framework": 3e9}}}}}
    row = gpu_check._errors(summary)["bf16_mbs2"]
    assert row["memory_predicted_bytes"] == 85e9 and row["memory"] == pytest.approx(85 / 80 - 1)
    assert row["step_time_calibrated"] == pytest.approx(0.05) and row["step_time_bundled"] is None
    target = {t["key"]: t for t in gpu_check._targets({**summary, "errors": {"bf16_mbs2": row}}, "bf16")}
    assert target["memory"]["met"] is False and target["step_time_after_calibrate"]["met"] is True
    assert target["mfu_bf16"]["met"] is None  # no bf16 run recorded its precision


def test_the_gpu_configurations_fit_one_h200_by_the_bundled_model(tmp_path):
    """The GPU check's layouts run on one device and the bundled h200 file predicts each feasible."""
    for config in gpu_check.GPU_CONFIGS:
        done = subprocess.run([sys.executable, "-m", "mosaic.cli.app", "predict", "--cluster", "h200", "--model",
                               str(gpu_check.GPU_MODEL), "--layout", config.layout, "--json"],
                              capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr
        printed = json.loads(done.stdout)
        assert printed["devices"] == 1 and printed["feasible"], (config.name, printed["reason"])
    model = gpu_check._model_figures(gpu_check.GPU_MODEL)
    assert 0.9e9 < model["active_params"] < 1.2e9  # "about 1B active"

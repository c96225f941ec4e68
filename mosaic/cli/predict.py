"""`mosaic predict`: step time, throughput, MFU and memory of one model + layout on a cluster.

The devices are the layout's world size (tp x cp x pp x dp) when dp is given,
otherwise `--devices N` (default: the cluster file's count, also the upper
bound). `--layout best` searches the layouts (`perfmodel.layouts`) and
prints the top five. An invalid layout exits 2 naming every violated rule; a
valid but infeasible one (memory, precision) prints its prediction and exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.table import Table

from mosaic.cli.common import cli_errors, console, err_console, print_json
from perfmodel.errors import InfeasibleError, InputError
from perfmodel.specs.strict import save_figure_atomic

if TYPE_CHECKING:
    from perfmodel.specs.cluster import ClusterSpec

FIX_HINTS = {
    "memory": "try recompute=full or selective, a smaller mbs, more tp/pp/ep, or dp_flavor=zero1/fsdp",
    "precision": "choose a precision the accelerator has a peak for (see `mosaic show-cluster`)",
    "devices": "use at most the cluster's device count or edit its 'devices' key",
}


def _within_cluster(spec: ClusterSpec, n: int, option: str) -> None:
    """The cluster's count bounds the job (`ClusterSpec.with_devices`); its error names `option`."""
    try:
        spec.with_devices(n)
    except InputError as exc:
        raise InputError(f"{option}: {exc}") from None


def _gb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e9:,.2f} GB"


def _seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:,.1f} ms" if value < 1 else f"{value:,.3f} s"


def plot_breakdown(rows: list[dict[str, Any]], labels: list[str], path: Path, title: str) -> None:
    """Stacked horizontal bars: the exposed components of each step, then the hidden communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from perfmodel.evaluate import HIDDEN_COMPONENTS, STEP_COMPONENTS

    keys = [k for k in STEP_COMPONENTS + HIDDEN_COMPONENTS if any((r["breakdown"].get(k) or 0) > 0 for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(rows)))
    cmap = plt.get_cmap("tab20")
    for y, row in enumerate(rows):
        left = 0.0
        for j, key in enumerate(keys):
            if key in HIDDEN_COMPONENTS:
                continue
            width = row["breakdown"].get(key) or 0.0
            ax.barh(y, width, left=left, height=0.5, color=cmap(j % 20), label=key if y == 0 else None)
            left += width
        hidden_left = 0.0
        for j, key in enumerate(keys):
            if key not in HIDDEN_COMPONENTS:
                continue
            width = row["breakdown"].get(key) or 0.0
            ax.barh(y + 0.4, width, left=hidden_left, height=0.2, color=cmap(j % 20), hatch="//", alpha=0.6,
                    label=f"{key} (under compute)" if y == 0 else None)
            hidden_left += width
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.15))
    save_figure_atomic(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _summary_table(row: dict[str, Any], usable_hbm: float, title: str, split: str = "") -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("feasible", "yes" if row["feasible"] else f"no ({row['reason']})")
    table.add_row("step time", _seconds(row["step_time_s"]))
    table.add_row("tokens/s", f"{row['tokens_per_s']:,.0f}")
    table.add_row("tokens/s per device", f"{row['tokens_per_s_per_device']:,.1f}")
    table.add_row("MFU (causal attention as run)", f"{row['mfu']:.1%}")
    if "mfu_palm" in row:
        table.add_row("MFU, PaLM/Megatron convention", f"{row['mfu_palm']:.1%}")
    table.add_row("model TFLOP/s per device", f"{row['tflops_per_device']:,.1f}")
    table.add_row("memory per device", f"{_gb(row['memory_per_device_bytes'])} of {_gb(usable_hbm)} usable")
    if "model_card_params" in row:
        total, active = row["model_card_params"]["total"], row["model_card_params"]["active"]
        table.add_row("parameters total / active (model-card count)", f"{total / 1e9:,.2f}B / {active / 1e9:,.2f}B")
    table.add_row("devices", str(row["devices"]))
    table.add_row("micro-batches per step (m)", f"{row['micro_batches']:g}")
    table.add_row("slowest pipeline stage", f"{row['bottleneck_stage']} (rank {row.get('bottleneck_rank', 0)})"
                  if row["bottleneck_stage"] == "middle" else row["bottleneck_stage"])
    if split:
        table.add_row("pipeline split (layers per virtual stage)", split)
    if row.get("dropped_fraction"):
        table.add_row("routed tokens dropped (capacity factor)", f"{row['dropped_fraction']:.2%}")
    return table


def _breakdown_table(row: dict[str, Any]) -> Table:
    from perfmodel.evaluate import HIDDEN_COMPONENTS, STEP_COMPONENTS

    step = row["step_time_s"] or 1.0
    table = Table(title="where the step goes (seconds per step)")
    table.add_column("component")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    for key in STEP_COMPONENTS:
        value = row["breakdown"][key] or 0.0
        if value > 0:
            table.add_row(key, _seconds(value), f"{value / step:.1%}")
    for key in HIDDEN_COMPONENTS:
        value = row["breakdown"][key] or 0.0
        if value > 0:
            table.add_row(f"[dim]{key} (under compute)[/dim]", f"[dim]{_seconds(value)}[/dim]", "")
    return table


def _memory_table(row: dict[str, Any]) -> Table:
    table = Table(title="memory per device (larger pipeline stage)")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    for key, value in row["memory_breakdown"].items():
        if value:
            table.add_row(key, _gb(value))
    return table


@cli_errors
def predict(
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Bundled cluster name or a cluster YAML path "
                                          "(with --plan: default the plan's cluster)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Model YAML (version: 1 + the MoEArchitecture keys)."),
    layout: Optional[str] = typer.Option(None, "--layout", help='e.g. "tp=2,ep=8,pp=4,mbs=1,gbs=1024", or "best" '
                                         "to search."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="A plan YAML: its model, resolved layout, devices "
                                             "and cluster instead of --model/--layout/--devices."),
    devices: Optional[int] = typer.Option(None, "--devices", help="Devices when the layout has no dp "
                                          "(default: the cluster's count, also the upper bound)."),
    gbs: Optional[int] = typer.Option(None, "--gbs", help="Global batch (sequences) for --layout best "
                                      "(default ~4M tokens, 1-8 sequences per device)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="Precision for --layout best (default bf16)."),
    top: int = typer.Option(5, "--top", help="Layouts to show with --layout best."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the breakdown as stacked bars to FILE.png."),
) -> None:
    """Predict step time, tokens/s, MFU and memory of a model and layout on a cluster."""
    from mosaic.planner.plan import layout_dict, model_dict
    from perfmodel.clusters import load_cluster
    from perfmodel.dispatch import dispatcher_problem
    from perfmodel.evaluate import evaluate
    from perfmodel.specs.architecture import MoEArchitecture
    from perfmodel.specs.layout import PRECISIONS, parse_layout
    from perfmodel.specs.stages import describe_split
    from perfmodel.specs.strict import load_spec
    from perfmodel.validity import violations

    if plan_file is not None:
        from mosaic.planfile import cluster_of, read_plan

        if model is not None or layout is not None or devices is not None:
            raise InputError("--plan gives the model, layout and devices: drop --model, --layout and --devices")
        plan_obj = read_plan(plan_file)
        if cluster is None:
            if plan_obj.cluster is None:
                raise InputError(f"--plan {plan_file}: the plan names no cluster; pass --cluster")
            cluster = plan_obj.cluster.source()
            drift = cluster_of(plan_obj)[1]
            if drift:
                err_console.print(f"warning: {drift}", markup=False)
        arch, model = plan_obj.model, plan_file
        layout, devices = plan_obj.layout.to_string(), plan_obj.devices
    if cluster is None or model is None or layout is None:
        raise InputError("give --cluster, --model and --layout (or --plan FILE)")
    spec = load_cluster(cluster)
    if plan_file is None:
        arch = load_spec(MoEArchitecture, model)
    if plot is not None and plot.suffix.lower() != ".png":
        raise InputError(f"--plot {plot}: give a .png file name")
    if devices is not None and devices < 1:
        raise InputError(f"--devices {devices}: must be >= 1")

    if layout.strip().lower() == "best":
        from perfmodel.layouts import best_layouts

        n = spec.devices if devices is None else devices
        _within_cluster(spec, n, "--devices")
        if precision is not None and precision not in PRECISIONS:
            raise InputError(f"--precision {precision!r} is unknown; use one of {', '.join(PRECISIONS)}")
        if top < 1:
            raise InputError(f"--top {top}: must be >= 1")
        grid, result, stats = best_layouts(arch, spec, n, gbs=gbs, precision=precision, top=top)
        if result is None or len(grid) == 0:
            reasons = ", ".join(f"{k}: {v}" for k, v in stats["reasons"].items()) or "no valid layout in the grid"
            raise InfeasibleError(f"no feasible layout for {model} on {spec.name} with {n} devices, "
                                  f"gbs={stats['gbs']} ({stats['candidates']} candidates; {reasons}); "
                                  "try more devices, another gbs or a smaller model")
        rows = [{"layout": layout_dict(grid.row(i)), "layout_string": grid.row(i).to_string(), **result.row(i)}
                for i in range(len(grid))]
        if plot is not None:
            plot_breakdown(rows, [f"#{i + 1} {grid.row(i).label()}" for i in range(len(rows))], plot,
                           f"{model.stem} on {spec.name} ({n} devices): top layouts")
        if json_output:
            print_json({"cluster": spec.name, "model": str(model), "search": stats, "top": rows, **rows[0]})
            return
        table = Table(title=f"best layouts for {model.stem} on {spec.name}: {n} devices, gbs={stats['gbs']}, "
                            f"{stats['precision']}\n({stats['feasible']:,} feasible of {stats['candidates']:,} "
                            "valid layouts, ranked by tokens/s)")
        for column in ("#", "layout", "step", "tokens/s", "MFU", "memory", "largest exposed cost"):
            table.add_column(column, overflow="fold")
        from perfmodel.evaluate import STEP_COMPONENTS

        for i, r in enumerate(rows):
            worst = max((k for k in STEP_COMPONENTS if k not in ("compute", "attention", "expert_gemm")),
                        key=lambda k: r["breakdown"][k] or 0.0)
            table.add_row(str(i + 1), grid.row(i).label(), _seconds(r["step_time_s"]), f"{r['tokens_per_s']:,.0f}",
                          f"{r['mfu']:.1%}", _gb(r["memory_per_device_bytes"]),
                          f"{worst} {_seconds(r['breakdown'][worst])}")
        console.print(table)
        console.print(_breakdown_table(rows[0]))
        if plot is not None:
            console.print(f"plot: {plot}")
        return

    lay = parse_layout(layout) if plan_file is None else plan_obj.layout
    if lay.dp is None:
        n = spec.devices if devices is None else devices
        lay = lay.resolve(n)
    else:
        lay = lay.resolve(lay.tp * lay.cp * lay.pp * lay.dp)
        n = lay.world()
        if devices is not None and devices != n:
            raise InputError(f"--devices {devices} disagrees with the layout's world size tp*cp*pp*dp={n}; "
                             "drop --devices or dp")
    _within_cluster(spec, n, "--devices" if devices is not None else "--layout")
    problems = violations(arch, lay, n)
    if problems:
        raise InputError("invalid layout: " + "; ".join(problems))
    problem = dispatcher_problem(spec, lay)
    if problem:
        raise InputError(problem)
    sizes = model_dict(arch)
    row = {**evaluate(arch, lay, spec, n).row(0), "model_card_params": {
        "total": sizes["n_total_params_with_embeddings"], "active": sizes["n_active_params_model_card"]}}
    split = describe_split(arch.n_layers, arch.n_mtp_layers, lay)
    payload = {"cluster": spec.name, "model": str(model), "layout": layout_dict(lay), "pipeline_split": split, **row}
    if plot is not None:
        plot_breakdown([row], [lay.label()], plot, f"{model.stem} on {spec.name} ({n} devices)")
    if json_output:
        print_json(payload)
    else:
        console.print(_summary_table(row, spec.accelerator.usable_hbm_bytes,
                                     f"{model.stem} on {spec.name}\n{lay.label()}", split))
        console.print(_breakdown_table(row))
        console.print(_memory_table(row))
        if plot is not None:
            console.print(f"plot: {plot}")
    if not row["feasible"]:
        err_console.print(f"infeasible ({row['reason']}): {FIX_HINTS.get(row['reason'], '')}", markup=False)
        raise typer.Exit(1)

"""`mosaic plan`: the model and the way to run it, for a cluster and a wall time."""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich.table import Table

from mosaic import frameworks
from mosaic.cli.common import cli_errors, console, err_console, print_json
from mosaic.frameworks import FRAMEWORKS
from mosaic.planner.space import geometry_label
from perfmodel.specs.architecture import ARCH_FIELDS, MoEArchitecture
from perfmodel.specs.layout import ParallelLayout


def _si(value: Optional[float], unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g}{prefix}{unit}"
    return f"{value:.{digits}g}{unit}"


def _arch(model: dict[str, Any]) -> MoEArchitecture:
    """The MoEArchitecture of a plan section's `model` mapping (derived sizes left out)."""
    return MoEArchitecture(**{name: model[name] for name in ARCH_FIELDS})


def _layout(layout: Optional[dict[str, Any]]) -> str:
    return "none fits" if layout is None else ParallelLayout(**layout).label()


def progress_bar(total: int, label: str, enabled: bool) -> Any:
    """A rich progress bar with candidates/s; returns (context, advance)."""
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} candidates/s" if speed else "", style="cyan")

    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                        Rate(), TimeElapsedColumn(), console=err_console, transient=True, disable=not enabled)
    task = progress.add_task(label, total=total)

    def advance(n: int) -> None:
        progress.update(task, advance=n)

    return progress, advance


def search_line(s: dict[str, Any]) -> str:
    """One line: what the search considered, pruned and evaluated, and how long it took."""
    space = s.get("space_layouts", s["layouts_per_geometry"])
    line = f"search: {s['solver']}, {s['geometries']:,} geometries x {space:,} layouts"
    if s.get("framework"):
        line += f" that {s['framework']} runs ({s['framework_excluded_layouts']:,} it cannot run left out)"
    if "candidates_in_space" in s:
        line += (f" = {s['candidates_in_space']:,} candidates; {s['timed']:,} timed, the rest pruned exactly "
                 f"(overlap rules and dominance {s['pruned_overlap_dominance']:,}, loss bound {s['pruned_loss_bound']:,} "
                 f"in {s['pruned_geometries']:,} geometries, layout-table bound "
                 f"{s.get('pruned_layout_table_bound', 0):,}, validity/memory/recompute/compute bound "
                 f"{s['pruned_after_building']:,})")
    if "status" in s:
        line += (f"; MINLP over {s.get('geometries_in_model', 0):,} geometries after presolve: status {s['status']}, "
                 f"gap {s.get('gap')}, solver {s.get('solver_seconds', 0):.2f} s")
        co = s.get("compute_optimal") or {}
        if co:
            line += f"; compute-optimal MINLP {co['status']}, gap {co.get('gap')}, {co.get('solver_seconds', 0):.2f} s"
    return line + f"; {s['seconds']:.1f} s"


def decision_line(dec: dict[str, Any]) -> str:
    """The decision under uncertainty in words: how many plans are indistinguishable, from which
    measured uncertainties, how likely the pick is best, and the rule."""
    err = dec["throughput_error"]
    if err.get("bias_measured"):
        bias = f"bias {err['bias_pct']:+.0f}% from {err['own_rows']} {err['kind']} runs on this cluster"
    elif err.get("borrowed_bias_range_pct"):
        lo, hi = err["borrowed_bias_range_pct"]
        bias = f"bias unmeasured here, drawn from the other accelerators' {lo:+.0f}% to {hi:+.0f}%"
    else:
        bias = "no bias rows"
    spread = f", spread {err['spread_pct']:.0f}% per layout" if err.get("spread_pct") is not None else ""
    n, k = dec["candidates"], dec["indistinguishable"]
    head = (f"at least {k} of the {n} best plans" if dec.get("capped") else f"{k} of the {n} best plans") + \
        " are indistinguishable from the nominal best"
    rank = dec["chosen_rank"]
    picked = ("the nominal best kept (--pick nominal)" if dec.get("pick") == "nominal" else
              ("the nominal best is also the robust pick" if rank == 0 else f"picked nominal #{rank + 1}"))
    return (f"decision: {head} (P(beats it) >= 5% over {dec['draws']} draws: {dec['fit_draws']} bootstrap fits x "
            f"throughput error, {bias}{spread}; {err['source']}); P(nominal best is best) "
            f"{100 * dec['p_nominal_best_is_best']:.0f}%, P(pick is best) {100 * dec['p_chosen_is_best']:.0f}%; "
            f"rule: {dec['rule']}: {picked}")


def render(data: dict[str, Any]) -> None:
    """The plan (its file's mapping, `Plan.to_dict()`) as tables readable at 80 columns."""
    co = data["compute_optimal"]
    on = co["predicted"]["on_cluster"]
    budget = data["budget"]
    span = f"{budget['hours']} h" if "hours" in budget else f"{budget['days']} days"
    title = f"{data['cluster']['name']}: {budget['devices']} devices x {span} (fit {data['fit']['name']})"
    table = Table(title=title, show_lines=False)
    table.add_column("")
    table.add_column("cluster-optimal\n(deliverable compute, memory enforced)", style="green")
    table.add_column("compute-optimal\n(fixed C_model at nominal MFU)", style="yellow")
    cm, om = {**data["model"], **data["derived"]}, co["model"]
    cp, op = data["predicted"], co["predicted"]
    rows = [
        ("geometry", geometry_label(_arch(cm)), geometry_label(_arch(om))),
        ("params total / active", f"{_si(cm['n_total_params'])} / {_si(cm['n_active_params'])}",
         f"{_si(om['n_total_params'])} / {_si(om['n_active_params'])}"),
        ("sparsity S", f"{cm['sparsity']:.3f}", f"{om['sparsity']:.3f}"),
        ("tokens D", _si(data["tokens"]), f"{_si(co['tokens'])} (needs {on.get('days_needed') or 0:.1f} days here)"
         if on["feasible"] else f"{_si(co['tokens'])}"),
        ("predicted loss", f"{cp['loss']:.4f}", f"{op['loss']:.4f} (classic); in this budget: "
         + (f"{on['loss_in_budget']:.4f}" if on.get("loss_in_budget") else "infeasible")),
        ("layout", _layout(data["layout"]), _layout(co["layout"])),
        ("MFU", f"{cp['mfu']:.3f}", f"{on['mfu']:.3f} (nominal {op['nominal_mfu']:.2f})" if on["feasible"]
         else f"infeasible ({on['reason']})"),
        ("step time / tokens/s", f"{cp['step_time_s']:.2f} s / {_si(cp['tokens_per_s'])}",
         f"{on['step_time_s']:.2f} s / {_si(on['tokens_per_s'])}" if on["feasible"] else "-"),
        ("memory / device", f"{cp['memory_per_device_bytes'] / 1e9:.1f} GB",
         f"{on['memory_per_device_bytes'] / 1e9:.1f} GB" if on["feasible"]
         else f">= {(on.get('min_memory_per_device_bytes') or 0) / 1e9:.1f} GB"),
        ("model FLOPs", f"{cp['model_flops']:.3g}", f"{op['model_flops']:.3g}"),
    ]
    dec = data.get("decision") or {}
    if dec.get("available"):
        mine = cp.get("decision") or {}
        lo, hi = mine.get("loss_interval_90") or (None, None)
        rows.append(("under uncertainty", f"{'robust pick' if dec.get('pick') == 'robust' else 'nominal best'}, "
                     f"nominal #{mine.get('rank', 0) + 1}; P(best) {100 * dec['p_chosen_is_best']:.0f}%; "
                     f"loss 90% {lo:.3f}-{hi:.3f}" if lo is not None else "-", "-"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    alts = data["alternatives"]
    if alts:
        with_dec = bool(dec.get("available"))
        t2 = Table(title="next best (cluster-optimal)" + ("; ≈: indistinguishable from the nominal best" if with_dec else ""))
        cols = [("#", "right"), ("geometry / layout", "left"), ("S", "right"), ("total / active", "right"),
                ("tokens", "right"), ("loss", "right"), ("MFU", "right")]
        if with_dec:  # P(best) and the mark take the sparsity's place (S is in the geometry: E and k)
            cols = [c for c in cols if c[0] != "S"] + [("P best", "right")]
        for col, justify in cols:
            t2.add_column(col, justify=justify, no_wrap=col in ("#", "S", "tokens", "loss", "MFU", "P best"))
        for i, a in enumerate(alts, 1):
            m, p = a["model"], a["predicted"]
            d = p.get("decision") or {}
            cells = [str(d["rank"] + 1) if "rank" in d else str(i),
                     f"{geometry_label(_arch(m))}\n[dim]{_layout(a['layout'])}[/dim]",
                     *([] if with_dec else [f"{m['sparsity']:.3f}"]),
                     f"{_si(m['n_total_params'])} / {_si(m['n_active_params'])}", _si(a["tokens"]), f"{p['loss']:.4f}",
                     f"{p['mfu']:.3f}"]
            if with_dec:
                cells.append((f"{100 * d['p_best']:.0f}%" if "p_best" in d else "-")
                             + (" ≈" if d.get("indistinguishable") else ""))
            t2.add_row(*cells)
        console.print(t2)
    if dec.get("available"):
        console.print(decision_line(dec), highlight=False)
    elif dec.get("note"):
        console.print(f"decision under uncertainty: {dec['note']}", highlight=False)
    b = data["binding"]
    console.print(f"binding constraint: [bold]{b['constraint']}[/bold]: {b['detail']}; "
                  f"memory headroom of the plan {100 * b['memory_headroom']:.0f}%", highlight=False)
    console.print(search_line(data["search"]), highlight=False)
    analysis = data.get("analysis") or {}
    if "sensitivity" in analysis:
        t3 = Table(title="sensitivity (cluster-optimal)")
        for col in ("change", "geometry", "loss", "MFU", "same geometry"):
            t3.add_column(col, no_wrap=col in ("change", "loss", "MFU"))
        for r in analysis["sensitivity"]:
            t3.add_row(r["change"], r["geometry"], f"{r['loss']:.4f}" if r["loss"] else "infeasible",
                       f"{r['mfu']:.3f}" if r["mfu"] else "-", "yes" if r["same_geometry"] else "no")
        console.print(t3)
    if "bootstrap" in analysis:
        bs = analysis["bootstrap"]
        if bs.get("p_beats_runner_up") is not None:
            console.print(f"bootstrap ({bs['samples']} fits): P(plan beats runner-up) = {bs['p_beats_runner_up']:.2f}")
        else:
            console.print(f"bootstrap: {bs['note']}")


@cli_errors
def plan(
    cluster: str = typer.Option(..., "--cluster", help="Bundled cluster name or cluster YAML path."),
    devices: Optional[int] = typer.Option(None, "--devices", help="Devices of the job (default: the cluster file's)."),
    days: Optional[float] = typer.Option(None, "--days", help="Wall time in days (default 20)."),
    hours: Optional[float] = typer.Option(None, "--hours", help="Wall time in hours (instead of --days)."),
    fit: Optional[str] = typer.Option(None, "--fit", help="Scaling-law fit YAML (default: the bundled fit)."),
    space: Optional[str] = typer.Option(None, "--space", help="Search-space YAML (default: the bundled space)."),
    solver: str = typer.Option("enumerate", "--solver", help="enumerate | scip | bonmin | mindtpy."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the plan YAML here."),
    json_output: bool = typer.Option(False, "--json", help="Print the plan (the -o file's content) as JSON."),
    top: int = typer.Option(10, "--top", help="Alternatives to list."),
    time_limit: float = typer.Option(300.0, "--time-limit", help="Seconds the MINLP solver may take (scip, bonmin, mindtpy)."),
    pick: str = typer.Option("robust", "--pick", help="robust: the robust pick among the indistinguishable plans; "
                             "nominal: the lowest predicted loss."),
    workers: int = typer.Option(0, "--workers", min=0, help="Processes for the enumeration (0 = auto: every core for a "
                                "space of over 2e7 pairs, else 1)."),
    sensitivity: bool = typer.Option(False, "--sensitivity", help="Move budget, bandwidth and HBM by +-20%; bootstrap."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide the progress bar."),
    framework: Optional[str] = typer.Option(None, "--framework", help="megatron | mindspeed | torchtitan: search "
                                            "only the layouts that framework runs (default: every layout the "
                                            "model prices; the plan then says which exports refuse it)."),
) -> None:
    """Plan a sparse MoE training run: the cluster-optimal and the compute-optimal answer side by side."""
    from mosaic.planfile import write_plan
    from mosaic.planner.enumerate import auto_workers
    from mosaic.planner.plan import solve
    from mosaic.planner.problem import build_problem

    if top < 0:
        raise typer.BadParameter("--top must be >= 0")
    if not time_limit > 0:
        raise typer.BadParameter("--time-limit must be > 0 seconds")
    if framework is not None:
        frameworks.rules(framework)  # an unknown name fails before the space is built
    problem = build_problem(cluster, devices=devices, days=days, hours=hours, fit=fit, space=space, framework=framework)
    total = len(problem.geoms) * len(problem.evaluator.grid)
    bar, advance = progress_bar(total, "planning", enabled=not json_output and not no_progress)
    with bar:
        result = solve(problem, solver=solver, top=top, progress=advance, workers=auto_workers(problem, workers),
                       time_limit_s=time_limit, pick=pick)
    if sensitivity:
        from mosaic.planner.sensitivity import bootstrap_comparison, sensitivity_table

        result.extra["sensitivity"] = sensitivity_table(result)
        result.extra["bootstrap"] = bootstrap_comparison(result)
    plan_file = result.to_plan()
    if output:
        write_plan(output, plan_file)
    data = plan_file.to_dict()
    if json_output:
        print_json(data)  # the plan file's own mapping
        return
    render(data)
    refused = {name: frameworks.refusals(name, plan_file.layout) for name in FRAMEWORKS}
    if any(refused.values()):  # each message starts "key 'layout.FIELD'"
        console.print("exports: " + ", ".join(f"{name} refuses {why[0].split(chr(39))[1]}" if why else f"{name} runs it"
                                             for name, why in refused.items())
                      + " (`mosaic export` says why); `--framework NAME` searches only the layouts NAME runs")
    if output:
        console.print(f"plan written to {output}")

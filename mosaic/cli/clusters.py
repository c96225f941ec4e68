"""`mosaic clusters` and `mosaic show-cluster`: the cluster library."""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from mosaic.cli.common import cli_errors, console, print_json
from perfmodel.clusters import bundled_cluster_paths, load_cluster
from perfmodel.specs.strict import spec_to_dict


def _escape(text: object) -> str:
    """Source text for a rich cell: citation keys like [verl] are not markup."""
    return escape(str(text))


def _flops(value: float) -> str:
    """FLOP/s with a unit that keeps three significant digits (CPU cores are GFLOP/s)."""
    unit, scale = ("TFLOP/s", 1e12) if value >= 1e12 else ("GFLOP/s", 1e9)
    return f"{value / scale:,.4g} {unit}"


def _tflops(value: float) -> str:
    """TFLOP/s as a plain number: 2,250 or 989, two digits below 1 (a CPU core: 0.22)."""
    tflops = value / 1e12
    return f"{tflops:,.0f}" if tflops >= 1 else f"{tflops:.2g}"


def _bytes_per_s(value: float) -> str:
    return f"{value / 1e12:.3g} TB/s" if value >= 1e12 else f"{value / 1e9:.3g} GB/s"


def _peaks(peaks: dict[str, float]) -> str:
    """All dense peaks on one cell, one precision per line."""
    return "\n".join(f"{precision} {_flops(value)}" for precision, value in peaks.items())


@cli_errors
def clusters(json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the bundled cluster library with its key figures (sources: `mosaic show-cluster NAME`)."""
    rows = []
    for name in bundled_cluster_paths():
        spec = load_cluster(name)
        acc = spec.accelerator
        rows.append({
            "name": name,
            "accelerator": acc.name,
            "devices": spec.devices,
            "peak_flops_per_s": dict(acc.peak_flops_per_s),
            "hbm_gb": acc.hbm_bytes / 1e9,
            "levels": [f"{lvl.name}:{lvl.devices}@{lvl.bandwidth_bytes_per_s / 1e9:g}GB/s" for lvl in spec.levels],
            "peak_source": acc.sources["peak_flops_per_s"],
        })
    if json_output:
        print_json(rows)
        return
    table = Table(title="MOSAIC cluster library", box=box.SIMPLE_HEAD, row_styles=["", "dim"], pad_edge=False)
    for column, justify in (("name", "left"), ("accelerator", "left"), ("devices", "right"),
                            ("bf16\nTFLOP/s", "right"), ("HBM\nGB", "right"), ("fabric levels", "left")):
        table.add_column(column, justify=justify, no_wrap=column in ("name", "devices", "fabric levels"),
                         min_width=len("accelerator") if column == "accelerator" else None)
    for row in rows:
        peak = row["peak_flops_per_s"].get("bf16")
        table.add_row(row["name"], _escape(row["accelerator"]), str(row["devices"]),
                      "-" if peak is None else _tflops(peak), f"{row['hbm_gb']:.3g}",
                      "\n".join(f"{lvl.name} {lvl.devices}" for lvl in load_cluster(row["name"]).levels))
    console.print(table)
    console.print("every figure with its source: mosaic show-cluster NAME", highlight=False)


def _provenance(rows: int, error: Optional[float], derived: str) -> str:
    """'12 rows, median error 4%' for a measured figure; 'DERIVED: rule' for a carried-over one."""
    if derived and not rows:
        return f"DERIVED: {derived}"
    text = f"{rows} measured rows, median error {100 * (error or 0):.0f}%"
    return f"{text} ({derived})" if derived else text


def _kernel_table(kernels: Any) -> Table:
    """Every fitted kernel figure with its provenance (measured rows or the derivation rule)."""
    table = Table(title="kernels (fitted to perfmodel/data/kernels/*.csv)", show_lines=True)
    table.add_column("kernel", no_wrap=True)
    table.add_column("figures [dim](provenance)[/dim]")
    rows = []
    for precision, g in kernels.gemm.items():
        rows.append((f"GEMM {precision}", f"e_max {g.e_max:.2f}; halves m {g.m_half:.4g} n {g.n_half:.4g} k {g.k_half:.4g}",
                     _provenance(g.rows, g.median_abs_error, g.derived)))
    for precision, grouped in kernels.grouped_gemm.items():
        for phase in ("fwd", "dgrad", "wgrad"):
            g = grouped.phase(phase)
            rows.append((f"grouped {precision} {phase}", f"e_max {g.e_max:.2f}", _provenance(g.rows, g.median_abs_error, g.derived)))
    for precision, a in kernels.attention.items():
        rows.append((f"attention {precision}", f"e_max fwd {a.fwd_e_max:.2f} bwd {a.bwd_e_max:.2f}; causal seq half "
                     f"{a.seq_half_causal:.4g}; head-dim half {a.head_dim_half:.3g}",
                     _provenance(a.rows, a.median_abs_error, a.derived)))
    m = kernels.memory
    for cls, fraction in m.fraction.items():
        derived = m.derived.get(cls, "")
        rows.append((f"memory {cls}", f"{fraction:.0%} of HBM bw; bytes half {m.bytes_half:.3g}",
                     f"DERIVED: {derived}" if derived else f"measured ({m.rows} rows over the classes, median error "
                                                           f"{100 * (m.median_abs_error or 0):.0f}%)"))
    for kernel, value, provenance in rows:
        table.add_row(kernel, f"{value}\n[dim]{_escape(provenance)}[/dim]")
    return table


@cli_errors
def show_cluster(
    name: str = typer.Argument(..., help="Bundled cluster name or a cluster YAML path."),
    json_output: bool = typer.Option(False, "--json", help="Print the resolved spec as JSON."),
) -> None:
    """Show every figure of one cluster with its source."""
    spec = load_cluster(name)
    if json_output:
        print_json(spec_to_dict(spec))
        return
    acc = spec.accelerator
    console.print(f"[bold]{_escape(spec.name)}[/bold]: {_escape(spec.description)}")
    cores = f", sized from this host: {spec.host_cores} cores shared by the ranks" if spec.size_from_host else ""
    console.print(f"devices: {spec.devices} (default job size and upper bound{cores})   "
                  f"content hash: {spec.content_hash()}")
    table = Table(title=f"accelerator: {_escape(acc.name)}", show_lines=True)
    table.add_column("figure", no_wrap=True)
    table.add_column("value [dim](source)[/dim]")
    rows = [
        ("peak (dense)", _peaks(acc.peak_flops_per_s), acc.sources["peak_flops_per_s"]),
        ("HBM", f"{acc.hbm_bytes / 1e9:.3g} GB (usable {acc.usable_hbm_bytes / 1e9:.3g})", acc.sources["hbm_bytes"]),
        ("HBM bandwidth", _bytes_per_s(acc.hbm_bandwidth_bytes_per_s), acc.sources["hbm_bandwidth_bytes_per_s"]),
        ("launch latency", f"{acc.launch_latency_s * 1e6:.1f} us", acc.sources["launch_latency_s"]),
    ]
    for figure, value, source in rows:
        table.add_row(figure, f"{value}\n[dim]{_escape(source)}[/dim]")
    console.print(table)
    console.print(_kernel_table(acc.kernels))
    fabric = Table(title="fabric levels (innermost first)", show_lines=True)
    for column, justify in (("level", "left"), ("devices", "right"), ("GB/s per\ndevice (uni)", "right"),
                            ("latency\nus", "right"), ("collective\nefficiency", "left")):
        fabric.add_column(column, justify=justify, no_wrap=True)
    for lvl in spec.levels:
        eff = "\n".join([f"default {lvl.efficiency:.2f}"] + [f"{k} {v:.2f}" for k, v in lvl.collective_efficiency.items()])
        fabric.add_row(_escape(lvl.name), str(lvl.devices), f"{lvl.bandwidth_bytes_per_s / 1e9:g}",
                       f"{lvl.latency_s * 1e6:.1f}", eff)
    console.print(fabric)
    sources = Table(title="fabric sources", show_lines=True)
    sources.add_column("level", no_wrap=True)
    sources.add_column("source")
    for lvl in spec.levels:
        fit = lvl.collective_fit
        text = lvl.source if fit is None else (f"{lvl.source}\nlatency and efficiencies: "
                                               f"{_provenance(fit.rows, fit.median_abs_error, fit.derived)}; {fit.source}")
        sources.add_row(_escape(lvl.name), _escape(text))
    console.print(sources)
    gp = spec.goodput
    goodput = f"eta {gp.eta}" if gp.eta is not None else f"node MTBF {gp.node_mtbf_hours:g} h, checkpoint {gp.checkpoint_s:g} s, restart {gp.restart_s:g} s"
    console.print(f"goodput: {goodput} — {_escape(gp.source)}")
    ov = spec.overlap
    console.print(f"overlap (hideable fraction): tp {ov.tp}, ep {ov.ep}, dp {ov.dp}, pp {ov.pp} — {_escape(ov.source)}")
    console.print(f"straggler cv: {spec.straggler.cv} — {_escape(spec.straggler.source)}")
    console.print(f"framework overhead: {spec.framework_overhead_bytes / 1e9:.1f} GB — {_escape(spec.framework_overhead_source)}")
    if spec.calibration:
        console.print(f"calibration: {_escape(spec.calibration.get('provenance', spec.calibration))}")

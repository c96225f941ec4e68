"""`mosaic clusters` and `mosaic show-cluster`: the cluster library."""

from __future__ import annotations

import typer
from rich.table import Table

from mosaic.cli.common import cli_errors, console, print_json
from perfmodel.clusters import bundled_cluster_paths, load_cluster
from perfmodel.specs.strict import spec_to_dict


def _tflops(value: float) -> str:
    return f"{value / 1e12:,.0f}"


@cli_errors
def clusters(json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the bundled cluster library with its key figures and sources."""
    rows = []
    for name in bundled_cluster_paths():
        spec = load_cluster(name)
        acc = spec.accelerator
        rows.append({
            "name": name,
            "accelerator": acc.name,
            "devices": spec.devices,
            "bf16_tflops": acc.peak("bf16") / 1e12 if "bf16" in acc.peak_flops_per_s else None,
            "hbm_gb": acc.hbm_bytes / 1e9,
            "levels": [f"{lvl.name}:{lvl.devices}@{lvl.bandwidth_bytes_per_s / 1e9:g}GB/s" for lvl in spec.levels],
            "peak_source": acc.sources["peak_flops_per_s"],
        })
    if json_output:
        print_json(rows)
        return
    table = Table(title="MOSAIC cluster library", show_lines=True)
    for column in ("name", "accelerator", "devices", "BF16 TFLOP/s", "HBM GB", "fabric levels", "source (peak)"):
        table.add_column(column, overflow="fold")
    for row in rows:
        bf16 = f"{row['bf16_tflops']:,.0f}" if row["bf16_tflops"] else "-"
        table.add_row(row["name"], row["accelerator"], str(row["devices"]), bf16, f"{row['hbm_gb']:.0f}",
                      "\n".join(row["levels"]), row["peak_source"])
    console.print(table)


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
    console.print(f"[bold]{spec.name}[/bold]: {spec.description}")
    console.print(f"devices: {spec.devices} (default job size and upper bound)   content hash: {spec.content_hash()}")
    table = Table(title=f"accelerator: {acc.name}", show_lines=True)
    table.add_column("figure")
    table.add_column("value")
    table.add_column("source", overflow="fold")
    for precision, peak in acc.peak_flops_per_s.items():
        table.add_row(f"peak {precision}", f"{_tflops(peak)} TFLOP/s", acc.sources["peak_flops_per_s"])
    table.add_row("HBM", f"{acc.hbm_bytes / 1e9:.0f} GB (usable {acc.usable_hbm_bytes / 1e9:.0f})", acc.sources["hbm_bytes"])
    table.add_row("HBM bandwidth", f"{acc.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s", acc.sources["hbm_bandwidth_bytes_per_s"])
    table.add_row("launch latency", f"{acc.launch_latency_s * 1e6:.1f} us", acc.sources["launch_latency_s"])
    for precision, curve in acc.compute_efficiency.items():
        table.add_row(f"GEMM efficiency {precision}", f"max {curve.max_value:.1%}", curve.source)
    table.add_row("memory efficiency", f"max {acc.memory_efficiency.max_value:.0%}", acc.memory_efficiency.source)
    console.print(table)
    fabric = Table(title="fabric levels (innermost first)", show_lines=True)
    for column in ("level", "devices", "GB/s per device (uni)", "latency us", "efficiency", "source"):
        fabric.add_column(column, overflow="fold")
    for lvl in spec.levels:
        eff = ", ".join(f"{k} {v:.2f}" for k, v in lvl.collective_efficiency.items()) or f"{lvl.efficiency:.2f}"
        fabric.add_row(lvl.name, str(lvl.devices), f"{lvl.bandwidth_bytes_per_s / 1e9:g}", f"{lvl.latency_s * 1e6:.1f}",
                       eff, lvl.source)
    console.print(fabric)
    gp = spec.goodput
    goodput = f"eta {gp.eta}" if gp.eta is not None else f"node MTBF {gp.node_mtbf_hours:g} h, checkpoint {gp.checkpoint_s:g} s, restart {gp.restart_s:g} s"
    console.print(f"goodput: {goodput} — {gp.source}")
    ov = spec.overlap
    console.print(f"overlap (hideable fraction): tp {ov.tp}, ep {ov.ep}, dp {ov.dp}, pp {ov.pp} — {ov.source}")
    console.print(f"straggler cv: {spec.straggler.cv} — {spec.straggler.source}")
    console.print(f"framework overhead: {spec.framework_overhead_bytes / 1e9:.1f} GB — {spec.framework_overhead_source}")
    if spec.calibration:
        console.print(f"calibration: {spec.calibration.get('provenance', spec.calibration)}")

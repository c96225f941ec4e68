"""Fused expert-parallel dispatch (DeepEP / HybridEP-style): figures from measurements, and prices.

Figures (`derive_figures`, the rule behind every cluster file's `ep_dispatch:` section, which
`python -m perfmodel.kernels.build` writes from `cluster_figures`; the measurements are
`perfmodel/data/kernels/ep_dispatch.csv`, one row per published point):

1. Library: `hybridep` from HybridEP rows; `deepep` from DeepEP rows, else from a DeepEP-API
   implementation measured on the part (DeepEP-Ascend on Ascend, UCCL-EP elsewhere).
2. Rows: normal-mode (training) kernels of that accelerator, dispatch and combine, not marked
   superseded; grouped by span class (node, scale_up, scale_out), each class mapped to the
   cluster's fabric levels (`CLUSTER_SPANS`).
3. SM setting: the rows at the measured SM count nearest the library's default (DeepEP
   `Buffer.num_sms = 20`, deep_ep/buffer.py; HybridEP 24 SMs in a node and 8 across nodes,
   csrc/hybrid_ep/config.cuh @94a9f8f), ties to the larger; rows that state no SM count are
   kept when none does. sm_fraction = that SM count / the part's SMs (`COMPUTE_UNITS`; 0 when
   the rows state no SM count).
4. Bandwidth: the median of the bf16 rows (combine, bf16 dispatch; all rows when there is no
   bf16 row). Where the source gives each point both as "Torch API" time (what a framework
   sees) and "Kernel Only", the bandwidth is the kernel-only median and latency_s is the
   median of B (1/bw_api - 1/bw_kernel) over those pairs, B being the row's bytes in the
   source's convention (below) at its stated configuration; otherwise latency_s = 0 and the
   published rate is used as it is (it already holds the fixed cost at the measured size).
5. Byte convention (DeepEP/HybridEP tests; `traffic` of the figures): inside a scale-up domain,
   the token rows a rank RECEIVES (each token once per destination rank holding one of its
   experts) x hidden x element bytes; across the scale-out network, the rows a rank SENDS TO
   OTHER NODES (once per destination node).

Prices (`FusedDispatchPricer`): per MoE layer and micro-batch a rank dispatches and combines
forward, and the backward moves the gradients the other way (4 calls). A call's time is
latency_s + bytes / bandwidth at the outermost fabric level the EP group spans; bytes follow
the figures' convention with the uniform-routing model of `perfmodel.routing`:
received = ep T_moe p_rank(E, k, ep) f h b, off-node = T_moe (nodes - 1) p_node(E, k, nodes) f h b,
with f the busiest-rank factor, b the element bytes (the forward dispatch under fp8/mxfp8:
1 + 4/128, fp8 with one fp32 scale per 128 elements as the kernels send it; else the
activation bytes). A layout whose EP group spans a level without figures cannot be priced
(`available` is False there).
"""

from __future__ import annotations

import csv
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import numpy as np

from perfmodel.comm import group_levels
from perfmodel.routing import ranks_hit_probability
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.dispatch import FUSED_DISPATCHERS, EpDispatcherFigures
from perfmodel.specs.protocols import LayoutLike, Values

LIBRARIES = {"deepep": ("deepep", "deepep_ascend", "uccl_ep"), "hybridep": ("hybridep",)}
"""Measured libraries each dispatcher is priced from, in order of preference (rule 1)."""
DEFAULT_SMS = {"deepep": {"node": 20, "scale_up": 20, "scale_out": 20},
               "hybridep": {"node": 24, "scale_up": 24, "scale_out": 8}}
"""Default SM counts of the libraries by span (rule 3)."""
COMPUTE_UNITS = {
    "h100": (132, "H100 SXM5: 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper)"),
    "h800": (132, "H800: the H100 SXM5 configuration, 132 SMs (NVIDIA H100 whitepaper)"),
    "h200": (132, "H200: GH100 with 132 SMs, as H100 SXM5"),
    "b200": (148, "B200: 2 dies x 74 enabled SMs = 148 (Chips and Cheese, 'Nvidia's B200: Keeping the CUDA "
                  "Juggernaut Rolling', 2025)"),
    "gb200": (148, "GB200: Grace + B200 GPUs, 148 SMs each (as B200)"),
    "mi300x": (304, "MI300X: 304 compute units (AMD CDNA 3 white paper)"),
}
"""Compute units (SMs, CUs) of each part: the denominator of sm_fraction (rule 3)."""
BENCHMARK_LOCAL_EXPERTS = {"docs/README_Hybrid-EP.md": 8}
"""Local experts per rank of a source's benchmark configuration, where its rows' notes do not
repeat it (DeepEP hybrid-ep branch, docs/README_Hybrid-EP.md: "Local Experts: 8" in its H100,
B200 and GB200 test configurations)."""
FP8_DISPATCH_BYTES = 1.0 + 4.0 / 128.0
"""Bytes per element of an fp8 dispatch: fp8 data + one fp32 scale per 128 elements (the
`fp8_factor` of DeepEP's hybrid-ep test, tests/test_hybrid_ep.py)."""


@dataclass(frozen=True)
class ClusterSpan:
    """How a bundled cluster's fabric levels map onto the measurements' span classes."""

    accelerator: str
    """The `accelerator` key of the measurements."""
    levels: Mapping[str, str]
    """Fabric level name -> span class (node, scale_up, scale_out)."""
    carried_from: Optional[str] = None
    """Accelerator whose measurements stand in (same fabric level), for a part without its own."""
    carried_levels: tuple[str, ...] = ()
    """The levels the carried measurements cover (the fabric they share)."""
    carried_reason: str = ""


CLUSTER_SPANS: dict[str, ClusterSpan] = {
    "h100": ClusterSpan("h100", {"node": "node", "scale_out": "scale_out"}),
    "h200": ClusterSpan("h200", {"node": "node", "scale_out": "scale_out"}),
    "h800": ClusterSpan("h800", {"node": "node", "scale_out": "scale_out"}),
    "b200": ClusterSpan("b200", {"node": "node", "scale_out": "scale_out"}),
    "b300": ClusterSpan("b300", {"node": "node"}, carried_from="b200", carried_levels=("node",),
                        carried_reason="no published B300 measurement; the B200 node figures stand in: the "
                                       "same NVLink 5 NVSwitch node (900 GB/s per direction per GPU)"),
    "gb200_nvl72": ClusterSpan("gb200", {"tray": "scale_up", "nvl72": "scale_up"}),
    "gb300_nvl72": ClusterSpan("gb300", {"tray": "scale_up", "nvl72": "scale_up"}, carried_from="gb200",
                               carried_levels=("tray", "nvl72"),
                               carried_reason="no published GB300 measurement; the GB200 NVL72 figures stand in: the "
                                              "same NVLink 5 NVL72 switch fabric (900 GB/s per direction per GPU)"),
    "mi300x": ClusterSpan("mi300x", {"node": "node", "scale_out": "scale_out"}),
    "ascend_superpod": ClusterSpan("ascend_910c", {"node": "node", "supernode": "scale_up"}),
}
"""The bundled clusters that get an `ep_dispatch:` section; the others (a100_80gb, ascend_910b,
cpu_local) have no published fused-dispatch measurement."""


def measurements_path() -> Path:
    return Path(str(resources.files("perfmodel") / "data" / "kernels" / "ep_dispatch.csv"))


def load_measurements(path: Optional[Path] = None) -> list[dict[str, str]]:
    with open(path or measurements_path(), newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _sms(row: Mapping[str, str]) -> Optional[int]:
    match = re.search(r"(\d+)\s*SMs", row.get("software", ""))
    return int(match.group(1)) if match else None


def _measurement(row: Mapping[str, str]) -> str:
    text = row.get("software", "").lower()
    if "kernel only" in text or "only kernel" in text:
        return "kernel"
    if "torch api" in text:
        return "api"
    return ""


def _benchmark_bytes(row: Mapping[str, str], span: str) -> Optional[float]:
    """Bytes of one call in the source's convention at the row's configuration (rule 5): tokens
    per rank, hidden, top-k, the experts from '<n> local experts' in the note (or the source's
    configuration, BENCHMARK_LOCAL_EXPERTS), bf16."""
    match = re.search(r"(\d+) local experts", row.get("note", ""))
    local = int(match.group(1)) if match else next(
        (n for key, n in BENCHMARK_LOCAL_EXPERTS.items() if key in row.get("source", "")), None)
    if local is None or not row.get("tokens"):
        return None
    ep, tokens, hidden, k = int(float(row["ep"])), float(row["tokens"]), float(row["hidden"]), float(row["topk"])
    experts = local * ep
    if span == "scale_out":
        nodes = float(row["nodes"])
        rows = tokens * (nodes - 1.0) * float(ranks_hit_probability(experts, k, nodes))
    else:
        rows = ep * tokens * float(ranks_hit_probability(experts, k, ep))
    return rows * hidden * 2.0


def derive_figures(rows: Sequence[Mapping[str, str]], accelerator: str, dispatcher: str, span: str,
                   compute_units: Optional[int] = None) -> Optional[EpDispatcherFigures]:
    """The figures of one dispatcher on one span class of one part by the module's rule (None
    when no row qualifies)."""
    chosen: list[Mapping[str, str]] = []
    library = ""
    for library in LIBRARIES[dispatcher]:
        chosen = [r for r in rows if r["accelerator"] == accelerator and r["library"] == library
                  and r["mode"] == "normal" and r["op"] in ("dispatch", "combine")
                  and "superseded" not in r.get("note", "").lower() and r.get("bandwidth_gbps")]
        if chosen:
            break
    chosen = [r for r in chosen if r["span"] == span]
    if not chosen:
        return None
    stated = [s for s in (_sms(r) for r in chosen) if s is not None]
    sms: Optional[int] = None
    if stated:
        target = DEFAULT_SMS[dispatcher][span]
        sms = min(set(stated), key=lambda s: (abs(s - target), -s))
        chosen = [r for r in chosen if _sms(r) == sms]
    bf16 = [r for r in chosen if r["precision"] == "bf16"] or chosen
    kernel = [r for r in bf16 if _measurement(r) == "kernel"]
    api = [r for r in bf16 if _measurement(r) == "api"]
    latency = 0.0
    if kernel and api:
        bandwidth = statistics.median(float(r["bandwidth_gbps"]) for r in kernel) * 1e9
        gaps = []
        for a in api:
            for kr in kernel:
                if (kr["ep"], kr["op"], kr["precision"], kr["source"]) == (a["ep"], a["op"], a["precision"], a["source"]):
                    nbytes = _benchmark_bytes(a, span)
                    if nbytes is not None:
                        gaps.append(nbytes * (1.0 / (float(a["bandwidth_gbps"]) * 1e9)
                                              - 1.0 / (float(kr["bandwidth_gbps"]) * 1e9)))
        latency = max(statistics.median(gaps), 0.0) if gaps else 0.0
        how = (f"kernel-only median of {len(kernel)} bf16 rows; latency = median gap to the Torch-API time over "
               f"{len(gaps)} pairs")
    else:
        pick = api or bf16
        bandwidth = statistics.median(float(r["bandwidth_gbps"]) for r in pick) * 1e9
        how = f"median of {len(pick)} bf16 rows (published rate, latency 0)" if pick[0]["precision"] == "bf16" else \
            f"median of {len(pick)} rows (no bf16 row; published rate, latency 0)"
    sm_fraction = sms / compute_units if (sms is not None and compute_units) else 0.0
    sources = sorted({r["source"].split(",")[0].split(" (")[0] for r in chosen})
    eps = sorted({int(float(r["ep"])) for r in chosen})
    text = (f"{library} {span} rows of ep_dispatch.csv (EP {', '.join(map(str, eps))}"
            + (f", {sms} SMs" if sms is not None else "") + f"): {how}; " + "; ".join(sources)
            + (f"; sm_fraction = {sms} / {compute_units} SMs" if sms is not None and compute_units else
               "; sm_fraction 0: the rows state no SM count"))
    return EpDispatcherFigures(bandwidth_bytes_per_s=round(bandwidth, -6), latency_s=float(f"{latency:.3g}"),
                               sm_fraction=round(sm_fraction, 4), source=text,
                               traffic="off_node" if span == "scale_out" else "received")


def cluster_figures(cluster_name: str, rows: Optional[Sequence[Mapping[str, str]]] = None
                    ) -> dict[str, dict[str, EpDispatcherFigures]]:
    """The `ep_dispatch:` section of a bundled cluster (`CLUSTER_SPANS`), derived by the rule."""
    rows = load_measurements() if rows is None else rows
    spans = CLUSTER_SPANS[cluster_name]
    out: dict[str, dict[str, EpDispatcherFigures]] = {}
    for dispatcher in FUSED_DISPATCHERS:
        by_level: dict[str, EpDispatcherFigures] = {}
        for level, span in spans.levels.items():
            accelerator = spans.accelerator
            note = ""
            if spans.carried_from and level in spans.carried_levels:
                accelerator, note = spans.carried_from, spans.carried_reason
            units = COMPUTE_UNITS.get(accelerator, (None, ""))[0]
            figures = derive_figures(rows, accelerator, dispatcher, span, units)
            if figures is not None:
                if note:
                    figures = EpDispatcherFigures(figures.bandwidth_bytes_per_s, figures.latency_s,
                                                  figures.sm_fraction, f"{note}; {figures.source}", figures.traffic)
                by_level[level] = figures
        if by_level:
            out[dispatcher] = by_level
    return out


def dispatcher_problem(cluster: ClusterSpec, layout: LayoutLike) -> Optional[str]:
    """Why `cluster` cannot price the layout's fused dispatcher (a one-line message naming the
    field and the fix), or None: its EP group must span a fabric level with figures."""
    name = layout.dispatcher
    if name not in FUSED_DISPATCHERS or int(layout.ep) <= 1:
        return None
    levels = group_levels(cluster, float(layout.ep), float(layout.etp))
    spanned = [level.name for level, (_, _, fan, _, _) in zip(cluster.levels, levels) if float(fan) > 1.0]
    have = cluster.ep_dispatch.get(name, {})
    if spanned and spanned[-1] in have:
        return None
    measured = ", ".join(f"{d} on {'/'.join(v)}" for d, v in cluster.ep_dispatch.items()) or "none"
    return (f"layout: dispatcher={name}: cluster '{cluster.name}' has no measured {name} figures for its "
            f"'{spanned[-1] if spanned else '?'}' level, which the ep={layout.ep} group spans (ep_dispatch: "
            f"{measured}); use dispatcher=alltoall or allgather, or an ep within a measured level")


# ---------------------------------------------------------------------------
# Prices

@dataclass(frozen=True)
class FusedDispatchTimes:
    """Seconds of the four fused calls of one MoE layer and micro-batch, per candidate."""

    dispatch_fwd: np.ndarray
    combine_fwd: np.ndarray
    dispatch_bwd: np.ndarray
    """The gradient of the combine (a dispatch of output gradients)."""
    combine_bwd: np.ndarray
    sm_fraction: np.ndarray
    available: np.ndarray
    """False where a fused dispatcher is asked for over a level without figures."""


def _span_level(cluster: ClusterSpec, ep: np.ndarray, etp: np.ndarray, shape: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(index of the outermost fabric level the EP group crosses, -1 for none; the group's members
    inside that level's inner domain) per candidate (`comm.group_levels` at stride etp)."""
    span_level = np.full(shape, -1)
    inner = np.ones(shape)
    for j, (c_prev, _, fan, _, _) in enumerate(group_levels(cluster, ep, etp)):
        crossed = np.broadcast_to(fan > 1.0, shape)
        span_level = np.where(crossed, j, span_level)
        inner = np.where(crossed, np.broadcast_to(c_prev, shape), inner)
    return span_level, inner


def fused_span_figures(cluster: ClusterSpec, lay: LayoutLike, dispatcher_code: np.ndarray,
                       fused_codes: dict[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """(available, sm_fraction) per candidate, properties of the layout and the cluster alone:
    False where a fused dispatcher is asked for over a level its `ep_dispatch` has no figures for
    (as `fused_dispatch_times(...).available`), and the compute-unit share the dispatcher holds
    there (0 where it is not fused, ep = 1 or the level has no figures; `...sm_fraction`)."""
    ep = np.asarray(lay.ep, dtype=float)
    shape = np.broadcast(ep, np.asarray(dispatcher_code)).shape
    code = np.broadcast_to(np.asarray(dispatcher_code), shape)
    if not np.any(np.isin(code, list(fused_codes))) or not np.any(ep > 1):
        return np.ones(shape, dtype=bool), np.zeros(shape)
    span_level, _ = _span_level(cluster, ep, np.asarray(lay.etp, dtype=float), shape)
    return _figures_at(cluster, code, ep, span_level, fused_codes)


def _figures_at(cluster: ClusterSpec, code: np.ndarray, ep: np.ndarray, span_level: np.ndarray,
                fused_codes: dict[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """`fused_span_figures` given the level each candidate's EP group spans (`_span_level`)."""
    available, sm = np.ones(code.shape, dtype=bool), np.zeros(code.shape)
    for c_value, name in fused_codes.items():
        mine = (code == c_value) & (ep > 1)
        for j, level in enumerate(cluster.levels):
            here = mine & (span_level == j)
            fig = cluster.ep_dispatch.get(name, {}).get(level.name)
            if fig is None:
                available &= ~here
            else:
                sm = np.where(here, fig.sm_fraction, sm)
    return available, sm


def fused_dispatch_times(cluster: ClusterSpec, lay: LayoutLike, dispatcher_code: np.ndarray, fused_codes: dict[int, str],
                         n_experts: Values, top_k: Values, tokens: Values, hidden: Values, load_factor: Values,
                         act_bytes: Values, dispatch_bytes: Values, share: Values = 1.0) -> FusedDispatchTimes:
    """The four calls' seconds for candidates whose dispatcher code is in `fused_codes` (0 for the
    others; module doc). `tokens` = T_moe (tokens one rank routes), `load_factor` = f."""
    ep = np.asarray(lay.ep, dtype=float)
    etp = np.asarray(lay.etp, dtype=float)
    shape = np.broadcast(ep, np.asarray(dispatcher_code)).shape
    zeros = np.zeros(shape)
    times = {k: zeros.copy() for k in ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd")}
    code = np.broadcast_to(np.asarray(dispatcher_code), shape)
    if not np.any(np.isin(code, list(fused_codes))) or not np.any(ep > 1):
        return FusedDispatchTimes(zeros, zeros, zeros, zeros, zeros, np.ones(shape, dtype=bool))
    span_level, inner = _span_level(cluster, ep, etp, shape)
    available, sm_fraction = _figures_at(cluster, code, ep, span_level, fused_codes)
    E, k = np.asarray(n_experts, dtype=float), np.asarray(top_k, dtype=float)
    T = np.asarray(tokens, dtype=float)
    h = np.asarray(hidden, dtype=float)
    f = np.asarray(load_factor, dtype=float)
    received_rows = ep * T * ranks_hit_probability(E, k, ep) * f
    nodes = ep / np.maximum(inner, 1.0)
    off_node_rows = T * (nodes - 1.0) * ranks_hit_probability(E, k, nodes) * f
    slowdown = 1.0 / np.asarray(share, dtype=float)
    for c_value, name in fused_codes.items():
        mine = (code == c_value) & (ep > 1)
        if not np.any(mine):
            continue
        for j, level in enumerate(cluster.levels):
            here = mine & (span_level == j)
            if not np.any(here):
                continue
            fig = cluster.ep_dispatch.get(name, {}).get(level.name)
            if fig is None:
                continue
            rows = off_node_rows if fig.traffic == "off_node" else received_rows
            for key, elem in (("dispatch_fwd", dispatch_bytes), ("combine_fwd", act_bytes),
                              ("dispatch_bwd", act_bytes), ("combine_bwd", act_bytes)):
                seconds = (fig.latency_s + rows * h * elem / fig.bandwidth_bytes_per_s) * slowdown
                times[key] = np.where(here, seconds, times[key])
    return FusedDispatchTimes(times["dispatch_fwd"], times["combine_fwd"], times["dispatch_bwd"], times["combine_bwd"],
                              sm_fraction, available)


__all__ = ["CLUSTER_SPANS", "COMPUTE_UNITS", "FusedDispatchTimes", "cluster_figures", "derive_figures",
           "dispatcher_problem",
           "fused_dispatch_times", "fused_span_figures", "load_measurements"]

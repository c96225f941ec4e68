"""How well a cluster file reproduces its measured tables: the relative error of each row.

Recomputed from the cluster file's own figures (not from the fit's internals), through the same
forms the step prices with, so a test can hold every bundled cluster to its measurements:
- gemm / grouped_gemm: predicted TFLOP/s = 2mnk / max(2mnk / (peak e(m, n, k)), bytes / (HBM bw x
  f_copy)), per phase (a fwd_bwd row: the three phases' times summed); a best-of-search
  (ceiling) row: peak x e_max;
- attention: rate = peak x e_max[phase] s(seq) s(head dim) (causal rows on the causal half);
- memory_kernels: achieved bytes/s of the row's kernel class at its size;
- collectives: `perfmodel.comm.collective_time` of the row's collective on `ranks` ranks, for
  messages of at least COLLECTIVE_MIN_BYTES (below it NCCL switches to its low-latency protocols,
  which a two-parameter alpha-beta curve does not follow; training moves larger messages);
- ep_dispatch (normal kernels, on levels whose all-to-all the build took from them): the
  all-to-all time of DISPATCH_BYTES over `ep` ranks against the row's GB/s, counted as the
  build counts it (`perfmodel.kernels.build.counts_link_bytes`).
Only rows the fit used are scored (not `excluded`, the accelerator's own, a modelled precision).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from perfmodel.comm import collective_time
from perfmodel.kernels.derive import span_of_level
from perfmodel.kernels.fit import ELEMENT_BYTES, MEMORY_KERNEL_CLASS, gemm_bytes
from perfmodel.kernels.forms import GEMM_PHASES, phase_dims, saturation
from perfmodel.kernels.tables import KernelTable
from perfmodel.specs.cluster import ClusterSpec

COLLECTIVE_MIN_BYTES = 1 << 20
DISPATCH_BYTES = float(1 << 28)
"""The per-rank buffer a normal (bandwidth) dispatch row is scored at: its latency is negligible."""
COLLECTIVE_NAME = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                   "all_to_all": "all_to_all", "send_recv": "p2p"}


def _operand_seconds(cluster: ClusterSpec, nbytes: np.ndarray) -> np.ndarray:
    """A GEMM's memory side, as `perfmodel.hardware.HardwareView.operand_seconds` prices it."""
    m = cluster.accelerator.kernels.memory
    return nbytes / (cluster.accelerator.hbm_bandwidth_bytes_per_s * m.fraction["copy"])


def gemm_errors(cluster: ClusterSpec, rows: KernelTable, grouped: bool) -> np.ndarray:
    acc = cluster.accelerator
    k = acc.kernels
    out = []
    for i in range(len(rows)):
        precision = str(rows["precision"][i])
        if precision not in ELEMENT_BYTES:
            continue
        try:
            peak = acc.peak(precision)
        except Exception:
            continue
        measured = rows["tflops"][i] * 1e12
        m = rows["m_per_group"][i] if grouped else rows["m"][i]
        n, kk = rows["n"][i], rows["k"][i]
        role = rows.get("role")
        if not grouped and role is not None and str(role[i]) == "ceiling":
            out.append(peak * k.gemm[k.precision("gemm", precision)].e_max / measured - 1.0)
            continue
        if not (np.isfinite(m) and np.isfinite(n) and np.isfinite(kk)):
            continue
        groups = rows["groups"][i] if grouped and np.isfinite(rows["groups"][i]) else 1.0
        phase = str(rows["phase"][i]) if grouped else "fwd"
        phases = GEMM_PHASES if phase == "fwd_bwd" else (phase,)
        seconds = flops = 0.0
        for ph in phases:
            pm, pn, pk = phase_dims(ph, m, n, kk)
            fig = (k.grouped_gemm[k.precision("grouped_gemm", precision)].phase(ph) if grouped
                   else k.gemm[k.precision("gemm", precision)])
            eff = min(fig.e_max * saturation(pm, fig.m_half) * saturation(pn, fig.n_half) * saturation(pk, fig.k_half), 1.0)
            f = 2.0 * pm * pn * pk * groups
            nbytes = groups * gemm_bytes(np.asarray([pm]), np.asarray([pn]), np.asarray([pk]), [precision])[0]
            seconds += max(f / (peak * eff), float(_operand_seconds(cluster, nbytes)))
            flops += f
        out.append(flops / seconds / measured - 1.0)
    return np.asarray(out)


def attention_errors(cluster: ClusterSpec, rows: KernelTable) -> np.ndarray:
    acc = cluster.accelerator
    k = acc.kernels
    out = []
    for i in range(len(rows)):
        precision = str(rows["precision"][i])
        key = k.precision("attention", precision if precision in k.attention else "bf16")
        fig = k.attention[key]
        try:
            peak = acc.peak(precision)
        except Exception:
            peak = acc.peak(key)
        causal = str(rows["causal"][i]).lower() == "true"
        s = saturation(rows["seq_len"][i], fig.seq_half_causal if causal else fig.seq_half)
        s *= saturation(rows["head_dim"][i], fig.head_dim_half)
        t_fwd = 1.0 / (peak * fig.fwd_e_max * s)
        t_bwd = 2.5 / (peak * fig.bwd_e_max * s)
        phase = str(rows["phase"][i])
        work, seconds = {"fwd": (1.0, t_fwd), "bwd": (2.5, t_bwd)}.get(phase, (3.5, t_fwd + t_bwd))
        out.append(work / seconds / (rows["tflops"][i] * 1e12) - 1.0)
    return np.asarray(out)


def memory_errors(cluster: ClusterSpec, rows: KernelTable) -> np.ndarray:
    m = cluster.accelerator.kernels.memory
    bw = cluster.accelerator.hbm_bandwidth_bytes_per_s
    out = []
    for i in range(len(rows)):
        cls = MEMORY_KERNEL_CLASS.get(str(rows["kernel"][i]))
        if cls is None or not np.isfinite(rows["gbps"][i]):
            continue
        nbytes = rows["bytes_moved"][i]
        s = saturation(nbytes, m.bytes_half) if np.isfinite(nbytes) else 1.0
        out.append(bw * m.fraction[cls] * s / (rows["gbps"][i] * 1e9) - 1.0)
    return np.asarray(out)


def collective_errors(cluster: ClusterSpec, rows: KernelTable, spans: Mapping[str, int]) -> np.ndarray:
    """Rows of the spans this cluster's levels cover (span -> innermost level index holding it)."""
    out = []
    for i in range(len(rows)):
        kind = COLLECTIVE_NAME.get(str(rows["collective"][i]))
        span = str(rows["span"][i])
        size, ranks, busbw = rows["size_bytes"][i], rows["ranks"][i], rows["busbw_gbps"][i]
        if kind is None or span not in spans or not (np.isfinite(size) and size >= COLLECTIVE_MIN_BYTES):
            continue
        if not (np.isfinite(busbw) and busbw > 0 and np.isfinite(ranks)):
            continue
        factor = 2.0 * (ranks - 1) / ranks if kind == "all_reduce" else (1.0 if kind == "p2p" else (ranks - 1) / ranks)
        measured = size * factor / (busbw * 1e9)
        if kind == "p2p":
            level = spans[span]
            stride = float(cluster.levels[level - 1].devices) if level > 0 else 1.0
            predicted = float(collective_time(cluster, kind, size, 2.0, stride))
        else:
            predicted = float(collective_time(cluster, kind, size, ranks, 1.0))
        out.append(predicted / measured - 1.0)
    return np.asarray(out)


def dispatch_errors(cluster: ClusterSpec, rows: KernelTable, spans: Mapping[str, int]) -> np.ndarray:
    """Normal-kernel rows on the levels whose all-to-all figure came from dispatch rows."""
    from perfmodel.kernels.build import counts_link_bytes

    out = []
    for i in range(len(rows)):
        span = str(rows["span"][i])
        if str(rows["mode"][i]) != "normal" or span not in spans or not np.isfinite(rows["bandwidth_gbps"][i]):
            continue
        j = spans[span]
        level = cluster.levels[j]
        fit = level.collective_fit
        if fit is None or "EP dispatch" not in (fit.derived or ""):
            continue
        ep = float(rows["ep"][i])
        inside = float(cluster.levels[j - 1].devices) if j > 0 else 1.0
        share = 1.0
        if bool(counts_link_bytes(np.asarray([rows["bandwidth_kind"][i]]))[0]):
            share = (min(ep, float(level.devices)) - min(ep, inside)) / ep
        measured = DISPATCH_BYTES * share / (rows["bandwidth_gbps"][i] * 1e9)
        predicted = float(collective_time(cluster, "all_to_all", DISPATCH_BYTES, ep, 1.0))
        out.append(predicted / measured - 1.0)
    return np.asarray(out)


def cluster_spans(cluster: ClusterSpec) -> dict[str, int]:
    """Span (node | scale_up | scale_out) -> the innermost level of `cluster` holding it
    (`perfmodel.kernels.derive.span_of_level`): which collective rows a cluster is scored on."""
    out: dict[str, int] = {}
    for j, level in enumerate(cluster.levels):
        out.setdefault(span_of_level(j, level.name, len(cluster.levels)), j)
    return out


def table_errors(cluster: ClusterSpec, tables: Mapping[str, KernelTable], accelerator: str,
                 spans: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Relative error of every used row of `accelerator` per kind, from the cluster's figures."""
    own = {kind: table.rows_of(accelerator) for kind, table in tables.items()}
    return {
        "gemm": gemm_errors(cluster, own["gemm"], grouped=False),
        "grouped_gemm": gemm_errors(cluster, own["grouped_gemm"], grouped=True),
        "attention": attention_errors(cluster, own["attention"]),
        "memory_kernels": memory_errors(cluster, own["memory_kernels"]),
        "collectives": collective_errors(cluster, own["collectives"], spans),
        "ep_dispatch": dispatch_errors(cluster, own["ep_dispatch"], spans),
    }

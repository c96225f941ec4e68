"""A readable scalar reference of the performance model: one configuration, plain Python.

It restates, loop by loop, the formulas that `perfmodel.evaluate` applies to
numpy arrays (operators, collectives with placement, overlap, dispatch,
pipeline, optimizer, straggler, memory), without sharing their code, so that
`tests/perfmodel/test_reference.py` can check the fast path against it on
random configurations. Read the vectorised modules' docstrings for sources;
this file is the same model written for a person to follow.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from perfmodel import eager
from perfmodel.specs.architecture import MoEArchitecture, model_flops_per_token
from perfmodel.specs.layout import ParallelLayout
from perfmodel.validity import violations

LOAD_FACTOR = 1.25          # busiest EP rank / mean (operators.MOE_LOAD_FACTOR)
FLASH_BWD = 2.5             # flash-attention backward / forward FLOPs
CAUSAL = 0.5                # causal kernels skip half the scores
GRAD_BYTES = 4.0            # fp32 main gradients
BUCKET_PARAMS = 40e6        # Megatron DDP bucket
OPT_KERNELS_PER_LAYER = 3.0


def _eager_ops(arch: MoEArchitecture) -> dict[str, tuple[float, float]]:
    """(fwd, bwd) ops per micro-batch of each block in eager PyTorch (perfmodel.eager's counts)."""
    ops = {}
    for block, (fwd, bwd) in eager.EAGER_OPS.items():
        if block == "attention" and arch.n_kv_heads < arch.n_heads:
            fwd, bwd = fwd + eager.EAGER_GQA_OPS[0], bwd + eager.EAGER_GQA_OPS[1]
        if block == "moe" and arch.n_shared_experts > 0:
            fwd, bwd = fwd + eager.EAGER_SHARED_EXPERT_OPS[0], bwd + eager.EAGER_SHARED_EXPERT_OPS[1]
        if block in eager.EAGER_UNGATED_OPS and not arch.gated_ffn:
            fwd, bwd = fwd + eager.EAGER_UNGATED_OPS[block][0], bwd + eager.EAGER_UNGATED_OPS[block][1]
        ops[block] = (fwd, bwd)
    return ops


def _dtensor_ops(arch: MoEArchitecture) -> dict[str, tuple[float, float]]:
    """(fwd, bwd) DTensor ops per micro-batch of each block under tp > 1 (perfmodel.eager's counts)."""
    out = {}
    for block, (fwd, bwd) in eager.EAGER_DTENSOR_OPS.items():
        if block == "moe" and arch.n_shared_experts > 0:
            fwd, bwd = fwd + eager.EAGER_DTENSOR_SHARED_EXPERT_OPS[0], bwd + eager.EAGER_DTENSOR_SHARED_EXPERT_OPS[1]
            if not arch.gated_ffn:
                fwd, bwd = fwd + eager.EAGER_DTENSOR_UNGATED_OPS["moe"][0], bwd + eager.EAGER_DTENSOR_UNGATED_OPS["moe"][1]
        if block == "dense_ffn" and not arch.gated_ffn:
            fwd, bwd = fwd + eager.EAGER_DTENSOR_UNGATED_OPS[block][0], bwd + eager.EAGER_DTENSOR_UNGATED_OPS[block][1]
        out[block] = (fwd, bwd)
    return out


def _ceil_log2(x: float) -> float:
    return float(math.ceil(math.log2(x) - 1e-9)) if x > 1 else 0.0


class _Device:
    """Peaks, curves and bandwidth of one rank for one precision."""

    def __init__(self, cluster: Any, precision: str, devices: int) -> None:
        acc = cluster.accelerator
        self.acc = acc
        self.share = 1.0 if cluster.host_cores is None else min(1.0, cluster.host_cores / devices)
        attn_precision = "bf16" if precision in ("fp8", "mxfp8") else precision
        self.missing = False
        peaks = {}
        for p in (precision, attn_precision):
            try:
                peaks[p] = acc.peak(p)
            except Exception:
                self.missing = True
                peaks[p] = max(acc.peak_flops_per_s.values())
        self.gemm_peak = peaks[precision] * self.share
        self.attn_peak = peaks[attn_precision] * self.share
        self.gemm_curve = acc.compute_curve(precision)
        self.attn_curve = acc.compute_curve(attn_precision)

    def memory_seconds(self, nbytes: float, kernels: float) -> float:
        if nbytes <= 0:
            return 0.0
        eff = float(self.acc.memory_efficiency(nbytes / max(kernels, 1.0)))
        return nbytes / (self.acc.hbm_bandwidth_bytes_per_s * eff)

    def op_phase_seconds(self, op: dict[str, Any]) -> list[float]:
        """Each phase: max(FLOPs / (peak x eff_compute), bytes / (bandwidth x eff_memory)),
        both efficiencies read at the op's forward size (kernel FLOPs, bytes per kernel)."""
        j0 = op.get("size_phase", 0)             # a backward-only op is sized by its backward
        mem_eff = float(self.acc.memory_efficiency(op["bytes"][j0] / max(op["kernels"][j0], 1.0)))
        bandwidth = self.acc.hbm_bandwidth_bytes_per_s * mem_eff
        if op["kind"] in ("attention", "gemm_hp"):   # bf16 even under fp8
            rate = self.attn_peak * float(self.attn_curve(op["sizes"][0]))
            if op["kind"] == "attention":  # the core runs at a measured fraction of a GEMM's rate
                rate *= self.acc.attention_efficiency_vs_gemm or 1.0
        elif op["kind"] != "memory":
            rate = self.gemm_peak * float(self.gemm_curve(op["sizes"][0]))
        seconds = []
        for j in range(3):
            memory = op["bytes"][j] / bandwidth
            seconds.append(memory if op["kind"] == "memory" else max(op["flops"][j] / rate, memory))
        return seconds


def collective_seconds(cluster: Any, kind: str, nbytes: float, n: float, stride: float) -> float:
    """Hierarchical alpha-beta: max over levels of bytes/bandwidth, plus alpha per tree step."""
    n, stride = max(n, 1.0), max(stride, 1.0)
    if n <= 1 or nbytes <= 0:
        return 0.0
    worst, latency, inside_prev, alpha, sync = 0.0, 0.0, 1.0, 0.0, 0.0
    for j, level in enumerate(cluster.levels):
        alpha = max(alpha, level.latency_s)
        if j == len(cluster.levels) - 1:
            inside = n
        else:
            inside = max(min(n, max(1.0, math.floor(level.devices / stride))), inside_prev)
        fan = inside / inside_prev
        if kind == "all_reduce":
            moved, steps = 2.0 * (fan - 1.0) / fan * nbytes / inside_prev, 2.0 * _ceil_log2(fan)
        elif kind in ("all_gather", "reduce_scatter"):
            moved, steps = (fan - 1.0) / fan * nbytes / inside_prev, _ceil_log2(fan)
        elif kind == "all_to_all":
            moved, steps = (inside - inside_prev) / n * nbytes, _ceil_log2(fan)
        else:
            moved, steps = (nbytes, 1.0) if fan > 1 else (0.0, 0.0)
        worst = max(worst, moved / (level.bandwidth_bytes_per_s * level.efficiency_of(kind)))
        latency += steps * alpha
        if inside > inside_prev and kind != "p2p":
            sync = max(sync, level.sync_latency_s)
        inside_prev = inside
    return worst + latency + sync


def _gemm(name: str, kind: str, m: float, k: float, n: float, b_in: float, b_out: float, groups: float = 1.0
          ) -> dict[str, Any]:
    flops = 2.0 * m * k * n
    return {"name": name, "kind": kind, "overlap": True, "size": flops / groups,
            "flops": (flops, flops, flops),
            "bytes": (b_in * (m * k + k * n) + b_out * m * n,
                      b_in * (m * n + k * n) + b_out * m * k,
                      b_in * (m * k + m * n) + 2 * GRAD_BYTES * k * n),
            "kernels": (groups, groups, groups)}     # TE grouped GEMM: one cuBLAS call per expert


def _mem(name: str, fwd: float, bwd: float, kf: float = 1.0, kb: float = 1.0) -> dict[str, Any]:
    return {"name": name, "kind": "memory", "overlap": False, "size": 0.0, "flops": (0.0, 0.0, 0.0),
            "bytes": (fwd, bwd, 0.0), "kernels": (kf, kb, 0.0)}


def evaluate_one(arch: MoEArchitecture, layout: ParallelLayout, cluster: Any, devices: Optional[int] = None
                 ) -> dict[str, Any]:
    """The model for one configuration, as `EvalResult.row` gives it (same keys)."""
    lay = layout
    if lay.dp is None or lay.gbs is None:
        lay = lay.resolve(devices if devices is not None else lay.model_parallel)
    world = lay.tp * lay.cp * lay.pp * lay.dp
    devices = world if devices is None else devices
    dev = _Device(cluster, lay.precision, devices)
    ov = cluster.overlap
    lat = cluster.accelerator.launch_latency_s / dev.share  # ranks sharing a CPU core dispatch in turns

    # ---- sizes of one micro-batch on one rank
    tp, cp, ep, etp, pp, vpp, dp = lay.tp, lay.cp, lay.ep, lay.etp, lay.pp, lay.vpp, lay.dp
    b = 4.0 if lay.precision == "fp32" else 2.0                       # activation bytes
    b_in = 1.0 if lay.precision in ("fp8", "mxfp8") else b           # GEMM operand bytes
    w_bytes = {"fp32": 4.0, "fp8": 3.0, "mxfp8": 3.0}.get(lay.precision, 2.0)
    h, V, s = float(arch.d_model), float(arch.vocab_size), float(arch.seq_len)
    h_q, h_kv = float(arch.n_heads * arch.head_dim), float(arch.n_kv_heads * arch.head_dim)
    E, k = float(arch.n_experts), float(arch.top_k)
    T = lay.mbs * s / cp
    T_sp = T / tp if lay.sequence_parallel else T
    T_moe = T / tp
    M = etp * T_moe * k * LOAD_FACTOR
    E_local = max(E / ep, 1.0)
    up = 2.0 if arch.gated_ffn else 1.0

    def act(rows: float, width: float) -> tuple[float, float]:
        return ((3.0 if arch.gated_ffn else 2.0) * rows * width * b, (5.0 if arch.gated_ffn else 3.0) * rows * width * b)

    # fp8 quantisation kernels (operators.py "FP8 casts"): bytes and kernels per element
    cast_b, cast_k = {"fp8": (2.0 * b + 2.0, 2.0), "mxfp8": (b + 2.0 * (1.0 + 1.0 / 32.0), 1.0)}.get(
        lay.precision, (0.0, 0.0))

    def cast(fwd_elements: float, bwd_elements: float, n_fwd: float, n_bwd: float) -> dict[str, Any]:
        op = _mem("fp8_cast", cast_b * fwd_elements, cast_b * bwd_elements, cast_k * n_fwd, cast_k * n_bwd)
        op["size_phase"] = 0 if n_fwd else 1
        return op

    def mlp(prefix: str, width: float) -> list[dict[str, Any]]:
        af, ab = act(T, width / tp)
        ops = [_gemm(f"{prefix}_up", "gemm", T, h, up * width / tp, b_in, b), _mem(f"{prefix}_act", af, ab),
               _gemm(f"{prefix}_down", "gemm", T, width / tp, h, b_in, b)]
        if width == 0:   # no shared experts: nothing is launched
            for op in ops:
                op["kernels"] = (0.0, 0.0, 0.0)
        return ops

    norm_f, norm_b = 2.0 * b * T_sp * h, 3.0 * b * T_sp * h
    core = 4.0 * CAUSAL * T * s * h_q / tp
    blocks: dict[str, list[dict[str, Any]]] = {
        "attention": [
            _mem("attn_norm", norm_f, norm_b),
            _gemm("qkv_proj", "gemm", T, h, (h_q + 2 * h_kv) / tp, b_in, b),
            _mem("rope", 2.0 * b * T * (h_q + h_kv) / tp, 2.0 * b * T * (h_q + h_kv) / tp),
            {"name": "core_attention", "kind": "attention", "overlap": True, "flops": (core, FLASH_BWD * core, 0.0),
             "sizes": (core, FLASH_BWD * core / 2.0, 0.0),
             "bytes": (b * T * (2 * h_q + 2 * h_kv) / tp + 4.0 * T * arch.n_heads / tp,
                       b * T * (4 * h_q + 4 * h_kv) / tp + 4.0 * T * arch.n_heads / tp, 0.0),
             "kernels": (1.0, 2.0, 0.0)},
            _gemm("out_proj", "gemm", T, h_q / tp, h, b_in, b),
            cast(T * h_q / tp, T * (h + (h_q + 2 * h_kv) / tp), 1.0, 2.0),
            _mem("attn_residual", norm_b, norm_b),
        ],
        "dense_ffn": [_mem("ffn_norm", norm_f, norm_b), *mlp("ffn", float(arch.d_ff_dense)),
                      cast(0.0, T * h, 0.0, 1.0), _mem("ffn_residual", norm_b, norm_b)],
        "embedding": [_mem("embedding", 2.0 * b * T * h, (b + 2 * GRAD_BYTES) * T * h, 2.0, 2.0)],
        "head": [_mem("final_norm", norm_f, norm_b), _gemm("lm_head", "gemm_hp", T, h, V / tp, b, b),
                 _mem("cross_entropy", (b + 8.0) * T * V / tp, (4.0 + b) * T * V / tp, 4.0, 2.0)],
    }
    d_loc = arch.d_expert / etp
    ef, eb = act(M, d_loc)
    copies = T_moe * k
    blocks["moe"] = [
        _mem("moe_norm", norm_f, norm_b),
        _gemm("router", "gemm_hp", T_moe, h, E, b, 4.0),
        _mem("router_topk", 8.0 * T_moe * E, 12.0 * T_moe * E, 3.0, 3.0),
        _mem("router_aux_loss", 13.0 * T_moe * E, 16.0 * T_moe * E, 4.0, 2.0),   # Switch balancing loss
        _mem("permute", 2.0 * b * copies * h, 2.0 * b * copies * h, 2.0, 2.0),
        _gemm("expert_up", "expert_gemm", M, h, up * d_loc, b_in, b, E_local),
        _mem("expert_act", ef, eb),
        _gemm("expert_down", "expert_gemm", M, d_loc, h, b_in, b, E_local),
        _mem("unpermute_combine", b * (2 * copies + T_moe) * h, b * (3 * copies + T_moe) * h, 2.0, 3.0),
        *mlp("shared", float(arch.n_shared_experts * arch.d_expert)),
        _mem("moe_residual", norm_b, norm_b),
    ]
    shared_w = arch.n_shared_experts * arch.d_expert / tp
    if shared_w > 0:
        blocks["moe"].append(cast(M * (h + d_loc) + T * (h + shared_w), M * (h + up * d_loc) + T * (h + up * shared_w),
                                  4.0, 4.0))
    else:
        blocks["moe"].append(cast(M * (h + d_loc), M * (h + up * d_loc), 2.0, 2.0))

    # ---- time of every block per micro-batch (fwd / bwd per category)
    category = {"gemm": "compute", "gemm_hp": "compute", "memory": "compute", "attention": "attention",
                "expert_gemm": "expert_gemm"}
    table: dict[str, dict[str, float]] = {}
    for name, ops in blocks.items():
        t = {key: 0.0 for key in ("fwd_compute", "fwd_attention", "fwd_expert_gemm", "bwd_compute",
                                  "bwd_attention", "bwd_expert_gemm", "fwd_overlap", "bwd_overlap",
                                  "fwd_kernels", "bwd_kernels", "core_fwd")}
        for op in ops:
            if "sizes" not in op:
                op["sizes"] = (op["size"],) * 3
            secs = dev.op_phase_seconds(op)
            cat = category[op["kind"]]
            t[f"fwd_{cat}"] += secs[0]
            t[f"bwd_{cat}"] += secs[1] + secs[2]
            if op["overlap"]:
                t["fwd_overlap"] += secs[0]
                t["bwd_overlap"] += secs[1] + secs[2]
            t["fwd_kernels"] += op["kernels"][0]
            t["bwd_kernels"] += op["kernels"][1] + op["kernels"][2]
            if op["name"] == "core_attention":
                t["core_fwd"] = secs[0]
        table[name] = t

    # ---- collectives per block per micro-batch, placed in Megatron rank order
    edp = max(tp * cp * dp / (etp * ep), 1.0)
    groups = {"tp": (tp, 1), "cp": (cp, tp), "ep": (ep, etp), "etp": (etp, 1), "dp": (dp * cp, tp),
              "edp": (edp, etp * ep), "pp": (2 if pp > 1 else 1, tp * cp * dp), "pp_all": (pp, tp * cp * dp),
              "world": (tp * cp * dp * pp, 1)}

    def coll(group: str, kind: str, nbytes: float) -> float:
        n, stride = groups[group]
        return collective_seconds(cluster, kind, nbytes, n, stride) / dev.share  # ranks sharing CPU cores

    hidden_b = b * T * h
    a2a = b * T_moe * k * h * LOAD_FACTOR
    kv = b * cp * T * 2 * h_kv / tp
    sp = lay.sequence_parallel
    comm_list = {
        "attention": [("tp", "all_reduce", "fwd", hidden_b), ("tp", "all_reduce", "bwd", hidden_b),
                      ("cp", "all_gather", "fwd", kv), ("cp", "all_gather", "bwd", kv),
                      ("cp", "reduce_scatter", "bwd", kv)],
        "dense_ffn": [("tp", "all_reduce", "fwd", hidden_b), ("tp", "all_reduce", "bwd", hidden_b)],
        "moe": [("ep", "all_to_all", ph, a2a) for ph in ("fwd", "fwd", "bwd", "bwd")]
               + [("etp", kind, ph, b * M * h) for ph in ("fwd", "bwd") for kind in ("all_gather", "reduce_scatter")]
               + [("tp", "all_reduce", ph, hidden_b if arch.n_shared_experts > 0 else 0.0) for ph in ("fwd", "bwd")],
        "embedding": [("tp", "reduce_scatter" if sp else "all_reduce", "fwd", hidden_b)],
        "head": ([("tp", "all_gather", "fwd", hidden_b), ("tp", "reduce_scatter", "bwd", hidden_b)] if sp
                 else [("tp", "all_reduce", "bwd", hidden_b)]) + [("tp", "all_reduce", "fwd", 4.0 * T)] * 3,
    }
    if cluster.host_cores is not None and not sp:  # CPU ranks run the bundled trainer: its tp collectives
        gated_n = 2 if arch.gated_ffn else 1
        sh_b = hidden_b if arch.n_shared_experts > 0 else 0.0
        trainer_tp = {
            "attention": [("fwd", "all_reduce", hidden_b)] + [("bwd", "all_reduce", hidden_b)] * 3,
            "dense_ffn": [("fwd", "all_reduce", hidden_b)] + [("bwd", "all_reduce", hidden_b)] * gated_n,
            "moe": [("fwd", "all_reduce", 4.0 * arch.n_experts), ("fwd", "all_gather", hidden_b),
                    ("bwd", "all_gather", hidden_b), ("fwd", "all_gather", sh_b), ("fwd", "reduce_scatter", sh_b),
                    ("bwd", "all_gather", sh_b)] + [("bwd", "all_reduce", sh_b)] * gated_n,
            "embedding": [("fwd", "all_reduce", hidden_b)],
            "head": [("fwd", "all_gather", b * T * arch.vocab_size), ("bwd", "all_reduce", hidden_b)],
        }
        for block, extra in trainer_tp.items():
            comm_list[block] = ([c for c in comm_list[block] if c[0] != "tp"]
                                + [("tp", kind, phase, size) for phase, kind, size in extra])
    if cluster.host_cores is not None:  # the trainer's expert-parallel count exchange (int64 per expert)
        comm_list["moe"].append(("ep", "all_to_all", "fwd", 8.0 * arch.n_experts))
    comm_class = {"tp": "tp", "cp": "cp", "ep": "ep", "etp": "ep"}
    for name, items in comm_list.items():
        t = table[name]
        for cls in ("tp", "cp", "ep"):
            t[f"fwd_{cls}"] = t[f"bwd_{cls}"] = 0.0
        t["fwd_comm_kernels"] = t["bwd_comm_kernels"] = 0.0
        for group, kind, phase, nbytes in items:
            secs = coll(group, kind, nbytes)
            t[f"{phase}_{comm_class[group]}"] += secs
            t[f"{phase}_comm_kernels"] += 1.0 if secs > 0 else 0.0

    # ---- the first and the last pipeline stage
    per_stage = arch.n_layers / pp
    n_dense = arch.n_layers - (arch.n_layers - arch.n_dense_layers if arch.n_experts > 0 else 0)
    first_dense = min(n_dense, per_stage)
    last_dense = min(max(n_dense - (pp - 1) * per_stage, 0.0), per_stage)
    stage_counts = {
        "first": {"attention": per_stage, "dense_ffn": first_dense, "moe": per_stage - first_dense,
                  "embedding": 1.0, "head": 1.0 if pp == 1 else 0.0},
        "last": {"attention": per_stage, "dense_ffn": last_dense, "moe": per_stage - last_dense,
                 "embedding": 1.0 if pp == 1 else 0.0, "head": 1.0},
    }
    m = max(lay.gbs / (lay.mbs * dp), 1.0)
    slots = (pp - 1) / vpp
    full, selective = lay.recompute == "full", lay.recompute == "selective"
    layer_blocks = ("attention", "dense_ffn", "moe")
    expert_param = (3 if arch.gated_ffn else 2) * h * arch.d_expert
    attn_params = h * (h_q + 2 * h_kv) + h_q * h

    def params_of(c: dict[str, float]) -> tuple[float, float]:
        vocab = V * h / tp
        tied_here = arch.tie_embeddings and c["embedding"] > 0 and c["head"] > 0
        dense = (c["attention"] * (attn_params / tp + 2 * h)
                 + c["dense_ffn"] * (3 if arch.gated_ffn else 2) * h * arch.d_ff_dense / tp
                 + c["moe"] * (h * E + arch.n_shared_experts * expert_param / tp)
                 + c["embedding"] * vocab + c["head"] * ((0.0 if tied_here else vocab) + h))
        experts = c["moe"] * E / ep * expert_param / etp
        return dense, experts

    stages: dict[str, dict[str, float]] = {}
    for stage_name, c in stage_counts.items():
        def tot(key: str, names: tuple[str, ...] = tuple(table), c: dict[str, float] = c) -> float:
            return sum(c[n] * table[n][key] for n in names)

        st: dict[str, float] = {}
        for cat in ("compute", "attention", "expert_gemm"):
            st[cat] = tot(f"fwd_{cat}") + tot(f"bwd_{cat}")
        layer_fwd = sum(tot(f"fwd_{cat}", layer_blocks) for cat in ("compute", "attention", "expert_gemm"))
        core_fwd = c["attention"] * table["attention"]["core_fwd"]
        st["recompute"] = layer_fwd if full else (core_fwd if selective else 0.0)
        fwd_compute = sum(tot(f"fwd_{cat}") for cat in ("compute", "attention", "expert_gemm"))
        bwd_compute = sum(tot(f"bwd_{cat}") for cat in ("compute", "attention", "expert_gemm")) + st["recompute"]
        windows = {"fwd": tot("fwd_overlap"),
                   "bwd": tot("bwd_overlap") + (tot("fwd_overlap", layer_blocks) if full else
                                                (core_fwd if selective else 0.0))}
        attn_windows = {"fwd": tot("fwd_attention"),
                        "bwd": tot("bwd_attention") + (core_fwd if (full or selective) else 0.0)}
        comm = {}
        for cls in ("tp", "cp", "ep"):
            comm[f"fwd_{cls}"] = tot(f"fwd_{cls}")
            comm[f"bwd_{cls}"] = tot(f"bwd_{cls}") + (tot(f"fwd_{cls}", layer_blocks) if full else 0.0)
        p2p = vpp * coll("pp", "p2p", b * T * h / (tp if sp else 1))
        comm["fwd_pp"] = comm["bwd_pp"] = p2p
        dense_p, expert_p = params_of(c)
        gather_b = 4.0 if lay.precision == "fp32" else 2.0
        gather = coll("dp", "all_gather", gather_b * dense_p) + coll("edp", "all_gather", gather_b * expert_p)
        grad_rs = (coll("dp", "reduce_scatter", GRAD_BYTES * dense_p)
                   + coll("edp", "reduce_scatter", GRAD_BYTES * expert_p))
        fsdp = lay.dp_flavor == "fsdp"
        comm["fwd_fsdp"] = gather if fsdp else 0.0
        comm["bwd_fsdp"] = gather + grad_rs if fsdp else 0.0

        exposed: dict[str, float] = {}
        hidden: dict[str, float] = {}
        left: dict[str, float] = {}
        for phase in ("fwd", "bwd"):
            window = windows[phase]
            hid = min(ov.cp * comm[f"{phase}_cp"], max(attn_windows[phase], 0.0))
            hidden[f"{phase}_cp"] = hid
            window -= hid
            for cls, fraction in (("tp", ov.tp), ("ep", ov.ep), ("pp", ov.pp), ("fsdp", ov.dp)):
                hid = min(fraction * comm[f"{phase}_{cls}"], max(window, 0.0))
                hidden[f"{phase}_{cls}"] = hid
                window -= hid
            for cls in ("cp", "tp", "ep", "pp", "fsdp"):
                exposed[f"{phase}_{cls}"] = comm[f"{phase}_{cls}"] - hidden[f"{phase}_{cls}"]
            left[phase] = max(window, 0.0)

        fwd_kernels = tot("fwd_kernels") + tot("fwd_comm_kernels")
        bwd_kernels = tot("bwd_kernels") + tot("bwd_comm_kernels") + (
            tot("fwd_kernels", layer_blocks) if full else (c["attention"] if selective else 0.0))
        if cluster.host_cores is not None:   # eager PyTorch ranks: the bundled trainer's op counts
            ops = _eager_ops(arch)
            ep_fwd, ep_bwd = eager.EAGER_EP_OPS if ep > 1 else (0.0, 0.0)
            fwd_kernels = tot("fwd_comm_kernels") + sum(c[blk] * ops[blk][0] for blk in ops) + ep_fwd * c["moe"]
            bwd_kernels = tot("bwd_comm_kernels") + sum(c[blk] * ops[blk][1] for blk in ops) + ep_bwd * c["moe"]
            if full:
                bwd_kernels += (sum(c[blk] * ops[blk][0] for blk in layer_blocks) + ep_fwd * c["moe"]
                                + eager.EAGER_FULL_RECOMPUTE_OPS * c["attention"])
            elif selective:
                bwd_kernels += eager.EAGER_SELECTIVE_RECOMPUTE_OPS * c["attention"]
        fwd_device = fwd_compute + sum(exposed[f"fwd_{x}"] for x in ("cp", "tp", "ep", "pp", "fsdp"))
        bwd_device = bwd_compute + sum(exposed[f"bwd_{x}"] for x in ("cp", "tp", "ep", "pp", "fsdp"))
        dtensor_lat = (cluster.accelerator.dtensor_op_latency_s or 0.0) / dev.share
        if cluster.host_cores is not None:   # a CPU rank launches and runs its own kernels
            st["dispatch"] = (fwd_kernels + bwd_kernels) * lat
            if tp > 1:                       # the trainer's tensor-parallel modules are DTensors
                dt = _dtensor_ops(arch)
                dt_mb = sum(c[blk] * (dt[blk][0] + dt[blk][1]) for blk in dt)
                if full:
                    dt_mb += eager.EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR * sum(c[blk] * dt[blk][0] for blk in layer_blocks)
                st["dispatch"] += dt_mb * dtensor_lat
            acc = cluster.accelerator
            region, per_saved = acc.checkpoint_region_latency_s or 0.0, acc.checkpoint_saved_tensor_latency_s or 0.0
            if full:
                ffn_saved = (15.0 if arch.gated_ffn else 11.0) * c["dense_ffn"] + (
                    30.0 + (9.0 if arch.n_shared_experts > 0 else 0.0)
                    - (9.0 if arch.n_shared_experts > 0 and not arch.gated_ffn else 0.0)) * c["moe"]
                st["dispatch"] += (c["attention"] * region + per_saved * (23.0 * c["attention"] + ffn_saved)) / dev.share
            elif selective:
                st["dispatch"] += c["attention"] * (region + per_saved * 5.0) / dev.share
        else:                                # launches overlap device work; the excess shows
            st["dispatch"] = max(fwd_kernels * lat - fwd_device, 0.0) + max(bwd_kernels * lat - bwd_device, 0.0)
        st["t_mb"] = fwd_device + bwd_device + st["dispatch"]
        for cls in ("tp", "cp", "ep", "pp", "fsdp"):
            st[f"{cls}_exposed"] = exposed[f"fwd_{cls}"] + exposed[f"bwd_{cls}"]
            st[f"{cls}_hidden"] = hidden[f"fwd_{cls}"] + hidden[f"bwd_{cls}"]

        # once per step: DDP all-reduce or ZeRO-1 reduce-scatter + all-gather
        if lay.dp_flavor == "ddp":
            grads = coll("dp", "all_reduce", GRAD_BYTES * dense_p) + coll("edp", "all_reduce", GRAD_BYTES * expert_p)
        elif lay.dp_flavor == "zero1":
            grads = grad_rs
        else:
            grads = 0.0
        params_ag = gather if lay.dp_flavor == "zero1" else 0.0
        last_bucket = min(1.0, BUCKET_PARAMS / max(dense_p + expert_p, 1.0))
        h_grads = min(ov.dp * grads, left["bwd"], grads * (1 - last_bucket))
        h_params = min(ov.dp * params_ag, left["fwd"], params_ag * (1 - last_bucket))
        st["dp_step_exposed"] = grads + params_ag - h_grads - h_params
        st["dp_step_hidden"] = h_grads + h_params

        updated = (dense_p / (dp * cp) + expert_p / edp) if lay.dp_flavor != "ddp" else dense_p + expert_p
        opt_bytes = (32.0 if lay.precision == "fp32" else 34.0) * updated
        opt_kernels = OPT_KERNELS_PER_LAYER * max(c["attention"], 1.0)
        st["optimizer"] = max(dev.memory_seconds(opt_bytes, opt_kernels), opt_kernels * lat)
        if cluster.host_cores is not None:   # eager: every parameter tensor's AdamW + norm ops, then bookkeeping
            gated = 3.0 if arch.gated_ffn else 2.0
            tensors = (c["embedding"] + 5.0 * c["attention"] + (1.0 + gated) * c["dense_ffn"]
                       + (2.0 + gated + (gated if arch.n_shared_experts > 0 else 0.0)) * c["moe"]
                       + (1.0 if arch.tie_embeddings else 2.0) * c["head"])
            opt_kernels = (eager.EAGER_OPS_PER_PARAM_TENSOR * tensors + eager.EAGER_STEP_OPS
                           + eager.EAGER_STEP_OPS_PER_MOE_LAYER * c["moe"] + eager.EAGER_OPS_PER_MICRO_BATCH * m)
            st["optimizer"] = dev.memory_seconds(opt_bytes, opt_kernels) + opt_kernels * lat
            # the trainer's per-step small all-reduces: token count, statistics, gradient-norm parts
            for group, count in (("dp", 1.0), ("world", 1.0), ("tp", 2.0), ("ep", 1.0), ("etp", 1.0), ("pp_all", 1.0)):
                st["optimizer"] += count * coll(group, "all_reduce", eager.EAGER_STEP_COLLECTIVE_BYTES)
            if tp > 1:
                dt_tensors = (c["embedding"] + 4.0 * c["attention"] + gated * c["dense_ffn"]
                              + (1.0 + (gated if arch.n_shared_experts > 0 else 0.0)) * c["moe"]
                              + (0.0 if arch.tie_embeddings else 1.0) * c["head"])
                st["optimizer"] += (eager.EAGER_DTENSOR_OPS_PER_PARAM_TENSOR * dt_tensors
                                    + eager.EAGER_DTENSOR_STEP_OPS) * dtensor_lat
        st["base"] = (m + slots) * st["t_mb"] + st["dp_step_exposed"] + st["optimizer"]
        st["dense_params"], st["expert_params"] = dense_p, expert_p
        stages[stage_name] = st

    bottleneck = "last" if stages["last"]["base"] > stages["first"]["base"] else "first"
    st = stages[bottleneck]
    nodes = math.ceil(devices / cluster.node_devices)
    factor = 1.0 + cluster.straggler.cv * math.sqrt(2.0 * math.log(max(nodes, 1)))
    step = st["base"] * factor
    breakdown = {
        "compute": m * st["compute"], "attention": m * st["attention"], "expert_gemm": m * st["expert_gemm"],
        "recompute": m * st["recompute"], "tp_exposed": m * st["tp_exposed"], "cp_exposed": m * st["cp_exposed"],
        "ep_exposed": m * st["ep_exposed"], "pp_exposed": m * st["pp_exposed"],
        "dp_exposed": m * st["fsdp_exposed"] + st["dp_step_exposed"], "dispatch": m * st["dispatch"],
        "bubble": slots * st["t_mb"], "optimizer": st["optimizer"], "straggler": st["base"] * (factor - 1.0),
        "tp_hidden": m * st["tp_hidden"], "cp_hidden": m * st["cp_hidden"], "ep_hidden": m * st["ep_hidden"],
        "pp_hidden": m * st["pp_hidden"], "dp_hidden": m * st["fsdp_hidden"] + st["dp_step_hidden"],
    }

    # ---- memory of each stage, the larger one counts
    memories = {name: _stage_memory(arch, lay, cluster, stage_counts[name], stages[name], name, m, b, w_bytes,
                                    T, T_sp, T_moe, M, h, h_q, h_kv, V, edp)
                for name in ("first", "last")}
    bigger = "last" if sum(memories["last"].values()) > sum(memories["first"].values()) else "first"
    memory = sum(memories[bigger].values())

    tokens_per_s = lay.gbs * s / step
    model_flops = float(model_flops_per_token(arch)) * tokens_per_s
    reason = "ok"
    if memory > cluster.accelerator.usable_hbm_bytes:
        reason = "memory"
    if dev.missing:
        reason = "precision"
    if devices > cluster.devices:
        reason = "devices"
    if violations(arch, lay, devices):
        reason = "invalid_layout"
    return {
        "step_time_s": step,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "mfu": model_flops / (devices * dev.gemm_peak),
        "tflops_per_device": model_flops / devices / 1e12,
        "memory_per_device_bytes": memory,
        "feasible": reason == "ok",
        "reason": reason,
        "devices": devices,
        "micro_batches": m,
        "bottleneck_stage": bottleneck,
        "breakdown": breakdown,
        "memory_breakdown": memories[bigger],
    }


def _stage_memory(arch: Any, lay: Any, cluster: Any, c: dict[str, float], st: dict[str, float], stage: str,
                  m: float, b: float, w_bytes: float, T: float, T_sp: float, T_moe: float, M: float, h: float,
                  h_q: float, h_kv: float, V: float, edp: float) -> dict[str, float]:
    """Korthikanti-style stored tensors, 1F1B in-flight micro-batches, sharded states."""
    tp, cp, dp, pp, vpp = lay.tp, lay.cp, lay.dp, lay.pp, lay.vpp
    dense_p, expert_p = st["dense_params"], st["expert_params"]
    fsdp = lay.dp_flavor == "fsdp"
    sharded = (dense_p / (dp * cp) + expert_p / edp)
    held = sharded if fsdp else dense_p + expert_p
    updated = sharded if lay.dp_flavor in ("zero1", "fsdp") else dense_p + expert_p
    up = 2.0 if arch.gated_ffn else 1.0
    fp8 = lay.precision in ("fp8", "mxfp8")
    g = 1.0 if fp8 else b                      # a tensor kept only as a GEMM input (TE fp8 copy)
    if lay.recompute == "selective":           # core_attn checkpointed: only out_proj's input stays
        kept = g * T * h_q / tp
    else:                                      # flash keeps its output (bf16) and fp32 log-sum-exp
        kept = (b + (g if fp8 else 0.0)) * T * h_q / tp + 4.0 * T * arch.n_heads / tp
    attention = (b + g) * T_sp * h + b * T * (h_q + 2 * h_kv) / tp + kept
    dense = (b + g) * T_sp * h + (b * up + g) * T * arch.d_ff_dense / tp
    shared = arch.n_shared_experts * arch.d_expert
    d_loc = arch.d_expert / lay.etp
    M_mean = M / LOAD_FACTOR                   # stored over many layers: the mean rows per rank
    moe = (2 * b * T_sp * h + 4.0 * T_moe * arch.n_experts + M_mean * (g * h + (b * up + g) * d_loc + 4.0)
           + (((g * T_sp * h) if fp8 else 0.0) + (b * up + g) * T * shared / tp if shared > 0 else 0.0))
    rank = 0 if stage == "first" else pp - 1
    held_mb = (pp - rank) if vpp == 1 else ((pp - rank - 1) * 2 + (vpp - 1) * pp + 1) / vpp
    held_mb = min(held_mb, m)
    if lay.recompute == "full":
        ffn_max = max(moe if c["moe"] > 0 else 0.0, dense if c["dense_ffn"] > 0 else 0.0)
        activations = held_mb * c["attention"] * b * T_sp * h + attention + ffn_max
    else:
        activations = held_mb * (c["attention"] * attention + c["dense_ffn"] * dense + c["moe"] * moe)
    layer_params = (dense_p + expert_p) / max(c["attention"], 1.0)
    gather_b = 4.0 if lay.precision == "fp32" else 2.0
    return {
        "weights": w_bytes * held,
        "gradients": GRAD_BYTES * held,
        "optimizer": (8.0 if lay.precision == "fp32" else 12.0) * updated,
        "activations": activations,
        "logits": c["head"] * (b + 4.0) * T * V / tp,
        "moe_buffers": 2 * b * M * h + b * T_moe * arch.top_k * h if c["moe"] > 0 else 0.0,
        "fsdp_buffers": layer_params * (2 * gather_b + GRAD_BYTES) if fsdp else 0.0,
        "framework": float(cluster.framework_overhead_bytes),
    }

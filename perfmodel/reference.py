"""A readable scalar reference of the performance model: one configuration, plain Python.

It restates, loop by loop, the formulas that `perfmodel.evaluate` applies to
numpy arrays, without sharing their code, so that
`tests/perfmodel/test_reference.py` can check the fast path against it on
random configurations. Its sections follow the vectorised modules, one each:
hardware (`perfmodel.hardware`), collectives (`perfmodel.comm`), operators
(`perfmodel.operators`), the host policy (`perfmodel.host`, chosen once per
cluster), block tables (`perfmodel.tables`), the stage schedule
(`perfmodel.stage`), memory (`perfmodel.memory`) and the result
(`perfmodel.evaluate`). Read the vectorised modules' docstrings for sources;
this file is the same model written for a person to follow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from perfmodel import eager
from perfmodel.routing import erf, expected_max_normal
from perfmodel.specs.architecture import MoEArchitecture, model_flops_per_token, model_flops_per_token_palm
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.layout import ParallelLayout
from perfmodel.specs.stages import virtual_stage_layers
from perfmodel.validity import violations

# The special functions erf and z_n (the expected maximum of n standard normals) come from
# perfmodel.routing, as math functions would; every formula built on them is restated here.
FLASH_BWD = 2.5             # flash-attention backward / forward FLOPs
CAUSAL = 0.5                # causal kernels skip half the scores
GRAD_BYTES = 4.0            # fp32 main gradients
BUCKET_PARAMS = 40e6        # Megatron DDP bucket
OPT_KERNELS_PER_LAYER = 3.0
LAYER_BLOCKS = ("attention", "dense_ffn", "moe")
CATEGORIES = ("compute", "attention", "expert_gemm")

Op = dict[str, Any]
"""One operator: name, kind, overlap, flops/bytes/kernels per phase (fwd, dgrad, wgrad), sizes."""
CommItem = tuple[str, str, str, float]
"""(group, kind, phase, bytes) of one collective per micro-batch."""
Coll = Callable[[str, str, float], float]
"""Seconds of a collective: (group, kind, bytes) -> s."""


# ---------------------------------------------------------------------------
# Hardware (perfmodel.hardware)

class _Device:
    """Peaks, curves and bandwidth of one rank for one precision."""

    def __init__(self, cluster: ClusterSpec, precision: str, share: float) -> None:
        acc = cluster.accelerator
        self.acc = acc
        self.share = share
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
        k = acc.kernels
        self.gemm = k.gemm[k.precision("gemm", precision)]
        self.gemm_hp = k.gemm[k.precision("gemm", attn_precision)]
        self.grouped = k.grouped_gemm[k.precision("grouped_gemm", precision)]
        self.attention = k.attention[k.precision("attention", attn_precision)]
        self.memory = k.memory
        self.launch_latency_s = acc.launch_latency_s / self.share  # ranks sharing a CPU core dispatch in turns

    def memory_seconds(self, nbytes: float, kernels: float, kernel_class: str = "copy") -> float:
        """bytes / (HBM bw x fraction[class] x s(bytes per kernel)), i.e. (bytes + kernels x
        bytes_half) / (HBM bw x fraction[class])."""
        if nbytes <= 0:
            return 0.0
        per_kernel = nbytes / max(kernels, 1.0)
        eff = self.memory.fraction[kernel_class] * per_kernel / (per_kernel + self.memory.bytes_half)
        return nbytes / (self.acc.hbm_bandwidth_bytes_per_s * eff)

    @staticmethod
    def _gemm_eff(fig: Any, m: float, n: float, k: float) -> float:
        return fig.e_max * m / (m + fig.m_half) * n / (n + fig.n_half) * k / (k + fig.k_half)

    def op_phase_seconds(self, op: Op) -> list[float]:
        """Memory-bound: each phase's bytes at its class's efficiency. GEMM: each phase
        max(FLOPs / (peak x eff(that phase's m, n, k)), operand bytes as copies); the input
        gradient reduces over n, the weight gradient over the m tokens. Attention: fwd / bwd at
        e_max[phase] s(seq) s(head dim)."""
        if op["kind"] == "memory":
            return [self.memory_seconds(op["bytes"][j], op["kernels"][j], op["class"]) for j in range(3)]
        seconds = []
        for j in range(3):
            if op["flops"][j] == 0 and op["bytes"][j] == 0:
                seconds.append(0.0)
                continue
            if op["kind"] == "attention":
                seq, dim = op["shape"][0], op["shape"][1]
                fig = self.attention
                e_max = fig.fwd_e_max if j == 0 else fig.bwd_e_max
                rate = self.attn_peak * e_max * seq / (seq + fig.seq_half_causal) * dim / (dim + fig.head_dim_half)
            else:
                m, n, k = op["shape"]
                dims = ((m, n, k), (m, k, n), (k, n, m))[j]     # fwd, dgrad, wgrad
                if op["kind"] == "expert_gemm":
                    fig, peak = (self.grouped.fwd, self.grouped.dgrad, self.grouped.wgrad)[j], self.gemm_peak
                elif op["kind"] == "gemm_hp":   # bf16 even under fp8
                    fig, peak = self.gemm_hp, self.attn_peak
                else:
                    fig, peak = self.gemm, self.gemm_peak
                rate = peak * self._gemm_eff(fig, *dims)
            compute_s = op["flops"][j] / rate if op["flops"][j] > 0 else 0.0
            operand_s = op["bytes"][j] / (self.acc.hbm_bandwidth_bytes_per_s * self.memory.fraction["copy"])
            seconds.append(max(compute_s, operand_s))
        return seconds


# ---------------------------------------------------------------------------
# Collectives (perfmodel.comm)

def _ceil_log2(x: float) -> float:
    return float(math.ceil(math.log2(x) - 1e-9)) if x > 1 else 0.0


def _line_seconds(cluster: ClusterSpec, kind: str, nbytes: float, n: float, stride: float, low_latency: bool) -> float:
    worst_s, latency_s, inside_prev, alpha_s, sync_s = 0.0, 0.0, 1.0, 0.0, 0.0
    for j, level in enumerate(cluster.levels):
        step = level.ll_latency_of(kind) if low_latency else level.latency_of(kind)
        eff = level.ll_efficiency_of(kind) if low_latency else level.efficiency_of(kind)
        alpha_s = max(alpha_s, step)
        if j == len(cluster.levels) - 1:
            inside = n
        else:
            inside = max(min(n, max(1.0, math.floor(level.devices / stride))), inside_prev)
        fan = inside / inside_prev
        if kind == "all_reduce":
            moved, steps = 2.0 * (fan - 1.0) / fan * nbytes / inside_prev, 2.0 * _ceil_log2(fan)
        elif kind in ("all_gather", "reduce_scatter"):   # a ring over all n ranks, on the levels it crosses
            moved, steps = ((n - 1.0) / n * nbytes / inside_prev if fan > 1 else 0.0), _ceil_log2(fan)
        elif kind == "all_to_all":
            moved, steps = (inside - inside_prev) / n * nbytes, _ceil_log2(fan)
        else:
            moved, steps = (nbytes, 1.0) if fan > 1 else (0.0, 0.0)
        worst_s = max(worst_s, moved / (level.bandwidth_bytes_per_s * eff))
        latency_s += steps * alpha_s
        if inside > inside_prev and kind != "p2p":
            sync_s = max(sync_s, level.sync_latency_s)
        inside_prev = inside
    return worst_s + latency_s + sync_s


def collective_seconds(cluster: ClusterSpec, kind: str, nbytes: float, n: float, stride: float) -> float:
    """Hierarchical alpha-beta: max over levels of bytes/bandwidth, plus alpha per tree step; the
    faster of the bandwidth protocol and (where a level has its figures) the low-latency one."""
    n, stride = max(n, 1.0), max(stride, 1.0)
    if n <= 1 or nbytes <= 0:
        return 0.0
    seconds = _line_seconds(cluster, kind, nbytes, n, stride, low_latency=False)
    if any(level.has_low_latency(kind) for level in cluster.levels):
        seconds = min(seconds, _line_seconds(cluster, kind, nbytes, n, stride, low_latency=True))
    return seconds


def _groups(lay: ParallelLayout) -> dict[str, tuple[float, float]]:
    """(size, stride) of each process group in Megatron rank order (tp, cp, dp, pp; etp, ep, edp)."""
    tp, cp, ep, etp, pp, dp = lay.tp, lay.cp, lay.ep, lay.etp, lay.pp, lay.dp
    edp = max(tp * cp * dp / (etp * ep), 1.0)
    return {"tp": (tp, 1), "cp": (cp, tp), "ep": (ep, etp), "etp": (etp, 1), "ep_etp": (ep * etp, 1), "dp": (dp * cp, tp),
            "edp": (edp, etp * ep), "pp": (2 if pp > 1 else 1, tp * cp * dp), "pp_all": (pp, tp * cp * dp),
            "world": (tp * cp * dp * pp, 1)}


# ---------------------------------------------------------------------------
# Operators (perfmodel.operators)

@dataclass(frozen=True)
class _Sizes:
    """Element sizes, widths and token counts of one micro-batch on one rank."""

    b: float        # activation bytes
    b_in: float     # GEMM operand bytes
    w_bytes: float  # weight bytes per parameter
    h: float
    V: float
    s: float
    h_q: float
    h_kv: float
    E: float
    k: float
    T: float        # tokens on this rank: mbs * s / cp
    T_sp: float     # tokens a norm sees
    T_moe: float    # tokens this rank routes
    M: float        # rows of the busiest rank's grouped expert GEMM
    E_local: float
    up: float       # up-projection width factor (2 gated)
    M_mean: float   # mean rows per expert-parallel rank
    M_kept: float   # rows a rank stores on average (capacity: not dropped, or padded)
    rows: float     # busiest rank's rows / mean
    drop: float     # fraction of copies a capacity factor drops


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + float(erf(x / math.sqrt(2.0))))


def _busiest(E: float, k: float, g: float, N: float) -> float:
    """Busiest of g expert groups over the mean, uniform routing: 1 + q_g sqrt(g (E-k) / ((E-1) N k)),
    q_g = z_g + gamma (z_g^2 - 1) / 6 with gamma the skewness of Binomial(N k, 1/g)."""
    if E <= 1 or k <= 0 or g <= 1 or N <= 0:
        return 1.0
    z = float(expected_max_normal(g))
    gamma = (1.0 - 2.0 / g) / math.sqrt(N * k * (1.0 / g) * (1.0 - 1.0 / g))
    return 1.0 + (z + gamma * (z * z - 1.0) / 6.0) * math.sqrt(g * max(E - k, 0.0) / (max(E - 1.0, 1.0) * N * k))


def _dropped(E: float, k: float, T: float, c: float) -> float:
    """E[(Y - C)+] / E[Y] for Y ~ Normal(T k/E, T (k/E)(1 - k/E)), C = c T k / E."""
    if E <= 0 or k <= 0 or c <= 0 or T <= 0:
        return 0.0
    p = k / E
    mu = T * p
    sd = math.sqrt(max(T * p * (1.0 - p), 1e-300))
    a = (c * mu - mu) / sd
    pdf = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    return min(max(sd * (pdf - a * (1.0 - _normal_cdf(a))) / mu, 0.0), 1.0)


def _hit(E: float, k: float, g: float) -> float:
    """P(a token has one of its k experts in a given one of g groups) = 1 - C(E - E/g, k) / C(E, k)."""
    if E <= 0:
        return 0.0
    g = max(g, 1.0)
    miss = 1.0
    for i in range(int(k)):
        miss *= min(max((E - E / g - i) / max(E - i, 1.0), 0.0), 1.0)
    return 1.0 - miss


def _sizes(arch: MoEArchitecture, lay: ParallelLayout) -> _Sizes:
    b = 4.0 if lay.precision == "fp32" else 2.0
    h_q, h_kv = float(arch.n_heads * arch.head_dim), float(arch.n_kv_heads * arch.head_dim)
    k = float(arch.top_k)
    T = lay.mbs * float(arch.seq_len) / lay.cp
    T_moe = T / lay.tp
    E = float(arch.n_experts)
    load = _busiest(E, k, float(lay.ep), lay.etp * lay.ep * T_moe)
    c = lay.capacity_factor or 0.0
    if c > 0:
        rows = c if lay.pad_to_capacity else min(load, c)
    else:
        rows = load
    drop = _dropped(E, k, T_moe, c)
    M_mean = lay.etp * T_moe * k
    kept = (c if lay.pad_to_capacity else 1.0 - drop) if c > 0 else 1.0
    return _Sizes(b=b, b_in=1.0 if lay.precision in ("fp8", "mxfp8") else b,
                  w_bytes={"fp32": 4.0, "fp8": 3.0, "mxfp8": 3.0}.get(lay.precision, 2.0),
                  h=float(arch.d_model), V=float(arch.vocab_size), s=float(arch.seq_len), h_q=h_q, h_kv=h_kv,
                  E=E, k=k, T=T, T_sp=T / lay.tp if lay.sequence_parallel else T, T_moe=T_moe,
                  M=M_mean * rows, E_local=max(E / lay.ep, 1.0),
                  up=2.0 if arch.gated_ffn else 1.0, M_mean=M_mean, M_kept=M_mean * kept, rows=rows, drop=drop)


def _gemm(name: str, kind: str, m: float, k: float, n: float, b_in: float, b_out: float, groups: float = 1.0) -> Op:
    flops = 2.0 * m * k * n
    return {"name": name, "kind": kind, "overlap": True, "shape": (m / groups, n, k),
            "flops": (flops, flops, flops),
            "bytes": (b_in * (m * k + k * n) + b_out * m * n,
                      b_in * (m * n + k * n) + b_out * m * k,
                      b_in * (m * k + m * n) + 2 * GRAD_BYTES * k * n),
            "kernels": (groups, groups, groups)}     # TE grouped GEMM: one cuBLAS call per expert


MEMORY_CLASS = {"attn_norm": "norm", "ffn_norm": "norm", "moe_norm": "norm", "final_norm": "norm",
                "ffn_act": "activation", "expert_act": "activation", "shared_act": "activation",
                "permute": "permute", "unpermute_combine": "permute", "embedding": "permute",
                "cross_entropy": "cross_entropy", "fp8_cast": "cast"}   # the rest: elementwise


def _mem(name: str, fwd: float, bwd: float, kf: float = 1.0, kb: float = 1.0) -> Op:
    return {"name": name, "kind": "memory", "overlap": False, "class": MEMORY_CLASS.get(name, "elementwise"),
            "flops": (0.0, 0.0, 0.0), "bytes": (fwd, bwd, 0.0), "kernels": (kf, kb, 0.0)}


def _block_ops(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes) -> dict[str, list[Op]]:
    """Every block's operators for one micro-batch on one rank."""
    tp, etp = lay.tp, lay.etp
    b, b_in, h, V, T, T_sp, T_moe, M = z.b, z.b_in, z.h, z.V, z.T, z.T_sp, z.T_moe, z.M
    h_q, h_kv, E, k, up = z.h_q, z.h_kv, z.E, z.k, z.up

    def act(rows: float, width: float) -> tuple[float, float]:
        return ((3.0 if arch.gated_ffn else 2.0) * rows * width * b, (5.0 if arch.gated_ffn else 3.0) * rows * width * b)

    # fp8 quantisation kernels (operators.py "FP8 casts"): bytes and kernels per element
    cast_b, cast_k = {"fp8": (2.0 * b + 2.0, 2.0), "mxfp8": (b + 2.0 * (1.0 + 1.0 / 32.0), 1.0)}.get(
        lay.precision, (0.0, 0.0))

    def cast(fwd_elements: float, bwd_elements: float, n_fwd: float, n_bwd: float) -> Op:
        op = _mem("fp8_cast", cast_b * fwd_elements, cast_b * bwd_elements, cast_k * n_fwd, cast_k * n_bwd)
        return op

    def mlp(prefix: str, width: float) -> list[Op]:
        af, ab = act(T, width / tp)
        ops = [_gemm(f"{prefix}_up", "gemm", T, h, up * width / tp, b_in, b), _mem(f"{prefix}_act", af, ab),
               _gemm(f"{prefix}_down", "gemm", T, width / tp, h, b_in, b)]
        if width == 0:   # no shared experts: nothing is launched
            for op in ops:
                op["kernels"] = (0.0, 0.0, 0.0)
        return ops

    norm_f, norm_b = 2.0 * b * T_sp * h, 3.0 * b * T_sp * h
    core = 4.0 * CAUSAL * T * z.s * h_q / tp
    blocks: dict[str, list[Op]] = {
        "attention": _mla_ops(arch, lay, z, norm_f, norm_b, cast) if arch.kv_lora_rank > 0 else [
            _mem("attn_norm", norm_f, norm_b),
            _gemm("qkv_proj", "gemm", T, h, (h_q + 2 * h_kv) / tp, b_in, b),
            _mem("rope", 2.0 * b * T * (h_q + h_kv) / tp, 2.0 * b * T * (h_q + h_kv) / tp),
            {"name": "core_attention", "kind": "attention", "overlap": True, "flops": (core, FLASH_BWD * core, 0.0),
             "shape": (z.s / lay.cp, float(arch.head_dim), 0.0),
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
    if lay.dispatcher == "alltoall":   # permute the copies before, un-permute after the all-to-alls
        permute = _mem("permute", 2.0 * b * copies * h, 2.0 * b * copies * h, 2.0, 2.0)
        unpermute = _mem("unpermute_combine", b * (2 * copies + T_moe) * h, b * (3 * copies + T_moe) * h, 2.0, 3.0)
    elif lay.dispatcher == "hybridep":  # both fused into its dispatch and combine kernels
        permute = _mem("permute", 0.0, 0.0, 0.0, 0.0)
        unpermute = _mem("unpermute_combine", 0.0, 0.0, 0.0, 0.0)
    else:   # allgather: pick the local copies of the gathered tokens; deepep: order the received rows
        back = lay.etp * lay.ep * T_moe if lay.dispatcher == "allgather" else \
            lay.ep * T_moe * _hit(E, k, lay.ep) * z.rows
        permute = _mem("permute", 2.0 * b * M * h, 2.0 * b * M * h, 2.0, 2.0)
        unpermute = _mem("unpermute_combine", b * (2 * M + back) * h, b * (3 * M + back) * h, 2.0, 3.0)
    blocks["moe"] = [
        _mem("moe_norm", norm_f, norm_b),
        _gemm("router", "gemm_hp", T_moe, h, E, b, 4.0),
        _mem("router_topk", 8.0 * T_moe * E, 12.0 * T_moe * E, 3.0, 3.0),
        _mem("router_aux_loss", 13.0 * T_moe * E, 16.0 * T_moe * E, 4.0, 2.0),   # Switch balancing loss
        permute,
        _gemm("expert_up", "expert_gemm", M, h, up * d_loc, b_in, b, z.E_local),
        _mem("expert_act", ef, eb),
        _gemm("expert_down", "expert_gemm", M, d_loc, h, b_in, b, z.E_local),
        unpermute,
        *mlp("shared", float(arch.n_shared_experts * arch.d_expert)),
        _mem("moe_residual", norm_b, norm_b),
    ]
    shared_w = arch.n_shared_experts * arch.d_expert / tp
    if shared_w > 0:
        blocks["moe"].append(cast(M * (h + d_loc) + T * (h + shared_w), M * (h + up * d_loc) + T * (h + up * shared_w),
                                  4.0, 4.0))
    else:
        blocks["moe"].append(cast(M * (h + d_loc), M * (h + up * d_loc), 2.0, 2.0))
    if arch.n_mtp_layers > 0:   # the MTP module's own ops: two norms, the 2h -> h projection
        blocks["mtp"] = [_mem("mtp_norms", 2.0 * norm_f, 2.0 * norm_b, 2.0, 2.0),
                         _gemm("mtp_proj", "gemm", T, 2.0 * h, h / tp, b_in, b),
                         cast(T * 2.0 * h, T * h / tp, 1.0, 1.0)]
    return blocks


def _mla_ops(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes, norm_f: float, norm_b: float,
             cast: Callable[..., Op]) -> list[Op]:
    """Multi-head latent attention (operators.mla_attention_ops): down projections on the shard,
    latent norms, up projections over the heads of this rank, RoPE, the core, output projection."""
    tp, b, b_in, T, T_sp, h = lay.tp, z.b, z.b_in, z.T, z.T_sp, z.h
    H, d_q, d_r, d_v = float(arch.n_heads), float(arch.head_dim), float(arch.qk_rope_head_dim), float(arch.v_head_dim)
    r_q, r_kv = float(arch.q_lora_rank), float(arch.kv_lora_rank)
    ops = [_mem("attn_norm", norm_f, norm_b)]
    if r_q > 0:
        ops += [_gemm("q_down", "gemm", T_sp, h, r_q, b_in, b), _mem("q_norm", 2 * b * T * r_q, 3 * b * T * r_q),
                _gemm("q_up", "gemm", T, r_q, H * d_q / tp, b_in, b)]
    else:
        ops.append(_gemm("q_proj", "gemm", T, h, H * d_q / tp, b_in, b))
    core = 2.0 * CAUSAL * T * z.s * H * (d_q + d_v) / tp
    rope = 2.0 * b * T * (H * d_r / tp + d_r)
    ops += [
        _gemm("kv_down", "gemm", T_sp, h, r_kv + d_r, b_in, b),
        _mem("kv_norm", 2 * b * T * r_kv, 3 * b * T * r_kv),
        _gemm("kv_up", "gemm", T, r_kv, H * (d_q - d_r + d_v) / tp, b_in, b),
        _mem("mla_rope", rope, rope),
        {"name": "core_attention", "kind": "attention", "overlap": True, "flops": (core, FLASH_BWD * core, 0.0),
         "shape": (z.s / lay.cp, d_q, 0.0),
         "bytes": (b * T * H * (2 * d_q + 2 * d_v) / tp + 4.0 * T * H / tp,
                   b * T * H * (4 * d_q + 4 * d_v) / tp + 4.0 * T * H / tp, 0.0),
         "kernels": (1.0, 2.0, 0.0)},
        _gemm("out_proj", "gemm", T, H * d_v / tp, h, b_in, b),
        cast((2.0 * T_sp * h if r_q > 0 else T * h + T_sp * h) + T * H * d_v / tp,
             (T_sp * r_q if r_q > 0 else 0.0) + T_sp * (r_kv + d_r) + T * H * d_q / tp
             + T * H * (d_q - d_r + d_v) / tp + T * h, 3.0, 5.0 if r_q > 0 else 4.0),
        _mem("attn_residual", norm_b, norm_b),
    ]
    return ops


def _megatron_comms(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes) -> dict[str, list[CommItem]]:
    """Collectives per block per micro-batch of Megatron-Core (operators.layer_comms)."""
    b, T, h, tp = z.b, z.T, z.h, lay.tp
    hidden_b = b * T * h
    sp = lay.sequence_parallel
    if arch.kv_lora_rank > 0:   # MLA: latents gathered (sp) or their gradients reduced; K, V over cp
        H, d_q, d_v = arch.n_heads, arch.head_dim, arch.v_head_dim
        latent = (arch.q_lora_rank or arch.d_model) + arch.kv_lora_rank + arch.qk_rope_head_dim
        kv = b * lay.cp * T * H * (d_q + d_v) / tp
        attn_tp = ([("tp", "all_gather", "fwd", b * T * latent), ("tp", "reduce_scatter", "fwd", hidden_b),
                    ("tp", "reduce_scatter", "bwd", b * T * latent), ("tp", "all_gather", "bwd", hidden_b)] if sp
                   else [("tp", "all_reduce", "fwd", hidden_b), ("tp", "all_reduce", "bwd", b * T * latent)])
    else:
        kv = b * lay.cp * T * 2 * z.h_kv / tp
        attn_tp = [("tp", "all_reduce", "fwd", hidden_b), ("tp", "all_reduce", "bwd", hidden_b)]
    if lay.dispatcher == "alltoall":
        dispatch = [("ep", "all_to_all", ph, b * z.T_moe * z.k * h * z.rows) for ph in ("fwd", "fwd", "bwd", "bwd")]
    elif lay.dispatcher == "allgather":   # tokens + routing (bool + fp32 per expert) over etp*ep, output back
        n = lay.etp * lay.ep * z.T_moe
        dispatch = [("ep_etp", "all_gather", "fwd", b * n * h + 5.0 * n * z.E), ("ep_etp", "reduce_scatter", "fwd", b * n * h),
                    ("ep_etp", "all_gather", "bwd", b * n * h), ("ep_etp", "reduce_scatter", "bwd", b * n * h)]
    else:   # fused dispatch/combine: priced from the cluster's measured figures (_fused_seconds)
        dispatch = [("ep", f"fused:{call}", call.rsplit("_", 1)[1], 1.0 if lay.ep > 1 else 0.0)
                    for call in ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd")]
    etp_b = 0.0 if lay.dispatcher == "allgather" else b * z.M * h
    comms = {
        "attention": attn_tp + [("cp", "all_gather", "fwd", kv), ("cp", "all_gather", "bwd", kv),
                                ("cp", "reduce_scatter", "bwd", kv)],
        "dense_ffn": [("tp", "all_reduce", "fwd", hidden_b), ("tp", "all_reduce", "bwd", hidden_b)],
        "moe": dispatch
               + [("etp", kind, ph, etp_b) for ph in ("fwd", "bwd") for kind in ("all_gather", "reduce_scatter")]
               + [("tp", "all_reduce", ph, hidden_b if arch.n_shared_experts > 0 else 0.0) for ph in ("fwd", "bwd")],
        "embedding": [("tp", "reduce_scatter" if sp else "all_reduce", "fwd", hidden_b)],
        "head": ([("tp", "all_gather", "fwd", hidden_b), ("tp", "reduce_scatter", "bwd", hidden_b)] if sp
                 else [("tp", "all_reduce", "bwd", hidden_b)]) + [("tp", "all_reduce", "fwd", 4.0 * T)] * 3,
    }
    if arch.n_mtp_layers > 0:   # the MTP projection's tp reduction, as an MLP's
        comms["mtp"] = [("tp", "all_reduce", "fwd", hidden_b), ("tp", "all_reduce", "bwd", hidden_b)]
    return comms


def _fused_seconds(cluster: ClusterSpec, arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes, call: str
                   ) -> tuple[float, float, bool]:
    """(seconds, compute share, priced) of one fused call (perfmodel.dispatch): latency + bytes /
    bandwidth at the outermost level the EP group (ep ranks at stride etp) spans; bytes = received
    rows (ep T_moe P(rank hit) f) or rows sent off-node (T_moe (nodes - 1) P(node hit) f), x h x
    element bytes (the forward dispatch under fp8: 1 + 4/128)."""
    if lay.ep <= 1:
        return 0.0, 0.0, True
    span, inner, inside_prev = None, 1.0, 1.0
    for j, level in enumerate(cluster.levels):
        if j == len(cluster.levels) - 1:
            inside = float(lay.ep)
        else:
            inside = max(min(float(lay.ep), max(1.0, math.floor(level.devices / lay.etp))), inside_prev)
        if inside > inside_prev:
            span, inner = level.name, inside_prev
        inside_prev = inside
    fig = cluster.ep_dispatch.get(lay.dispatcher, {}).get(span or "")
    if fig is None:
        return 0.0, 0.0, False
    if fig.traffic == "off_node":
        nodes = lay.ep / max(inner, 1.0)
        rows = z.T_moe * (nodes - 1.0) * _hit(z.E, z.k, nodes) * z.rows
    else:
        rows = lay.ep * z.T_moe * _hit(z.E, z.k, float(lay.ep)) * z.rows
    elem = (1.0 + 4.0 / 128.0) if (call == "dispatch_fwd" and lay.precision in ("fp8", "mxfp8")) else z.b
    return fig.latency_s + rows * z.h * elem / fig.bandwidth_bytes_per_s, fig.sm_fraction, True


# ---------------------------------------------------------------------------
# Host policy (perfmodel.host): chosen once per cluster

@dataclass(frozen=True)
class _StageView:
    """What the host policy reads of one stage: blocks held, their table sums, recompute."""

    arch: MoEArchitecture
    lay: ParallelLayout
    c: dict[str, float]
    tot: Callable[..., float]
    full: bool
    selective: bool
    m: float
    recomputed: Callable[[str], float]
    """Sum over the checkpointed modules of an entry (fwd, fwd_overlap, kernels) of their ops."""

    @property
    def reruns(self) -> bool:
        """The host runs each layer's forward again: full recompute or torchtitan's op policy."""
        return self.full or "op" in _recomputed_modules(self.lay)


class _AsyncHost:
    """An accelerator host enqueues ahead of the device: only launch time beyond device time
    shows; each routed MoE layer forward (recomputed too) waits one device-to-host read."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.sync_s = cluster.accelerator.host_sync_latency_s

    def share(self, devices: int) -> float:
        return 1.0

    def block_comms(self, arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes,
                    comms: dict[str, list[CommItem]]) -> dict[str, list[CommItem]]:
        return comms

    def phase_kernels(self, st: _StageView) -> tuple[float, float]:
        fwd = st.tot("fwd_kernels") + st.tot("fwd_comm_kernels")
        bwd = st.tot("bwd_kernels") + st.tot("bwd_comm_kernels") + (
            st.tot("fwd_kernels", LAYER_BLOCKS) if st.full else
            (st.recomputed("kernels") if st.selective else 0.0))
        return fwd, bwd

    def dispatch_s(self, st: _StageView, fwd_kernels: float, bwd_kernels: float, fwd_device_s: float,
                   bwd_device_s: float, dev: _Device) -> float:
        lat = dev.launch_latency_s
        syncs = (st.c["moe"] if st.arch.n_experts > 0 and self.sync_s is not None else 0.0) * (2.0 if st.reruns else 1.0)
        return (max(fwd_kernels * lat - fwd_device_s, 0.0) + max(bwd_kernels * lat - bwd_device_s, 0.0)
                + syncs * ((self.sync_s or 0.0) + lat))

    def optimizer_s(self, st: _StageView, optimizer_bytes: float, dev: _Device, coll: Coll) -> float:
        kernels = OPT_KERNELS_PER_LAYER * max(st.c["attention"], 1.0)
        return max(dev.memory_seconds(optimizer_bytes, kernels, "optimizer"), kernels * dev.launch_latency_s)


class _EagerHost:
    """CPU ranks run the bundled trainer in eager PyTorch: each rank launches and runs its own ops."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cores = cluster.host_cores
        acc = cluster.accelerator
        self.dtensor_s = acc.dtensor_op_latency_s or 0.0
        self.region_s, self.per_saved_s = acc.checkpoint_region_latency_s or 0.0, acc.checkpoint_saved_tensor_latency_s or 0.0

    def share(self, devices: int) -> float:
        return min(1.0, self.cores / devices)

    def block_comms(self, arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes,
                    comms: dict[str, list[CommItem]]) -> dict[str, list[CommItem]]:
        """Without sequence parallel the trainer's own tp collectives replace Megatron's; expert
        parallel adds the count exchange (int64 per expert)."""
        comms = dict(comms)
        hidden_b = z.b * z.T * z.h
        if not lay.sequence_parallel:
            gated_n = 2 if arch.gated_ffn else 1
            sh_b = hidden_b if arch.n_shared_experts > 0 else 0.0
            trainer_tp = {
                "attention": [("fwd", "all_reduce", hidden_b)] + [("bwd", "all_reduce", hidden_b)] * 3,
                "dense_ffn": [("fwd", "all_reduce", hidden_b)] + [("bwd", "all_reduce", hidden_b)] * gated_n,
                "moe": [("fwd", "all_reduce", 4.0 * arch.n_experts), ("fwd", "all_gather", hidden_b),
                        ("bwd", "all_gather", hidden_b), ("fwd", "all_gather", sh_b), ("fwd", "reduce_scatter", sh_b),
                        ("bwd", "all_gather", sh_b)] + [("bwd", "all_reduce", sh_b)] * gated_n,
                "embedding": [("fwd", "all_reduce", hidden_b)],
                "head": [("fwd", "all_gather", z.b * z.T * arch.vocab_size), ("bwd", "all_reduce", hidden_b)],
            }
            for block, extra in trainer_tp.items():
                comms[block] = ([c for c in comms[block] if c[0] != "tp"]
                                + [("tp", kind, phase, size) for phase, kind, size in extra])
            if "mtp" in comms:   # the trainer has no MTP module: no tp collective of its own
                comms["mtp"] = [c for c in comms["mtp"] if c[0] != "tp"]
        comms["moe"] = comms["moe"] + [("ep", "all_to_all", "fwd", 8.0 * arch.n_experts)]
        return comms

    def phase_kernels(self, st: _StageView) -> tuple[float, float]:
        """The bundled trainer's op counts (perfmodel.eager)."""
        arch, c = st.arch, st.c
        ops = _eager_ops(arch)
        ep_fwd, ep_bwd = eager.EAGER_EP_OPS if st.lay.ep > 1 else (0.0, 0.0)
        fwd = st.tot("fwd_comm_kernels") + sum(c[blk] * ops[blk][0] for blk in ops) + ep_fwd * c["moe"]
        bwd = st.tot("bwd_comm_kernels") + sum(c[blk] * ops[blk][1] for blk in ops) + ep_bwd * c["moe"]
        if st.reruns:
            bwd += (sum(c[blk] * ops[blk][0] for blk in LAYER_BLOCKS) + ep_fwd * c["moe"]
                    + eager.EAGER_FULL_RECOMPUTE_OPS * c["attention"])
        elif st.selective:
            bwd += eager.EAGER_SELECTIVE_RECOMPUTE_OPS * c["attention"]
        return fwd, bwd

    def dispatch_s(self, st: _StageView, fwd_kernels: float, bwd_kernels: float, fwd_device_s: float,
                   bwd_device_s: float, dev: _Device) -> float:
        """A CPU rank launches and runs its own kernels: launch time adds, DTensor and checkpoint costs too."""
        arch, c = st.arch, st.c
        dispatch_s = (fwd_kernels + bwd_kernels) * dev.launch_latency_s
        if st.lay.tp > 1:                       # the trainer's tensor-parallel modules are DTensors
            dt = _dtensor_ops(arch)
            dt_mb = sum(c[blk] * (dt[blk][0] + dt[blk][1]) for blk in dt)
            if st.reruns:
                dt_mb += eager.EAGER_DTENSOR_FULL_RECOMPUTE_FACTOR * sum(c[blk] * dt[blk][0] for blk in LAYER_BLOCKS)
            dispatch_s += dt_mb * (self.dtensor_s / dev.share)
        if st.reruns:
            ffn_saved = (15.0 if arch.gated_ffn else 11.0) * c["dense_ffn"] + (
                30.0 + (9.0 if arch.n_shared_experts > 0 else 0.0)
                - (9.0 if arch.n_shared_experts > 0 and not arch.gated_ffn else 0.0)) * c["moe"]
            dispatch_s += (c["attention"] * self.region_s + self.per_saved_s * (23.0 * c["attention"] + ffn_saved)) / dev.share
        elif st.selective:
            dispatch_s += c["attention"] * (self.region_s + self.per_saved_s * 5.0) / dev.share
        return dispatch_s

    def optimizer_s(self, st: _StageView, optimizer_bytes: float, dev: _Device, coll: Coll) -> float:
        """Every parameter tensor's AdamW + norm ops, the per-step bookkeeping ops and all-reduces."""
        arch, c = st.arch, st.c
        gated = 3.0 if arch.gated_ffn else 2.0
        tensors = (c["embedding"] + 5.0 * c["attention"] + (1.0 + gated) * c["dense_ffn"]
                   + (2.0 + gated + (gated if arch.n_shared_experts > 0 else 0.0)) * c["moe"]
                   + (1.0 if arch.tie_embeddings else 2.0) * c["head"])
        kernels = (eager.EAGER_OPS_PER_PARAM_TENSOR * tensors + eager.EAGER_STEP_OPS
                   + eager.EAGER_STEP_OPS_PER_MOE_LAYER * c["moe"] + eager.EAGER_OPS_PER_MICRO_BATCH * st.m)
        seconds = dev.memory_seconds(optimizer_bytes, kernels, "optimizer") + kernels * dev.launch_latency_s
        # the trainer's per-step small all-reduces: token count, statistics, gradient-norm parts
        for group, count in (("dp", 1.0), ("world", 1.0), ("tp", 2.0), ("ep", 1.0), ("etp", 1.0), ("pp_all", 1.0)):
            seconds += count * coll(group, "all_reduce", eager.EAGER_STEP_COLLECTIVE_BYTES)
        if st.lay.tp > 1:
            dt_tensors = (c["embedding"] + 4.0 * c["attention"] + gated * c["dense_ffn"]
                          + (1.0 + (gated if arch.n_shared_experts > 0 else 0.0)) * c["moe"]
                          + (0.0 if arch.tie_embeddings else 1.0) * c["head"])
            seconds += (eager.EAGER_DTENSOR_OPS_PER_PARAM_TENSOR * dt_tensors
                        + eager.EAGER_DTENSOR_STEP_OPS) * (self.dtensor_s / dev.share)
        return seconds


def _host(cluster: ClusterSpec) -> Union[_AsyncHost, _EagerHost]:
    return _AsyncHost(cluster) if cluster.host_cores is None else _EagerHost(cluster)


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


# ---------------------------------------------------------------------------
# Block tables (perfmodel.tables)

_RECOMPUTED_OPS = {"core_attn": ("core_attention",), "mla_up_proj": ("q_norm", "q_up", "kv_norm", "kv_up", "mla_rope"),
                   "layernorm": ("attn_norm", "ffn_norm", "moe_norm"), "moe_act": ("expert_act",),
                   "mlp": ("ffn_up", "ffn_act", "ffn_down")}
"""The ops each selective recompute module runs again (Megatron-Core --recompute-modules)."""


def _op_sac_calls(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes, block: str
                  ) -> list[tuple[str, float, float, bool]]:
    """torchtitan's matmul calls of one block in order: (op, FLOP share, output elements, aten.mm)."""
    tp, lowp = lay.tp, lay.precision not in ("fp8", "mxfp8")
    if block == "attention":
        if arch.kv_lora_rank > 0:
            H, d_q, d_r, d_v = arch.n_heads, arch.head_dim, arch.qk_rope_head_dim, arch.v_head_dim
            q = ([("q_down", 1.0, z.T_sp * arch.q_lora_rank, lowp), ("q_up", 1.0, z.T * H * d_q / tp, lowp)]
                 if arch.q_lora_rank > 0 else [("q_proj", 1.0, z.T * H * d_q / tp, lowp)])
            return q + [("kv_down", 1.0, z.T_sp * (arch.kv_lora_rank + d_r), lowp),
                        ("kv_up", 1.0, z.T * H * (d_q - d_r + d_v) / tp, lowp), ("out_proj", 1.0, z.T * z.h, lowp)]
        qkv = z.h_q + 2 * z.h_kv
        return [("qkv_proj", z.h_q / qkv, z.T * z.h_q / tp, lowp), ("qkv_proj", z.h_kv / qkv, z.T * z.h_kv / tp, lowp),
                ("qkv_proj", z.h_kv / qkv, z.T * z.h_kv / tp, lowp), ("out_proj", 1.0, z.T * z.h, lowp)]
    if block == "dense_ffn":
        d = arch.d_ff_dense / tp
        ups = [("ffn_up", 0.5, z.T * d, lowp)] * 2 if arch.gated_ffn else [("ffn_up", 1.0, z.T * d, lowp)]
        return ups + [("ffn_down", 1.0, z.T * z.h, lowp)]
    if block == "moe":
        calls = [("router", 1.0, z.T_moe * arch.n_experts, True)]
        ds = arch.n_shared_experts * arch.d_expert / tp
        if ds > 0:
            ups = [("shared_up", 0.5, z.T * ds, lowp)] * 2 if arch.gated_ffn else [("shared_up", 1.0, z.T * ds, lowp)]
            calls += ups + [("shared_down", 1.0, z.T * z.h, lowp)]
        return calls
    return []


def _op_sac(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes, block: str, count: int
            ) -> tuple[dict[str, float], float, int]:
    """torchtitan's per-op policy on one block: (recomputed FLOP share per op, saved matmul output
    elements, the aten.mm count after it): every second aten.mm of a block is recomputed."""
    shares: dict[str, float] = {}
    saved = 0.0
    for name, share, elems, mm in _op_sac_calls(arch, lay, z, block):
        count += 1 if mm else 0
        keep = mm and count % 2 == 1
        shares[name] = shares.get(name, 0.0) + (0.0 if keep else share)
        saved += elems if keep else 0.0
    # checkpoint's early stop: the last down projection and the residual add are not run again
    shares.update({name: 0.0 for name in ("ffn_down", "shared_down", "ffn_residual", "moe_residual")})
    return shares, saved, count


def _recomputed_modules(lay: ParallelLayout) -> set[str]:
    """The modules a layout's selective recompute checkpoints (none under none / full)."""
    if lay.recompute != "selective":
        return set()
    return set((lay.recompute_modules or "core_attn").split("+"))


def _block_tables(blocks: dict[str, list[Op]], comms: dict[str, list[CommItem]], dev: _Device,
                  coll: Coll, fused: Callable[[str], tuple[float, float, bool]], moe_model: bool,
                  arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes) -> dict[str, dict[str, float]]:
    """Per block per micro-batch: seconds per category and phase, overlappable seconds, kernels,
    the attention core's forward, what selective recompute repeats (the core and MLA's up
    projections); communication seconds per class and phase, collective launches; the MTP block
    with one attention, FFN, head and embedding block added."""
    category = {"gemm": "compute", "gemm_hp": "compute", "memory": "compute", "attention": "attention",
                "expert_gemm": "expert_gemm"}
    tables: dict[str, dict[str, float]] = {}
    for name, ops in blocks.items():
        table = {key: 0.0 for key in ("fwd_compute", "fwd_attention", "fwd_expert_gemm", "bwd_compute",
                                      "bwd_attention", "bwd_expert_gemm", "fwd_overlap", "bwd_overlap",
                                      "fwd_kernels", "bwd_kernels", "core_fwd")}
        table.update({f"selective_{mod}_{key}": 0.0 for mod in tuple(_RECOMPUTED_OPS) + ("op", "op_odd")
                      for key in ("fwd", "fwd_overlap", "kernels")})
        op_shares = {"op": _op_sac(arch, lay, z, name, 0)[0], "op_odd": _op_sac(arch, lay, z, name, 1)[0]}
        for op in ops:
            seconds = dev.op_phase_seconds(op)
            cat = category[op["kind"]]
            table[f"fwd_{cat}"] += seconds[0]
            table[f"bwd_{cat}"] += seconds[1] + seconds[2]
            if op["overlap"]:
                table["fwd_overlap"] += seconds[0]
                table["bwd_overlap"] += seconds[1] + seconds[2]
            table["fwd_kernels"] += op["kernels"][0]
            table["bwd_kernels"] += op["kernels"][1] + op["kernels"][2]
            if op["name"] == "core_attention":
                table["core_fwd"] = seconds[0]
            for parity, shares in op_shares.items():
                share = shares.get(op["name"], 0.0 if op["kind"] == "attention" else 1.0)
                table[f"selective_{parity}_fwd"] += share * seconds[0]
                table[f"selective_{parity}_fwd_overlap"] += share * seconds[0] if op["overlap"] else 0.0
                table[f"selective_{parity}_kernels"] += op["kernels"][0] if share > 0 else 0.0
            for mod, names in _RECOMPUTED_OPS.items():
                if op["name"] in names:
                    table[f"selective_{mod}_fwd"] += seconds[0]
                    table[f"selective_{mod}_fwd_overlap"] += seconds[0] if op["overlap"] else 0.0
                    table[f"selective_{mod}_kernels"] += op["kernels"][0]
        tables[name] = table
    comm_class = {"tp": "tp", "cp": "cp", "ep": "ep", "etp": "ep", "ep_etp": "ep"}
    for name, items in comms.items():
        table = tables[name]
        for cls in ("tp", "cp", "ep"):
            table[f"fwd_{cls}"] = table[f"bwd_{cls}"] = 0.0
        table["fwd_comm_kernels"] = table["bwd_comm_kernels"] = 0.0
        for group, kind, phase, nbytes in items:
            if kind.startswith("fused:"):
                comm_s, share, priced = fused(kind.split(":", 1)[1])
                comm_s *= nbytes
                table["ep_sm_fraction"], table["dispatch_missing"] = share, not priced
            else:
                comm_s = coll(group, kind, nbytes)
            table[f"{phase}_{comm_class[group]}"] += comm_s
            table[f"{phase}_comm_kernels"] += 1.0 if comm_s > 0 else 0.0
    if "mtp" in tables:
        ffn = tables["moe"] if moe_model else tables["dense_ffn"]
        for key in list(tables["mtp"]):
            if key.startswith("selective") or key == "core_fwd":
                continue
            tables["mtp"][key] += (tables["attention"][key] + ffn.get(key, 0.0) + tables["head"][key]
                                   + tables["embedding"][key])
    return tables


# ---------------------------------------------------------------------------
# Stage schedule (perfmodel.schedule, perfmodel.stage)

def _rank_counts(arch: MoEArchitecture, lay: ParallelLayout) -> dict[int, dict[str, float]]:
    """Blocks on EVERY pipeline rank: virtual stage j (layers by `specs.stages`, the layout's
    split) sits on rank j % pp; the leading dense layers come first; the embedding on rank 0,
    the LM head and the MTP modules on rank pp - 1."""
    pp = lay.pp
    n_dense = arch.n_layers - (arch.n_layers - arch.n_dense_layers if arch.n_experts > 0 else 0)
    ranks = {r: {"attention": 0.0, "dense_ffn": 0.0, "moe": 0.0, "embedding": 1.0 if r == 0 else 0.0,
                 "head": 1.0 if r == pp - 1 else 0.0, "mtp": float(arch.n_mtp_layers) if r == pp - 1 else 0.0}
             for r in range(pp)}
    start = 0
    for j, layers in enumerate(virtual_stage_layers(arch.n_layers, lay)):
        dense = min(max(n_dense - start, 0), layers)
        ranks[j % pp]["attention"] += layers
        ranks[j % pp]["dense_ffn"] += dense
        ranks[j % pp]["moe"] += layers - dense
        start += layers
    return ranks


def _stage_params(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes, c: dict[str, float]) -> tuple[float, float]:
    """(dense, expert) parameters one rank of a stage holds before dp sharding."""
    h, tp = z.h, lay.tp
    expert_param = (3 if arch.gated_ffn else 2) * h * arch.d_expert
    attn_params = h * (z.h_q + 2 * z.h_kv) + z.h_q * h
    vocab = z.V * h / tp
    tied_here = arch.tie_embeddings and c["embedding"] > 0 and c["head"] > 0
    if arch.kv_lora_rank > 0:   # MLA projections and latent norms
        H, d_q, d_r, d_v = arch.n_heads, arch.head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        r_q, r_kv = arch.q_lora_rank, arch.kv_lora_rank
        q = h * r_q + r_q + r_q * H * d_q if r_q > 0 else h * H * d_q
        attn_params = q + h * (r_kv + d_r) + r_kv + r_kv * H * (d_q - d_r + d_v) + H * d_v * h
    dense_ffn = (3 if arch.gated_ffn else 2) * h * arch.d_ff_dense / tp
    moe_dense = h * z.E + arch.n_shared_experts * expert_param / tp
    dense = (c["attention"] * (attn_params / tp + 2 * h)
             + c["dense_ffn"] * dense_ffn
             + c["moe"] * moe_dense
             + c["embedding"] * vocab + c["head"] * ((0.0 if tied_here else vocab) + h))
    experts = c["moe"] * z.E / lay.ep * expert_param / lay.etp
    if c["mtp"] > 0:   # MTP: a layer of the last layer's type, 3 norms, the 2h x h projection, an embedding copy
        moe_model = arch.n_experts > 0 and arch.n_layers > arch.n_dense_layers
        dense += c["mtp"] * (attn_params / tp + 2 * h + (moe_dense if moe_model else dense_ffn) + 3 * h + 2 * h * h / tp)
        dense += vocab if c["embedding"] == 0 else 0.0
        experts += c["mtp"] * (z.E / lay.ep * expert_param / lay.etp if moe_model else 0.0)
    return dense, experts


def _stage_times(arch: MoEArchitecture, lay: ParallelLayout, z: _Sizes, cluster: ClusterSpec, dev: _Device,
                 host: Union[_AsyncHost, _EagerHost], table: dict[str, dict[str, float]], c: dict[str, float],
                 m: float, coll: Coll) -> dict[str, float]:
    """Per-micro-batch and per-step seconds of one stage."""
    overlap = cluster.overlap
    tp, cp, vpp, dp = lay.tp, lay.cp, lay.vpp, lay.dp
    full, selective = lay.recompute == "full", lay.recompute == "selective"

    def tot(key: str, names: tuple[str, ...] = tuple(table)) -> float:
        return sum(c[n] * table[n][key] for n in names)

    st: dict[str, float] = {}
    for cat in CATEGORIES:
        st[cat] = tot(f"fwd_{cat}") + tot(f"bwd_{cat}")
    layer_fwd_s = sum(tot(f"fwd_{cat}", LAYER_BLOCKS) for cat in CATEGORIES)
    core_fwd_s = c["attention"] * table["attention"]["core_fwd"]
    modules = _recomputed_modules(lay)
    odd = _op_sac(arch, lay, z, "attention", 0)[2] % 2 == 1  # the FFN blocks continue the attention's count

    def recomputed(entry: str) -> float:
        """The checkpointed modules' ops (torchtitan's op policy: its shares of every op)."""
        out = 0.0
        for mod in modules:
            if mod == "op":
                out += (tot(f"selective_op_{entry}", ("attention",))
                        + tot(f"selective_{'op_odd' if odd else 'op'}_{entry}", ("dense_ffn", "moe")))
            else:
                out += tot(f"selective_{mod}_{entry}", LAYER_BLOCKS)
        return out

    repeat_s = recomputed("fwd")
    st["recompute"] = layer_fwd_s if full else (repeat_s if selective else 0.0)
    fwd_compute_s = sum(tot(f"fwd_{cat}") for cat in CATEGORIES)
    bwd_compute_s = sum(tot(f"bwd_{cat}") for cat in CATEGORIES) + st["recompute"]
    windows_s = {"fwd": tot("fwd_overlap"),
                 "bwd": tot("bwd_overlap") + (tot("fwd_overlap", LAYER_BLOCKS) if full else
                                              recomputed("fwd_overlap"))}
    attn_windows_s = {"fwd": tot("fwd_attention"),
                      "bwd": tot("bwd_attention") + (core_fwd_s if (full or "core_attn" in modules) else 0.0)}

    # communication of one micro-batch (full recompute repeats the forward collectives)
    comm_s = {}
    for cls in ("tp", "cp", "ep"):
        comm_s[f"fwd_{cls}"] = tot(f"fwd_{cls}")
        comm_s[f"bwd_{cls}"] = tot(f"bwd_{cls}") + (tot(f"fwd_{cls}", LAYER_BLOCKS) if full else 0.0)
    p2p_s = vpp * coll("pp", "p2p", z.b * z.T * z.h / (tp if lay.sequence_parallel else 1))
    comm_s["fwd_pp"] = comm_s["bwd_pp"] = p2p_s
    dense_p, expert_p = _stage_params(arch, lay, z, c)
    gather_b = 4.0 if lay.precision == "fp32" else 2.0
    param_gather_s = coll("dp", "all_gather", gather_b * dense_p) + coll("edp", "all_gather", gather_b * expert_p)
    grad_scatter_s = (coll("dp", "reduce_scatter", GRAD_BYTES * dense_p)
                      + coll("edp", "reduce_scatter", GRAD_BYTES * expert_p))
    fsdp = lay.dp_flavor == "fsdp"
    comm_s["fwd_fsdp"] = param_gather_s if fsdp else 0.0
    comm_s["bwd_fsdp"] = param_gather_s + grad_scatter_s if fsdp else 0.0

    # what may hide: the runtime's fraction where the layout overlaps the class
    may_hide = {"tp": overlap.tp if lay.tp_comm_overlap else 0.0, "ep": overlap.ep if lay.ep_comm_overlap else 0.0,
                "pp": overlap.pp if vpp > 1 else 0.0, "fsdp": overlap.dp,
                "grad": overlap.dp if lay.overlap_grad_reduce else 0.0,
                "param": overlap.dp if lay.overlap_param_gather else 0.0}

    # overlap inside each phase: cp behind attention, then tp, ep, pp, FSDP behind the window
    exposed_s: dict[str, float] = {}
    hidden_s: dict[str, float] = {}
    left_s: dict[str, float] = {}
    for phase in ("fwd", "bwd"):
        window_s = windows_s[phase]
        hid = min(overlap.cp * comm_s[f"{phase}_cp"], max(attn_windows_s[phase], 0.0))
        hidden_s[f"{phase}_cp"] = hid
        window_s -= hid
        for cls, fraction in (("tp", may_hide["tp"]), ("ep", may_hide["ep"]), ("pp", may_hide["pp"]),
                              ("fsdp", may_hide["fsdp"])):
            hid = min(fraction * comm_s[f"{phase}_{cls}"], max(window_s, 0.0))
            hidden_s[f"{phase}_{cls}"] = hid
            window_s -= hid
        for cls in ("cp", "tp", "ep", "pp", "fsdp"):
            exposed_s[f"{phase}_{cls}"] = comm_s[f"{phase}_{cls}"] - hidden_s[f"{phase}_{cls}"]
        left_s[phase] = max(window_s, 0.0)

    # the host: launches per phase and what they add
    view = _StageView(arch, lay, c, tot, full, selective, m, recomputed)
    fwd_kernels, bwd_kernels = host.phase_kernels(view)
    classes = ("cp", "tp", "ep", "pp", "fsdp")
    share = table["moe"].get("ep_sm_fraction", 0.0)
    # compute beside hidden communication runs slower (Overlap.compute_slowdown); under a hidden
    # fused dispatch it runs on 1 - share of the compute units instead
    ep_stretch = share / (1.0 - min(share, 0.99)) if share > 0 else overlap.compute_slowdown
    slow = {ph: overlap.compute_slowdown * sum(hidden_s[f"{ph}_{x}"] for x in classes if x != "ep")
            + ep_stretch * hidden_s[f"{ph}_ep"] for ph in ("fwd", "bwd")}
    st["overlap_slowdown"] = slow["fwd"] + slow["bwd"]
    fwd_device_s = fwd_compute_s + sum(exposed_s[f"fwd_{x}"] for x in classes) + slow["fwd"]
    bwd_device_s = bwd_compute_s + sum(exposed_s[f"bwd_{x}"] for x in classes) + slow["bwd"]
    st["dispatch"] = host.dispatch_s(view, fwd_kernels, bwd_kernels, fwd_device_s, bwd_device_s, dev)
    st["micro_batch"] = fwd_device_s + bwd_device_s + st["dispatch"]
    for cls in ("tp", "cp", "ep", "pp", "fsdp"):
        st[f"{cls}_exposed"] = exposed_s[f"fwd_{cls}"] + exposed_s[f"bwd_{cls}"]
        st[f"{cls}_hidden"] = hidden_s[f"fwd_{cls}"] + hidden_s[f"bwd_{cls}"]

    # once per step: DDP all-reduce or ZeRO-1 reduce-scatter + all-gather
    if lay.dp_flavor == "ddp":
        grad_sync_s = coll("dp", "all_reduce", GRAD_BYTES * dense_p) + coll("edp", "all_reduce", GRAD_BYTES * expert_p)
    elif lay.dp_flavor == "zero1":
        grad_sync_s = grad_scatter_s
    else:
        grad_sync_s = 0.0
    zero1_gather_s = param_gather_s if lay.dp_flavor == "zero1" else 0.0
    last_bucket = min(1.0, BUCKET_PARAMS / max(dense_p + expert_p, 1.0))
    grad_hidden_s = min(may_hide["grad"] * grad_sync_s, left_s["bwd"], grad_sync_s * (1 - last_bucket))
    gather_hidden_s = min(may_hide["param"] * zero1_gather_s, left_s["fwd"], zero1_gather_s * (1 - last_bucket))
    st["dp_step_exposed"] = grad_sync_s + zero1_gather_s - grad_hidden_s - gather_hidden_s
    st["dp_step_hidden"] = grad_hidden_s + gather_hidden_s
    st["dp_step_slowdown"] = overlap.compute_slowdown * st["dp_step_hidden"]

    # optimizer over the parameters this rank updates
    edp = max(tp * cp * dp / (lay.etp * lay.ep), 1.0)
    updated = (dense_p / (dp * cp) + expert_p / edp) if lay.dp_flavor != "ddp" else dense_p + expert_p
    optimizer_bytes = (32.0 if lay.precision == "fp32" else 34.0) * updated
    st["optimizer"] = host.optimizer_s(view, optimizer_bytes, dev, coll)
    st["dense_params"], st["expert_params"] = dense_p, expert_p
    return st


# ---------------------------------------------------------------------------
# Memory (perfmodel.memory)

def _stage_memory(arch: MoEArchitecture, lay: ParallelLayout, cluster: ClusterSpec, z: _Sizes, c: dict[str, float],
                  st: dict[str, float], rank: int, m: float) -> dict[str, float]:
    """Korthikanti-style stored tensors, 1F1B in-flight micro-batches, sharded states."""
    tp, cp, dp, pp, vpp = lay.tp, lay.cp, lay.dp, lay.pp, lay.vpp
    b, T, T_sp, T_moe, M, h, h_q, h_kv, V = z.b, z.T, z.T_sp, z.T_moe, z.M, z.h, z.h_q, z.h_kv, z.V
    edp = max(tp * cp * dp / (lay.etp * lay.ep), 1.0)
    dense_p, expert_p = st["dense_params"], st["expert_params"]
    fsdp = lay.dp_flavor == "fsdp"
    sharded = (dense_p / (dp * cp) + expert_p / edp)
    held = sharded if fsdp else dense_p + expert_p
    updated = sharded if lay.dp_flavor in ("zero1", "fsdp") else dense_p + expert_p
    up = 2.0 if arch.gated_ffn else 1.0
    fp8 = lay.precision in ("fp8", "mxfp8")
    g = 1.0 if fp8 else b                      # a tensor kept only as a GEMM input (TE fp8 copy)
    modules = _recomputed_modules(lay)
    norm_out = 0.0 if "layernorm" in modules else 1.0   # layernorm: the norms' outputs are recomputed
    if "core_attn" in modules:                 # core_attn checkpointed: only out_proj's input stays
        kept = g * T * h_q / tp
    else:                                      # flash keeps its output (bf16) and fp32 log-sum-exp
        kept = (b + (g if fp8 else 0.0)) * T * h_q / tp + 4.0 * T * arch.n_heads / tp
    attention = (b + norm_out * g) * T_sp * h + b * T * (h_q + 2 * h_kv) / tp + kept
    if arch.kv_lora_rank > 0:   # MLA: latents, Q/K/V, core output; selective keeps latents + out_proj input
        H, d_q, d_v = arch.n_heads, arch.head_dim, arch.v_head_dim
        latents = b * T * (arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_head_dim)
        out = T * H * d_v / tp
        stored = 0.0 if "mla_up_proj" in modules else b * T * H * (2 * d_q + d_v) / tp
        if "core_attn" in modules:
            stored += g * out
        else:
            stored += (b + (g if fp8 else 0.0)) * out + 4.0 * T * H / tp
        attention = (b + norm_out * g) * T_sp * h + latents + stored
    dense = (b + norm_out * g) * T_sp * h + (0.0 if "mlp" in modules else (b * up + g) * T * arch.d_ff_dense / tp)
    act_out = 0.0 if "moe_act" in modules else g
    if "op" in modules:  # torchtitan's per-op policy: the block input, saved matmul outputs, the core
        _, saved, count = _op_sac(arch, lay, z, "attention", 0)
        core_out = T * arch.n_heads * arch.v_head_dim / tp if arch.kv_lora_rank > 0 else T * h_q / tp
        attention = b * T_sp * h + b * (saved + core_out) + 4.0 * T * arch.n_heads / tp
        dense = b * _op_sac(arch, lay, z, "dense_ffn", count)[1]
    shared = arch.n_shared_experts * arch.d_expert
    d_loc = arch.d_expert / lay.etp
    M_kept = z.M_kept                          # stored over many layers: the mean rows per rank
    moe = ((1.0 + norm_out) * b * T_sp * h + 4.0 * T_moe * arch.n_experts + M_kept * (g * h + (b * up + act_out) * d_loc + 4.0)
           + (((g * T_sp * h) if fp8 else 0.0) + (b * up + g) * T * shared / tp if shared > 0 else 0.0))
    if "op" in modules:
        moe = b * _op_sac(arch, lay, z, "moe", _op_sac(arch, lay, z, "attention", 0)[2])[1]
    held_mb = (pp - rank) if vpp == 1 else ((pp - rank - 1) * 2 + (vpp - 1) * pp + 1) / vpp
    held_mb = min(held_mb, m)
    if lay.recompute == "full":
        ffn_max = max(moe if c["moe"] > 0 else 0.0, dense if c["dense_ffn"] > 0 else 0.0)
        per_mb = c["attention"] * b * T_sp * h
        one_layer = attention + ffn_max
    else:
        per_mb = c["attention"] * attention + c["dense_ffn"] * dense + c["moe"] * moe
        one_layer = 0.0
    moe_model = arch.n_experts > 0 and arch.n_layers > arch.n_dense_layers
    # an MTP module keeps its layer, its normed inputs (the projection's 2h input), its own logits
    per_mb += c["mtp"] * (attention + (moe if moe_model else dense) + 4.0 * b * T * h)
    activations = held_mb * per_mb + one_layer
    layer_params = (dense_p + expert_p) / max(c["attention"], 1.0)
    gather_b = 4.0 if lay.precision == "fp32" else 2.0
    return {
        "weights": z.w_bytes * held,
        "gradients": GRAD_BYTES * held,
        "optimizer": (8.0 if lay.precision == "fp32" else 12.0) * updated,
        "activations": activations,
        "logits": (c["head"] + c["mtp"]) * (b + 4.0) * T * V / tp,
        "moe_buffers": 2 * b * M * h + b * T_moe * arch.top_k * h if c["moe"] > 0 else 0.0,
        "fsdp_buffers": layer_params * (2 * gather_b + GRAD_BYTES) if fsdp else 0.0,
        "framework": float(cluster.framework_overhead_bytes),
    }


# ---------------------------------------------------------------------------
# Result (perfmodel.evaluate)

def evaluate_one(arch: MoEArchitecture, layout: ParallelLayout, cluster: ClusterSpec, devices: Optional[int] = None
                 ) -> dict[str, Any]:
    """The model for one configuration, as `EvalResult.row` gives it (same keys)."""
    lay = layout
    if lay.dp is None or lay.gbs is None:
        lay = lay.resolve(devices if devices is not None else lay.model_parallel)
    world = lay.tp * lay.cp * lay.pp * lay.dp
    devices = world if devices is None else devices
    host = _host(cluster)
    dev = _Device(cluster, lay.precision, host.share(devices))
    z = _sizes(arch, lay)

    groups = _groups(lay)

    def coll(group: str, kind: str, nbytes: float) -> float:
        n, stride = groups[group]
        return collective_seconds(cluster, kind, nbytes, n, stride) / dev.share  # ranks sharing CPU cores

    def fused(call: str) -> tuple[float, float, bool]:
        seconds, share, priced = _fused_seconds(cluster, arch, lay, z, call)
        return seconds / dev.share, share, priced

    comms = host.block_comms(arch, lay, z, _megatron_comms(arch, lay, z))
    moe_model = arch.n_experts > 0 and arch.n_layers > arch.n_dense_layers
    table = _block_tables(_block_ops(arch, lay, z), comms, dev, coll, fused, moe_model, arch, lay, z)

    rank_counts = _rank_counts(arch, lay)
    order = [0] + ([lay.pp - 1] if lay.pp > 1 else []) + list(range(1, lay.pp - 1))  # ties: first, last, middle
    m = max(lay.gbs / (lay.mbs * lay.dp), 1.0)
    slots = (lay.pp - 1) / lay.vpp
    stages: dict[int, dict[str, float]] = {}
    for rank in order:   # every pipeline rank
        st = _stage_times(arch, lay, z, cluster, dev, host, table, rank_counts[rank], m, coll)
        st["step"] = (m + slots) * st["micro_batch"] + st["dp_step_exposed"] + st["dp_step_slowdown"] + st["optimizer"]
        stages[rank] = st

    bottleneck_rank = order[0]
    for rank in order[1:]:
        if stages[rank]["step"] > stages[bottleneck_rank]["step"]:
            bottleneck_rank = rank
    bottleneck = "first" if bottleneck_rank == 0 else ("last" if bottleneck_rank == lay.pp - 1 else "middle")
    st = stages[bottleneck_rank]
    nodes = math.ceil(devices / cluster.node_devices)
    factor = 1.0 + cluster.straggler.cv * math.sqrt(2.0 * math.log(max(nodes, 1)))
    step_s = st["step"] * factor
    breakdown = {
        "compute": m * st["compute"], "attention": m * st["attention"], "expert_gemm": m * st["expert_gemm"],
        "recompute": m * st["recompute"], "tp_exposed": m * st["tp_exposed"], "cp_exposed": m * st["cp_exposed"],
        "ep_exposed": m * st["ep_exposed"], "pp_exposed": m * st["pp_exposed"],
        "dp_exposed": m * st["fsdp_exposed"] + st["dp_step_exposed"], "dispatch": m * st["dispatch"],
        "overlap_slowdown": m * st["overlap_slowdown"] + st["dp_step_slowdown"],
        "bubble": slots * st["micro_batch"], "optimizer": st["optimizer"], "straggler": st["step"] * (factor - 1.0),
        "tp_hidden": m * st["tp_hidden"], "cp_hidden": m * st["cp_hidden"], "ep_hidden": m * st["ep_hidden"],
        "pp_hidden": m * st["pp_hidden"], "dp_hidden": m * st["fsdp_hidden"] + st["dp_step_hidden"],
    }

    # memory of every rank, the largest counts
    memories = {rank: _stage_memory(arch, lay, cluster, z, rank_counts[rank], stages[rank], rank, m) for rank in order}
    bigger = order[0]
    for rank in order[1:]:
        if sum(memories[rank].values()) > sum(memories[bigger].values()):
            bigger = rank
    memory = sum(memories[bigger].values())

    tokens_per_s = lay.gbs * z.s / step_s
    model_flops = float(model_flops_per_token(arch)) * tokens_per_s
    reason = "ok"
    if memory > cluster.accelerator.usable_hbm_bytes:
        reason = "memory"
    if moe_model and table["moe"].get("dispatch_missing", False):
        reason = "dispatcher"
    if dev.missing:
        reason = "precision"
    if devices > cluster.devices:
        reason = "devices"
    if violations(arch, lay, devices):
        reason = "invalid_layout"
    return {
        "step_time_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "mfu": model_flops / (devices * dev.gemm_peak),
        "mfu_palm": float(model_flops_per_token_palm(arch)) * tokens_per_s / (devices * dev.gemm_peak),
        "tflops_per_device": model_flops / devices / 1e12,
        "memory_per_device_bytes": memory,
        "feasible": reason == "ok",
        "reason": reason,
        "devices": devices,
        "micro_batches": m,
        "bottleneck_stage": bottleneck,
        "bottleneck_rank": bottleneck_rank,
        "dropped_fraction": z.drop,
        "breakdown": breakdown,
        "memory_breakdown": memories[bigger],
    }

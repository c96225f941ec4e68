"""The one fit from measured tables to kernel figures (the forms of `perfmodel.kernels.forms`).

Every fit minimises a robust loss (soft-L1, scale 0.1) of log(predicted / measured) over the
table rows, with the same function that prices a training step, so a figure is exactly what
makes the model reproduce its measurements:

- memory: fraction per kernel class and one bytes_half per accelerator; rows give bytes moved
  and achieved GB/s (a row without bytes constrains the fraction only);
- GEMM: shape halves (m, n, k) shared by the accelerators of one generation (the tile and wave
  structure of the silicon, `derive.GENERATION`), e_max per (accelerator, precision); predicted
  time is the roofline max(2mnk / (peak eff), bytes / (HBM bw f_copy)), the memory side as
  `perfmodel.hardware.HardwareView.operand_seconds` prices it;
- grouped GEMM: the GEMM form per phase with the generation's halves and e_max per phase;
  a fwd_bwd row is timed as the sum of its three phases;
- attention: e_max per phase (fwd, bwd), seq halves causal / non-causal and a head-dim half;
  a fwd_bwd row is fwd + bwd (the FLOP convention of every source here: bwd = 2.5 fwd);
- collectives: per fabric level, one latency per collective step and an efficiency per
  collective, through `perfmodel.comm.collective_time` on the level's devices.

Each result records its rows, median absolute relative error, and sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from perfmodel.kernels.forms import (
    GEMM_PHASES,
    gemm_efficiency,
    phase_dims,
    saturation,
)
from perfmodel.kernels.tables import KernelTable

LOSS_SCALE = 0.1
"""soft-L1 scale on log(pred / meas): residuals beyond ~10% count linearly, so a stray row of
another software version moves a figure less than a squared loss would let it."""


@dataclass(frozen=True)
class FitResult:
    """Parameters by name, and per-row relative errors (pred / meas - 1) with the rows' sources."""

    params: dict[str, float]
    errors: np.ndarray
    sources: tuple[str, ...]

    @property
    def rows(self) -> int:
        return int(len(self.errors))

    @property
    def median_abs_error(self) -> float:
        return float(np.median(np.abs(self.errors))) if len(self.errors) else float("nan")


def _robust(residual: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lower: np.ndarray,
            upper: np.ndarray) -> np.ndarray:
    x0 = np.clip(x0, lower + 1e-9, upper - 1e-9)
    return least_squares(residual, x0, bounds=(lower, upper), loss="soft_l1", f_scale=LOSS_SCALE,
                         x_scale="jac", max_nfev=4000).x


def sources_of(table: KernelTable) -> tuple[str, ...]:
    """Distinct sources of the rows, in first-seen order."""
    seen: dict[str, None] = {}
    for s in table["source"]:
        seen.setdefault(str(s), None)
    return tuple(seen)


# ---------------------------------------------------------------------------
# memory

MEMORY_KERNEL_CLASS = {
    "copy": "copy", "clone": "copy", "read": "copy", "write": "copy", "triad": "copy",
    "hbm_roofline_benchmark": "copy",
    "exp": "elementwise", "sigmoid": "elementwise", "softmax": "elementwise", "rope": "elementwise",
    "hadamard": "elementwise", "amax_reduce": "elementwise", "add": "elementwise",
    "rmsnorm": "norm", "layernorm": "norm",
    "swiglu": "activation", "gelu": "activation", "geglu": "activation",
    "permute": "permute", "unpermute": "permute", "gather": "permute", "scatter": "permute",
    "cross_entropy": "cross_entropy", "cross_entropy_fused": "cross_entropy",
    "adam": "optimizer", "adamw": "optimizer",
    "fp8_quantize": "cast", "fp8_blockwise_quantize": "cast", "mxfp8_quantize": "cast",
    "nvfp4_quantize": "cast", "cast": "cast",
}
"""Table `kernel` -> the kernel class of `perfmodel.kernels.forms.MEMORY_CLASSES`."""


def fit_memory(rows: KernelTable, peak_bytes_per_s: float) -> tuple[dict[str, FitResult], float]:
    """Per class present: fraction (FitResult.params['fraction']); and the shared bytes_half."""
    kernel = np.asarray([MEMORY_KERNEL_CLASS.get(str(k), "") for k in rows["kernel"]])
    if np.any(kernel == ""):
        unknown = sorted(set(str(k) for k, c in zip(rows["kernel"], kernel) if not c))
        raise AssertionError(f"memory kernels without a class: {unknown}")
    gbps = rows["gbps"] * 1e9
    nbytes = rows["bytes_moved"]
    classes = sorted(set(kernel))
    idx = np.asarray([classes.index(c) for c in kernel])
    sized = np.isfinite(nbytes)

    def predict(x: np.ndarray) -> np.ndarray:
        half = np.exp(x[0])
        frac = np.exp(x[1:])[idx]
        s = np.where(sized, saturation(np.where(sized, nbytes, 1.0), half), 1.0)
        return peak_bytes_per_s * frac * s

    def residual(x: np.ndarray) -> np.ndarray:
        return np.log(predict(x)) - np.log(gbps)

    x0 = np.r_[np.log(1e6), np.log(np.full(len(classes), 0.8))]
    lower = np.r_[np.log(1e3), np.full(len(classes), np.log(1e-3))]
    upper = np.r_[np.log(1e10), np.full(len(classes), np.log(1.5))]
    x = _robust(residual, x0, lower, upper)
    errors = predict(x) / gbps - 1.0
    out = {}
    for j, cls in enumerate(classes):
        mine = idx == j
        out[cls] = FitResult({"fraction": float(np.exp(x[1 + j]))}, errors[mine], sources_of(rows.select(mine)))
    return out, float(np.exp(x[0]))


# ---------------------------------------------------------------------------
# GEMM

BIG = 1.0e9
"""Stand-in dimension of a ceiling row: s(BIG; half) = 1 to 1e-5 for any fitted half."""

ELEMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "mxfp8": 1.0}


def gemm_bytes(m: np.ndarray, n: np.ndarray, k: np.ndarray, precision: Sequence[str]) -> np.ndarray:
    """HBM bytes of C[m,n] = A[m,k] B[k,n]: inputs at the precision's size, bf16 output (fp32 out for fp32)."""
    b_in = np.asarray([ELEMENT_BYTES[p] for p in precision])
    b_out = np.where(b_in == 4.0, 4.0, 2.0)
    return b_in * (m * k + k * n) + b_out * m * n


@dataclass(frozen=True)
class GemmRows:
    """Shaped GEMM rows prepared for a fit: one entry per (row, phase timed)."""

    key: np.ndarray
    """Index into `keys` (accelerator, precision[, phase]) of the e_max each row uses."""
    keys: list[tuple[str, ...]]
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    row: np.ndarray
    """Row index in the measured arrays (a fwd_bwd row spans three entries)."""
    peak: np.ndarray
    hbm: np.ndarray
    nbytes: np.ndarray
    groups: np.ndarray
    scale: np.ndarray
    """Multiplier on the key's e_max (a fwd_bwd row's weight gradient without its own rows:
    the measured wgrad/fwd ratio)."""


def fit_gemm_family(entries: GemmRows, measured_s: np.ndarray, sources: Sequence[str],
                    halves: tuple[float, float, float] | None = None,
                    tied: bool = False) -> tuple[tuple[float, float, float], dict[tuple[str, ...], FitResult]]:
    """Shared (m, n, k) halves (fitted unless given; `tied`: one half for all three, what square
    shapes alone identify) and one e_max per key; each measured row's time is the sum of its
    entries' rooflines (a fwd_bwd row: three phases)."""
    n_keys = len(entries.keys)
    free_halves = halves is None
    n_halves = 1 if tied else 3

    def predict(x: np.ndarray) -> np.ndarray:
        if free_halves:
            hm, hn, hk = np.exp(x[:3]) if not tied else np.exp(np.repeat(x[:1], 3))
            e_max = np.exp(x[n_halves:])[entries.key]
        else:
            hm, hn, hk = halves
            e_max = np.exp(x)[entries.key]
        eff = np.minimum(gemm_efficiency(entries.m, entries.n, entries.k, e_max * entries.scale, hm, hn, hk), 1.0)
        seconds = np.maximum(2.0 * entries.m * entries.n * entries.k * entries.groups / (entries.peak * eff),
                             entries.nbytes / entries.hbm)
        return np.bincount(entries.row, weights=seconds, minlength=len(measured_s))

    def residual(x: np.ndarray) -> np.ndarray:
        return np.log(predict(x)) - np.log(measured_s)

    e0 = np.log(np.full(n_keys, 0.75))
    e_lo, e_hi = np.full(n_keys, np.log(1e-3)), np.zeros(n_keys)
    if free_halves:
        x0 = np.r_[np.log([100.0, 500.0, 500.0] if not tied else [300.0]), e0]
        lower = np.r_[np.log(np.ones(n_halves)), e_lo]
        upper = np.r_[np.log(np.full(n_halves, 2e5)), e_hi]
    else:
        x0, lower, upper = e0, e_lo, e_hi
    x = _robust(residual, x0, lower, upper)
    errors = predict(x) / measured_s - 1.0
    if free_halves:
        fitted = tuple(float(v) for v in (np.exp(x[:3]) if not tied else np.exp(np.repeat(x[:1], 3))))
    else:
        fitted = halves
    e_values = np.exp(x[n_halves:] if free_halves else x)
    src = np.asarray(sources)
    results = {}
    row_key = np.full(len(measured_s), -1)
    row_key[entries.row] = entries.key
    for j, key in enumerate(entries.keys):
        mine = row_key == j
        seen: dict[str, None] = {}
        for s in src[mine]:
            seen.setdefault(str(s), None)
        results[key] = FitResult({"e_max": float(e_values[j])}, errors[mine], tuple(seen))
    return fitted, results


def gemm_entries(table: KernelTable, peaks: dict[tuple[str, str], float], hbm: dict[str, float],
                 copy_fraction: dict[str, float], grouped: bool,
                 wgrad_ratio: float = 1.0) -> tuple[GemmRows, np.ndarray]:
    """Entries and measured seconds of every shaped row whose (accelerator, precision) has a peak.

    Dense rows key on (accelerator, precision); grouped rows on (accelerator, precision, phase)
    with phase fwd or wgrad: an input-gradient GEMM shares the forward's figure (the same operand
    shapes up to a transpose; measured equal where both exist), a fwd_bwd row adds one entry per
    phase, and its weight gradient uses the (accelerator, precision)'s own wgrad key when some row
    measures wgrad alone, else fwd's e_max x `wgrad_ratio`."""
    own_wgrad = set()
    if grouped:
        for a, p, ph in zip(table["accelerator"], table["precision"], table["phase"]):
            if ph == "wgrad":
                own_wgrad.add((str(a), str(p)))
    acc, prec = table["accelerator"], table["precision"]
    m = table["m_per_group"] if grouped else table["m"]
    n, k = table["n"], table["k"]
    groups = table["groups"] if grouped else np.ones(len(table))
    phases = table["phase"] if grouped else np.full(len(table), "fwd")
    keys: list[tuple[str, ...]] = []
    cols: dict[str, list] = {c: [] for c in ("key", "m", "n", "k", "row", "peak", "hbm", "nbytes", "groups", "scale")}
    measured = []
    for i in range(len(table)):
        peak = peaks.get((str(acc[i]), str(prec[i])))
        shaped = np.isfinite(m[i]) and np.isfinite(n[i]) and np.isfinite(k[i])
        is_ceiling = not grouped and table.get("role") is not None and str(table["role"][i]) == "ceiling"
        if peak is None or not (shaped or is_ceiling):
            continue
        row = len(measured)
        ceiling = not grouped and str(table.get("role")[i] if table.get("role") is not None else "") == "ceiling"
        if ceiling:  # the best shape of a search: the saturations are ~1 there, the row measures e_max
            key = (str(acc[i]), str(prec[i]))
            if key not in keys:
                keys.append(key)
            for name, value in (("key", keys.index(key)), ("m", BIG), ("n", BIG), ("k", BIG), ("row", row),
                                ("peak", peak), ("hbm", 1.0), ("nbytes", 0.0), ("groups", 1.0), ("scale", 1.0)):
                cols[name].append(value)
            measured.append(2.0 * BIG ** 3 / (table["tflops"][i] * 1e12))
            continue
        timed = GEMM_PHASES if phases[i] == "fwd_bwd" else (str(phases[i]),)
        flops = 0.0
        for phase in timed:
            pm, pn, pk = phase_dims(phase, m[i], n[i], k[i])
            pair = (str(acc[i]), str(prec[i]))
            scale = 1.0
            key_phase = phase
            if grouped and phase == "dgrad":
                key_phase = "fwd"
            if grouped and phase == "wgrad" and pair not in own_wgrad:
                key_phase, scale = "fwd", wgrad_ratio
            key = pair + ((key_phase,) if grouped else ())
            if key not in keys:
                keys.append(key)
            g = groups[i] if np.isfinite(groups[i]) else 1.0
            cols["key"].append(keys.index(key))
            cols["m"].append(pm)
            cols["n"].append(pn)
            cols["k"].append(pk)
            cols["row"].append(row)
            cols["peak"].append(peak)
            cols["hbm"].append(hbm[str(acc[i])] * copy_fraction[str(acc[i])])
            cols["nbytes"].append(float(g * gemm_bytes(np.asarray([pm]), np.asarray([pn]), np.asarray([pk]),
                                                       [str(prec[i])])[0]))
            cols["groups"].append(g)
            cols["scale"].append(scale)
            flops += 2.0 * pm * pn * pk * g
        measured.append(flops / (table["tflops"][i] * 1e12))
    arrays = {c: np.asarray(v, dtype=np.int64 if c in ("key", "row") else float) for c, v in cols.items()}
    return GemmRows(keys=keys, **arrays), np.asarray(measured)


def used_rows(table: KernelTable, peaks: dict[tuple[str, str], float], grouped: bool) -> np.ndarray:
    """Mask of the rows `gemm_entries` keeps (same order as its measured rows)."""
    m = table["m_per_group"] if grouped else table["m"]
    keep = np.isfinite(m) & np.isfinite(table["n"]) & np.isfinite(table["k"])
    if not grouped and table.get("role") is not None:
        keep |= table["role"] == "ceiling"
    return keep & np.asarray([(str(a), str(p)) in peaks for a, p in zip(table["accelerator"], table["precision"])], dtype=bool)


# ---------------------------------------------------------------------------
# attention

def fit_attention(rows: KernelTable, peak_flops_per_s: float) -> FitResult:
    """fwd/bwd e_max, causal and non-causal seq halves, head-dim half from one accelerator's rows
    (tflops on executed FLOPs: causal rows count half the score FLOPs)."""
    phase = rows["phase"]
    causal = np.asarray([str(c).lower() == "true" for c in rows["causal"]])
    seq, dim = rows["seq_len"], rows["head_dim"]
    measured_rate = rows["tflops"] * 1e12
    # one work unit per row: rate = work / time; fwd 1, bwd 2.5, fwd_bwd 3.5 (the sources' convention)
    work = np.where(phase == "fwd", 1.0, np.where(phase == "bwd", 2.5, 3.5))
    has_causal = bool(np.any(causal))
    has_full = bool(np.any(~causal))
    has_bwd = bool(np.any(phase != "fwd"))
    has_fwd = bool(np.any(phase != "bwd"))

    def unpack(x: np.ndarray) -> tuple[float, float, float, float, float]:
        e_f, e_b, h_c, h_n, h_d = np.exp(x)
        return e_f, e_b, h_c, h_n, h_d

    def predict(x: np.ndarray) -> np.ndarray:
        e_f, e_b, h_c, h_n, h_d = unpack(x)
        s = saturation(seq, np.where(causal, h_c, h_n)) * saturation(dim, h_d)
        t_f = 1.0 / (peak_flops_per_s * e_f * s)
        t_b = 2.5 / (peak_flops_per_s * e_b * s)
        seconds = np.where(phase == "fwd", t_f, np.where(phase == "bwd", t_b, t_f + t_b))
        return work / seconds

    def residual(x: np.ndarray) -> np.ndarray:
        out = np.log(predict(x)) - np.log(measured_rate)
        # parameters the rows cannot see are pinned to their partners (weak prior, 1e-3 weight)
        e_f, e_b, h_c, h_n, _ = x
        pins = [1e-3 * (e_f - e_b), 1e-3 * (h_c - h_n)]
        return np.r_[out, pins]

    x0 = np.log([0.6, 0.5, 1024.0, 512.0, 32.0])
    lower = np.log([1e-3, 1e-3, 1.0, 1.0, 1.0])
    upper = np.log([1.0, 1.0, 1e6, 1e6, 1e4])
    x = _robust(residual, x0, lower, upper)
    errors = predict(x) / measured_rate - 1.0
    e_f, e_b, h_c, h_n, h_d = unpack(x)
    params = {"fwd_e_max": e_f, "bwd_e_max": e_b, "seq_half_causal": h_c, "seq_half": h_n, "head_dim_half": h_d}
    seen = {"causal": has_causal, "non_causal": has_full, "fwd": has_fwd, "bwd": has_bwd}
    params.update({f"seen_{k}": float(v) for k, v in seen.items()})
    return FitResult({k: float(v) for k, v in params.items()}, errors, sources_of(rows))


# ---------------------------------------------------------------------------
# collectives

@dataclass(frozen=True)
class LevelFit:
    """A fabric level's fitted collective figures: per collective the bandwidth protocol's step
    latency and efficiency, and the low-latency protocol's where the rows identify two lines."""

    latency_s: dict[str, float]
    efficiency: dict[str, float]
    ll_latency_s: dict[str, float]
    ll_efficiency: dict[str, float]
    errors: np.ndarray


def fit_level(times_s: np.ndarray, kinds: np.ndarray, sizes: np.ndarray,
              predict: Callable[[dict[str, float], dict[str, float], dict[str, float], dict[str, float]], np.ndarray],
              latency0: float, fixed_latency: float | None = None, small_bytes: float = 4 * 2**20) -> LevelFit:
    """Fit the collectives of one level to measured times (robust log error of `predict`).

    A collective whose rows reach below `small_bytes` and above 16x it gets two lines, the
    low-latency protocol's (smaller latency, smaller efficiency) and the bandwidth protocol's;
    one with small rows only its own latency; the others take the median latency of those, or
    `fixed_latency` when no collective has small rows. A collective whose efficiency moves no
    row's time by 1% when it falls by 10% (its rows are bound by an inner level) is not
    identified: left out of `efficiency`."""
    names = sorted({str(k) for k in kinds})
    small = {c for c in names if np.any((kinds == c) & (sizes < small_bytes))} if fixed_latency is None else set()
    two = {c for c in small if np.sum((kinds == c) & (sizes < small_bytes)) >= 3
           and np.sum((kinds == c) & (sizes >= 16 * small_bytes)) >= 3}
    own = sorted(small)
    dual = sorted(two)
    n_lat, n_eff, n_dual = len(own), len(names), len(dual)

    def unpack(x: np.ndarray):
        lat = {c: float(np.exp(v)) for c, v in zip(own, x[:n_lat])}
        shared = float(np.median(list(lat.values()))) if lat else float(fixed_latency if fixed_latency is not None
                                                                          else latency0)
        lat_all = {c: lat.get(c, shared) for c in names}
        eff = {c: float(np.exp(v)) for c, v in zip(names, x[n_lat:n_lat + n_eff])}
        rest = x[n_lat + n_eff:]
        # low-latency line: latency below the bandwidth protocol's, efficiency a fraction of its
        ll_lat = {c: lat_all[c] / (1.0 + float(np.exp(u))) for c, u in zip(dual, rest[:n_dual])}
        ll_eff = {c: eff[c] / (1.0 + float(np.exp(v))) for c, v in zip(dual, rest[n_dual:])}
        return lat_all, eff, ll_lat, ll_eff

    def residual(x: np.ndarray) -> np.ndarray:
        return np.log(predict(*unpack(x))) - np.log(times_s)

    lower = np.r_[np.full(n_lat, np.log(1e-8)), np.full(n_eff, np.log(1e-3)), np.full(2 * n_dual, -8.0)]
    upper = np.r_[np.full(n_lat, np.log(1e-2)), np.full(n_eff, np.log(2.0)), np.full(2 * n_dual, 8.0)]
    best = None
    for lat_start, ll_start in ((latency0, 1.0), (latency0 * 4.0, 2.0), (latency0 / 2.0, 0.0)):
        x0 = np.r_[np.full(n_lat, np.log(lat_start)), np.log(np.full(n_eff, 0.8)), np.full(n_dual, ll_start),
                   np.full(n_dual, 1.5)]
        x = _robust(residual, x0, lower, upper)
        cost = float(np.sum(np.log1p(np.abs(residual(x)) / LOSS_SCALE)))
        if best is None or cost < best[0]:
            best = (cost, x)
    lat, eff, ll_lat, ll_eff = unpack(best[1])
    base = predict(lat, eff, ll_lat, ll_eff)
    identified = {}
    for c in names:  # does some row's time move by >= 1% when this efficiency falls by 10%?
        moved = predict(lat, {**eff, c: eff[c] * 0.9}, ll_lat, ll_eff)
        identified[c] = bool(np.max(np.abs(np.log(moved / base))) >= 0.01)
    return LevelFit({c: v for c, v in lat.items() if c in small}, {c: v for c, v in eff.items() if identified[c]},
                    ll_lat, ll_eff, base / times_s - 1.0)

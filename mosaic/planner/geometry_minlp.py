"""The geometry itself as integer variables: spaces of integer widths, depths and expert counts too
large to list.

Enumeration lists every geometry; this MINLP does not. Its space (`IntegerSpace`):
  n_heads = kv_heads x v (so n_kv_heads = kv_heads divides it), d_model = head_dim x n_heads,
  v integer in [v_min, v_max];  n_layers L, n_experts E and top_k k integers in their ranges;
  one binary x_c per structure c = (granularity, n_shared_experts, n_dense_layers) from the lists;
  head_dim, kv_heads, ffn_ratio, gated FFN, seq_len, vocab fixed; the aspect ratio and the
  active-parameter band as in the enumerated space.

Counts, from perfmodel's own formulas: for a structure c, `total_params`, `active_params` and
`model_flops_per_token` (perfmodel.specs.architecture) are polynomials in (v, L, E, k) on the
basis B = {L v^2, L v, v^2, v, L, E L v^2, E L v, k L v^2, E v^2, E v, k v^2, 1} (d_expert =
ffn_ratio x d_model / G, a whole multiple of d_expert_multiple for every v: checked). Their
coefficients are read off perfmodel at probe points (least squares) and verified at other points
to 1e-12 relative, so the model counts exactly what perfmodel counts; a formula that leaves the
basis is refused.

  variables   x_c binary, sum_c x_c = 1;  v, L, E, k integer;  M_b the monomials of B, tied by
              their products (L v = L . v, L v^2 = (L v) . v, E L v^2 = E . (L v^2), ...);
              y_cb = x_c M_b (exact: y_cb <= U_b x_c, sum_c y_cb = M_b, y >= 0)
  counts      N_tot = sum_cb a_cb y_cb + sum_c a_c1 x_c;  N_act, F likewise (units 1e9, 1e12)
  rules       k + 1 <= E;  aspect_min L <= d_model <= aspect_max L;  N_act in the band;
              L >= n_dense_layers + 1
  objective   the mosaic4d law at D = C_model / F (the compute-optimal budget), one epigraph
              row per term: a/N_tot^alpha, b (F/C)^beta, c (N_act/N_tot)^-lambda,
              j (N_act/N_tot)^-delta N_tot^-gamma G^-eta, + e   (checked against law.predict)

The answer is then rebuilt as an architecture and priced by perfmodel and the law again; an
objective that disagrees by more than 1e-6 relative is an error. Only the compute-optimal budget
is algebraic: the deliverable budget needs `perfmodel.evaluate`'s step time, a numeric model of
kernels and collectives that exists per geometry, not as a formula (docs/design.md).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mosaic.planner import law as lawmod
from mosaic.planner.minlp import solve_nl_scip
from perfmodel.errors import InputError, Param, SolverError
from perfmodel.specs.architecture import CORE_ARCH_FIELDS, ArchBatch, active_params, model_flops_per_token, total_params
from perfmodel.specs.strict import check

N_SCALE = 1.0e9
F_SCALE = 1.0e12
BASIS = ("Lv2", "Lv", "v2", "v", "L", "ELv2", "ELv", "kLv2", "Ev2", "Ev", "kv2", "1")
PRODUCTS = {"Lv": ("L", "v"), "Lv2": ("Lv", "v"), "v2": ("v", "v"), "ELv2": ("E", "Lv2"), "ELv": ("E", "Lv"),
            "kLv2": ("k", "Lv2"), "Ev2": ("E", "v2"), "Ev": ("E", "v"), "kv2": ("k", "v2")}
"""How each monomial of BASIS is built from the integer variables (v, L, E, k) and other monomials."""
LAW_PARAMS = ("a", "alpha", "b", "beta", "c", "lambda", "j", "delta", "gamma", "eta", "e")


@dataclass(frozen=True)
class IntegerSpace:
    """Integer ranges of width (in KV-head groups), depth, experts and top-k; structures from lists."""

    heads_per_kv: tuple[int, int]
    """[v_min, v_max]: n_heads = kv_heads x v, d_model = head_dim x n_heads."""
    depth: tuple[int, int]
    """[L_min, L_max] layers."""
    n_experts: tuple[int, int] = (2, 256)
    """[E_min, E_max] routed experts."""
    top_k: tuple[int, int] = (1, 8)
    granularity: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    n_shared_experts: tuple[int, ...] = (0, 1)
    n_dense_layers: tuple[int, ...] = (0,)
    head_dim: int = 128
    kv_heads: int = 8
    ffn_ratio: float = 4.0
    d_expert_multiple: int = 64
    gated_ffn: bool = True
    tie_embeddings: bool = False
    seq_len: int = 4096
    vocab_size: int = 131072
    aspect_ratio: tuple[float, float] = (32.0, 256.0)
    active_params: tuple[float, float] = (1.0e8, 1.0e13)

    def __post_init__(self) -> None:
        for key in ("heads_per_kv", "depth", "n_experts", "top_k"):
            lo, hi = getattr(self, key)
            check(1 <= lo <= hi, key, f"must be [min, max] with 1 <= min <= max, got {[lo, hi]}", "e.g. [1, 16]")
        check(self.top_k[0] < self.n_experts[1], "top_k", "no top_k below the largest expert count",
              "lower top_k or raise n_experts")
        for g in self.granularity:
            per_v = self.ffn_ratio * self.head_dim * self.kv_heads / g
            check(per_v == int(per_v) and int(per_v) % self.d_expert_multiple == 0, "granularity",
                  f"G={g:g} gives d_expert = {per_v:g} x v, not a multiple of {self.d_expert_multiple} for every v",
                  "use G dividing ffn_ratio x head_dim x kv_heads / d_expert_multiple")

    def structures(self) -> list[tuple[float, int, int]]:
        """(granularity, n_shared, n_dense) with room for a MoE layer."""
        return [(g, s, nd) for g, s, nd in itertools.product(self.granularity, self.n_shared_experts,
                                                            self.n_dense_layers) if nd < self.depth[1]]

    def size(self) -> int:
        """Geometries the space holds (what enumeration would list, before its rules)."""
        span = [hi - lo + 1 for lo, hi in (self.heads_per_kv, self.depth, self.n_experts, self.top_k)]
        return int(np.prod(span, dtype=float)) * len(self.structures())

    def archs(self, structure: tuple[float, int, int], v: Any, layers: Any, experts: Any, k: Any) -> ArchBatch:
        """The geometries (v, L, E, k) of one structure, as perfmodel's ArchBatch."""
        g, shared, nd = structure
        v, layers, experts, k = (np.asarray(a, dtype=np.int64).ravel() for a in np.broadcast_arrays(v, layers, experts, k))
        heads = self.kv_heads * v
        h = self.head_dim * heads
        full = lambda value: np.full(v.shape, value)  # noqa: E731
        cols = {"n_layers": layers, "d_model": h, "n_heads": heads, "n_kv_heads": full(self.kv_heads),
                "head_dim": full(self.head_dim), "vocab_size": full(self.vocab_size), "seq_len": full(self.seq_len),
                "n_experts": experts, "top_k": k, "n_shared_experts": full(shared),
                "d_expert": np.rint(self.ffn_ratio * h / g).astype(np.int64),
                "d_ff_dense": np.rint(self.ffn_ratio * h).astype(np.int64) if nd > 0 else np.zeros_like(v),
                "n_dense_layers": full(nd), "ffn_ratio": full(float(self.ffn_ratio)), "gated_ffn": full(self.gated_ffn),
                "tie_embeddings": full(self.tie_embeddings)}
        return ArchBatch(**{name: cols[name] for name in CORE_ARCH_FIELDS})


def _basis(v: Any, layers: Any, experts: Any, k: Any) -> np.ndarray:
    """The BASIS monomials at points (v, L, E, k), one column each."""
    v, layers, experts, k = (np.asarray(a, dtype=float) for a in (v, layers, experts, k))
    cols = {"v": v, "L": layers, "E": experts, "k": k, "1": np.ones_like(v)}
    for name, (a, b) in PRODUCTS.items():
        cols[name] = cols[a] * cols[b]
    return np.stack([cols[name] for name in BASIS], axis=-1)


def count_coefficients(space: IntegerSpace, structure: tuple) -> dict[str, np.ndarray]:
    """Coefficients on BASIS of N_tot, N_act and F for one structure, read off perfmodel (module doc)."""
    l0 = max(space.depth[0], structure[2] + 1)
    e0 = max(space.n_experts[0], 3)
    axes = [space.heads_per_kv[0] + np.arange(3), l0 + np.arange(3), e0 + np.arange(3), 1 + np.arange(2)]
    grid = np.stack([a.ravel() for a in np.meshgrid(*axes, indexing="ij")], axis=1)
    rng = np.random.default_rng(0)
    pts = np.stack([rng.integers(space.heads_per_kv[0], space.heads_per_kv[1] + 1, 24),
                    rng.integers(l0, max(l0, space.depth[1]) + 1, 24),
                    rng.integers(e0, max(e0, space.n_experts[1]) + 1, 24), np.ones(24, dtype=np.int64)], axis=1)
    pts[:, 3] = np.maximum(1, (pts[:, 2] - 1) // 2)
    out = {}
    for name, fn in (("n_total", total_params), ("n_active", active_params), ("flops", model_flops_per_token)):
        fit = np.asarray(fn(space.archs(structure, *grid.T)), dtype=float)
        coef, *_ = np.linalg.lstsq(_basis(*grid.T), fit, rcond=None)
        coef = np.where(np.abs(coef) < 1e-9 * np.max(np.abs(coef)), 0.0, coef)
        want = np.asarray(fn(space.archs(structure, *pts.T)), dtype=float)
        if not np.allclose(_basis(*pts.T) @ coef, want, rtol=1e-12, atol=0.0):
            raise SolverError(f"perfmodel's {name} of structure {structure} is not a polynomial on the basis "
                              f"{', '.join(BASIS)}; the geometry MINLP cannot model it: use ", Param("solver", "enumerate"))
        out[name] = coef
    return out


def law_parameters(law: lawmod.Law) -> dict[str, float]:
    """The mosaic4d parameters of `law`, checked: the formula below reproduces law.predict."""
    mapping = law.params._asdict() if hasattr(law.params, "_asdict") else dict(law.params)
    missing = [p for p in LAW_PARAMS if p not in mapping]
    if missing:
        raise SolverError(f"law '{law.name}' is not the mosaic4d form (no {', '.join(missing)}); the geometry MINLP "
                          "writes that form: use ", Param("solver", "enumerate"))
    p = {k: float(mapping[k]) for k in LAW_PARAMS}
    n, s, d, g = np.asarray([1e9, 3e10, 8e11]), np.asarray([0.5, 0.9, 0.98]), np.asarray([1e10, 1e11, 1e12]), \
        np.asarray([1.0, 2.0, 8.0])
    mine = (p["a"] / n ** p["alpha"] + p["b"] / d ** p["beta"] + p["c"] / (1 - s) ** p["lambda"]
            + p["j"] / ((1 - s) ** p["delta"] * n ** p["gamma"] * g ** p["eta"]) + p["e"])
    if not np.allclose(mine, np.asarray(law.predict(n, s, d, g), dtype=float), rtol=1e-10):
        raise SolverError(f"law '{law.name}' does not evaluate as the mosaic4d formula; use ", Param("solver", "enumerate"))
    return p


@dataclass
class GeometryAnswer:
    structure: tuple
    heads_per_kv: int
    depth: int
    n_experts: int
    top_k: int
    loss: float
    """The law at the answer, priced by perfmodel's counts and law.predict (not the model's value)."""
    objective: float
    status: str
    gap: Optional[float]
    seconds: float
    arch: Any


def build_model(space: IntegerSpace, law: lawmod.Law, c_model: float) -> tuple[Any, list[tuple]]:
    """(Pyomo model, structures) of the compute-optimal problem over `space` (module doc)."""
    import pyomo.environ as pyo

    p = law_parameters(law)
    structs = space.structures()
    if not structs:
        raise InputError("integer space: no structure leaves room for a MoE layer; lower n_dense_layers")
    coefs = [count_coefficients(space, c) for c in structs]
    ranges = {"v": space.heads_per_kv, "L": space.depth, "E": space.n_experts, "k": space.top_k}
    bounds = dict(ranges)
    for name, (a, b) in PRODUCTS.items():
        bounds[name] = (bounds[a][0] * bounds[b][0], bounds[a][1] * bounds[b][1])
    mono = [b for b in BASIS if b != "1"]
    m = pyo.ConcreteModel(name="mosaic_geometry_compute_optimal")
    m.C = pyo.RangeSet(0, len(structs) - 1)
    m.x = pyo.Var(m.C, domain=pyo.Binary)
    m.one = pyo.Constraint(expr=sum(m.x[c] for c in m.C) == 1)
    m.I = pyo.Var(list(ranges), domain=pyo.Integers, bounds=lambda _m, n: ranges[n])
    m.P = pyo.Var(list(PRODUCTS), bounds=lambda _m, n: bounds[n])

    def term(name: str) -> Any:
        return m.I[name] if name in ranges else m.P[name]

    m.products = pyo.Constraint(list(PRODUCTS), rule=lambda _m, n: _m.P[n] == term(PRODUCTS[n][0]) * term(PRODUCTS[n][1]))
    m.y = pyo.Var(m.C, mono, bounds=lambda _m, c, b: (0.0, bounds[b][1]))
    m.y_sum = pyo.Constraint(mono, rule=lambda _m, b: sum(_m.y[c, b] for c in _m.C) == term(b))
    m.y_on = pyo.Constraint(m.C, mono, rule=lambda _m, c, b: _m.y[c, b] <= bounds[b][1] * _m.x[c])

    def count(name: str, scale: float) -> Any:
        return (sum(float(coefs[c][name][j]) / scale * m.y[c, b] for c in m.C for j, b in enumerate(BASIS)
                    if b != "1" and coefs[c][name][j] != 0.0)
                + sum(float(coefs[c][name][BASIS.index("1")]) / scale * m.x[c] for c in m.C))

    lo, hi = space.active_params
    m.N = pyo.Var(bounds=(1e-3, 1e7))
    m.Na = pyo.Var(bounds=(max(lo / N_SCALE, 1e-3), hi / N_SCALE))
    m.F = pyo.Var(bounds=(1e-6, 1e7))
    m.n_def = pyo.Constraint(expr=m.N == count("n_total", N_SCALE))
    m.na_def = pyo.Constraint(expr=m.Na == count("n_active", N_SCALE))
    m.f_def = pyo.Constraint(expr=m.F == count("flops", F_SCALE))
    m.top_k_below = pyo.Constraint(expr=m.I["k"] + 1 <= m.I["E"])
    width = space.head_dim * space.kv_heads * m.I["v"]
    m.aspect_lo = pyo.Constraint(expr=width >= space.aspect_ratio[0] * m.I["L"])
    m.aspect_hi = pyo.Constraint(expr=width <= space.aspect_ratio[1] * m.I["L"])
    m.dense_room = pyo.Constraint(expr=m.I["L"] >= sum((structs[c][2] + 1) * m.x[c] for c in m.C))
    m.G = pyo.Var(bounds=(min(space.granularity), max(space.granularity)))
    m.g_def = pyo.Constraint(expr=m.G == sum(float(structs[c][0]) * m.x[c] for c in m.C))
    m.Sd = pyo.Var(bounds=(1e-7, 1.0))  # 1 - S = N_act / N_tot
    m.s_def = pyo.Constraint(expr=m.Sd * m.N == m.Na)
    m.t = pyo.Var(range(4), bounds=(0.0, 1e3))
    m.t_a = pyo.Constraint(expr=m.t[0] >= p["a"] * N_SCALE ** -p["alpha"] * m.N ** -p["alpha"])
    m.t_b = pyo.Constraint(expr=m.t[1] >= p["b"] * (F_SCALE / c_model) ** p["beta"] * m.F ** p["beta"])
    m.t_c = pyo.Constraint(expr=m.t[2] >= p["c"] * m.Sd ** -p["lambda"])
    m.t_j = pyo.Constraint(expr=m.t[3] >= p["j"] * N_SCALE ** -p["gamma"] * m.Sd ** -p["delta"] * m.N ** -p["gamma"]
                           * m.G ** -p["eta"])
    m.loss = pyo.Objective(expr=sum(m.t[i] for i in range(4)) + p["e"], sense=pyo.minimize)
    return m, structs


def solve(space: IntegerSpace, law: lawmod.Law, c_model: float, time_limit_s: float = 600.0) -> GeometryAnswer:
    """The compute-optimal geometry of `space` by SCIP, checked against perfmodel and the law."""
    t0 = time.perf_counter()
    model, structs = build_model(space, law, c_model)
    status, gap, values, objective = solve_nl_scip(model, time_limit_s, gap=1e-7, feastol=None)
    if gap is None or status not in ("optimal", "gaplimit"):
        shown = math.inf if gap is None else gap
        raise SolverError(Param("solver", "scip"), f": no proven optimum of the geometry MINLP (status {status}, "
                          f"gap {shown:.2g}, {time.perf_counter() - t0:.0f} s); raise the time limit or narrow the "
                          "integer ranges")
    c = int(np.argmax([values[f"x[{i}]"] for i in range(len(structs))]))
    v, layers, experts, k = (int(round(values[f"I[{n}]"])) for n in ("v", "L", "E", "k"))
    arch = space.archs(structs[c], v, layers, experts, k)
    n_tot, s, g = lawmod.law_inputs(arch)
    loss = float(np.asarray(law.predict(n_tot, s, c_model / np.asarray(model_flops_per_token(arch), dtype=float), g)).ravel()[0])
    if not math.isclose(loss, objective, rel_tol=1e-6):
        raise SolverError(f"the geometry MINLP's objective {objective:.8f} is not the law at its answer {loss:.8f}; use ",
                          Param("solver", "enumerate"))
    return GeometryAnswer(structure=structs[c], heads_per_kv=v, depth=layers, n_experts=experts, top_k=k, loss=loss,
                          objective=objective, status=status, gap=gap, seconds=time.perf_counter() - t0, arch=arch.row(0))


def enumerate_space(space: IntegerSpace, law: lawmod.Law, c_model: float,
                    chunk: int = 2_000_000) -> tuple[float, tuple, tuple[int, int, int, int], int]:
    """Exact reference by listing (perfmodel's counts and law.predict over every (v, L, E, k) of every
    structure, in chunks): (loss, structure, (v, L, E, k), geometries that pass the rules)."""
    best: tuple[float, tuple, tuple[int, int, int, int]] = (math.inf, (), (0, 0, 0, 0))
    axes = [np.arange(lo, hi + 1) for lo, hi in (space.heads_per_kv, space.depth, space.n_experts, space.top_k)]
    inner = np.stack([a.ravel() for a in np.meshgrid(*axes[1:], indexing="ij")], axis=1)  # (L, E, k)
    inner = inner[inner[:, 2] < inner[:, 1]]
    passed = 0
    for structure in space.structures():
        for v in axes[0]:
            for start in range(0, len(inner), chunk):
                part = inner[start:start + chunk]
                layers, experts, k = part.T
                archs = space.archs(structure, np.full(len(part), v), layers, experts, k)
                n_act = np.asarray(active_params(archs), dtype=float)
                h = space.head_dim * space.kv_heads * v
                ok = ((h >= space.aspect_ratio[0] * layers) & (h <= space.aspect_ratio[1] * layers)
                      & (n_act >= space.active_params[0]) & (n_act <= space.active_params[1]) & (layers > structure[2]))
                if not np.any(ok):
                    continue
                passed += int(ok.sum())
                idx = np.flatnonzero(ok)
                sub = archs.take(idx)
                n_tot, s, g = lawmod.law_inputs(sub)
                loss = np.asarray(law.predict(n_tot, s, c_model / np.asarray(model_flops_per_token(sub), dtype=float), g))
                i = int(np.argmin(loss))
                if loss[i] < best[0]:
                    best = (float(loss[i]), structure, (int(v), int(layers[idx[i]]), int(experts[idx[i]]), int(k[idx[i]])))
    return (*best, passed)


__all__ = ["BASIS", "GeometryAnswer", "IntegerSpace", "build_model", "count_coefficients", "enumerate_space",
           "law_parameters", "solve"]

"""Expected load of the busiest expert group, and the tokens a capacity factor drops.

The statistical model (numpy only; each function states its formula):

- Routing: every token picks top_k distinct experts out of E, uniformly at random and
  independently of the other tokens (what a load-balancing loss or DeepSeek-V3's bias
  balancing aims for; the benchmarks' "random uniform router"). It is the floor of a
  balanced router: the bundled trainer's logged `expert_imbalance` settles 1-3% above it
  with the sigmoid router and bias balancing, 8-55% above with the softmax router and aux
  loss 0.01 (`benchmarks/expert_imbalance.py`, docs/validation.md).
- A group of E/g experts (an expert-parallel rank: g = ep; one expert: g = E) receives
  X copies from N tokens: per token the count is hypergeometric (E, E/g, k), so
  E[X] = N k / g and Var[X] = N k (1/g)(1 - 1/g)(E - k)/(E - 1).
- The g group loads sum to N k, so they are the centred Y_i - mean(Y) of g i.i.d. variables
  of variance Var[X] g/(g - 1); their expected maximum is E[X] + q_g sd[X] sqrt(g/(g - 1)),
  with q_g = z_g + gamma (z_g^2 - 1) / 6 (Cornish-Fisher: z_g the expected maximum of g
  standard normal variables, `expected_max_normal`, and gamma = (1 - 2/g) / sqrt(N k (1/g)(1 - 1/g))
  the skewness of a binomial count of N k copies at 1/g, which matters when an expert receives
  few copies). Hence the busiest group's load over the mean,
      f(E, k, g, N) = 1 + q_g sqrt(g (E - k) / ((E - 1) N k))          (1 for g = 1).
- Capacity factor c (Megatron-Core `get_capacity` on each rank's own tokens): expert
  capacity C = c T k / E for the T tokens a rank routes; the copies one rank sends one
  expert are Y ~ Binomial(T, k/E), normal with mean mu = T k / E and sd s; the dropped
  fraction is E[(Y - C)+] / mu = s (phi(a) - a (1 - Phi(a))) / mu, a = (C - mu) / s.

`expected_max_normal` is a table of z_n = integral x n phi(x) Phi(x)^(n-1) dx computed once
by quadrature (trapezoid on [-8, 8], 1601 points; 241 log-spaced n up to 2^15), interpolated in log n; Phi from the
Abramowitz & Stegun 7.1.26 rational approximation of erf (|error| < 1.5e-7).
"""

from __future__ import annotations

import numpy as np

from perfmodel.specs.protocols import Values

_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_P = 0.3275911


def erf(x: Values) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26: erf(x) = 1 - (a1 t + ... + a5 t^5) exp(-x^2), t = 1/(1 + p|x|)."""
    x = np.asarray(x, dtype=float)
    t = 1.0 / (1.0 + _P * np.abs(x))
    poly = t * (_A[0] + t * (_A[1] + t * (_A[2] + t * (_A[3] + t * _A[4]))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def normal_cdf(x: Values) -> np.ndarray:
    return 0.5 * (1.0 + erf(np.asarray(x, dtype=float) / np.sqrt(2.0)))


def normal_pdf(x: Values) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    return np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


def _max_normal_table() -> tuple[np.ndarray, np.ndarray]:
    x = np.linspace(-8.0, 8.0, 1601)
    cdf, pdf = normal_cdf(x), normal_pdf(x)
    n = np.unique(np.round(np.logspace(0, 15, 241, base=2.0))).astype(float)  # 1 .. 32768 groups
    integrand = x[None, :] * n[:, None] * pdf[None, :] * cdf[None, :] ** (n[:, None] - 1.0)
    z = np.trapezoid(integrand, x, axis=1)
    z[0] = 0.0  # the maximum of one variable is its mean
    return np.log(n), z


_LOG_N, _Z = _max_normal_table()


def expected_max_normal(n: Values) -> np.ndarray:
    """z_n: the expected maximum of n independent standard normal variables (module doc)."""
    return np.interp(np.log(np.maximum(np.asarray(n, dtype=float), 1.0)), _LOG_N, _Z)


def busiest_load_factor(n_experts: Values, top_k: Values, groups: Values, tokens: Values) -> np.ndarray:
    """f = 1 + q_g sqrt(g (E - k) / ((E - 1) N k)): the busiest of g equal expert groups receives
    f times the mean N k / g copies of N uniformly routed tokens (module doc); 1 for one group,
    a dense model or no tokens."""
    E = np.asarray(n_experts, dtype=float)
    k = np.asarray(top_k, dtype=float)
    g = np.asarray(groups, dtype=float)
    N = np.asarray(tokens, dtype=float)
    active = (E > 1.0) & (k > 0.0) & (g > 1.0) & (N > 0.0)
    spread = np.where(active, g * np.maximum(E - k, 0.0) / (np.maximum(E - 1.0, 1.0) * np.maximum(N * k, 1e-300)), 0.0)
    z = expected_max_normal(np.where(active, g, 1.0))
    p = 1.0 / np.maximum(g, 1.0)
    skew = np.where(active, (1.0 - 2.0 * p) / np.sqrt(np.maximum(N * k * p * (1.0 - p), 1e-300)), 0.0)
    return 1.0 + (z + skew * (z * z - 1.0) / 6.0) * np.sqrt(spread)


def dropped_fraction(n_experts: Values, top_k: Values, tokens_per_rank: Values, capacity_factor: Values) -> np.ndarray:
    """Fraction of routed copies a capacity factor c drops (module doc); 0 without a capacity
    (c <= 0, dropless) or experts."""
    E = np.asarray(n_experts, dtype=float)
    k = np.asarray(top_k, dtype=float)
    T = np.asarray(tokens_per_rank, dtype=float)
    c = np.asarray(capacity_factor, dtype=float)
    active = (E > 0.0) & (k > 0.0) & (c > 0.0) & (T > 0.0)
    p = np.where(active, k / np.maximum(E, 1.0), 0.0)
    mu = T * p
    sd = np.sqrt(np.maximum(T * p * (1.0 - p), 1e-300))
    a = (c * mu - mu) / sd
    excess = sd * (normal_pdf(a) - a * (1.0 - normal_cdf(a)))
    return np.where(active & (mu > 0), np.clip(excess / np.maximum(mu, 1e-300), 0.0, 1.0), 0.0)


def expert_imbalance(n_experts: Values, top_k: Values, tokens: Values) -> np.ndarray:
    """Expected max / mean tokens per expert over N tokens: f with g = E (what the bundled
    trainer logs as `expert_imbalance` per MoE layer and step)."""
    return busiest_load_factor(n_experts, top_k, n_experts, tokens)


def ranks_hit_probability(n_experts: Values, top_k: Values, groups: Values) -> np.ndarray:
    """Probability that a token has at least one of its k experts in a given one of g equal expert
    groups: 1 - C(E - E/g, k) / C(E, k) = 1 - prod_{i<k} (E - E/g - i) / (E - i) (the
    deduplicated dispatch of DeepEP/HybridEP sends a token once per such rank or node)."""
    E = np.asarray(n_experts, dtype=float)
    k = np.asarray(top_k, dtype=float)
    g = np.maximum(np.asarray(groups, dtype=float), 1.0)
    outside = E - E / g
    miss = np.ones(np.broadcast(E, k, g).shape)
    for i in range(int(np.max(k)) if np.size(k) else 0):
        term = np.clip((outside - i) / np.maximum(E - i, 1.0), 0.0, 1.0)
        miss = miss * np.where(i < k, term, 1.0)
    return np.where(E > 0, 1.0 - miss, 0.0)


__all__ = ["busiest_load_factor", "dropped_fraction", "erf", "expected_max_normal", "expert_imbalance",
           "normal_cdf", "normal_pdf", "ranks_hit_probability"]

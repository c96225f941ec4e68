"""The kernel forms: achieved fraction of peak as pure vectorised functions of a kernel's shape.

One function per kind, used by the performance model's hot path (`perfmodel.hardware`) and by
the fit that derives each cluster's figures from the measured tables (`perfmodel.kernels.fit`),
so the figures are fitted with the very formula that prices a step. s(x; x_half) = x / (x + x_half)
is a saturation: 1/2 at x = x_half, -> 1 for x >> x_half.

- Dense GEMM C[m, n] = A[m, k] B[k, n], 2mnk FLOPs:
      eff = e_max * s(m; m_half) * s(n; n_half) * s(k; k_half)
  Output rows and columns (m, n) fill the tiles and waves of the machine; the reduction depth k
  amortises each tile's prologue and epilogue. Time = max(2mnk / (peak eff), bytes / (HBM bw
  eff_copy)): a skinny GEMM (m of a few dozen rows) is bound by reading its weights.
  The phases of one linear layer are three GEMMs of the same matrices with different roles
  (`phase_dims`): forward (m, n, k) = (tokens, out, in); input gradient (tokens, in, out);
  weight gradient (in, out, tokens): its reduction runs over the tokens, which is why a grouped
  expert GEMM's weight gradient with few tokens per expert is slow.
- Grouped (MoE expert) GEMM: the same form per phase with its own figures, m = tokens per
  expert (one group).
- Flash attention, executed FLOPs (causal: half of 4 s^2 h_q per sequence forward; backward
  2.5x forward, Dao 2023):
      eff = e_max[phase] * s(s; s_half[causal]) * s(d; d_half)
  s = sequence length, d = head dim; causal kernels waste the diagonal blocks, so their s_half
  is larger.
- Memory-bound kernel of class c moving b bytes (reads + writes):
      eff = f[c] * s(b; b_half)
  f[c]: the class's large-size fraction of HBM bandwidth (a norm, an activation, a permute,
  cross-entropy, the optimizer step, a cast, a copy); b_half: the size at which fixed launch
  and tail costs halve it.
"""

from __future__ import annotations

from typing import Union

import numpy as np

Values = Union[float, np.ndarray]

MEMORY_CLASSES = ("copy", "elementwise", "norm", "activation", "permute", "cross_entropy", "optimizer", "cast")
"""Classes of memory-bound kernels (each op of `perfmodel.operators` names one)."""

GEMM_PHASES = ("fwd", "dgrad", "wgrad")
ATTENTION_PHASES = ("fwd", "bwd")


def saturation(x: Values, half: Values) -> Values:
    """x / (x + half): 1/2 at x = half, -> 1 for x >> half."""
    return x / (x + half)


def gemm_efficiency(m: Values, n: Values, k: Values, e_max: Values, m_half: Values, n_half: Values,
                    k_half: Values) -> Values:
    """e_max * s(m) * s(n) * s(k) for C[m, n] = A[m, k] B[k, n] (module doc)."""
    return e_max * saturation(m, m_half) * saturation(n, n_half) * saturation(k, k_half)


def phase_dims(phase: str, m: Values, n: Values, k: Values) -> tuple[Values, Values, Values]:
    """(m, n, k) of the GEMM a linear layer of forward shape (m, n, k) runs in `phase`:
    fwd Y[m, n] = X[m, k] W[k, n]; dgrad dX[m, k] = dY[m, n] W^T[n, k];
    wgrad dW[k, n] = X^T[k, m] dY[m, n] (reduction over the m tokens)."""
    if phase == "fwd":
        return m, n, k
    if phase == "dgrad":
        return m, k, n
    if phase == "wgrad":
        return k, n, m
    raise AssertionError(phase)


def attention_efficiency(seq_len: Values, head_dim: Values, e_max: Values, seq_half: Values,
                         head_dim_half: Values) -> Values:
    """e_max * s(seq_len; seq_half) * s(head_dim; head_dim_half) of a flash-attention phase."""
    return e_max * saturation(seq_len, seq_half) * saturation(head_dim, head_dim_half)


def memory_efficiency(nbytes: Values, fraction: Values, bytes_half: Values) -> Values:
    """fraction * s(bytes; bytes_half) of a memory-bound kernel moving `nbytes`."""
    return fraction * saturation(nbytes, bytes_half)


def gemm_seconds(m: Values, n: Values, k: Values, peak_flops_per_s: Values, efficiency: Values,
                 nbytes: Values, hbm_bytes_per_s: Values) -> Values:
    """max(2mnk / (peak eff), bytes / hbm): the roofline of one GEMM."""
    return np.maximum(2.0 * m * n * k / (peak_flops_per_s * efficiency), nbytes / hbm_bytes_per_s)

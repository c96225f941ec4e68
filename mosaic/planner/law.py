"""The scaling law as the planner uses it: loss of geometries at a token count.

One place turns an architecture into the law's inputs (DESIGN.md symbols):
N_tot = total_params(arch) (non-embedding), S = sparsity(arch), G = granularity(arch).
`tokens_term` splits a law into  L = K(N, S, G) + b / D^beta  (every law we ship
has that form); the MINLP uses the split, enumeration calls `predict` itself,
and the split is checked against `predict` before it is trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from perfmodel.errors import InputError, Param, SolverError
from perfmodel.specs.architecture import granularity, sparsity, total_params


class Law(Protocol):
    """What the planner needs from `scaling_fits.FittedLaw`."""

    name: str
    params: Any

    def predict(self, n_total: Any, sparsity: Any, tokens: Any, granularity: Any) -> Any: ...

    def content_hash(self) -> str: ...


def load_law(path: Optional[str] = None) -> Law:
    """`scaling_fits.load_fit(path)`; None = the bundled default fit."""
    try:
        from scaling_fits import load_fit
    except ImportError as exc:  # pragma: no cover - scaling_fits is part of this distribution
        raise InputError(f"scaling_fits is not importable ({exc}); reinstall mosaic-planner") from None
    return load_fit(path)


def law_inputs(archs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N_tot, S, G) of an ArchBatch or MoEArchitecture."""
    return (np.asarray(total_params(archs), dtype=float), np.asarray(sparsity(archs), dtype=float),
            np.asarray(granularity(archs), dtype=float))


def loss(law: Law, archs: Any, tokens: Any) -> np.ndarray:
    """Predicted loss of each geometry trained on `tokens` tokens."""
    n_tot, s, g = law_inputs(archs)
    tokens = np.asarray(tokens, dtype=float)
    safe = np.where(tokens > 0, tokens, 1.0)
    out = np.asarray(law.predict(n_tot, s, safe, g), dtype=float)
    return np.where(tokens > 0, out, np.inf)


def _param(params: Any, *names: str) -> Optional[float]:
    mapping = params._asdict() if hasattr(params, "_asdict") else (params if isinstance(params, dict) else vars(params))
    for name in names:
        if name in mapping:
            return float(mapping[name])
    return None


@dataclass(frozen=True)
class TokensTerm:
    """L = constant[g] + coef / D^exponent, per geometry."""

    constant: np.ndarray
    coef: float
    exponent: float


def tokens_term(law: Law, archs: Any, d_ref: float = 1.0e12) -> TokensTerm:
    """Split the law into a geometry constant and b / D^beta; verified against `predict`."""
    n_tot, s, g = law_inputs(archs)
    coef = _param(law.params, "b", "B")
    exponent = _param(law.params, "beta")
    probe = np.asarray([d_ref / 10.0, d_ref, d_ref * 10.0])
    f = np.stack([np.asarray(law.predict(n_tot, s, np.full_like(n_tot, d), g), dtype=float) for d in probe])
    if coef is None or exponent is None:
        d1, d2 = f[0] - f[1], f[1] - f[2]
        exponent = float(np.median(np.log(d1 / d2) / np.log(10.0)))
        coef = float(np.median(d1 / (probe[0] ** -exponent - probe[1] ** -exponent)))
    constant = f[1] - coef * d_ref ** -exponent
    rebuilt = constant[None, :] + coef * probe[:, None] ** -exponent
    if not np.allclose(rebuilt, f, rtol=1e-9, atol=1e-12):
        raise SolverError(f"law '{law.name}' is not of the form K(N, S, G) + b/D^beta, which the MINLP needs; use ",
                          Param("solver", "enumerate"))
    return TokensTerm(constant=constant, coef=float(coef), exponent=float(exponent))


def sparsity_exponents(law: Law) -> Optional[dict[str, float]]:
    """The power of (1 - S) in each sparsity-dependent term of the mosaic4d law at fixed active
    parameters N_act = (1 - S) N_tot (fixed model FLOPs per token), fixed D and G:

      a / N_tot^alpha                  = a N_act^-alpha (1-S)^alpha           -> alpha
      c / (1-S)^lambda                 = c (1-S)^-lambda                      -> -lambda
      j / ((1-S)^delta N_tot^gamma G^eta) = j N_act^-gamma G^-eta (1-S)^(gamma - delta) -> gamma - delta

    A positive power makes its term fall as S -> 1: when all are positive the loss at a fixed
    model-FLOPs budget falls monotonically with sparsity, so that optimum is the sparsest point
    the space allows (boundary-seeking). None for a law without these parameters."""
    names = ("alpha", "lambda", "gamma", "delta")
    values = [_param(law.params, n) for n in names]
    if any(v is None for v in values):
        return None
    alpha, lam, gamma, delta = values
    return {"a_term": alpha, "c_term": -lam, "j_term": gamma - delta}


__all__ = ["Law", "TokensTerm", "law_inputs", "load_law", "loss", "sparsity_exponents", "tokens_term"]

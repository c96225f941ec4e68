"""What a fitted theta vector means: a law plus coefficients that take one value per data source.

Several public sources (different corpora, tokenizers, evaluation sets) measure
loss on different scales: the same model has a different irreducible loss on
each. A joint fit shares the law's exponents and coefficients across sources
and gives each source its own value of the named constant terms (`per_source`,
normally ``("e",)``):

    L_s(N, S, D, G) = law(N, S, D, G) with e -> e_s

theta = (the law's own parameters, which are those of the *reference* source,
then one log-coefficient per (per-source coefficient, other source)), so every
term stays linear in theta and the fitter's log-sum-exp objective is unchanged:
a row of source s reads its constant from the column of e_s. With one source
(or no per-source coefficient) the model is the law itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from scaling_fits.data import RunData
from scaling_fits.errors import FitDataError
from scaling_fits.laws import Law, field_name


@dataclass(frozen=True)
class Model:
    """A law with per-source copies of some constant coefficients."""

    law: Law
    per_source: tuple[str, ...] = ()
    sources: tuple[str, ...] = ("",)
    reference: int = 0

    def __post_init__(self) -> None:
        for name in self.per_source:
            if not self.law.is_coef(name):
                raise FitDataError(f"per-source parameter '{name}' is not a coefficient of law '{self.law.name}'; "
                                   f"use a constant term such as e")
            term = next(t for t in self.law.terms if t.coef == field_name(name))
            if term.powers:
                raise FitDataError(f"per-source parameter '{name}' multiplies powers of the inputs; only constant "
                                   "terms (the irreducible loss e) can take one value per source")
        if not 0 <= self.reference < len(self.sources):
            raise FitDataError(f"reference source number {self.reference} outside 0..{len(self.sources) - 1}")

    @classmethod
    def for_data(cls, law: Law, data: RunData, per_source: tuple[str, ...] = (),
                 reference: Optional[str] = None) -> Model:
        """The model of `law` fitted to `data`; `reference` names the source whose values the law keeps."""
        if reference is None:
            ref = 0
        elif reference in data.source_names:
            ref = data.source_names.index(reference)
        else:
            raise FitDataError(f"reference source {reference!r} is not in the data; sources: "
                               f"{', '.join(data.source_names)}")
        return cls(law, tuple(per_source) if data.n_sources > 1 else (), data.source_names, ref)

    @property
    def extra(self) -> tuple[tuple[str, int], ...]:
        """(coefficient, source number) of each extra theta entry, in order."""
        return tuple((c, s) for c in self.per_source for s in range(len(self.sources)) if s != self.reference)

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.law.param_names + tuple(f"{c}[{self.sources[s]}]" for c, s in self.extra)

    @property
    def n_params(self) -> int:
        return len(self.law.fields) + len(self.extra)

    @property
    def reference_name(self) -> str:
        return self.sources[self.reference]

    def column(self, coef: str, source: int) -> int:
        """theta column holding `coef` for rows of `source`."""
        if coef not in self.per_source or source == self.reference:
            return self.law.index(coef)
        return len(self.law.fields) + self.extra.index((coef, source))

    def is_coef(self, column: int) -> bool:
        return column >= len(self.law.fields) or self.law.is_coef(self.law.fields[column])

    def theta_bounds(self) -> list[tuple[float, float]]:
        base = self.law.theta_bounds()
        return base + [base[self.law.index(c)] for c, _ in self.extra]

    def theta_start_ranges(self) -> list[tuple[float, float]]:
        base = self.law.theta_start_ranges()
        return base + [base[self.law.index(c)] for c, _ in self.extra]

    def natural(self, theta: Any) -> np.ndarray:
        """Natural units of a (..., n_params) theta (coefficients exponentiated)."""
        theta = np.asarray(theta, dtype=float)
        P = len(self.law.fields)
        head = self.law.natural(theta[..., :P])
        return np.concatenate([head, np.exp(theta[..., P:])], axis=-1)

    def for_source(self, theta: Any, source: int) -> np.ndarray:
        """The law's theta (..., P) for rows of `source`."""
        theta = np.asarray(theta, dtype=float)
        out = theta[..., :len(self.law.fields)].copy()
        for c, s in self.extra:
            if s == source:
                out[..., self.law.index(c)] = theta[..., self.column(c, s)]
        return out

    def project(self, theta: Any, source: Optional[str] = None) -> np.ndarray:
        """The law's theta for a named source (None: the reference source)."""
        if source is None:
            return self.for_source(theta, self.reference)
        if source not in self.sources:
            raise FitDataError(f"no source {source!r}; sources: {', '.join(self.sources)}")
        return self.for_source(theta, self.sources.index(source))

    def predict(self, theta: Any, data: RunData) -> np.ndarray:
        """Loss of every row of `data` under theta (n_params,) or (B, n_params): shape (n,) or (B, n)."""
        theta = np.asarray(theta, dtype=float)
        if not self.extra:
            return self.law.predict_theta(theta, data.n_total, data.sparsity, data.tokens, data.granularity)
        out = np.empty(theta.shape[:-1] + (data.n_points,))
        for s in np.unique(data.source_index):
            rows = data.source_index == s
            out[..., rows] = self.law.predict_theta(self.for_source(theta, int(s)), data.n_total[rows],
                                                    data.sparsity[rows], data.tokens[rows], data.granularity[rows])
        return out


def as_model(law_or_model: Law | Model) -> Model:
    return law_or_model if isinstance(law_or_model, Model) else Model(law_or_model)


__all__ = ["Model", "as_model"]

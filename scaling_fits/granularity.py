"""The granularity exponent of a fitted law, calibrated to a published granularity effect.

When the runs of a fit never vary G (every public per-run data set we have: Clark et al. 2022,
Hoffmann et al. 2022), eta must come from elsewhere. Copying a published exponent is not enough:
the exponent acts on different terms in different laws. Krajewski et al. 2024 (arXiv
2402.07871, eq. 9),

    L = c + (g / G^gamma_K + a) / N^alpha + b / D^beta,

let G shrink only the part g / (g + a) (~10 %) of the parameter-limited loss; mosaic4d lets it
shrink the whole interaction term j / ((1-S)^delta N^gamma), which a joint fit may make most of
the N-dependent loss. The same exponent then claims a several-fold larger effect than was
measured. So eta is calibrated to the measured *effect*: over the runs of the published study
(their N_tot and sparsity, G = 1..16) the N-dependent loss of the fitted law,

    L_N(G) = a / N^alpha + j / ((1-S)^delta N^gamma G^eta),

must shrink with G by the same factor as in the published law,
(g G^-gamma_K + a) / (g + a): eta minimises sum over runs and G of
(ln L_N(G)/L_N(1) - ln r_K(G))^2 (a one-dimensional bounded least-squares problem). The relative
change of the parameter-limited loss is the transferred quantity because the corpora, tokenizers
and irreducible losses differ (C4 with the GPT-2 tokenizer there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaling_fits.errors import FitDataError
from scaling_fits.laws import Law


@dataclass(frozen=True)
class PublishedGranularityLaw:
    """A published fit of L = c + (g/G^gamma + a)/N^alpha + b/D^beta and the runs it was fitted on."""

    name: str
    g: float
    gamma: float
    a: float
    experts: int
    d_model_blocks: tuple[tuple[int, int], ...]   # (d_model, n_blocks) of the MoE runs
    granularity: tuple[float, ...]
    source: str

    def n_total(self) -> np.ndarray:
        """N = d_model^2 (8E + 4) n_blocks (their section 6.1: 8E d^2 in experts, 4 d^2 in attention)."""
        return np.array([d * d * (8 * self.experts + 4) * n for d, n in self.d_model_blocks], dtype=float)

    def sparsity(self) -> float:
        """S = 1 - N_act/N_tot with 12 d^2 active per block (MoE FLOPs matched to the dense model)."""
        return 1.0 - 12.0 / (8 * self.experts + 4)

    def ratio(self, granularity: Any) -> np.ndarray:
        """Factor by which G shrinks the N-dependent loss: (g G^-gamma + a) / (g + a)."""
        g = np.asarray(granularity, dtype=float)
        return (self.g * g ** -self.gamma + self.a) / (self.g + self.a)


_SRC = "Krajewski et al. 2024, Scaling Laws for Fine-Grained Mixture of Experts, arXiv 2402.07871"
_E64_RUNS = ((256, 4), (384, 4), (512, 4), (512, 8), (640, 10), (768, 12))   # Table 3
_E16_RUNS = ((256, 4), (256, 8), (512, 4), (512, 8), (640, 10))              # Table 7
_G = (1.0, 2.0, 4.0, 8.0, 16.0)
KRAJEWSKI_2024 = {
    "table1": PublishedGranularityLaw("table1", 2.1, 0.58, 18.1, 64, _E64_RUNS, _G,
                                      f"{_SRC}, Table 1 (E = 64, all runs)"),
    "table5": PublishedGranularityLaw("table5", 2.07, 0.570, 17.6, 64, _E64_RUNS, _G,
                                      f"{_SRC}, Table 5 (E = 64, lowest-loss 20% of runs excluded)"),
    "table8": PublishedGranularityLaw("table8", 1.18, 0.986, 19.64, 16, _E16_RUNS, _G,
                                      f"{_SRC}, Table 8 (E = 16)"),
}


def n_dependent_ratio(law: Law, params: Mapping[str, float], n_total: Any, sparsity: float, granularity: Any,
                      eta: float) -> np.ndarray:
    """L_N(G) / L_N(1) of mosaic4d: shape broadcast(n_total[:, None], granularity[None, :])."""
    n = np.asarray(n_total, dtype=float)[:, None]
    g = np.asarray(granularity, dtype=float)[None, :]
    plain = params["a"] / n ** params["alpha"]
    inter = params["j"] / ((1.0 - sparsity) ** params["delta"] * n ** params["gamma"])
    return (plain + inter * g ** -eta) / (plain + inter)


def calibrate_eta(law: Law, params: Mapping[str, float], published: PublishedGranularityLaw) -> float:
    """eta of `law` (mosaic4d) reproducing `published`'s shrinkage of the N-dependent loss over its runs."""
    from scipy.optimize import minimize_scalar

    if law.name != "mosaic4d":
        raise FitDataError(f"granularity calibration is written for mosaic4d, not {law.name}")
    n = published.n_total()
    s = published.sparsity()
    target = np.log(published.ratio(published.granularity))[None, :]
    lo, hi = law.params_type.BOUNDS["eta"]

    def loss(eta: float) -> float:
        return float(np.sum((np.log(n_dependent_ratio(law, params, n, s, published.granularity, eta)) - target) ** 2))

    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-8})
    return float(res.x)


def calibration_report(law: Law, params: Mapping[str, float], eta: float,
                       published: PublishedGranularityLaw) -> dict[str, Any]:
    """How well the calibrated eta reproduces the published shrinkage (per G, averaged over the runs)."""
    n = published.n_total()
    ours = n_dependent_ratio(law, params, n, published.sparsity(), published.granularity, eta)
    return {"published": published.source, "eta": eta,
            "granularity": list(published.granularity),
            "published_ratio": [float(v) for v in published.ratio(published.granularity)],
            "fitted_ratio_mean": [float(v) for v in ours.mean(axis=0)],
            "fitted_ratio_spread": [float(v) for v in np.ptp(ours, axis=0)]}


def with_calibrated_eta(fitted: Any, granularity_of_runs: Any, published: Mapping[str, PublishedGranularityLaw],
                        point: str, seed: int = 0) -> Any:
    """A copy of a mosaic4d `FittedLaw` fitted on G = 1 runs with eta calibrated to published fits.

    The point value uses `published[point]`; every bootstrap sample is calibrated with its own
    parameters (so the interval follows the fitted split between the plain and the interaction
    term) against one of the published fits drawn uniformly (the spread between published fits).
    Exact because eta does not enter the fitted predictions when every run has the same G.
    """
    import dataclasses

    g = np.asarray(granularity_of_runs, dtype=float)
    if np.ptp(g) > 0:
        raise FitDataError("eta can be calibrated to a published effect only when the fitted runs do not vary G; "
                           "these do: fit eta instead")
    law = fitted.law
    col = law.index("eta")
    theta = np.array(fitted.theta, dtype=float)
    theta[col] = calibrate_eta(law, fitted.params, published[point])
    boot = None
    ci = dict(fitted.ci)
    if fitted.bootstrap_theta is not None:
        boot = np.array(fitted.bootstrap_theta, dtype=float)
        names = list(published)
        pick = np.random.default_rng([seed, 0x6E7A]).integers(0, len(names), boot.shape[0])
        for i, row in enumerate(fitted.bootstrap_params):
            boot[i, col] = calibrate_eta(law, dict(zip(law.param_names, row)), published[names[pick[i]]])
        level = fitted.ci_level or 0.95
        lo, hi = np.quantile(boot[:, col], [(1 - level) / 2, (1 + level) / 2])
        ci["eta"] = (float(lo), float(hi))
    params = dict(zip(law.param_names, law.natural(theta)))
    prior = {"value": float(theta[col]), "method": "calibrated to a published granularity effect "
             "(scaling_fits/granularity.py)", "point": published[point].source,
             "bootstrap": [p.source for p in published.values()],
             "check": {k: calibration_report(law, params, float(theta[col]), p) for k, p in published.items()}}
    provenance = {**fitted.provenance, "priors": {**fitted.provenance.get("priors", {}), "eta": prior}}
    metrics = {**fitted.metrics, "derived": {k: float(v) for k, v in law.params_from_theta(theta).derived.items()}}
    return dataclasses.replace(fitted, theta=theta, bootstrap_theta=boot, ci=ci, provenance=provenance,
                               metrics=metrics)


__all__ = ["KRAJEWSKI_2024", "PublishedGranularityLaw", "calibrate_eta", "calibration_report", "n_dependent_ratio",
           "with_calibrated_eta"]

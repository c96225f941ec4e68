"""One call from runs data to a `FittedLaw` with intervals, errors and provenance (`mosaic fit` uses it)."""

from __future__ import annotations

import datetime as _dt
import platform
import time
from typing import Any, Optional

import numpy as np

from scaling_fits.data import RunData
from scaling_fits.errors import FitDataError
from scaling_fits.fitfile import FittedLaw
from scaling_fits.fitter import (
    FitOptions,
    Progress,
    bootstrap,
    fit,
    holdout_top,
    identifiability,
    intervals,
    leave_one_out,
    mape,
    residual_diagnostics,
)
from scaling_fits.laws import get_law
from scaling_fits.model import Model


def fit_law(data: RunData, law_name: str = "mosaic4d", options: Optional[FitOptions] = None, n_boot: int = 0,
            boot_seed: Optional[int] = None, holdout_fraction: Optional[float] = 0.2, loo: bool = True,
            ci_level: float = 0.95, priors: Optional[dict[str, Any]] = None, sources: Optional[list[str]] = None,
            progress: Optional[Progress] = None) -> FittedLaw:
    """Fit, then (optionally) bootstrap, hold out the largest-compute runs, leave one run out.

    `priors` documents fixed parameters: {name: {"value": v, "source": "..."}}; its
    values are added to `options.fixed`.

    With several data sources and `options.per_source` (e.g. ("e",)), the joint fit gives every source
    its own value of those coefficients; the returned law is that of `options.reference_source`, the
    per-source values (with intervals) are in `metrics["sources"]`.
    """
    law = get_law(law_name)
    options = options or FitOptions()
    fixed = dict(options.fixed)
    for name, prior in (priors or {}).items():
        fixed[name] = float(prior["value"])
    options = FitOptions(**{**options.as_dict(), "fixed": fixed, "per_source": tuple(options.per_source)})
    if not 0 < ci_level < 1:
        raise FitDataError(f"ci level must be in (0, 1), got {ci_level}")
    if data.n_runs < 2 and (n_boot or holdout_fraction or loo):
        raise FitDataError(f"{data.source}: {data.n_runs} run(s); bootstrap, hold-out and leave-one-out need >= 2 "
                           "runs (give run_id, or switch them off)")
    t0 = time.perf_counter()
    result = fit(law, data, options, progress)
    model = result.model
    metrics: dict[str, Any] = {
        "n_points": data.n_points, "n_runs": data.n_runs,
        "objective": result.objective,
        "starts": result.report.as_dict(),
        "fit_seconds": result.seconds,
        "mape_in_sample": mape(model, result.theta, data),
        "residuals": residual_diagnostics(model, result.theta, data),
        "derived": {k: float(v) for k, v in result.params.derived.items()},
        "identifiability": identifiability(result, data),
    }
    boot_theta = None
    ci: dict[str, tuple[float, float]] = {}
    seed = options.seed if boot_seed is None else boot_seed
    if n_boot:
        boot_theta = bootstrap(result, data, n_boot, seed=seed, progress=progress)
        ci = intervals(model, boot_theta, ci_level)
        free = [n for n in model.param_names if n not in result.fixed]
        ci = {k: v for k, v in ci.items() if k in free}
        boot_pred = model.predict(boot_theta, data)
        lo, hi = np.quantile(boot_pred, [(1 - ci_level) / 2, (1 + ci_level) / 2], axis=0)
        metrics["prediction_ci_rel_halfwidth_median"] = float(np.median((hi - lo) / 2 / data.loss))
    if holdout_fraction:
        metrics["holdout"] = holdout_top(law, data, options, holdout_fraction, progress)
        metrics["mape_holdout"] = metrics["holdout"]["mape"]
    else:
        metrics["mape_holdout"] = None
    if loo:
        metrics["leave_one_out"] = leave_one_out(result, data, progress=progress)
        metrics["mape_loo"] = metrics["leave_one_out"]["mape"]
    if data.n_sources > 1:
        metrics["sources"] = _source_summary(model, result.theta, boot_theta, ci, data)
    metrics["total_seconds"] = time.perf_counter() - t0
    provenance = {
        "data": {"source": data.source, "sha256": data.sha256, "n_points": data.n_points, "n_runs": data.n_runs,
                 "sources": list(data.source_names) if data.n_sources > 1 else []},
        "sources": list(sources or []) + [law.source],
        "priors": dict(priors or {}),
        "fitter": {**options.as_dict(), "method": "L-BFGS-B on summed Huber(log residual), log-sum-exp form, "
                                                   "scrambled-Sobol start grid",
                   "bootstrap": {"n": n_boot, "seed": seed, "over": "runs", "ci_level": ci_level if n_boot else None},
                   "holdout": {"fraction": holdout_fraction, "by": "largest compute 6 N_act D per run"},
                   "leave_one_out": {"enabled": loo, "warm_start": "full-data optimum"}},
        "fit_date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tool": {"package": "scaling_fits", "python": platform.python_version(), "numpy": np.__version__},
    }
    law_ci = {k: v for k, v in ci.items() if k in law.param_names}
    return FittedLaw(law=law, theta=model.project(result.theta),
                     bootstrap_theta=None if boot_theta is None else model.project(boot_theta),
                     fixed=tuple(result.fixed), ci=law_ci, ci_level=ci_level if n_boot else None,
                     bootstrap_seed=seed if n_boot else None, metrics=metrics, provenance=provenance, source="<fit>")


def _source_summary(model: Model, theta: np.ndarray, boot_theta: Optional[np.ndarray],
                    ci: dict[str, tuple[float, float]], data: RunData) -> dict[str, Any]:
    """Per source: runs, in-sample MAPE and the value (with interval) of each per-source coefficient."""
    out: dict[str, Any] = {}
    for s, name in enumerate(data.source_names):
        sub = data.subset_sources((name,))
        item: dict[str, Any] = {"n_runs": sub.n_runs, "n_points": sub.n_points, "reference": s == model.reference,
                                "mape_in_sample": mape(model, theta, sub)}
        for c in model.per_source:
            key = model.param_names[model.column(c, s)]
            item[c] = float(model.natural(theta)[model.column(c, s)])
            if key in ci:
                item[f"{c}_ci"] = list(ci[key])
        out[name] = item
    return out


__all__ = ["fit_law"]

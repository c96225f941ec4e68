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
    intervals,
    leave_one_out,
    mape,
    residual_diagnostics,
)
from scaling_fits.laws import get_law


def fit_law(data: RunData, law_name: str = "mosaic4d", options: Optional[FitOptions] = None, n_boot: int = 0,
            boot_seed: Optional[int] = None, holdout_fraction: Optional[float] = 0.2, loo: bool = True,
            ci_level: float = 0.95, priors: Optional[dict[str, Any]] = None, sources: Optional[list[str]] = None,
            progress: Optional[Progress] = None) -> FittedLaw:
    """Fit, then (optionally) bootstrap, hold out the largest-compute runs, leave one run out.

    `priors` documents fixed parameters: {name: {"value": v, "source": "..."}}; its
    values are added to `options.fixed`.
    """
    law = get_law(law_name)
    options = options or FitOptions()
    fixed = dict(options.fixed)
    for name, prior in (priors or {}).items():
        fixed[name] = float(prior["value"])
    options = FitOptions(**{**options.as_dict(), "fixed": fixed})
    if not 0 < ci_level < 1:
        raise FitDataError(f"ci level must be in (0, 1), got {ci_level}")
    if data.n_runs < 2 and (n_boot or holdout_fraction or loo):
        raise FitDataError(f"{data.source}: {data.n_runs} run(s); bootstrap, hold-out and leave-one-out need >= 2 "
                           "runs (give run_id, or switch them off)")
    t0 = time.perf_counter()
    result = fit(law, data, options, progress)
    metrics: dict[str, Any] = {
        "n_points": data.n_points, "n_runs": data.n_runs,
        "objective": result.objective,
        "starts": result.report.as_dict(),
        "fit_seconds": result.seconds,
        "mape_in_sample": mape(law, result.theta, data),
        "residuals": residual_diagnostics(law, result.theta, data),
        "derived": {k: float(v) for k, v in result.params.derived.items()},
    }
    boot_theta = None
    ci: dict[str, tuple[float, float]] = {}
    seed = options.seed if boot_seed is None else boot_seed
    if n_boot:
        boot_theta = bootstrap(result, data, n_boot, seed=seed, progress=progress)
        ci = intervals(law, boot_theta, ci_level)
        free = [n for n in law.param_names if n not in result.fixed]
        ci = {k: v for k, v in ci.items() if k in free}
        boot_pred = law.predict_theta(boot_theta, data.n_total, data.sparsity, data.tokens, data.granularity)
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
    metrics["total_seconds"] = time.perf_counter() - t0
    provenance = {
        "data": {"source": data.source, "sha256": data.sha256, "n_points": data.n_points, "n_runs": data.n_runs},
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
    return FittedLaw(law=law, theta=result.theta, bootstrap_theta=boot_theta, fixed=tuple(result.fixed),
                     ci=ci, ci_level=ci_level if n_boot else None, bootstrap_seed=seed if n_boot else None,
                     metrics=metrics, provenance=provenance, source="<fit>")


__all__ = ["fit_law"]

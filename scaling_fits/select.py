"""Choosing the granularity form by held-out error: power law G^-eta or log-quadratic G^-(eta + eta2 ln G).

The two forms the literature fits (DESIGN.md "Scaling law"):
- power law, `mosaic4d`: the interaction term scales as G^-eta (Krajewski et al. 2024, arXiv
  2402.07871, eq. 9: (g / G^gamma + a) / N^alpha);
- log-quadratic, `mosaic4d_lg2`: G^-(eta + eta2 ln G), the form of Tian et al. 2025 ("Towards
  Greater Leverage", arXiv 2507.17702, eqs. 11 and 13: log EL quadratic in log G, so there is an
  optimal granularity).

`choose_granularity_form` fits both on the same runs and picks the one with the lower
extrapolation error (fit on all but the largest-compute runs, error on those), reporting both
errors and the leave-one-run-out errors. The log-quadratic form has one parameter more; it is
chosen only if it also identifies eta2 (see `fitter.identifiability`), otherwise the extra
parameter is a trade-off, not a measurement. With fewer than three distinct G the forms cannot
be told apart and the result says so instead of choosing.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from scaling_fits.data import RunData
from scaling_fits.fitter import FitOptions, fit, holdout_top, identifiability, leave_one_out, mape

FORMS = {"power": "mosaic4d", "logquad": "mosaic4d_lg2"}
MIN_DISTINCT_G = 3


def choose_granularity_form(data: RunData, options: Optional[FitOptions] = None, holdout_fraction: float = 0.2,
                            loo: bool = True) -> dict[str, Any]:
    """Fit both forms; {"choice": "power"|"logquad"|None, "reason": ..., "forms": {form: errors}}."""
    options = options or FitOptions()
    distinct = np.unique(np.round(data.granularity, 9))
    report: dict[str, Any] = {"distinct_granularity": [float(g) for g in distinct], "forms": {},
                              "criterion": f"extrapolation MAPE (top {holdout_fraction:.0%} of runs by compute held out)"}
    if distinct.size < MIN_DISTINCT_G:
        report["choice"] = None
        report["reason"] = (f"granularity takes {distinct.size} value(s) in these runs; telling a power law from a "
                            f"log-quadratic needs >= {MIN_DISTINCT_G}: the form is not identifiable from them")
        return report
    for form, law_name in FORMS.items():
        fixed = {k: v for k, v in options.fixed.items() if k != "eta"}
        opts = FitOptions(**{**options.as_dict(), "fixed": fixed, "per_source": tuple(options.per_source)})
        res = fit(law_name, data, opts)
        item = {"law": law_name, "mape_in_sample": mape(res.model, res.theta, data),
                "mape_holdout": holdout_top(law_name, data, opts, holdout_fraction)["mape"],
                "params": dict(zip(res.model.param_names, map(float, res.model.natural(res.theta)))),
                "flagged": sorted(identifiability(res, data)["flagged"])}
        if loo:
            item["mape_loo"] = leave_one_out(res, data)["mape"]
        report["forms"][form] = item
    power, logquad = report["forms"]["power"], report["forms"]["logquad"]
    if "eta2" in logquad["flagged"]:
        report["choice"] = "power"
        report["reason"] = "eta2 of the log-quadratic form is not identified by these runs"
    elif logquad["mape_holdout"] < power["mape_holdout"]:
        report["choice"] = "logquad"
        report["reason"] = (f"lower extrapolation error: {logquad['mape_holdout']:.2%} against "
                            f"{power['mape_holdout']:.2%}")
    else:
        report["choice"] = "power"
        report["reason"] = (f"lower or equal extrapolation error with one parameter fewer: "
                            f"{power['mape_holdout']:.2%} against {logquad['mape_holdout']:.2%}")
    return report


__all__ = ["FORMS", "MIN_DISTINCT_G", "choose_granularity_form"]

"""Fitting a ladder's runs: the granularity form, the extrapolation check, the 4-D law with intervals.

1. Granularity form (`scaling_fits.select.choose_granularity_form`) on the fitted rungs: power law
   or log-quadratic, whichever extrapolates better to their largest-compute runs (reported).
2. Extrapolation: that law fitted on the fitted rungs only (full start grid), then the held-out
   largest rung predicted: APE = |pred / observed - 1|.
3. The law fitted on every run (bootstrap over runs, leave-one-run-out, identifiability report):
   what DIR/fit.yaml holds and `mosaic plan --fit DIR/fit.yaml` reads.
The loss of a run is its final validation loss on the held-out split, D its trained tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from scaling_fits.data import RunData, from_arrays
from scaling_fits.fitfile import FittedLaw
from scaling_fits.fitter import FitOptions, fit, mape
from scaling_fits.pipeline import fit_law
from scaling_fits.select import FORMS, choose_granularity_form

SOURCE = "mosaic ladder: runs of the bundled trainer, final validation loss on the corpus's held-out split"


@dataclass(frozen=True)
class LadderFitOptions:
    n_boot: int = 100
    n_starts: int = 64
    seed: int = 0
    law: Optional[str] = None
    """None: choose the granularity form by held-out error; or 'mosaic4d' / 'mosaic4d_lg2'."""


def runs_data(frame: Any, rows: Optional[np.ndarray] = None) -> RunData:
    f = frame if rows is None else frame[rows]
    return from_arrays(f["n_total"].to_numpy(float), f["tokens"].to_numpy(float), f["loss"].to_numpy(float),
                       f["sparsity"].to_numpy(float), f["granularity"].to_numpy(float),
                       run_id=f["run_id"].astype(str).to_numpy(), source="ladder results.csv")


def fit_ladder(frame: Any, options: Optional[LadderFitOptions] = None) -> tuple[FittedLaw, dict[str, Any]]:
    """(the law fitted on every run, the ladder report: form choice, extrapolation, LOO)."""
    options = options or LadderFitOptions()
    held = frame["note_heldout"].astype(bool).to_numpy()
    fitted_rows = ~held
    fit_opts = FitOptions(n_starts=options.n_starts, seed=options.seed)
    train = runs_data(frame, fitted_rows)
    if options.law is None:
        form = choose_granularity_form(train, fit_opts, loo=False)
        law = FORMS[form["choice"]] if form["choice"] else "mosaic4d"
    else:
        form = {"choice": None, "reason": f"--law {options.law} given", "forms": {}}
        law = options.law
    extrapolation: dict[str, Any] = {}
    if held.any():
        res = fit(law, train, fit_opts)
        test = runs_data(frame, held)
        pred = res.predict(test)
        for run_id, p, obs in zip(frame["run_id"][held], pred, test.loss):
            extrapolation[str(run_id)] = {"observed": float(obs), "predicted": float(p), "ape": float(abs(p / obs - 1))}
        extrapolation_mape = mape(res.model, res.theta, test)
    else:
        extrapolation_mape = None
    data = runs_data(frame)
    fitted = fit_law(data, law, fit_opts, n_boot=options.n_boot, holdout_fraction=None, loo=True, sources=[SOURCE])
    report = {"law": law, "granularity_form": {k: v for k, v in form.items() if k != "forms"},
              "granularity_form_errors": {f: {k: v for k, v in item.items() if k.startswith("mape")}
                                          for f, item in form.get("forms", {}).items()},
              "extrapolation": extrapolation, "extrapolation_mape": extrapolation_mape,
              "n_runs": int(len(frame)), "n_fitted_rungs": int(fitted_rows.sum()),
              "mape_loo": fitted.metrics.get("mape_loo"), "mape_in_sample": fitted.metrics["mape_in_sample"]}
    fitted.metrics["ladder"] = report
    fitted.provenance["ladder"] = {"granularity_form": report["granularity_form"],
                                   "extrapolation": "fit on the other rungs, predict the held-out largest"}
    return fitted, report


__all__ = ["LadderFitOptions", "SOURCE", "fit_ladder", "runs_data"]

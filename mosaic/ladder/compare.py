"""Two (or more) fitted laws on the same plan: predicted loss with bootstrap intervals, and what each would plan.

`laws_on_choice` evaluates every law at one plan choice (its geometry's N_tot, S, G and its
tokens D): the point prediction and the 2.5-97.5 % band of the bootstrap samples (when the fit
has them). A ladder's law and the default law are fitted on different corpora and tokenizers, so
their absolute losses differ by construction; what a comparison can say is whether they agree on
the choice (which geometry, how many tokens) and how wide each band is at that point.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mosaic.planner.law import law_inputs


def laws_on_choice(choice: Any, laws: Mapping[str, Any]) -> Any:
    """DataFrame: one row per law with its loss at `choice` (a PlanResult's cluster/compute-optimal choice)."""
    import pandas as pd

    n_tot, s, g = (float(np.asarray(x).ravel()[0]) for x in law_inputs(choice.arch))
    tokens = float(choice.tokens)
    rows = []
    for name, law in laws.items():
        loss = float(np.asarray(law.predict(n_tot, s, tokens, g)))
        row = {"law": name, "fit": getattr(law, "name", "law"), "loss": loss, "loss_lo": None, "loss_hi": None,
               "n_total": n_tot, "sparsity": s, "granularity": g, "tokens": tokens}
        if getattr(law, "bootstrap_theta", None) is not None:
            lo, hi = np.quantile(law.predict_bootstrap(n_tot, s, tokens, g), [0.025, 0.975])
            row.update(loss_lo=float(lo), loss_hi=float(hi))
        rows.append(row)
    return pd.DataFrame(rows)


def choices_under(results: Mapping[str, Any]) -> Any:
    """DataFrame: the cluster-optimal choice of each PlanResult (one per law), side by side."""
    import pandas as pd

    rows = []
    for name, result in results.items():
        c = result.cluster_optimal
        a = c.arch
        n_tot, s, g = (float(np.asarray(x).ravel()[0]) for x in law_inputs(a))
        rows.append({"law": name, "geometry": f"L{a.n_layers} h{a.d_model} E{a.n_experts} k{a.top_k} G{g:g}",
                     "n_total": n_tot, "n_active": float(a.active_params()), "sparsity": s, "tokens": float(c.tokens),
                     "loss": c.predicted.get("loss"), "mfu": c.predicted.get("mfu")})
    return pd.DataFrame(rows)


__all__ = ["choices_under", "laws_on_choice"]

"""The 4-D MoE scaling law L(N_tot, S, D, G): laws, fitter, bootstrap, bundled fit.

Stable API for the planner: `load_fit(path_or_None) -> FittedLaw` (None = the
bundled default fit), `FittedLaw.predict(n_total, sparsity, tokens, granularity)`,
`.name`, `.params`, `.content_hash()`, `.bootstrap_params`, `.predict_bootstrap(...)`.
Imports nothing else of MOSAIC; scipy and pandas are imported only when fitting or
reading runs.
"""

from scaling_fits.errors import FitDataError
from scaling_fits.fitfile import FittedLaw, default_fit_path, load_fit, write_fit
from scaling_fits.laws import LAWS, get_law

__all__ = ["LAWS", "FitDataError", "FittedLaw", "default_fit_path", "get_law", "load_fit", "write_fit"]

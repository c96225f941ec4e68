"""Regenerate the bundled default fit, scaling_fits/data/default_fit.yaml.

    python -m scaling_fits.make_default_fit          # from the bundled runs CSVs
    python -m scaling_fits.make_default_fit --from-clark ../shared/data/clark2022_routing_curves.csv \\
        --from-chinchilla analyzing-chinchilla/data/svg_extracted_data.csv   # reconvert the runs first

Law `mosaic4d` fitted jointly to two public sets of real training runs, each with its own
irreducible loss e (different corpora, tokenizers and evaluation sets) and everything else shared:

- Clark et al. 2022 (Dense + S-BASE, final evaluation of each run; scaling_fits/clark2022.py): the
  N and S terms at D = 131B tokens;
- Hoffmann et al. 2022 (dense runs each ending its own cosine schedule, as extracted by Besiroglu
  et al. 2024; scaling_fits/chinchilla2022.py): the N and D terms from separate runs.

The law the planner reads is Clark et al.'s (the MoE source; its e). Granularity does not vary
in either source (G = 1), so eta is calibrated to the granularity effect Krajewski et al. 2024
measured (scaling_fits/granularity.py: the same relative shrinkage of the parameter-limited loss
over their runs, G = 1..16), each bootstrap sample against one of their three published fits;
whether the power law or the log-quadratic form (Tian et al. 2025) is right cannot be decided on
these runs, and the file says so (`provenance.granularity_form`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scaling_fits import chinchilla2022, clark2022
from scaling_fits.data import RunData, combine, load_runs
from scaling_fits.fitfile import default_fit_path, write_fit
from scaling_fits.fitter import FitOptions, describe_identifiability
from scaling_fits.granularity import KRAJEWSKI_2024, with_calibrated_eta
from scaling_fits.pipeline import fit_law
from scaling_fits.select import choose_granularity_form

DATA_DIR = Path(__file__).resolve().parent / "data"
CLARK_CSV = DATA_DIR / "clark2022_runs.csv"
CHINCHILLA_CSV = DATA_DIR / "chinchilla2022_runs.csv"
REFERENCE = clark2022.SOURCE_ID
PRIORS = {
    "eta": {
        "value": 0.0,
        "source": ("placeholder while fitting: every fitted run has G = 1, so eta does not enter the fit; it is "
                   "then calibrated to Krajewski et al. 2024's measured granularity effect (see priors.eta)"),
    },
}
DEFAULTS = {"n_boot": 200, "holdout": 0.2, "n_starts": 128, "seed": 0}


def default_runs() -> RunData:
    """Both bundled sources as one RunData (what the default fit is fitted to)."""
    return combine([load_runs(CLARK_CSV), load_runs(CHINCHILLA_CSV)],
                   label="scaling_fits/data/clark2022_runs.csv + chinchilla2022_runs.csv")


def default_options(n_starts: int = DEFAULTS["n_starts"], n_jobs: int = 1) -> FitOptions:
    """The default fit's settings: one e per source, Clark et al.'s the reference, eta at its placeholder."""
    return FitOptions(n_starts=n_starts, seed=DEFAULTS["seed"], n_jobs=n_jobs, per_source=("e",),
                      reference_source=REFERENCE, fixed={k: v["value"] for k, v in PRIORS.items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-clark", type=Path, default=None,
                    help="Clark et al. curves CSV to reconvert into scaling_fits/data/clark2022_runs.csv first")
    ap.add_argument("--from-chinchilla", type=Path, default=None,
                    help="Epoch AI's svg_extracted_data.csv to reconvert into scaling_fits/data/chinchilla2022_runs.csv")
    ap.add_argument("--out", type=Path, default=default_fit_path())
    ap.add_argument("--bootstrap", type=int, default=DEFAULTS["n_boot"])
    ap.add_argument("--starts", type=int, default=DEFAULTS["n_starts"])
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    if args.from_clark is not None:
        frame = clark2022.convert_file(args.from_clark, CLARK_CSV)
        print(f"converted {len(frame)} points of {frame['run_id'].nunique()} runs -> {CLARK_CSV}")
    if args.from_chinchilla is not None:
        frame = chinchilla2022.convert_file(args.from_chinchilla, CHINCHILLA_CSV)
        print(f"converted {len(frame)} runs -> {CHINCHILLA_CSV}")
    data = default_runs()
    options = FitOptions(**{**default_options(args.starts, args.jobs).as_dict(), "fixed": {},
                            "per_source": ("e",)})

    def progress(stage: str, done: int, total: int) -> None:
        if done == total or done % 50 == 0:
            print(f"  {stage}: {done}/{total}", file=sys.stderr)

    fitted = fit_law(data, "mosaic4d", options, n_boot=args.bootstrap, holdout_fraction=DEFAULTS["holdout"],
                     loo=True, priors=PRIORS, sources=[clark2022.SOURCE, chinchilla2022.SOURCE], progress=progress)
    fitted = with_calibrated_eta(fitted, data.granularity, KRAJEWSKI_2024, point="table1", seed=DEFAULTS["seed"])
    form = choose_granularity_form(data, options, loo=False)
    fitted.provenance["data"]["source"] = ("scaling_fits/data/clark2022_runs.csv + chinchilla2022_runs.csv "
                                           "(see scaling_fits/data/README.md)")
    fitted.provenance["regenerate"] = "python -m scaling_fits.make_default_fit"
    fitted.provenance["reference_source"] = (f"{REFERENCE}: the law's e is Clark et al.'s (their validation loss); "
                                             "the other source's e is in metrics.sources")
    fitted.provenance["data_choices"] = {
        "clark2022": "Dense and S-Base routers (learned balanced routing; Hash and RL-R follow other laws in the "
                     "paper), the final evaluation of each run only: every run is one cosine schedule set for "
                     "250k steps, so earlier checkpoints are not losses of shorter runs and nothing in the data "
                     "measures that bias; loss_validation; 524,288 tokens per step",
        "chinchilla2022": "Hoffmann et al. 2022 Figure 4 runs (each its own cosine schedule) as extracted by "
                          "Besiroglu et al. 2024, the 5 highest-loss runs excluded as they do; N = non-embedding "
                          "block parameters of the Table A9 configuration; D = FLOPs / (6 x reported size)",
        "shared": "all law parameters except e, which each source fits for itself",
    }
    fitted.provenance["granularity_form"] = {"choice": form["choice"], "reason": form["reason"],
                                             "used": "power law (mosaic4d), eta calibrated to Krajewski et al. "
                                                     "2024 (their G range 1-16; beyond it the law extrapolates)"}
    fitted.provenance["held_out_error"] = {
        "mape_holdout_top20pct_compute": fitted.metrics["mape_holdout"],
        "mape_holdout_by_source": fitted.metrics["holdout"].get("mape_by_source"),
        "mape_leave_one_run_out": fitted.metrics["mape_loo"],
        "mape_in_sample": fitted.metrics["mape_in_sample"],
    }
    write_fit(fitted, args.out)
    m = fitted.metrics
    print(f"wrote {args.out}: in-sample MAPE {100 * m['mape_in_sample']:.2f}%, held-out (top 20% compute) MAPE "
          f"{100 * m['mape_holdout']:.2f}%, leave-one-run-out MAPE {100 * m['mape_loo']:.2f}%, "
          f"{m['starts']['n_at_best']}/{m['starts']['n_starts']} starts reached the best; hash {fitted.content_hash()}")
    flagged = describe_identifiability(m["identifiability"])
    if flagged:
        print(f"not identified by these runs: {flagged}")
    print(f"eta = {fitted.params['eta']:.4f} (calibrated; 95% interval {fitted.ci['eta'][0]:.4f}-"
          f"{fitted.ci['eta'][1]:.4f}); granularity form: {form['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

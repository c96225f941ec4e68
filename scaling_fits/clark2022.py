"""Converter: Clark et al. 2022 routing curves -> our runs columns.

Source: "Unified Scaling Laws for Routed Language Models", Clark et al. 2022
(arXiv 2202.01169), data from google-deepmind/scaling_laws_for_routing
(`data/curves.csv.gz`, CC-BY 4.0): loss curves of 223 configurations, one row
per configuration (`hyper_id`) and evaluation step (every 10,000 steps).

Conversion (one output row per kept evaluation point):

- ``n_total``: `total_parameter_count` (all experts). The counts exclude the
  embeddings: for every dense model `dense_parameter_count` equals
  L * (4 h h_q + 8 h^2) + L h (h_q + 4) exactly (attention, 4h FFN, biases and
  norms), with nothing left for a token embedding - so they match our N_tot.
- ``n_active``: parameters a token uses. `dense_parameter_count` counts one
  expert per routed layer whatever k is, and total - dense = (E - 1) x (one
  expert in every routed layer) (+ the router, < 0.1 %), so
  N_act = dense + (k - 1) (total - dense) / (E - 1) for routed models. `Dense`
  rows with `flop_increase` > 1 have a wider FFN that every token uses:
  N_act = total (S = 0).
- ``sparsity``: S = 1 - N_act / N_tot.
- ``tokens``: step x tokens per step. Clark et al. train every model for 250k
  steps on 130B tokens; with their sequence length 2048 and batch of 256
  sequences that is 524,288 tokens per step (250,000 x 524,288 = 131B, the
  paper's "130B"). Checked here: the 130B-token fixed budget of these runs as
  quoted by Krajewski et al. 2024 (who build on this data) and the 250k-step
  curves in the file; the 256 x 2048 split is as we read the paper and was not
  re-verified from its text in this session. Only the product matters: change
  `TOKENS_PER_STEP` (or `tokens_per_step=`) if a better source disagrees.
- ``loss``: `loss_validation` (held-out part of the training distribution, the
  loss the paper fits).
- ``granularity``: 1 (every expert has the dense FFN's width: G does not vary in
  this data).
- ``run_id``: ``clark2022-<hyper_id>``; ``weight`` = 1 / (points kept of that run),
  so every training run counts once in the summed loss whatever its number of
  evaluation points; ``source``: ``clark2022``.

Which points (defaults of `convert`; `mosaic fit` takes any runs file):

- Router types `Dense` and `S-Base` (`router_types`). S-BASE is the learned,
  balanced-assignment router, the closest of the three to today's learned top-k
  routers with load balancing, and the best-scaling one in the paper; Hash
  (fixed routing) and RL-R (policy-gradient routing) follow different fitted
  laws in the paper (its Table 2) and mixing them would blur one law. Dense runs
  anchor S = 0.
- The final evaluation of each run only (`min_step_fraction` 1.0). Every run
  follows one cosine schedule set for 250k steps, and an intermediate point of
  that schedule is worse than a run whose schedule ends there (Hoffmann et al.
  2022, App. A; their Figure A1 shows the gap growing the earlier the point):
  these data contain no run that ends before 250k steps, so they cannot say how
  large the bias is, and no correction can be checked against them. What they
  allow is one clean point per run at D = 131B tokens: they measure the N and S
  terms at that D, and the token dimension must come from separate runs
  (`scaling_fits/chinchilla2022.py`). `min_step_fraction` < 1 keeps earlier
  checkpoints (the previous default, 0.4, for comparison).
- All seeds and all routing frequencies / k values of those routers (they
  move S at fixed N_tot, which is what the S terms need).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scaling_fits.errors import FitDataError

# Clark et al. 2022: 250k steps, 130B tokens, sequences of 2048 tokens, 256 per batch (see the docstring).
TOKENS_PER_STEP = 256 * 2048
SOURCE = ("Clark et al. 2022, Unified Scaling Laws for Routed Language Models, arXiv 2202.01169; data: "
          "google-deepmind/scaling_laws_for_routing data/curves.csv.gz (commit 42da0c39), CC-BY 4.0")
NEEDED = ("hyper_id", "step", "loss_validation", "num_experts", "k", "router_type", "flop_increase",
          "total_parameter_count", "dense_parameter_count")
SOURCE_ID = "clark2022"
OUTPUT_COLUMNS = ("run_id", "source", "step", "router_type", "n_experts", "top_k", "n_total", "n_active",
                  "sparsity", "granularity", "tokens", "loss", "weight")


def convert(frame: Any, router_types: Sequence[str] = ("Dense", "S-Base"), min_step_fraction: float = 1.0,
            tokens_per_step: int = TOKENS_PER_STEP) -> Any:
    """Clark et al. curves (pandas DataFrame) -> runs DataFrame with OUTPUT_COLUMNS."""
    import pandas as pd

    missing = [c for c in NEEDED if c not in frame.columns]
    if missing:
        raise FitDataError(f"Clark et al. curves: missing column(s) {', '.join(missing)}; "
                           "give the unmodified curves.csv from google-deepmind/scaling_laws_for_routing")
    if not 0 <= min_step_fraction <= 1:
        raise FitDataError(f"min_step_fraction must be in [0, 1], got {min_step_fraction}")
    unknown = sorted(set(router_types) - set(frame["router_type"].unique()))
    if unknown:
        raise FitDataError(f"router type(s) {', '.join(unknown)} not in the data; "
                           f"choose from {', '.join(sorted(frame['router_type'].unique()))}")
    df = frame[frame["router_type"].isin(list(router_types))].copy()
    df = df[df["loss_validation"].notna() & (df["step"] > 0)]
    final_step = df.groupby("hyper_id")["step"].transform("max")
    df = df[df["step"] >= min_step_fraction * final_step - 1e-9] if min_step_fraction < 1 else df[df["step"] == final_step]
    total = df["total_parameter_count"].to_numpy(dtype=float)
    dense = df["dense_parameter_count"].to_numpy(dtype=float)
    experts = df["num_experts"].to_numpy(dtype=float)
    k = df["k"].to_numpy(dtype=float)
    routed = (df["router_type"] != "Dense").to_numpy() & (experts > 1)
    per_expert = np.where(routed, (total - dense) / np.maximum(experts - 1, 1), 0.0)
    n_active = np.where(routed, dense + (k - 1) * per_expert, total)
    sparsity = 1.0 - n_active / total
    out = pd.DataFrame({
        "run_id": "clark2022-" + df["hyper_id"].astype(int).astype(str),
        "source": SOURCE_ID,
        "step": df["step"].astype(int).to_numpy(),
        "router_type": df["router_type"].to_numpy(),
        "n_experts": experts.astype(int),
        "top_k": np.where(routed, k, 1).astype(int),
        "n_total": total,
        "n_active": n_active,
        "sparsity": np.round(sparsity, 9),
        "granularity": 1.0,
        "tokens": df["step"].to_numpy(dtype=float) * tokens_per_step,
        "loss": df["loss_validation"].to_numpy(dtype=float),
    })
    out["weight"] = 1.0 / out.groupby("run_id")["run_id"].transform("size").to_numpy(dtype=float)
    return out.sort_values(["run_id", "step"], kind="stable").reset_index(drop=True)[list(OUTPUT_COLUMNS)]


def convert_file(src: str | Path, dst: str | Path, **kwargs: Any) -> Any:
    """Read Clark et al.'s curves CSV (optionally .gz), convert, write `dst` atomically; returns the frame."""
    from scaling_fits.data import convert_csv

    return convert_csv(convert, src, dst, "Clark et al.'s curves.csv (../shared/data/)", **kwargs)


__all__ = ["OUTPUT_COLUMNS", "SOURCE", "SOURCE_ID", "TOKENS_PER_STEP", "convert", "convert_file"]

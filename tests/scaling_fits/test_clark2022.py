"""Converter from Clark et al. 2022's curves to our runs columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from scaling_fits.clark2022 import TOKENS_PER_STEP, convert
from scaling_fits.data import load_runs
from scaling_fits.errors import FitDataError

REPO = Path(__file__).resolve().parents[2]
SHARED_CURVES = REPO.parent / "shared" / "data" / "clark2022_routing_curves.csv"
BUNDLED = REPO / "scaling_fits" / "data" / "clark2022_runs.csv"


def curves():
    """Three tiny configurations in Clark et al.'s column layout (dense, routed k=2, hash)."""
    rows = []
    configs = [  # hyper_id, router, E, k, flop_increase, total, dense
        (0, "Dense", 1, 1, 1.0, 1.0e8, 1.0e8),
        (1, "S-Base", 9, 2, 1.0, 9.0e8, 1.0e8),     # 8 extra experts of 1e8 each
        (2, "Hash", 9, 1, 1.0, 9.0e8, 1.0e8),
        (3, "Dense", 1, 2, 2.0, 1.5e8, 1.0e8),      # wider FFN, all active
    ]
    for hid, router, e, k, fi, total, dense in configs:
        for step in range(0, 250_001, 50_000):
            rows.append({"hyper_id": hid, "step": step, "loss_validation": 3.0 - step / 1e6, "num_experts": e,
                         "k": k, "router_type": router, "flop_increase": fi, "total_parameter_count": total,
                         "dense_parameter_count": dense})
    return pd.DataFrame(rows)


def test_columns_parameters_and_sparsity():
    out = convert(curves(), min_step_fraction=0.4)
    assert set(out["router_type"]) == {"Dense", "S-Base"}
    assert sorted(out["step"].unique()) == [100_000, 150_000, 200_000, 250_000]
    routed = out[out["run_id"] == "clark2022-1"].iloc[0]
    assert routed["n_active"] == pytest.approx(2.0e8)          # dense + (k-1) * one expert
    assert routed["sparsity"] == pytest.approx(1 - 2.0 / 9.0)
    wide = out[out["run_id"] == "clark2022-3"].iloc[0]
    assert wide["n_active"] == wide["n_total"] == 1.5e8 and wide["sparsity"] == 0.0
    assert np.allclose(out["tokens"], out["step"] * TOKENS_PER_STEP)
    assert np.allclose(out.groupby("run_id")["weight"].sum(), 1.0)
    assert (out["granularity"] == 1.0).all()


def test_final_points_only_and_router_choice():
    out = convert(curves(), router_types=("Hash",), min_step_fraction=1.0)
    assert list(out["step"]) == [250_000] and list(out["run_id"]) == ["clark2022-2"]
    with pytest.raises(FitDataError, match="router type"):
        convert(curves(), router_types=("Switch",))
    with pytest.raises(FitDataError, match="missing column"):
        convert(curves().drop(columns=["k"]))


def test_converted_runs_load(tmp_path):
    path = tmp_path / "runs.csv"
    convert(curves()).to_csv(path, index=False)
    data = load_runs(path)
    assert data.n_runs == 3 and data.n_points == 3          # default: the final evaluation of each run only
    assert data.source_names == ("clark2022",)
    assert set(convert(curves())["step"]) == {250_000}


@pytest.mark.skipif(not SHARED_CURVES.is_file(), reason="../shared/data (Clark et al. curves) is not beside this checkout")
def test_bundled_csv_is_the_conversion_of_the_shared_data():
    ours = convert(pd.read_csv(SHARED_CURVES))
    bundled = pd.read_csv(BUNDLED)
    assert list(bundled.columns) == list(ours.columns)
    assert len(bundled) == len(ours) == bundled["run_id"].nunique() == ours["run_id"].nunique()
    for col in ("n_total", "n_active", "sparsity", "tokens", "loss", "weight"):
        np.testing.assert_allclose(bundled[col].to_numpy(), ours[col].to_numpy(), rtol=1e-9, err_msg=col)

"""Runs files: columns, validation with one-line named errors, Parquet."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from scaling_fits.data import load_runs
from scaling_fits.errors import FitDataError

GOOD = {"run_id": ["a", "a", "b"], "n_total": [1e8, 1e8, 8e8], "sparsity": [0.0, 0.0, 0.75],
        "tokens": [1e9, 2e9, 1e9], "loss": [3.0, 2.9, 2.8]}


def write(tmp_path, **changes):
    frame = pd.DataFrame({**GOOD, **changes})
    path = tmp_path / "runs.csv"
    frame.to_csv(path, index=False)
    return path


def test_good_file_and_defaults(tmp_path):
    data = load_runs(write(tmp_path))
    assert data.n_points == 3 and data.n_runs == 2 and data.run_ids == ("a", "b")
    np.testing.assert_array_equal(data.granularity, 1.0)
    np.testing.assert_array_equal(data.weight, 1.0)
    assert len(data.sha256) == 64
    np.testing.assert_allclose(data.n_active, [1e8, 1e8, 2e8])


def test_n_active_and_sparsity_give_n_total(tmp_path):
    frame = pd.DataFrame({"n_active": [2e8], "sparsity": [0.75], "tokens": [1e9], "loss": [2.5]})
    path = tmp_path / "r.csv"
    frame.to_csv(path, index=False)
    assert load_runs(path).n_total[0] == pytest.approx(8e8)


@pytest.mark.parametrize("changes, match", [
    ({"loss": [3.0, -1.0, 2.8]}, r"column 'loss' row 2 .*not positive"),
    ({"tokens": [1e9, np.nan, 1e9]}, r"column 'tokens' row 2 .*missing or not finite"),
    ({"sparsity": [0.0, 0.0, 1.0]}, r"column 'sparsity' row 3 .*outside \[0, 1\)"),
    ({"n_total": [1e8, 0.0, 8e8]}, r"column 'n_total' row 2 .*not positive"),
    ({"weight": [1.0, -2.0, 1.0]}, r"column 'weight' row 2 .*negative"),
    ({"loss": [3.0, "abc", 2.8]}, r"column 'loss' row 2 .*not a number"),
    ({"wieght": [1.0, 1.0, 1.0]}, r"unknown column 'wieght'"),
])
def test_bad_values_are_named(tmp_path, changes, match):
    with pytest.raises(FitDataError, match=match):
        load_runs(write(tmp_path, **changes))


def test_missing_columns_and_moe_without_sparsity(tmp_path):
    path = tmp_path / "r.csv"
    pd.DataFrame({"n_total": [1e8], "tokens": [1e9]}).to_csv(path, index=False)
    with pytest.raises(FitDataError, match="missing column 'loss'"):
        load_runs(path)
    pd.DataFrame({"tokens": [1e9], "loss": [2.0]}).to_csv(path, index=False)
    with pytest.raises(FitDataError, match="missing column 'n_total'"):
        load_runs(path)
    pd.DataFrame({"n_total": [1e9], "n_experts": [8], "tokens": [1e9], "loss": [2.0]}).to_csv(path, index=False)
    with pytest.raises(FitDataError, match="MoE row without sparsity"):
        load_runs(path)
    pd.DataFrame({"n_total": [1e9], "n_active": [2e8], "sparsity": [0.5], "tokens": [1e9], "loss": [2.0]}).to_csv(
        path, index=False)
    with pytest.raises(FitDataError, match="disagrees"):
        load_runs(path)


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(FitDataError, match="no such runs file"):
        load_runs(tmp_path / "nope.csv")
    other = tmp_path / "runs.xlsx"
    other.write_text("x")
    with pytest.raises(FitDataError, match="unknown runs file type"):
        load_runs(other)


def test_parquet(tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow (extra 'parquet') not installed")
    path = tmp_path / "runs.parquet"
    pd.DataFrame(GOOD).to_parquet(path)
    data = load_runs(path)
    assert data.n_points == 3 and data.n_runs == 2


def test_error_is_a_value_error():
    assert issubclass(FitDataError, ValueError)

"""Converter from the Chinchilla runs (Hoffmann et al. 2022, as extracted by Besiroglu et al. 2024) to our runs columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from scaling_fits.chinchilla2022 import SOURCE_ID, convert, table_a9
from scaling_fits.data import load_runs
from scaling_fits.errors import FitDataError

BUNDLED = Path(__file__).resolve().parents[2] / "scaling_fits" / "data" / "chinchilla2022_runs.csv"


def points():
    """Rows in Epoch AI's layout: two Table A9 sizes (44M, 1,018M) and one badly undertrained run."""
    return pd.DataFrame({"x": 0.0, "y": 0.0, "color": "#000", "hex_color": "#000",
                         "Model Size": [44.1e6, 44.0e6, 1.0183e9, 1.0183e9],
                         "Training FLOP": [1e18, 3e18, 1e20, 1e19],
                         "loss": [3.3, 3.1, 2.5, 4.2]})


def test_table_a9_non_embedding_counts():
    t = table_a9().set_index("parameters_million")
    # 44M: 8 layers x (4 x 512 x 64 x 8 + 2 x 512 x 2048): attention and FFN weights of the blocks
    assert t.loc[44, "n_nonembedding"] == 8 * (4 * 512 * 64 * 8 + 2 * 512 * 2048)
    assert (t["n_nonembedding"] < t.index.to_numpy() * 1e6).all()   # the reported size also counts embeddings


def test_conversion_columns_and_exclusion():
    out = convert(points(), exclude_highest_loss=1)
    assert len(out) == 3 and 4.2 not in set(out["loss"])
    t = table_a9().set_index("parameters_million")
    np.testing.assert_allclose(out["n_total"], [t.loc[44, "n_nonembedding"]] * 2 + [t.loc[1018, "n_nonembedding"]])
    np.testing.assert_allclose(out["tokens"], out["note_training_flops"] / (6 * out["note_params_reported"]))
    assert (out["source"] == SOURCE_ID).all() and out["run_id"].is_unique


def test_unknown_size_and_missing_column_are_named():
    bad = points()
    bad.loc[0, "Model Size"] = 50e6
    with pytest.raises(FitDataError, match="matches no Table A9"):
        convert(bad, exclude_highest_loss=0)
    with pytest.raises(FitDataError, match="missing column"):
        convert(points().drop(columns=["loss"]))


def test_bundled_runs_load_as_one_source_of_separate_runs():
    data = load_runs(BUNDLED)
    assert data.source_names == (SOURCE_ID,) and data.n_runs == data.n_points
    assert np.all(data.sparsity == 0) and np.ptp(np.log10(data.tokens)) > 2   # D spans > 100x across runs

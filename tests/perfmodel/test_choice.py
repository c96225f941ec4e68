"""`perfmodel.choice`: alternatives given for some candidates equal the padded np.where chain."""

from __future__ import annotations

import numpy as np

from perfmodel import choice


def test_choice_on_row_subsets_equals_padded_chain():
    rng = np.random.default_rng(0)
    n = 200
    full = [rng.integers(0, 5, n).astype(float), rng.integers(0, 5, n).astype(float)]
    rows = [None, None, np.sort(rng.choice(n, 30, replace=False)), np.sort(rng.choice(n, 50, replace=False)), None]
    values = full + [rng.integers(0, 5, 30).astype(float), rng.integers(0, 5, 50).astype(float),
                     rng.integers(0, 5, n).astype(float)]
    padded = []
    for value, at in zip(values, rows):
        p = values[0].copy()
        if at is None:
            p = value
        else:
            p[at] = value
        padded.append(p)
    index = np.zeros(n, dtype=np.int64)
    best = padded[0]
    for i in range(1, len(padded)):  # ties to the earlier
        bigger = padded[i] > best
        index, best = np.where(bigger, i, index), np.where(bigger, padded[i], best)
    got_index, got_best = choice.largest(values, rows)
    np.testing.assert_array_equal(got_index, index)
    np.testing.assert_array_equal(got_best, best)
    other = [v * 10.0 + 1.0 for v in values]
    expected = padded[0] * 10.0 + 1.0
    for i in range(1, len(padded)):
        expected = np.where(index == i, padded[i] * 10.0 + 1.0, expected)
    np.testing.assert_array_equal(choice.Chosen(got_index, rows).of(other), expected)
    assert set(np.unique(got_index)) >= {0, 2, 3}  # the subsets win somewhere


def test_select_is_where_bit_for_bit():
    rng = np.random.default_rng(1)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-310, -2.5, 3.0])
    a, b = rng.choice(special, 500), rng.choice(special, 500)
    cond = rng.random(500) < 0.5
    for x, y in ((a, b), (a, 0.0), (1.0, b), (a, -0.0)):
        got, want = choice.select(cond, x, y), np.where(cond, x, y)
        np.testing.assert_array_equal(got.view(np.int64), np.asarray(want, dtype=float).view(np.int64))

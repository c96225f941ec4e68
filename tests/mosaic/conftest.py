"""Shared fixtures for the planner tests: a planted scaling law and small search spaces."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from mosaic.planner.space import load_space


class PlantedLaw:
    """The mosaic4d form with fixed coefficients (Krajewski et al. 2024's a, alpha, b, beta, c for
    the N and D terms; sparsity and granularity terms chosen so both matter). A test fixture, so
    that the planner tests do not depend on the bundled fit's values."""

    name = "planted_mosaic4d"

    def __init__(self, **overrides: float) -> None:
        self.params = {"a": 18.1, "alpha": 0.115, "b": 30.8, "beta": 0.147, "c": 0.05, "lambda": -0.3,
                       "j": 0.5, "delta": 0.2, "gamma": 0.1, "eta": 0.3, "e": 0.47, **overrides}

    def predict(self, n_total, sparsity, tokens, granularity):
        p = self.params
        n, s, d, g = (np.asarray(x, dtype=float) for x in (n_total, sparsity, tokens, granularity))
        return (p["a"] / n ** p["alpha"] + p["b"] / d ** p["beta"] + p["c"] / (1 - s) ** p["lambda"]
                + p["j"] / ((1 - s) ** p["delta"] * n ** p["gamma"] * g ** p["eta"]) + p["e"])

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.params, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture
def law() -> PlantedLaw:
    return PlantedLaw()


def small_space(**geometry):
    """A space small enough to enumerate by brute force (h100, 64 devices); GQA only unless `attention` is given."""
    geo = dict(d_model=(2048, 4096), n_layers=(16, 32), n_experts=(0, 16, 64), top_k=(1, 2), granularity=(1.0, 4.0),
               n_shared_experts=(0,), n_dense_layers=(0,), active_params=(1e8, 1e12), attention=("gqa",))
    geo.update(geometry)
    space = load_space().replace_geometry(**geo)
    return space.replace_layout(tp=(1, 2), pp=(1, 2), vpp=(1,), ep=(1, 8, 16), mbs=(1,), dp_flavor=("zero1", "fsdp"),
                                recompute=("none", "selective", "full"))


@pytest.fixture
def space():
    return small_space()


@pytest.fixture
def make_space():
    return small_space


@pytest.fixture
def planted_law_cls():
    return PlantedLaw


@pytest.fixture
def space_file(tmp_path, space):
    """The small space as a YAML file (what the CLI tests pass to --space)."""
    from perfmodel.specs.strict import spec_to_dict, write_yaml_atomic

    path = tmp_path / "space.yaml"
    write_yaml_atomic(path, spec_to_dict(space))
    return str(path)


@pytest.fixture
def planted(monkeypatch, law):
    """The CLI loads the planted law instead of the bundled fit."""
    from mosaic.planner import law as lawmod

    monkeypatch.setattr(lawmod, "load_law", lambda path=None: law)
    return law

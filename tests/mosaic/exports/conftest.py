"""Fixtures for the exporter tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mosaic.exports._plans import make_fake_bin


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """Stand-ins for torchrun, srun and scontrol that record their argv (one word per line)."""
    return make_fake_bin(tmp_path)

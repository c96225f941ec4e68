"""Every notebook under notebooks/ runs top to bottom on cpu (nbclient, kernel python3 = this interpreter).

Notebooks are committed without outputs; this test executes them in memory and never
writes them back. jupyter_client starts the `python3` kernel with `sys.executable`, so
the notebooks see the same installed packages as the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is in the 'notebooks' extra")
nbclient = pytest.importorskip("nbclient", reason="nbclient is in the 'notebooks' extra")
pytest.importorskip("ipykernel", reason="ipykernel is in the 'notebooks' extra")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120
"""A guard against a hung kernel, not a speed target."""


def test_the_three_notebooks_are_there():
    names = {p.name for p in NOTEBOOKS}
    assert {"loss_vs_deliverable_compute.ipynb", "calibration_report.ipynb", "plan_explorer.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    data = json.loads(path.read_text())
    for cell in data["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}: clear outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_without_error(path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # every notebook draws at least one figure
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no figure"

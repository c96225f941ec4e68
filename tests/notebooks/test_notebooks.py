"""Every notebook under notebooks/ runs top to bottom on cpu (nbclient, kernel python3 = this
interpreter), and its rendering in docs/notebooks/ is what that run shows.

Notebooks are committed without outputs; this test executes each once, in memory, and never
writes the notebook back. jupyter_client starts the `python3` kernel with `sys.executable`, so
the notebooks see the same installed packages as the tests. The executed notebook is rendered
to markdown + PNG figures (nbconvert's MarkdownExporter) and compared with the committed
docs/notebooks/NAME.md and NAME_files/: the text must be equal, each figure equal within
IMAGE_RMS_TOLERANCE (matplotlib.testing.compare). A stale rendering is rewritten in place from
this run and the test fails, so the CI run that executes the notebooks renders them into docs/
and a change that alters what a notebook shows fails until its new rendering is committed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from perfmodel.specs.strict import write_bytes_atomic, write_text_atomic

nbformat = pytest.importorskip("nbformat", reason="nbformat is in the 'notebooks' extra")
nbclient = pytest.importorskip("nbclient", reason="nbclient is in the 'notebooks' extra")
nbconvert = pytest.importorskip("nbconvert", reason="nbconvert is in the 'notebooks' extra")
pytest.importorskip("ipykernel", reason="ipykernel is in the 'notebooks' extra")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RENDERED = ROOT / "docs" / "notebooks"
CELL_TIMEOUT_S = 120
"""A guard against a hung kernel, not a speed target."""
IMAGE_RMS_TOLERANCE = 2.0
"""RMS pixel difference (0-255 scale, matplotlib.testing.compare.compare_images) under which a
re-rendered figure counts as the committed one: room for another FreeType or matplotlib build's
anti-aliasing of text, not for a changed curve (a 3 x 350 px line drawn across one of these
figures measures RMS 11)."""
PANDAS_STYLE = re.compile(r"<style scoped>.*?</style>\n", re.S)
"""The CSS block pandas puts before each HTML table: GitHub strips <style> and would show the
rules as text; the tables read the same without it."""


def test_the_three_notebooks_are_there():
    names = {p.name for p in NOTEBOOKS}
    assert {"loss_vs_deliverable_compute.ipynb", "calibration_report.ipynb", "plan_explorer.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    data = json.loads(path.read_text())
    for cell in data["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}: clear outputs"


def render(nb, stem: str) -> tuple[str, dict[str, bytes]]:
    """(markdown, figures by path relative to docs/notebooks/) of an executed notebook."""
    body, resources = nbconvert.MarkdownExporter().from_notebook_node(
        nb, resources={"output_files_dir": f"{stem}_files", "unique_key": stem})
    header = (f"<!-- Rendered from notebooks/{stem}.ipynb by tests/notebooks/test_notebooks.py, which executes it "
              "on cpu: edit the notebook, then run that test to refresh this page. -->\n\n")
    return header + PANDAS_STYLE.sub("", body).strip() + "\n", dict(resources["outputs"])


def stale_parts(stem: str, text: str, figures: dict[str, bytes], scratch: Path) -> list[str]:
    """What of the committed rendering of `stem` differs from this run's (empty: current)."""
    from matplotlib.testing.compare import compare_images
    from matplotlib.testing.exceptions import ImageComparisonFailure

    page = RENDERED / f"{stem}.md"
    stale = [] if page.is_file() and page.read_text() == text else [str(page.relative_to(ROOT))]
    committed = {str(p.relative_to(RENDERED)) for p in (RENDERED / f"{stem}_files").glob("*.png")}
    stale += [f"docs/notebooks/{name} (no figure now)" for name in sorted(committed - set(figures))]
    for name, data in sorted(figures.items()):
        if name not in committed:
            stale.append(f"docs/notebooks/{name} (new)")
            continue
        fresh = write_bytes_atomic(scratch / name, data)
        try:
            differs = compare_images(str(RENDERED / name), str(fresh), IMAGE_RMS_TOLERANCE, in_decorator=True)
            why = differs and f"RMS {differs['rms']:.2f} > {IMAGE_RMS_TOLERANCE}"
        except ImageComparisonFailure as failure:  # another size
            why = str(failure)
        if why:
            stale.append(f"docs/notebooks/{name} ({why})")
    return stale


def write_rendering(stem: str, text: str, figures: dict[str, bytes]) -> None:
    """The rendering of `stem` in docs/notebooks/ replaced by this run's, file by file atomically."""
    for old in (RENDERED / f"{stem}_files").glob("*.png"):
        if str(old.relative_to(RENDERED)) not in figures:
            old.unlink()
    for name, data in figures.items():
        write_bytes_atomic(RENDERED / name, data)
    write_text_atomic(RENDERED / f"{stem}.md", text)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_without_error_and_its_rendering_in_docs_is_current(path, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # every notebook draws at least one figure
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no figure"

    text, figures = render(nb, path.stem)
    assert str(ROOT) not in text, f"{path.name} shows a path of this machine; the rendering must not"
    assert all(f"]({name})" in text for name in figures)
    stale = stale_parts(path.stem, text, figures, tmp_path)
    if stale:
        write_rendering(path.stem, text, figures)
        assert not stale, (f"the rendering of {path.name} was stale and is rewritten from this run: review and "
                           f"commit docs/notebooks/ ({'; '.join(stale)})")


def test_every_rendering_in_docs_has_its_notebook():
    stems = {p.stem for p in NOTEBOOKS}
    pages = {p.stem for p in RENDERED.glob("*.md") if p.name != "README.md"}
    folders = {p.name[: -len("_files")] for p in RENDERED.glob("*_files")}
    assert pages == stems and folders <= stems, "remove the rendering of a notebook that is gone"

"""The docs pages stay in step with the code: every command and option is in docs/commands.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mosaic.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
runner = CliRunner()


def _commands() -> list[str]:
    res = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    block = res.output.split("Commands", 1)[1]
    return re.findall(r"│ ([a-z][a-z-]+) ", block)


def test_every_command_is_documented():
    text = (DOCS / "commands.md").read_text()
    names = _commands()
    assert {"plan", "calibrate", "train"} <= set(names)
    missing = [n for n in names if f"## `mosaic {n}`" not in text]
    assert not missing, f"docs/commands.md lacks sections for {missing}; regenerate it from --help"


@pytest.mark.parametrize("name", _commands())
def test_every_option_is_documented(name):
    res = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", res.output))
    section = (DOCS / "commands.md").read_text().split(f"## `mosaic {name}`", 1)[1].split("\n## ", 1)[0]
    missing = sorted(o for o in options if o not in section)
    assert not missing, f"docs/commands.md, mosaic {name}: options {missing} missing; regenerate from --help"


def test_pages_link_each_other_and_validation_has_both_sections():
    concepts = (DOCS / "concepts.md").read_text()
    assert "(cluster_sources.md)" in concepts and (DOCS / "cluster_sources.md").exists()
    validation = (DOCS / "validation.md").read_text()
    assert "## Performance model against published runs" in validation and "## Fidelity on cpu" in validation
    for page in ("concepts.md", "tutorial.md", "commands.md", "validation.md"):
        for target in re.findall(r"\]\(([\w./-]+\.md)", (DOCS / page).read_text()):
            assert (DOCS / target).exists(), f"docs/{page} links to missing {target}"

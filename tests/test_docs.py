"""The docs say what the code and results/ say: generated files match, the README is short."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_docs():
    spec = importlib.util.spec_from_file_location("write_docs", REPO / "scripts" / "write_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cli_md_matches_the_parsers_help():
    docs = write_docs()
    assert (REPO / "docs" / "cli.md").read_text() == docs.cli_markdown(), \
        "docs/cli.md is out of date: run python scripts/write_docs.py"


def test_every_generated_table_matches_results():
    assert write_docs().differences() == [], "run python scripts/write_docs.py"


def test_quoted_results_record_their_provenance():
    docs = write_docs()
    for table in docs.TABLES:
        data, why = docs.load_quotable(REPO / table.json)
        page = REPO / "docs" / "benchmarks" / f"{table.name}.md"
        assert page.exists() == (data is not None), f"{table.json}: {why}"


def test_readme_is_short_and_starts_with_the_two_set_up_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert "hybriddl train --usecase ComplexSmall" in blocks[0]
    assert "python -m pytest -q tests" in blocks[1]


def test_docs_links_point_at_files_that_exist():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}"

"""The docs say what the code and results/ say: generated files match, the README is short."""

from __future__ import annotations

import importlib.util
import os
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
    for table in docs.PAGES:
        data, why = docs.load_quotable(REPO / table.json)
        page = REPO / "docs" / "benchmarks" / f"{table.name}.md"
        assert page.exists() == (data is not None), f"{table.json}: {why}"


def test_every_scripts_pages_are_written_and_no_script_imports_the_writer():
    """Each benchmark's pages stand beside its runner (its PAGES); write_docs collects them
    all, and a runner never imports write_docs (no circle)."""
    docs = write_docs()
    for path in sorted((REPO / "scripts").glob("*.py")):
        text = path.read_text()
        assert path.name == "write_docs.py" or not re.search(r"^\s*(from|import) write_docs\b",
                                                             text, re.M), path.name
        for name in re.findall(r"^(\w*PAGES) = \[", text, re.M):
            module = importlib.import_module(path.stem)
            assert all(page in docs.PAGES for page in getattr(module, name)), \
                f"scripts/write_docs.py does not write {path.name}'s {name}"


def test_readme_is_short_and_starts_with_the_two_set_up_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert "hybriddl train --usecase ComplexSmall" in blocks[0]
    ci_command = next(line for line in (REPO / ".ci" / "run").read_text().splitlines()
                      if "pytest" in line and not line.startswith("#"))
    assert ci_command in blocks[1] and "python -m pytest -q -n 2 --dist loadfile tests" in ci_command


def test_docs_links_point_at_files_that_exist():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}"


def test_no_code_doc_or_test_points_outside_the_repository():
    """A page named (any `NAME.md`) is one in the repository; no path leaves it."""
    files = []
    for folder, dirs, names in os.walk(REPO):
        # Not the repository's: the venv, git's own, and what runs leave.
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "profiles",
                                                                        "__pycache__")]
        files += [Path(folder, name) for name in names]
    pages = {path.name for path in files if path.suffix == ".md"}
    for path in files:
        if path.suffix not in (".py", ".md", ".sh", ".cfg", ".toml", ".txt") or path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        named = {name for name in re.findall(r"[\w.-]+\.md\b", text) if Path(name).name not in pages}
        assert not named, f"{path.relative_to(REPO)} names {sorted(named)}, not in the repository"
        assert not re.search(r"\.\./shared|(?<![\w.])/work/", text), \
            f"{path.relative_to(REPO)} points outside the repository"


def test_the_main_job_line_quotes_the_readmes_first_command():
    """results/main_job.json measured the command README's block 1 gives, and the README
    says what it gave (scripts/write_docs.py writes the line from that JSON)."""
    docs = write_docs()
    text = (REPO / "README.md").read_text()
    data, why = docs.load_quotable(docs.MAIN_JOB_JSON)
    assert data is not None, f"results/main_job.json: {why}"
    first = re.findall(r"```bash\n(.*?)```", text, re.S)[0]
    assert data["main_job"].replace("hybriddl ", ".venv/bin/hybriddl ", 1) in first
    between = text.split(docs.MAIN_JOB_BEGIN, 1)[1].split(docs.MAIN_JOB_END, 1)[0]
    assert ", ".join(f"{a:.3f}" for a in data["val_accuracy"]) in between
    assert f"{data['cores']} cores" in between and data["cpu_model"] in between


def scaling_results(time_scale: float) -> dict:
    row = {"bandwidth": "1gbit", "images_per_second": 10.0, "efficiency": 0.9,
           "nic_bytes_per_step": 13.3e6}
    return {"usecase": "SimpleBig", "image_size": 224, "cores_per_host": 1,
            "command": "c", "cpu_model": "cpu", "cores": 2, "torch": "t", "commit": "x",
            "summary": [{**row, "contender": c, "hosts": h}
                        for c, h in (("data", 1), ("hybrid", 2), ("data", 2))],
            "cells": [{"contender": "data", "hosts": 1, "time_scale": 1.0},
                      {"contender": "hybrid", "hosts": 2, "time_scale": time_scale}]}


def test_the_scaling_headline_comes_only_from_hosts_side_by_side():
    import scaling_e2e

    table = scaling_e2e.PAGES[0]
    assert "D = 1" in scaling_e2e.scaling_headline(table, scaling_results(1.0))
    assert scaling_e2e.turns_line(scaling_results(1.0)) is None
    assert scaling_e2e.scaling_headline(table, scaling_results(2.0)) is None
    assert "2 hosts at D = 2" in scaling_e2e.turns_line(scaling_results(2.0))


def fast_results() -> dict:
    """A scaling_fast file in little: one host speed, 2 hosts side by side and 4 under a
    CPU quota (D = 2), one cell left out by --max-step-wall."""
    def row(contender, hosts, efficiency, images):
        return {"bandwidth": "1gbit", "contender": contender, "hosts": hosts,
                "speedup": 130.0, "host_step_seconds": 0.01, "images_per_second": images,
                "step_seconds_median": 32 * hosts / images, "step_seconds_spread": [0.02, 0.03],
                "efficiency": efficiency, "nic_bytes_per_step": 1e6}

    def cell(contender, hosts, **more):
        return {"contender": contender, "hosts": hosts, "bandwidth": "1gbit", "speedup": 130.0,
                "time_scale": 1.0 if hosts < 4 else 2.0, "turns": False, **more}

    return {"usecase": "SimpleBig", "image_size": 224, "cores_per_host": 1, "warmup": 2,
            "steps": 3, "rounds": 1, "theory_nic_bytes_per_step": {"2": {"data": 228e6}},
            "summary": [row("data", 1, 1.0, 3200), row("hybrid", 2, 0.09, 580),
                        row("data-powersgd", 2, 0.8, 5100), row("ddp-powersgd", 2, 0.5, 3200),
                        row("data-powersgd", 4, 0.6, 7700)],
            "cells": [cell("data", 1), cell("hybrid", 2),
                      cell("data-powersgd", 2, command="train --compression powersgd:2"),
                      cell("ddp-powersgd", 2, command="compare_ddp --powersgd-rank 2"),
                      cell("data-powersgd", 4, command="train --compression powersgd:2"),
                      {"contender": "data", "hosts": 2, "bandwidth": "1gbit", "speedup": 130.0,
                       "skipped": "not run (predicted 238 s/step ...)",
                       "predicted_step_wall_seconds": 238.4}],
            "cpu_model": "a CPU"}


def test_the_fast_host_page_names_the_winner_what_is_exact_and_what_was_not_run(tmp_path):
    import scaling_e2e
    from pages import chart_digest

    data = fast_results()
    page = scaling_e2e.scaling_fast_table(data)
    assert "| 1gbit | 10 ms (S = 130) | 2 | data-powersgd (**not exact**: PowerSGD rank 2): 0.80" \
        in page
    assert "| hybrid | exact | 580 |" in page
    assert "| data | exact | not run (predicted 238 s/step of wall time) |" in page
    assert "| 1.59 |" in page  # hybriddl's best over ddp-powersgd's images/s at 2 hosts
    # Under --speedup the 4 hosts ran at once under a quota: no turns.
    assert scaling_e2e.turns_line(data) is None
    assert "4 hosts at D = 2" in scaling_e2e.quota_line(data)
    headline = scaling_e2e.fast_headline(scaling_e2e.FAST_PAGES[0], data)
    assert "2 emulated hosts as fast as a 10 ms (S = 130) step" in headline
    assert "Exact: hybrid, data;" in headline and "data not run (predicted 238 s" in headline
    chart = scaling_e2e.scaling_fast_chart(data, tmp_path / "fast.png")
    assert chart_digest(chart) == scaling_e2e.scaling_fast_digest(data)
    data["summary"][1]["efficiency"] = 0.1
    assert chart_digest(chart) != scaling_e2e.scaling_fast_digest(data)  # a stale chart shows


def test_the_fast_host_headline_sends_the_compressed_rows_to_time_to_accuracy():
    """A compressed row's images/s is named not exact, and judged by time to accuracy over
    seeds: the headline quotes no accuracy of one seed at equal epochs."""
    import scaling_e2e

    headline = scaling_e2e.fast_headline(scaling_e2e.FAST_PAGES[0], fast_results())
    assert ("not exact (judged by time to accuracy over seeds, not by images/s) — "
            "PowerSGD rank 2: ") in headline
    assert "equal epochs" not in headline


def test_one_run_of_write_docs_links_a_new_pages_chart_from_the_readme(tmp_path, monkeypatch):
    """A results file measured for the first time: one `write_docs.py` draws its chart before
    it writes the README that links it, so `--check` is clean after one run (the README was
    written first, without the link, and a second run was needed)."""
    import shutil

    docs = write_docs()
    results = tmp_path / "results"
    results.mkdir()
    name = "scaling_fast-SimpleBig-1gbit-4ms-gpu-powersgd"
    shutil.copy(REPO / "results" / f"{name}.json", results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{docs.HEADLINE_BEGIN}\n{docs.HEADLINE_END}\n")
    for attribute, value in (("REPO", tmp_path), ("RESULTS", results),
                             ("DOCS", tmp_path / "docs"),
                             ("BENCHMARKS", tmp_path / "docs" / "benchmarks"),
                             ("README", readme), ("MAIN_JOB_JSON", results / "main_job.json")):
        monkeypatch.setattr(docs, attribute, value)
    assert docs.main([]) == 0
    assert (tmp_path / "docs" / "benchmarks" / f"{name}.png").stat().st_size > 0
    assert f"](docs/benchmarks/{name}.png)" in readme.read_text()
    assert docs.differences() == []


def test_a_page_says_where_its_command_wrote_a_results_file_since_moved():
    """A results file moved after its run (out of /tmp, or renamed): the quoted command
    names a file that is not there, and the page says so; where the command wrote the
    file quoted, nothing is added."""
    docs = write_docs()
    quoted = "results/time_to_accuracy-x.json"
    assert docs.renamed_since("python s.py --output /tmp/t.json --seeds 1", quoted) == \
        " (written as `/tmp/t.json`, moved to this name since)"
    assert docs.renamed_since(f"python s.py --output {quoted}", quoted) == ""
    assert docs.renamed_since("python s.py --steps 3", quoted) == ""
    page = (REPO / "docs" / "benchmarks" /
            "time_to_accuracy-mnist-SimpleBig-1core-powersgd.md").read_text()
    assert "moved to this name since" in page

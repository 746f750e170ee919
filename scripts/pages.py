"""What a benchmark's page in docs/benchmarks is made of, shared by the scripts that write
the results and by scripts/write_docs.py, which renders them.

    from pages import Page, provenance, ratio_text

Each benchmark script keeps its own pages beside its runner, as a module-level
`PAGES = [Page(...), ...]`: how its table, setting, notes, README headline and chart are
written from its results JSON. scripts/write_docs.py collects every script's PAGES and
writes them; a script never imports write_docs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Page:
    name: str                      # docs/benchmarks/<name>.md
    title: str
    json: str                      # relative to the repository
    render: Callable[[dict], str]
    setting: Callable[[dict], str]
    notes: str | Callable[[dict], str] = ""
    # The README's headline line for this page (None: not quoted there).
    headline: Callable[["Page", dict], str | None] | None = None
    # A chart beside the page, docs/benchmarks/<name>.png, drawn by this (None: no chart),
    # and what it is drawn from, hashed: the PNG records it (`save_chart`), --check compares.
    chart: Callable[[dict, Path], Path] | None = None
    digest: Callable[[dict], str] | None = None
    # Why a glob finds no file yet.
    none_yet: str = "they need a GPU host: scripts/gpu_check.py"


# ---------------------------------------------------------------- provenance

PROVENANCE = ("command", "cpu_model", "cores", "torch", "commit")


def provenance(data: dict) -> dict:
    """What a results JSON must record to be quoted (results_header's keys); a missing or
    empty item is None."""
    return {name: data[name] if data.get(name) not in (None, "") else None
            for name in PROVENANCE}


def measured_date(data: dict) -> str:
    return str(data["date"]) if data.get("date") not in (None, "") else \
        "not recorded in the JSON"


# ---------------------------------------------------------------- figures

def model_name(usecase: str) -> str:
    """The model a use case trains, as the pages name it."""
    return {"SimpleBig": "AlexNet", "ComplexSmall": "VGG16"}.get(usecase, usecase)


def ratio_text(x) -> str:
    """An efficiency, speed-up or ratio to two places; – where none was measured."""
    return "–" if x is None else f"{x:.2f}"


# ---------------------------------------------------------------- charts

def save_chart(figure, path: Path, digest: str) -> Path:
    """A matplotlib figure written atomically as a PNG that records `digest`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        # No software version or date in the PNG; the digest of what it draws instead.
        figure.savefig(tmp, format="png", dpi=100,
                       metadata={"Software": None, "Description": digest})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def chart_digest(path: Path) -> str | None:
    """The digest a chart recorded when drawn (None: no chart, or none recorded)."""
    if not path.exists():
        return None
    from PIL import Image

    with Image.open(path) as image:
        return image.text.get("Description")

"""What every benchmark script shares: the header its results JSON starts with, and the
spread of a measurement.

    from bench_common import results_header, spread

Scripts are run as `python scripts/NAME.py` (Python puts scripts/ first on the path), so
this imports without any path set-up; tests load scripts with tests/conftest.py, which
puts scripts/ on the path the same way.
"""

from __future__ import annotations

import datetime
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def results_header(script: str, argv: list[str] | None = None) -> dict:
    """cpu_model, cores, torch, commit, command and date: what scripts/write_docs.py
    needs to quote a results file (`script` is the script's file name)."""
    import torch

    from hybriddl.machine.hostinfo import cpu_model

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    # The code measured differs from the commit named (edits not committed yet, or a copy
    # of the checkout whose .git is older than its files): the header says which files.
    changed = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "hybriddl",
                              "scripts"], capture_output=True, text=True,
                             cwd=REPO).stdout.split()
    given = sys.argv[1:] if argv is None else argv
    return {"cpu_model": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "commit": commit,
            **({"code_changed_since_commit": changed} if changed else {}),
            "command": shlex.join(["python", f"scripts/{script}", *given]),
            "date": datetime.date.today().isoformat()}


def spread(values: list[float], digits: int | None = None) -> dict:
    """The median, lowest and highest of a measurement's repeats (rounded to `digits`)."""
    figures = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return figures if digits is None else {k: round(v, digits) for k, v in figures.items()}

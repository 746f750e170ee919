"""The run directory contract (ARCHITECTURE.md, "Contracts"): its files' names, the checks
before a run writes there, and reading a finished run's metrics. Below every reader of a run:
the trainer, the launcher, compare, inference and report."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from hybriddl.errors import UsageError
from hybriddl.files import format_bytes

METRICS = "metrics.json"
MODEL = "model.pt"
CHECKPOINT = "checkpoint.pt"


def check_storage(run_dir: Path, needed_bytes: int) -> None:
    """Before a run starts: RUN_DIR (or the folder it will be made in) is writable and its
    file system has `needed_bytes` free; otherwise a UsageError naming both figures."""
    run_dir = Path(run_dir)
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        why = "is on a read-only file system" if read_only else "is not writable by this user"
        raise UsageError(f"--run-dir {run_dir}: {existing} {why}; choose a directory you can "
                         "write to")
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise UsageError(f"--run-dir {run_dir}: {format_bytes(free)} ({free} bytes) free there, "
                         f"the run needs about {format_bytes(needed_bytes)} ({needed_bytes} "
                         "bytes) for two checkpoints (the last one kept while the next is "
                         "written); free some space or choose another --run-dir")


def default_run_dir(usecase: str, root: str = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"{usecase}-{stamp}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = Path(root) / f"{usecase}-{stamp}-{suffix}"
    return path


def check_new_run_dir(path: Path) -> None:
    """Refuse to mix two runs in one folder; called before any file is written."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--run-dir {path} is a file: give a directory path")
    if path.is_dir() and any(path.iterdir()):
        raise UsageError(f"--run-dir {path} already holds files: choose a new directory "
                         "(or --resume it to continue that run)")


def load_metrics(run_dir: Path) -> dict:
    path = Path(run_dir) / METRICS
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{run_dir} has no {METRICS}: give a run directory made by "
                         "'hybriddl train'") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg}): the run directory is damaged") from None

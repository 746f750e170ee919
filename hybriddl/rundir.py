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
from hybriddl.files import check_writable, format_bytes

METRICS = "metrics.json"
MODEL = "model.pt"
CHECKPOINT = "checkpoint.pt"


def errors_file(rank: int, steps_done: int | str) -> str:
    """The name of host `rank`'s compression errors at optimizer step `steps_done`, which a
    compressed run's hosts other than rank 0 keep beside its checkpoint (`rank` and
    `steps_done` "*": the pattern of them all)."""
    return f"compression-rank{rank}-step{steps_done}.pt"


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
    check_writable(run_dir, "--run-dir")  # tried: /proc lets root pass the access check
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise UsageError(f"--run-dir {run_dir}: {format_bytes(free)} ({free} bytes) free there, "
                         f"the run needs about {format_bytes(needed_bytes)} ({needed_bytes} "
                         "bytes) for two checkpoints (the last one kept while the next is "
                         "written); free some space or choose another --run-dir")


# The head of a torchvision classifier grows with the class count, unknown before the
# data are read; torchvision's default of 1000 bounds the estimate for the usual cases.
ESTIMATE_CLASSES = 1000


def check_run_storage(run_dir: Path, model_name: str, classes: int | None = None,
                      held_bytes=None) -> None:
    """Before data loading and tuning: RUN_DIR writable, room for two checkpoints.

    A checkpoint holds the model and its SGD momentum (2x the parameter bytes); at the
    peak the last one is kept while the next is written, so two. `held_bytes(model)`:
    what this host's gradient compression adds there (its error buffers). The model is
    built on PyTorch's meta device: sizes only, no memory, no random numbers drawn.
    """
    import torch  # here: the commands that only start processes load no torch

    from hybriddl.usecases import build_model

    with torch.device("meta"):
        model = build_model(model_name, classes or ESTIMATE_CLASSES)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    existing = Path(run_dir) / CHECKPOINT
    held = existing.stat().st_size if existing.is_file() else 0  # a resumed run's, replaced
    compression = held_bytes(model) if held_bytes else 0
    check_storage(run_dir, max(0, 2 * 2 * state_bytes + compression - held))


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
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"--run-dir {path} is a file: give a directory path")
        holds_files = path.is_dir() and any(path.iterdir())
    except OSError as exc:  # a folder this user cannot read or search
        raise UsageError(f"--run-dir {path}: cannot look in it ({exc.strerror}); choose a "
                         "directory you can write to") from None
    if holds_files:
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
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file: the run directory is damaged") from None
    except OSError as exc:  # unreadable, or a folder of that name
        raise UsageError(f"{path}: cannot read it ({exc.strerror}); give a run directory "
                         "made by 'hybriddl train'") from None

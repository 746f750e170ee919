"""The run directory contract (ARCHITECTURE.md, "Contracts")."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import torch

from hybriddl.errors import UsageError

METRICS = "metrics.json"
MODEL = "model.pt"
CHECKPOINT = "checkpoint.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Temporary file, fsync, rename: a kill at any moment leaves the old file or the new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_write_json(path: Path, payload: dict) -> None:
    atomic_write_bytes(path, (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode())


def atomic_torch_save(path: Path, obj) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


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

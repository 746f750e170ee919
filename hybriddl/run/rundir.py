"""The run directory contract (ARCHITECTURE.md, "Contracts")."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from hybriddl.errors import StorageError, UsageError

METRICS = "metrics.json"
MODEL = "model.pt"
CHECKPOINT = "checkpoint.pt"


# A write in progress lives beside its target under this name; only a kill can leave one.
PARTIAL_GLOB = ".*.tmp-*"


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Temporary file, fsync, rename, fsync the directory: a kill at any moment leaves the
    old file or the new, and a failed write (disk full, read-only, I/O error) leaves the old
    file, no temporary file, and a StorageError naming the file and the free space."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except Exception as exc:
        with contextlib.suppress(OSError):  # on a read-only file system even a no-op fails
            tmp.unlink(missing_ok=True)
        cause = os_error(exc)
        if cause is None:
            raise
        raise StorageError(f"writing {path} failed: {cause.strerror or cause} "
                           f"({describe_free_space(path.parent)})") from None


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind `exc`: torch.save reports a full disk as the RuntimeError its
    zip writer raises while closing, with the OSError as its context."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def atomic_write_bytes(path: Path, data: bytes) -> None:
    write_atomically(path, lambda handle: handle.write(data))


def atomic_write_json(path: Path, payload: dict) -> None:
    atomic_write_bytes(path, (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode())


def atomic_torch_save(path: Path, obj) -> None:
    # Straight into the file: a BytesIO first would hold a second copy of a 1 GB checkpoint.
    # A file object rather than a name: through Python's file the OSError (ENOSPC, EROFS)
    # survives as the context of torch's error; torch's own file writer loses it.
    write_atomically(path, lambda handle: torch.save(obj, handle))


def remove_partial_writes(run_dir: Path) -> list[Path]:
    """Delete the temporary files a killed run left behind (never complete, never loaded)."""
    removed = []
    for partial in Path(run_dir).glob(PARTIAL_GLOB):
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            continue  # a read-only run directory: check_storage says so next
        removed.append(partial)
    return removed


def describe_free_space(directory: Path) -> str:
    try:
        return f"{format_bytes(shutil.disk_usage(directory).free)} free there"
    except OSError:
        return "free space unknown"


def format_bytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


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


def fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable: without it a crash may undo the rename."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)

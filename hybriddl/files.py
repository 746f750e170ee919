"""Files written so that a kill or a full disk never leaves half of one: the run directory,
the data cache, profiles and every result file go through here."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hybriddl.errors import StorageError, UsageError

# A write in progress lives beside its target under this name; only a kill can leave one.
PARTIAL_GLOB = ".*.tmp-*"


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybriddl, else ~/.cache/hybriddl: what hybriddl keeps between runs
    on this machine (decoded data, the allocator measured fastest)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybriddl"


def check_writable(path: str | Path, flag: str, folder: bool = True) -> None:
    """Before any work: a file can be made where `path` (a folder, or with `folder` False a
    file) is to be written, or a UsageError naming `flag`. Tried, not guessed: a temporary
    file in the nearest folder that exists, removed at once (/proc and /sys refuse it)."""
    path = Path(path)
    try:
        if folder and path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {path} is a file: give a folder")
        if not folder and path.is_dir():
            raise UsageError(f"{flag} {path} is a folder: give a file path")
        existing = path if folder else path.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise UsageError(f"{flag} {path}: {existing} is a file, not a folder")
    except OSError as exc:  # a folder on the way this user cannot search
        raise UsageError(f"{flag} {path}: cannot look there ({exc.strerror}); choose a place "
                         "you can write to") from None
    try:
        handle, name = tempfile.mkstemp(prefix=".hybriddl-write-check-", dir=existing)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {existing} ({exc.strerror or exc}); "
                         "choose a place you can write to") from None


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
    except BaseException as exc:  # Ctrl-C in a long write (predict's) leaves no file either
        with contextlib.suppress(OSError):  # on a read-only file system even a no-op fails
            tmp.unlink(missing_ok=True)
        if isinstance(exc, UsageError) or not isinstance(exc, Exception):
            raise  # the content's own fault (an unreadable image), or an interruption
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
    import torch  # here, not above: the commands that only start processes never load torch

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


def fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable: without it a crash may undo the rename."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)

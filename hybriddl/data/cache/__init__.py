"""Streamed data: a one-time uint8 cache file per (source, stored size), read per batch.

Decoding a JPEG and scaling it costs milliseconds of CPU per image at 224 px; reading
the same decoded bytes back costs microseconds (a copy from the page cache). So each
source (hybriddl.data.sources) is decoded once, at its stored size, into one file;
training then reads only the rows of its own part of each global batch with
`os.preadv`. Memory stays flat in the data set's size: nothing but the labels (8 bytes an
image) is held, and rows are read into fresh buffers, not mapped, so the pages read count
as page cache, never as the process's resident memory.

The build goes through the whole source in one pass. A file that is no usable image is
left out and listed, with its reason, in the header and in a text file beside the cache
(`<cache>.skipped.txt`); the summary line names that list. How many images had to be
converted to RGB, from which modes, is counted.

A cache file is written under a temporary name, synced, and renamed into place, so a
file under its final name is always complete. Its header holds a fingerprint of the
source (every file's path, size and mtime), its size is checked against the header, and
every image has a CRC-32 checked on every read: a changed source or a truncated file is
never used, and a damaged row is decoded again from its source file and written back.
An interrupted build leaves its partial file, the rows' records and a marker of how far
it synced; the next run continues from there.

The file's layout is `layout.py`, reading it `reading.py`, writing it `building.py`; this
module finds a valid cache or has one built, one process of a machine at a time.
"""

from __future__ import annotations

import errno
import fcntl
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hybriddl.data import Progress
from hybriddl.data.cache.building import CacheBuildInterrupted, build
from hybriddl.data.cache.layout import read_header, read_records, skipped_list_path
from hybriddl.data.cache.reading import CacheFile, DiskImages, StreamedImageSet
from hybriddl.data.sources import Source
from hybriddl.errors import StorageError, TrainingError, UsageError
from hybriddl.files import atomic_write_bytes, user_cache_dir


LOCK_POLL_SECONDS = 0.2  # how often a process waiting for the cache's lock tries again


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybriddl, else ~/.cache/hybriddl: shared by every run and by tune."""
    return user_cache_dir()


def _open_valid(path: Path, source: Source) -> CacheFile | None:
    """The cache at `path` if it is complete and made from this very source; else None."""
    header = read_header(path)
    if header is None:
        return None
    try:
        if (header["fingerprint"] != source.fingerprint()
                or header["stored_size"] != source.stored_size
                or header["classes"] != source.classes):
            return None
        records = read_records(path, header)
    except (KeyError, TypeError, OSError):
        return None
    if records is None:
        return None
    return CacheFile(path, header, records, source)


def open_cache(source: Source, cache_dir: str | Path | None = None,
               progress: Progress | None = None,
               stop_signal: Callable[[], int | None] = lambda: None
               ) -> tuple[CacheFile, StreamedImageSet]:
    """The source's cache (built first when missing, stale or damaged) and its images.

    `stop_signal` is polled during a build: when it returns a signal number the build
    syncs what it has and raises CacheBuildInterrupted.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / source.cache_name()
    opened = _open_valid(path, source)
    if opened is None:
        _check_writable(directory)
        with _exclusive(path, source.name, stop_signal):
            # Another process of this machine (a second rank) may have built it meanwhile.
            opened = _open_valid(path, source)
            if opened is None:
                _build(path, source, progress, stop_signal)
                opened = _open_valid(path, source)
        if opened is None:
            raise TrainingError(f"the data cache {path} did not read back after it was built: "
                                "check the disk, or give another folder with --data-cache DIR")
    _keep_skipped_list(opened)
    images = DiskImages(opened)
    return opened, StreamedImageSet(images, torch.from_numpy(opened.labels), list(source.classes))


def _build(path: Path, source: Source, progress: Progress | None,
           stop_signal: Callable[[], int | None]) -> None:
    """`build`, its system errors one line (what was synced is kept for the next run)."""
    try:
        build(path, source, progress, stop_signal)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UsageError(f"--data-cache {path.parent}: no space left for the cache of "
                             f"{source.name}{where}; free some space or give another folder "
                             "with --data-cache DIR") from None
        raise TrainingError(f"the data cache {path} could not be built: {exc.strerror}{where}; "
                            "check the disk, or give another folder with --data-cache DIR; what "
                            "was written is kept for the next run") from None


def _keep_skipped_list(cache: CacheFile) -> None:
    """The list beside the cache, written again if it was removed or is another build's."""
    entries = cache.header["skipped"] + cache.header["not_read"]
    path = skipped_list_path(cache.path)
    if not entries:
        path.unlink(missing_ok=True)  # a list left by an older build would mislead
        return
    text = "".join(f"{where}\t{reason}\n" for where, reason in entries).encode()
    try:
        if path.read_bytes() == text:
            return
    except OSError:
        pass
    try:
        atomic_write_bytes(path, text)
    except (OSError, StorageError):
        pass  # a read-only cache folder: the header keeps the list, the summary names it


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # A name of its own: hosts sharing the folder may run processes of the same pid.
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as exc:
        raise UsageError(f"--data-cache {directory}: cannot write there ({exc.strerror}); "
                         "give a writable folder with --data-cache DIR") from None


@contextmanager
def _exclusive(path: Path, source: str, stop_signal: Callable[[], int | None]) -> Iterator[None]:
    """The cache's lock, one process of a machine (or of a shared folder) at a time. While
    another holds it (building, minutes perhaps) a stop requested here ends the wait: a
    blocking flock would outlast the stop, and a holder that was stopped would hold this
    process for ever."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if (signum := stop_signal()) is not None:
                    raise CacheBuildInterrupted.saying(
                        signum, f"stopped while waiting for another process to build the data "
                                f"cache of {source} (it holds {lock_path}); run the same command "
                                "again") from None
                time.sleep(LOCK_POLL_SECONDS)
            except OSError as exc:  # a file system without locks (ENOLCK, ENOSYS)
                raise UsageError(f"--data-cache {path.parent}: cannot lock {lock_path.name} "
                                 f"there ({exc.strerror}); give a local folder with "
                                 "--data-cache DIR") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

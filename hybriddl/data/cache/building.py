"""Building a cache: the whole source in one pass, resumable after an interruption.

A file that is no usable image is left out and listed with its reason; images converted to
RGB are counted by mode. The build writes under a temporary name and syncs every
SYNC_EVERY_SECONDS (rows, their records and a marker of how far it came), so an
interrupted build continues from its last sync; the header goes last, then the rename.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybriddl.data import Progress
from hybriddl.data.cache.layout import (FORMAT_VERSION, IMAGES_AT, MAGIC, PREFIX, RECORD,
                                        encode_header, header_at)
from hybriddl.data.sources import Source
from hybriddl.errors import TrainingInterrupted, UsageError
from hybriddl.files import atomic_write_json, fsync_directory

SYNC_EVERY_SECONDS = 2.0  # how much build work an interruption may lose at most
SPACE_MARGIN = 64 * 2**20  # left free beside a cache, for the rest of the system


class CacheBuildInterrupted(TrainingInterrupted):
    """A stop signal arrived while a cache was being built; what was synced is kept."""

    def __init__(self, signum: int, source: str, done: int, total: int):
        Exception.__init__(self, f"stopped while building the data cache of {source} "
                           f"({done} of {total} images kept); run the same command again "
                           "to continue the build")
        self.signum = signum

    ended, again = "built its data cache", "run the same command again to continue the build"


def check_free_space(directory: Path, needed: int, source: str) -> None:
    free = shutil.disk_usage(directory).free
    if needed + SPACE_MARGIN > free:
        raise UsageError(f"--data-cache {directory}: the cache of {source} needs "
                         f"{needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free "
                         "there; free some space or give another folder with --data-cache DIR")


class BuildProgress:
    """How far a build came: what the marker file keeps between interrupted runs."""

    def __init__(self, position: int = 0, rows: int = 0, skipped=None, converted=None):
        self.position = position  # source items tried
        self.rows = rows  # images written
        self.skipped: list[list[str]] = skipped or []
        self.converted: dict[str, int] = converted or {}


def build(path: Path, source: Source, progress: Progress | None,
           stop_signal: Callable[[], int | None]) -> None:
    partial = path.with_name(path.name + ".partial")
    marker = path.with_name(path.name + ".partial.json")
    rows_file = path.with_name(path.name + ".partial.rows")
    total = source.count()
    row_bytes = 3 * source.stored_size ** 2
    identity = {"format": FORMAT_VERSION, "source": source.name,
                "fingerprint": source.fingerprint(), "stored_size": source.stored_size,
                "files": total}
    done = _resumable(partial, marker, rows_file, identity, row_bytes)
    if not done.position:
        for leftover in (marker, partial, rows_file):
            leftover.unlink(missing_ok=True)
    # At most every item an image; a folder with files left out ends smaller.
    upper = IMAGES_AT + total * row_bytes
    check_free_space(path.parent, upper + total * RECORD.itemsize
                      - (partial.stat().st_size if done.position else 0), source.name)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    records = open(rows_file, "ab")
    try:
        try:
            os.posix_fallocate(fd, 0, upper)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise UsageError(f"--data-cache {path.parent}: no space left for the cache of "
                                 f"{source.name}; free some space or give another folder with "
                                 "--data-cache DIR") from None
            raise
        if not done.position:
            os.pwrite(fd, MAGIC + PREFIX.pack(0, 0), 0)
        pending = []
        synced_at = time.monotonic()

        def sync() -> None:
            records.write(np.array(pending, dtype=RECORD).tobytes())
            records.flush()
            os.fsync(records.fileno())
            os.fsync(fd)
            pending.clear()
            atomic_write_json(marker, {**identity, "position": done.position, "rows": done.rows,
                                       "skipped": done.skipped, "converted": done.converted})

        for item in source.items(done.position):
            if item.image is None:
                done.skipped.append([source.where(done.position), item.problem])
            else:
                data = item.image.tobytes()
                os.pwrite(fd, data, IMAGES_AT + done.rows * row_bytes)
                pending.append((item.label, zlib.crc32(data), done.position))
                done.rows += 1
                if item.converted:
                    done.converted[item.converted] = done.converted.get(item.converted, 0) + 1
            done.position += 1
            if progress is not None and (done.position % 64 == 0 or done.position == total):
                progress(done.position, total)
            if time.monotonic() - synced_at > SYNC_EVERY_SECONDS or done.position == total:
                sync()
                synced_at = time.monotonic()
                signum = stop_signal()
                if signum is not None and done.position < total:
                    raise CacheBuildInterrupted(signum, source.name, done.position, total)
        if done.position != total:
            raise UsageError(f"{source.name} gave {done.position} items where it had {total}: "
                             "it changed while the cache was built; run again")
        records.close()
        table = rows_file.read_bytes()[:done.rows * RECORD.itemsize]
        header = {**identity, "count": done.rows, "classes": source.classes,
                  "extra": source.extra(), "tables_crc": f"{zlib.crc32(table):08x}",
                  "skipped": done.skipped, "converted": done.converted,
                  "not_read": [list(problem) for problem in source.problems()]}
        at = header_at(done.rows, source.stored_size)
        encoded = encode_header(header)
        os.ftruncate(fd, at + len(encoded))
        os.pwrite(fd, table, at - len(table))
        os.pwrite(fd, encoded, at)
        os.fsync(fd)
        # Last, once everything it points to is on disk: until then the file is no cache.
        os.pwrite(fd, PREFIX.pack(at, len(encoded)), len(MAGIC))
        os.fsync(fd)
    finally:
        records.close()
        os.close(fd)
    os.replace(partial, path)
    fsync_directory(path.parent)
    marker.unlink(missing_ok=True)
    rows_file.unlink(missing_ok=True)


def _resumable(partial: Path, marker: Path, rows_file: Path, identity: dict,
               row_bytes: int) -> BuildProgress:
    """How far an interrupted build of this same cache synced, else nothing done."""
    try:
        mark = json.loads(marker.read_text())
        with open(partial, "rb") as handle:
            magic = handle.read(len(MAGIC))
        partial_size, rows_size = partial.stat().st_size, rows_file.stat().st_size
    except (OSError, ValueError):
        return BuildProgress()
    if (not isinstance(mark, dict) or magic != MAGIC
            or {key: mark.get(key) for key in identity} != identity
            or not isinstance(mark.get("position"), int) or not isinstance(mark.get("rows"), int)
            or not 0 < mark["position"] <= identity["files"]
            or not 0 <= mark["rows"] <= mark["position"]
            or rows_size < mark["rows"] * RECORD.itemsize
            or partial_size < IMAGES_AT + mark["rows"] * row_bytes
            or not isinstance(mark.get("skipped"), list)
            or not isinstance(mark.get("converted"), dict)):
        return BuildProgress()
    # Records written after the last sync belong to rows the marker does not count.
    os.truncate(rows_file, mark["rows"] * RECORD.itemsize)
    return BuildProgress(mark["position"], mark["rows"], mark["skipped"], mark["converted"])

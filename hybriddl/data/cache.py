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

Layout (format 2; format 1 files are rebuilt): MAGIC, then the header's offset and length
(zero until the build completes), images from ROW_ALIGN on, one record per image (label,
CRC-32, the source item it came from), then the JSON header. The header comes last because
how many images a folder really gives is known only once every file was tried.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from hybriddl.data import ImageSet, Progress
from hybriddl.data.sources import Source
from hybriddl.errors import StorageError, TrainingError, TrainingInterrupted, UsageError
from hybriddl.files import atomic_write_bytes, atomic_write_json, fsync_directory

MAGIC = b"HYBRIDDL-CACHE2\n"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<QQ")  # the header's offset and length
ROW_ALIGN = 4096  # rows start on a page, so a read of one row touches the fewest pages
IMAGES_AT = ROW_ALIGN
RECORD = np.dtype([("label", "<i8"), ("crc", "<u4"), ("item", "<u4")])
SYNC_EVERY_SECONDS = 2.0  # how much build work an interruption may lose at most
SPACE_MARGIN = 64 * 2**20  # left free beside a cache, for the rest of the system


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybriddl, else ~/.cache/hybriddl: shared by every run and by tune."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybriddl"


def skipped_list_path(cache: Path) -> Path:
    return cache.with_name(cache.name + ".skipped.txt")


# --------------------------------------------------------------------------- reading

class CacheFile:
    """One open cache: its header, records and descriptor, shared by every view of it.

    It also repairs: a row whose bytes no longer match their CRC-32 (a bit flipped on the
    disk or in transit) is decoded again from its source item, written back, and noted.
    """

    def __init__(self, path: Path, header: dict, records: np.ndarray, source: Source):
        self.path, self.header, self.source = path, header, source
        self.labels = records["label"].copy()
        self.crcs = records["crc"].copy()
        self.items = records["item"].copy()
        self.row_bytes = 3 * header["stored_size"] ** 2
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        self.repairs: list[str] = []  # one line per row rebuilt, for the CLI to show
        self._lock = threading.Lock()  # the prefetcher reads on its own thread

    def read_row(self, row: int, buffer: memoryview) -> None:
        if os.preadv(self.fd, [buffer], IMAGES_AT + row * self.row_bytes) == len(buffer) \
                and zlib.crc32(buffer) == int(self.crcs[row]):
            return
        self._repair(row, buffer)

    def _repair(self, row: int, buffer: memoryview) -> None:
        with self._lock:
            index = int(self.items[row])
            where = self.source.where(index)
            item = self.source.item(index)
            if item.image is None or zlib.crc32(item.image.tobytes()) != int(self.crcs[row]):
                why = item.problem or "it decodes to other bytes now"
                raise TrainingError(f"data cache {self.path}: image {row} ({where}) does not "
                                    f"match its checksum, and it cannot be rebuilt from its "
                                    f"file ({why}): delete {self.path} and run again to "
                                    "rebuild the cache")
            buffer[:] = item.image.tobytes()
            try:  # another process may read the same file: the right bytes are idempotent
                fd = os.open(self.path, os.O_WRONLY)
                try:
                    os.pwrite(fd, buffer, IMAGES_AT + row * self.row_bytes)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                kept = "written back"
            except OSError as exc:
                kept = f"used, but not written back ({exc.strerror})"
            self.repairs.append(f"data cache {self.path}: image {row} ({where}) did not match "
                                f"its checksum; decoded again from its file and {kept}")

    def summary(self) -> str | None:
        """"12 of 100,000 files skipped: see LIST" (None when nothing was left out)."""
        skipped, folders = self.header["skipped"], self.header["not_read"]
        if not skipped and not folders:
            return None
        parts = [f"{len(skipped):,} of {self.header['files']:,} files of "
                 f"{self.header['source']} skipped"]
        if folders:
            parts.append(f"{len(folders):,} folders not read")
        first = (skipped or folders)[0]
        return (f"{', '.join(parts)} (first: {first[0]}: {first[1]}): see "
                f"{skipped_list_path(self.path)}")

    def converted(self) -> str | None:
        modes = self.header["converted"]
        if not modes:
            return None
        counts = ", ".join(f"{count:,} {mode}" for mode, count in sorted(modes.items()))
        total = sum(modes.values())
        return (f"{total:,} image{'s' if total != 1 else ''} of {self.header['source']} "
                f"converted to RGB ({counts})")


class DiskImages:
    """Rows of a cache file, read on demand: indexing gives an N x 3 x S x S uint8 tensor.

    Indexing accepts what a tensor of images accepts in this code base (an index tensor,
    a list, a slice, an int), so an ImageSet holding one reads like one held in memory.
    """

    def __init__(self, cache: CacheFile, positions: np.ndarray | None = None):
        self.cache = cache
        self.path = cache.path
        self._size = cache.header["stored_size"]
        self._positions = np.arange(len(cache.labels)) if positions is None else positions
        self.rows_read = 0  # how many rows this view has read: tests check each host's share

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self._positions), 3, self._size, self._size))

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def __len__(self) -> int:
        return len(self._positions)

    def rows(self, indices) -> DiskImages:
        """A view of some rows, reading nothing."""
        return DiskImages(self.cache, self._positions[_as_numpy_index(indices)])

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, int):
            return self[[key]][0]
        positions = np.atleast_1d(self._positions[_as_numpy_index(key)])
        out = np.empty((len(positions), 3, self._size, self._size), dtype=np.uint8)
        # In file order, so a cache on a spinning or network disk is read forwards.
        for j in np.argsort(positions, kind="stable"):
            self.cache.read_row(int(positions[j]), memoryview(out[j]).cast("B"))
        self.rows_read += len(positions)
        return torch.from_numpy(out)


def _as_numpy_index(key):
    if isinstance(key, torch.Tensor):
        return key.numpy()
    if isinstance(key, list):
        return np.asarray(key, dtype=np.int64)
    return key


class StreamedImageSet(ImageSet):
    """An ImageSet whose images stay on disk; a subset is a view, not a copy."""

    def subset(self, indices: torch.Tensor) -> StreamedImageSet:
        return StreamedImageSet(self.images.rows(indices), self.labels[indices], self.classes)


# --------------------------------------------------------------------------- the file

def _encode(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True).encode()


def _header_at(count: int, stored_size: int) -> int:
    return IMAGES_AT + count * 3 * stored_size ** 2 + count * RECORD.itemsize


def _read_header(path: Path) -> dict | None:
    """The header of a complete cache file of this format, or None (not one, cut short,
    damaged, another format, an unfinished build)."""
    try:
        with open(path, "rb") as handle:
            if handle.read(len(MAGIC)) != MAGIC:
                return None
            at, length = _PREFIX.unpack(handle.read(_PREFIX.size))
            size = os.fstat(handle.fileno()).st_size
            if not at or at + length != size:
                return None
            handle.seek(at)
            header = json.loads(handle.read(length))
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION \
                or _header_at(header["count"], header["stored_size"]) != at:
            return None
        return header
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def _records(path: Path, header: dict) -> np.ndarray | None:
    n = header["count"]
    at = _header_at(n, header["stored_size"]) - n * RECORD.itemsize
    with open(path, "rb") as handle:
        handle.seek(at)
        raw = handle.read(n * RECORD.itemsize)
    if len(raw) != n * RECORD.itemsize or f"{zlib.crc32(raw):08x}" != header["tables_crc"]:
        return None
    return np.frombuffer(raw, dtype=RECORD)


def _open_valid(path: Path, source: Source) -> CacheFile | None:
    """The cache at `path` if it is complete and made from this very source; else None."""
    header = _read_header(path)
    if header is None:
        return None
    try:
        if (header["fingerprint"] != source.fingerprint()
                or header["stored_size"] != source.stored_size
                or header["classes"] != source.classes):
            return None
        records = _records(path, header)
    except (KeyError, TypeError, OSError):
        return None
    if records is None:
        return None
    return CacheFile(path, header, records, source)


class CacheBuildInterrupted(TrainingInterrupted):
    """A stop signal arrived while a cache was being built; what was synced is kept."""

    def __init__(self, signum: int, source: str, done: int, total: int):
        Exception.__init__(self, f"stopped while building the data cache of {source} "
                           f"({done} of {total} images kept); run the same command again "
                           "to continue the build")
        self.signum = signum


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
        with _exclusive(path):
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
        probe = directory / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--data-cache {directory}: cannot write there ({exc.strerror}); "
                         "give a writable folder with --data-cache DIR") from None


def _check_free_space(directory: Path, needed: int, source: str) -> None:
    free = shutil.disk_usage(directory).free
    if needed + SPACE_MARGIN > free:
        raise UsageError(f"--data-cache {directory}: the cache of {source} needs "
                         f"{needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free "
                         "there; free some space or give another folder with --data-cache DIR")


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- building

class _Progress:
    """How far a build came: what the marker file keeps between interrupted runs."""

    def __init__(self, position: int = 0, rows: int = 0, skipped=None, converted=None):
        self.position = position  # source items tried
        self.rows = rows  # images written
        self.skipped: list[list[str]] = skipped or []
        self.converted: dict[str, int] = converted or {}


def _build(path: Path, source: Source, progress: Progress | None,
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
    _check_free_space(path.parent, upper + total * RECORD.itemsize
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
            os.pwrite(fd, MAGIC + _PREFIX.pack(0, 0), 0)
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
        at = _header_at(done.rows, source.stored_size)
        encoded = _encode(header)
        os.ftruncate(fd, at + len(encoded))
        os.pwrite(fd, table, at - len(table))
        os.pwrite(fd, encoded, at)
        os.fsync(fd)
        # Last, once everything it points to is on disk: until then the file is no cache.
        os.pwrite(fd, _PREFIX.pack(at, len(encoded)), len(MAGIC))
        os.fsync(fd)
    finally:
        records.close()
        os.close(fd)
    os.replace(partial, path)
    fsync_directory(path.parent)
    marker.unlink(missing_ok=True)
    rows_file.unlink(missing_ok=True)


def _resumable(partial: Path, marker: Path, rows_file: Path, identity: dict,
               row_bytes: int) -> _Progress:
    """How far an interrupted build of this same cache synced, else nothing done."""
    try:
        mark = json.loads(marker.read_text())
        with open(partial, "rb") as handle:
            magic = handle.read(len(MAGIC))
        partial_size, rows_size = partial.stat().st_size, rows_file.stat().st_size
    except (OSError, ValueError):
        return _Progress()
    if (not isinstance(mark, dict) or magic != MAGIC
            or {key: mark.get(key) for key in identity} != identity
            or not isinstance(mark.get("position"), int) or not isinstance(mark.get("rows"), int)
            or not 0 < mark["position"] <= identity["files"]
            or not 0 <= mark["rows"] <= mark["position"]
            or rows_size < mark["rows"] * RECORD.itemsize
            or partial_size < IMAGES_AT + mark["rows"] * row_bytes
            or not isinstance(mark.get("skipped"), list)
            or not isinstance(mark.get("converted"), dict)):
        return _Progress()
    # Records written after the last sync belong to rows the marker does not count.
    os.truncate(rows_file, mark["rows"] * RECORD.itemsize)
    return _Progress(mark["position"], mark["rows"], mark["skipped"], mark["converted"])

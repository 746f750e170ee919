"""Streamed data: a one-time uint8 cache file per (source, stored size), read per batch.

Decoding a JPEG and scaling it costs milliseconds of CPU per image at 224 px; reading
the same decoded bytes back costs microseconds (a copy from the page cache). So each
source (an ImageFolder, CIFAR-10's python batches, `synthetic:N`) is decoded once, at
its stored size, into one file; training then reads only the rows of its own part of
each global batch with `os.preadv`. Memory stays flat in the data set's size: nothing
but the labels (8 bytes an image) is held, and rows are read into fresh buffers, not
mapped, so the pages read count as page cache, never as the process's resident memory.

A cache file is written under a temporary name, synced, and renamed into place, so a
file under its final name is always complete. Its header holds a fingerprint of the
source (every file's path, size and mtime), its size is checked against the header,
and every image has a CRC-32 checked on every read: a changed source, a truncated or a
damaged file is never used. An interrupted build leaves its partial file and a marker
of the rows already synced; the next run continues from there.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import struct
import time
import weakref
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torchvision
from torchvision.transforms import v2

from hybriddl.data import (SYNTHETIC_CLASSES, DataSplit, ImageSet, Progress, render_synthetic,
                           stratified_split)
from hybriddl.errors import TrainingError, TrainingInterrupted, UsageError
from hybriddl.run.rundir import atomic_write_json, fsync_directory

MAGIC = b"HYBRIDDL-CACHE1\n"
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<Q")
ROW_ALIGN = 4096  # rows start on a page, so a read of one row touches the fewest pages
SYNC_EVERY_SECONDS = 2.0  # how much build work an interruption may lose at most
SPACE_MARGIN = 64 * 2**20  # left free beside a cache, for the rest of the system
SYNTHETIC_SIZE = 64  # native pixels of the generated images, as the embedded set
SYNTHETIC_GENERATOR = "render_synthetic/1"  # bump when render_synthetic changes its bytes


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybriddl, else ~/.cache/hybriddl: shared by every run and by tune."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybriddl"


# --------------------------------------------------------------------------- sources

class Source(ABC):
    """What a cache is made from: its identity, a cheap fingerprint, and its rows."""

    name: str  # shown to the user, e.g. "imagefolder:/data/fire"
    stored_size: int  # pixels per side of the rows in the cache
    classes: list[str]

    @abstractmethod
    def key(self) -> str:
        """Which cache file this source owns (not its content: that is the fingerprint)."""

    @abstractmethod
    def _fingerprint(self) -> str:
        """Changes whenever the content may have changed; cheap enough for every run."""

    def fingerprint(self) -> str:
        # Taken once per process: a build compares it before and after, and 100,000
        # stat() calls are not free.
        if getattr(self, "_taken", None) is None:
            self._taken = self._fingerprint()
        return self._taken

    @abstractmethod
    def count(self) -> int:
        """How many images (may read the source: only called to build)."""

    @abstractmethod
    def rows(self, start: int) -> Iterator[tuple[np.ndarray, int]]:
        """(3 x S x S uint8 image, label) for every image from index `start` on."""

    def extra(self) -> dict:
        """Source-specific facts the split needs, kept in the cache header."""
        return {}

    def cache_name(self) -> str:
        kind = self.name.split(":", 1)[0]
        digest = hashlib.sha256(f"{self.key()}|{self.stored_size}".encode()).hexdigest()[:16]
        return f"{kind}-{digest}-{self.stored_size}px.cache"


def _stat_digest(files: list[Path], root: Path, also: str = "") -> str:
    digest = hashlib.sha256(also.encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# What reading a damaged or foreign pickle can raise, besides a clean UnpicklingError.
_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError,
                  AttributeError, ImportError, RuntimeError, OSError)


class CIFAR10Files(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR-10 reader for some python batch files of ROOT/cifar-10-batches-py.

    torchvision checks every file's MD5 against the full download; users with a trimmed
    or re-packed copy (and the tests) have valid files with other sums, so only their
    presence is checked.
    """

    def __init__(self, root: str, files: list[str]):
        self.train_list = [[name, None] for name in files]
        self.test_list = []
        super().__init__(root, train=True, download=False)

    def _check_integrity(self) -> bool:
        folder = Path(self.root) / self.base_folder
        return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

    def _load_meta(self) -> None:
        meta = Path(self.root) / self.base_folder / self.meta["filename"]
        with open(meta, "rb") as handle:
            self.classes = list(pickle.load(handle, encoding="latin1")[self.meta["key"]])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:120] if text else "no message"


class ImageFolderSource(Source):
    """An ImageFolder tree, each image scaled and centre-cropped to the image size."""

    def __init__(self, root: str, image_size: int):
        path = Path(root)
        if not path.is_dir():
            raise UsageError(f"--data {root}: no such directory; give a folder with one "
                             "subfolder of images per class, 'synthetic' or 'cifar10:DIR'")
        try:
            self.folder = torchvision.datasets.ImageFolder(str(path), allow_empty=False)
        except FileNotFoundError as exc:
            raise UsageError(f"--data {root}: {exc}; put the images of each class in its own "
                             "subfolder") from None
        self.root = path.resolve()
        self.name = f"imagefolder:{root}"
        self.stored_size = image_size
        self.classes = list(self.folder.classes)
        self._scale = v2.Compose([v2.PILToTensor(), v2.Resize(image_size, antialias=True),
                                  v2.CenterCrop(image_size)])

    def key(self) -> str:
        return str(self.root)

    def _fingerprint(self) -> str:
        files = [Path(file) for file, _ in self.folder.samples]
        return _stat_digest(files, self.root, also="\0".join(self.classes))

    def count(self) -> int:
        return len(self.folder.samples)

    def rows(self, start: int) -> Iterator[tuple[np.ndarray, int]]:
        for file, label in self.folder.samples[start:]:
            try:
                image = self.folder.loader(file)
            except Exception as exc:  # PIL raises several types for broken files
                raise UsageError(f"cannot read image {file} ({type(exc).__name__}): "
                                 "remove or replace the file") from None
            yield self._scale(image).numpy(), label


class Cifar10Source(Source):
    """CIFAR-10's python batches at their native 32 px (scaled per batch, as before):
    the data_batch_* files, then test_batch when present."""

    def __init__(self, root: str):
        path = Path(root)
        base = CIFAR10Files.base_folder
        if path.name == base:
            path = path.parent
        self.folder = path / base
        if not self.folder.is_dir():
            raise UsageError(f"--data cifar10:{root}: no {base} folder there; extract "
                             "cifar-10-python.tar.gz and give the folder that holds it")
        self.train_files = sorted(p.name for p in self.folder.glob("data_batch_*"))
        if not self.train_files or not (self.folder / "batches.meta").is_file():
            raise UsageError(f"--data cifar10:{root}: {self.folder} needs data_batch_* files "
                             "and batches.meta; re-extract cifar-10-python.tar.gz")
        self.val_files = ["test_batch"] if (self.folder / "test_batch").is_file() else []
        self.root, self.spec = path, root
        self.name = f"cifar10:{root}"
        self.stored_size = 32
        # Every run needs the classes, only a build needs the images: the meta file alone.
        try:
            with open(self.folder / "batches.meta", "rb") as handle:
                self.classes = [str(c) for c in pickle.load(handle, encoding="latin1")[
                    CIFAR10Files.meta["key"]]]
        except _PICKLE_ERRORS as exc:
            raise UsageError(f"--data cifar10:{root}: batches.meta is not CIFAR-10's "
                             f"({type(exc).__name__}: {first_line(exc)}); "
                             "re-extract cifar-10-python.tar.gz") from None

    def _read(self, name: str):
        # One file at a time, so that an error names the file that is damaged.
        try:
            reader = CIFAR10Files(str(self.root), [name])
        except _PICKLE_ERRORS as exc:
            raise UsageError(f"--data cifar10:{self.spec}: {name} or batches.meta is not a "
                             f"CIFAR-10 python batch ({type(exc).__name__}: {first_line(exc)}); "
                             "re-extract cifar-10-python.tar.gz") from None
        labels = np.asarray(reader.targets, dtype=np.int64)
        if len(labels) != len(reader.data) or (
                len(labels) and not 0 <= labels.min() <= labels.max() < len(reader.classes)):
            raise UsageError(f"--data cifar10:{self.spec}: {name} has {len(reader.data)} images "
                             f"and {len(labels)} labels for {len(reader.classes)} classes; "
                             "re-extract cifar-10-python.tar.gz")
        return reader.data, labels

    def key(self) -> str:
        return str(self.folder.resolve())

    def _fingerprint(self) -> str:
        names = self.train_files + self.val_files + ["batches.meta"]
        return _stat_digest([self.folder / n for n in names], self.folder)

    def _counts(self) -> list[int]:
        if getattr(self, "_read_counts", None) is None:
            self._read_counts = [len(self._read(name)[1])
                                 for name in self.train_files + self.val_files]
        return self._read_counts

    def count(self) -> int:
        return sum(self._counts())

    def extra(self) -> dict:
        counts = self._counts()
        return {"train_images": sum(counts[:len(self.train_files)])}

    def rows(self, start: int) -> Iterator[tuple[np.ndarray, int]]:
        first = 0
        for name in self.train_files + self.val_files:
            images, labels = self._read(name)
            for i in range(max(start - first, 0), len(labels)):
                yield np.ascontiguousarray(images[i].transpose(2, 0, 1)), int(labels[i])
            first += len(labels)


class SyntheticSource(Source):
    """`synthetic:N`: N generated images of the embedded kind, each from its own index."""

    def __init__(self, n: int):
        self.n = n
        self.name = f"synthetic:{n}"
        self.stored_size = SYNTHETIC_SIZE
        self.classes = list(SYNTHETIC_CLASSES)

    def key(self) -> str:
        return self.name

    def _fingerprint(self) -> str:
        return hashlib.sha256(f"{SYNTHETIC_GENERATOR}|{self.n}".encode()).hexdigest()

    def count(self) -> int:
        return self.n

    def rows(self, start: int) -> Iterator[tuple[np.ndarray, int]]:
        for index in range(start, self.n):
            label = index % len(SYNTHETIC_CLASSES)
            yield render_synthetic(label, index, SYNTHETIC_SIZE), label


def parse_synthetic_count(spec: str) -> int:
    text = spec[len("synthetic:"):]
    if not text.isdigit() or int(text) < 2:
        raise UsageError(f"--data {spec}: give synthetic:N with N a whole number of images, "
                         "at least 2 (or 'synthetic' for the embedded set)")
    return int(text)


# --------------------------------------------------------------------------- reading

class DiskImages:
    """Rows of a cache file, read on demand: indexing gives an N x 3 x S x S uint8 tensor.

    Indexing accepts what a tensor of images accepts in this code base (an index tensor,
    a list, a slice, an int), so an ImageSet holding one reads like one held in memory.
    """

    def __init__(self, path: Path, images_at: int, stored_size: int, crcs: np.ndarray,
                 positions: np.ndarray | None = None):
        self.path, self._images_at, self._size, self._crcs = path, images_at, stored_size, crcs
        self._positions = np.arange(len(crcs)) if positions is None else positions
        self._row_bytes = 3 * stored_size * stored_size
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
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
        return DiskImages(self.path, self._images_at, self._size, self._crcs,
                          self._positions[_as_numpy_index(indices)])

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, int):
            return self[[key]][0]
        positions = np.atleast_1d(self._positions[_as_numpy_index(key)])
        out = np.empty((len(positions), 3, self._size, self._size), dtype=np.uint8)
        # In file order, so a cache on a spinning or network disk is read forwards.
        for j in np.argsort(positions, kind="stable"):
            row = int(positions[j])
            buffer = memoryview(out[j]).cast("B")
            if os.preadv(self._fd, [buffer], self._images_at + row * self._row_bytes) != len(buffer) \
                    or zlib.crc32(buffer) != int(self._crcs[row]):
                raise TrainingError(f"data cache {self.path} is damaged (image {row} does not "
                                    f"match its checksum): delete the file and run again to "
                                    "rebuild it")
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

def _layout(header: dict) -> tuple[int, int, int, int]:
    """(labels_at, crcs_at, images_at, file size) for a header."""
    head = len(MAGIC) + _LENGTH.size + len(_encode(header))
    n, row = header["count"], 3 * header["stored_size"] ** 2
    labels_at = -(-head // 64) * 64
    crcs_at = labels_at + 8 * n
    images_at = -(-(crcs_at + 4 * n) // ROW_ALIGN) * ROW_ALIGN
    return labels_at, crcs_at, images_at, images_at + n * row


def _encode(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True).encode()


def _header_for(source: Source, count: int, tables_crc: int = 0) -> dict:
    # tables_crc is written as fixed-width hex so that the header's length, and with it
    # the layout, does not change when the real value replaces the placeholder.
    return {"format": FORMAT_VERSION, "source": source.name, "fingerprint": source.fingerprint(),
            "count": count, "stored_size": source.stored_size, "classes": source.classes,
            "extra": source.extra(), "tables_crc": f"{tables_crc:08x}"}


def _read_header(path: Path) -> dict | None:
    """The header of a cache file, or None when the file is not one (or is cut short)."""
    try:
        with open(path, "rb") as handle:
            if handle.read(len(MAGIC)) != MAGIC:
                return None
            (length,) = _LENGTH.unpack(handle.read(_LENGTH.size))
            if length > 2**26:
                return None
            header = json.loads(handle.read(length))
        return header if isinstance(header, dict) else None
    except (OSError, ValueError, struct.error):
        return None


def _tables(path: Path, header: dict) -> tuple[np.ndarray, np.ndarray] | None:
    labels_at, crcs_at, _, size = _layout(header)
    n = header["count"]
    if path.stat().st_size != size:
        return None
    with open(path, "rb") as handle:
        handle.seek(labels_at)
        raw = handle.read(12 * n)
    if len(raw) != 12 * n or f"{zlib.crc32(raw):08x}" != header["tables_crc"]:
        return None
    return (np.frombuffer(raw[:8 * n], dtype="<i8").copy(),
            np.frombuffer(raw[8 * n:], dtype="<u4").copy())


def _open_valid(path: Path, source: Source) -> tuple[dict, DiskImages, torch.Tensor] | None:
    """The cache at `path` if it is complete and made from this very source; else None."""
    header = _read_header(path)
    if header is None or header.get("format") != FORMAT_VERSION:
        return None
    try:
        if (header["fingerprint"] != source.fingerprint()
                or header["stored_size"] != source.stored_size
                or header["classes"] != source.classes):
            return None
        tables = _tables(path, header)
    except (KeyError, TypeError, OSError):
        return None
    if tables is None:
        return None
    labels, crcs = tables
    images = DiskImages(path, _layout(header)[2], source.stored_size, crcs)
    return header, images, torch.from_numpy(labels)


class CacheBuildInterrupted(TrainingInterrupted):
    """A stop signal arrived while a cache was being built; what was synced is kept."""

    def __init__(self, signum: int, source: str, done: int, total: int):
        Exception.__init__(self, f"stopped while building the data cache of {source} "
                           f"({done} of {total} images kept); run the same command again "
                           "to continue the build")
        self.signum = signum


def open_cache(source: Source, cache_dir: str | Path | None = None,
               progress: Progress | None = None,
               stop_signal: Callable[[], int | None] = lambda: None) -> tuple[dict, StreamedImageSet]:
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
    header, images, labels = opened
    return header, StreamedImageSet(images, labels, list(source.classes))


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


def _build(path: Path, source: Source, progress: Progress | None,
           stop_signal: Callable[[], int | None]) -> None:
    partial = path.with_name(path.name + ".partial")
    marker = path.with_name(path.name + ".partial.json")
    count = source.count()
    header = _header_for(source, count)
    labels_at, crcs_at, images_at, size = _layout(header)
    row_bytes = 3 * source.stored_size ** 2
    labels = np.zeros(count, dtype="<i8")
    crcs = np.zeros(count, dtype="<u4")
    start = _resumable_rows(partial, marker, header, size)
    if start:
        with open(partial, "rb") as handle:
            handle.seek(labels_at)
            labels[:start] = np.frombuffer(handle.read(8 * start), dtype="<i8")
            handle.seek(crcs_at)
            crcs[:start] = np.frombuffer(handle.read(4 * start), dtype="<u4")
    else:
        marker.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    _check_free_space(path.parent, size - (partial.stat().st_size if start else 0), source.name)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise UsageError(f"--data-cache {path.parent}: no space left for the cache of "
                                 f"{source.name}; free some space or give another folder with "
                                 "--data-cache DIR") from None
            raise
        if not start:
            os.pwrite(fd, MAGIC + _LENGTH.pack(len(_encode(header))) + _encode(header), 0)
        synced_at, synced_rows = time.monotonic(), start

        def sync(done: int) -> None:
            os.pwrite(fd, labels[synced_rows:done].tobytes(), labels_at + 8 * synced_rows)
            os.pwrite(fd, crcs[synced_rows:done].tobytes(), crcs_at + 4 * synced_rows)
            os.fsync(fd)
            atomic_write_json(marker, {"fingerprint": header["fingerprint"], "size": size,
                                       "rows_done": done})

        done = start
        for image, label in source.rows(start):
            os.pwrite(fd, image.tobytes(), images_at + done * row_bytes)
            crcs[done] = zlib.crc32(image.tobytes())
            labels[done] = label
            done += 1
            if progress is not None and (done % 64 == 0 or done == count):
                progress(done, count)
            if time.monotonic() - synced_at > SYNC_EVERY_SECONDS or done == count:
                sync(done)
                synced_at, synced_rows = time.monotonic(), done
                signum = stop_signal()
                if signum is not None and done < count:
                    raise CacheBuildInterrupted(signum, source.name, done, count)
        if done != count:
            raise UsageError(f"{source.name} gave {done} images where it had {count}: it "
                             "changed while the cache was built; run again")
        final = _header_for(source, count, zlib.crc32(labels.tobytes() + crcs.tobytes()))
        os.pwrite(fd, MAGIC + _LENGTH.pack(len(_encode(final))) + _encode(final), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)
    fsync_directory(path.parent)
    marker.unlink(missing_ok=True)


def _resumable_rows(partial: Path, marker: Path, header: dict, size: int) -> int:
    """Rows of an interrupted build of this same cache that were synced, else 0."""
    try:
        mark = json.loads(marker.read_text())
        on_disk = _read_header(partial)
    except (OSError, ValueError):
        return 0
    if (not isinstance(mark, dict) or on_disk is None
            or mark.get("fingerprint") != header["fingerprint"] or mark.get("size") != size
            or {**on_disk, "tables_crc": ""} != {**header, "tables_crc": ""}
            or not isinstance(mark.get("rows_done"), int)
            or not 0 < mark["rows_done"] <= header["count"]):
        return 0
    return mark["rows_done"]


# --------------------------------------------------------------------------- splits

def streamed_split(spec: str, *, image_size: int, classes: int | None, val_fraction: float,
                   cache_dir: str | Path | None = None, progress: Progress | None = None,
                   stop_signal: Callable[[], int | None] = lambda: None) -> DataSplit:
    """`--data SPEC` for an ImageFolder, cifar10:DIR or synthetic:N, streamed from its cache."""
    if spec.startswith("cifar10:"):
        return _cifar10_split(Cifar10Source(spec[len("cifar10:"):]), classes, val_fraction,
                              cache_dir, progress, stop_signal)
    if classes is not None:
        raise UsageError("--classes applies to cifar10: data only; leave it out")
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--val-fraction {val_fraction}: give a value between 0 and 1")
    source = (SyntheticSource(parse_synthetic_count(spec)) if spec.startswith("synthetic:")
              else ImageFolderSource(spec, image_size))
    _, every = open_cache(source, cache_dir, progress, stop_signal)
    train_idx, val_idx = stratified_split(every.labels, val_fraction)
    return DataSplit(every.subset(train_idx), every.subset(val_idx), source.name)


def _cifar10_split(source: Cifar10Source, classes, val_fraction, cache_dir, progress,
                   stop_signal) -> DataSplit:
    if classes is not None and not 2 <= classes <= len(source.classes):
        raise UsageError(f"--classes {classes}: give a number from 2 to {len(source.classes)}")
    if not 0.0 < val_fraction < 1.0 and not source.val_files:
        raise UsageError(f"--val-fraction {val_fraction}: give a value between 0 and 1")
    header, every = open_cache(source, cache_dir, progress, stop_signal)
    n_train = header["extra"]["train_images"]
    keep = every.labels < (classes or len(source.classes))
    positions = torch.arange(len(every))
    train_idx = positions[:n_train][keep[:n_train]]
    val_idx = positions[n_train:][keep[n_train:]]
    if not source.val_files:
        inner_train, inner_val = stratified_split(every.labels[train_idx], val_fraction)
        train_idx, val_idx = train_idx[inner_train], train_idx[inner_val]
    train, val = every.subset(train_idx), every.subset(val_idx)
    if classes is not None:
        train.classes = val.classes = list(source.classes[:classes])
    return DataSplit(train, val, source.name)

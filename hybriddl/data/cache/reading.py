"""Reading a cache: rows read per batch with `os.preadv`, each checked against its CRC-32.

Rows are read into fresh buffers, not mapped, so the pages read count as page cache, never
as the process's resident memory; only the labels (8 bytes an image) are held.
"""

from __future__ import annotations

import os
import threading
import weakref
import zlib
from pathlib import Path

import numpy as np
import torch

from hybriddl.data import ImageSet
from hybriddl.data.cache.layout import IMAGES_AT, skipped_list_path
from hybriddl.data.sources import Source
from hybriddl.errors import TrainingError


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
        try:
            read = os.preadv(self.fd, [buffer], IMAGES_AT + row * self.row_bytes)
        except OSError as exc:  # a failing disk, a cache on NFS another host replaced
            raise TrainingError(f"data cache {self.path}: reading image {row} failed "
                                f"({exc.strerror}): check the disk, or delete {self.path} and "
                                "run again to rebuild the cache") from None
        if read == len(buffer) and zlib.crc32(buffer) == int(self.crcs[row]):
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

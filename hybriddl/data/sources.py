"""What a data cache is made from: an ImageFolder, CIFAR-10's python batches, `synthetic:N`.

A source names itself, takes a cheap fingerprint of its content, and gives its items in
order: each item is an image row, or the reason it cannot be one (an ImageFolder's file
that is no usable image). Sources read user files only through readers that cannot run
code: a crafted CIFAR-10 "batch" is a pickle, and a pickle can run anything when loaded.
"""

from __future__ import annotations

import hashlib
import pickle
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybriddl.data import SYNTHETIC_CLASSES, render_synthetic
from hybriddl.data.images import CheckedImageFolder, UnusableImage, open_rgb, square_scaler
from hybriddl.errors import UsageError

SYNTHETIC_SIZE = 64  # native pixels of the generated images, as the embedded set
SYNTHETIC_GENERATOR = "render_synthetic/1"  # bump when render_synthetic changes its bytes


@dataclass
class Item:
    """One of a source's items: an image row, or why there is none."""

    label: int
    image: np.ndarray | None = None  # 3 x S x S uint8
    problem: str | None = None  # why the item was left out, for the list of skipped files
    converted: str | None = None  # the mode it was converted to RGB from, e.g. "CMYK"


class Source(ABC):
    """What a cache is made from: its identity, a cheap fingerprint, and its items."""

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
        """How many items (may read the source: only called to build)."""

    @abstractmethod
    def items(self, start: int) -> Iterator[Item]:
        """Every item from index `start` on."""

    def item(self, index: int) -> Item:
        """One item, decoded again (to repair a damaged cache row)."""
        return next(self.items(index))

    def where(self, index: int) -> str:
        """The item's name for the user: its file, or its place in a file."""
        return f"{self.name} image {index}"

    def problems(self) -> list[tuple[str, str]]:
        """(path, reason) for what the source found but could not read, beyond its items."""
        return []

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
        try:
            info = file.stat()
        except OSError:  # a broken link is an item too (listed as skipped): its link counts
            info = file.lstat()
        digest.update(f"{file.relative_to(root)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:120] if text else "no message"


class ImageFolderSource(Source):
    """An ImageFolder tree, each image made RGB, scaled and centre-cropped to the image size."""

    def __init__(self, root: str, image_size: int):
        path = Path(root)
        if not path.is_dir():
            raise UsageError(f"--data {root}: no such directory; give a folder with one "
                             "subfolder of images per class, 'synthetic' or 'cifar10:DIR'")
        try:
            self.folder = CheckedImageFolder(str(path))
        except FileNotFoundError as exc:
            raise UsageError(f"--data {root}: {exc}; put the images of each class in its own "
                             "subfolder") from None
        self.root = path.resolve()
        self.name = f"imagefolder:{root}"
        self.stored_size = image_size
        self.classes = list(self.folder.classes)
        self._scale = square_scaler(image_size)

    def key(self) -> str:
        return str(self.root)

    def _fingerprint(self) -> str:
        files = [Path(file) for file, _ in self.folder.samples]
        also = "\0".join(self.classes + [path for path, _ in self.folder.problems])
        return _stat_digest(files, self.root, also=also)

    def count(self) -> int:
        return len(self.folder.samples)

    def items(self, start: int) -> Iterator[Item]:
        for file, label in self.folder.samples[start:]:
            try:
                image, converted = open_rgb(file)
            except UnusableImage as exc:
                yield Item(label, problem=str(exc))
                continue
            yield Item(label, self._scale(image).numpy(), converted=converted)

    def where(self, index: int) -> str:
        return self.folder.samples[index][0]

    def problems(self) -> list[tuple[str, str]]:
        return list(self.folder.problems)


# --------------------------------------------------------------------------- CIFAR-10

class _ArraysOnly(pickle.Unpickler):
    """Unpickles CIFAR-10's batches (dicts, lists, strings, numpy arrays) and nothing else.

    torchvision's CIFAR10 reader calls pickle.load on the files, and a pickle may name any
    callable to run while it is loaded; this one may only rebuild numpy arrays.
    """

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch "
                                         "never does: refused without running it")
        return super().find_class(module, name)


def read_cifar_pickle(path: Path) -> dict:
    with open(path, "rb") as handle:
        entry = _ArraysOnly(handle, encoding="latin1").load()
    if not isinstance(entry, dict):
        raise ValueError(f"it holds a {type(entry).__name__}, not a dict")
    return entry


# What reading a damaged or foreign pickle can raise, besides a clean UnpicklingError.
_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError,
                  AttributeError, ImportError, RuntimeError, OSError, MemoryError)

CIFAR_FOLDER = "cifar-10-batches-py"


class Cifar10Source(Source):
    """CIFAR-10's python batches at their native 32 px (scaled per batch, as before):
    the data_batch_* files, then test_batch when present."""

    def __init__(self, root: str):
        path = Path(root)
        if path.name == CIFAR_FOLDER:
            path = path.parent
        self.folder = path / CIFAR_FOLDER
        if not self.folder.is_dir():
            raise UsageError(f"--data cifar10:{root}: no {CIFAR_FOLDER} folder there; extract "
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
            self.classes = [str(c) for c in read_cifar_pickle(self.folder / "batches.meta")[
                "label_names"]]
        except _PICKLE_ERRORS as exc:
            raise UsageError(f"--data cifar10:{root}: batches.meta is not CIFAR-10's "
                             f"({type(exc).__name__}: {first_line(exc)}); "
                             "re-extract cifar-10-python.tar.gz") from None

    def _read(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        # One file at a time, so that an error names the file that is damaged.
        try:
            entry = read_cifar_pickle(self.folder / name)
            labels = np.asarray(entry["labels"] if "labels" in entry else entry["fine_labels"],
                                dtype=np.int64)
            # Each row is 1024 red, 1024 green, 1024 blue values, row-major: C x H x W.
            images = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        except _PICKLE_ERRORS as exc:
            raise UsageError(f"--data cifar10:{self.spec}: {name} is not a CIFAR-10 python "
                             f"batch ({type(exc).__name__}: {first_line(exc)}); "
                             "re-extract cifar-10-python.tar.gz") from None
        if len(labels) != len(images) or (
                len(labels) and not 0 <= labels.min() <= labels.max() < len(self.classes)):
            raise UsageError(f"--data cifar10:{self.spec}: {name} has {len(images)} images "
                             f"and {len(labels)} labels for {len(self.classes)} classes; "
                             "re-extract cifar-10-python.tar.gz")
        return images, labels

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

    def items(self, start: int) -> Iterator[Item]:
        first = 0
        for name, count in zip(self.train_files + self.val_files, self._counts()):
            if start >= first + count:  # a resumed build or a repair skips whole files
                first += count
                continue
            images, labels = self._read(name)
            for i in range(max(start - first, 0), len(labels)):
                yield Item(int(labels[i]), np.ascontiguousarray(images[i]))
            first += len(labels)

    def where(self, index: int) -> str:
        first = 0
        for name, count in zip(self.train_files + self.val_files, self._counts()):
            if index < first + count:
                return f"{self.folder / name} image {index - first}"
            first += count
        return super().where(index)


# --------------------------------------------------------------------------- synthetic

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

    def items(self, start: int) -> Iterator[Item]:
        for index in range(start, self.n):
            label = index % len(SYNTHETIC_CLASSES)
            yield Item(label, render_synthetic(label, index, SYNTHETIC_SIZE))


def parse_synthetic_count(spec: str) -> int:
    text = spec[len("synthetic:"):]
    if not text.isdigit() or int(text) < 2:
        raise UsageError(f"--data {spec}: give synthetic:N with N a whole number of images, "
                         "at least 2 (or 'synthetic' for the embedded set)")
    return int(text)


def source_for(spec: str, image_size: int) -> Source:
    """The source `--data SPEC` names (the embedded "synthetic" is no cached source)."""
    if spec.startswith("cifar10:"):
        return Cifar10Source(spec[len("cifar10:"):])
    if spec.startswith("synthetic:"):
        return SyntheticSource(parse_synthetic_count(spec))
    return ImageFolderSource(spec, image_size)


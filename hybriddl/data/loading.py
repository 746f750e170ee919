"""`--data SPEC`, whatever it names: the embedded set in memory, everything else streamed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybriddl.data import DataSplit, ImageSet, Progress, stratified_split, synthetic_split
from hybriddl.data.cache import open_cache
from hybriddl.data.cache.reading import CacheFile, StreamedImageSet
from hybriddl.data.sources import Cifar10Source, source_for
from hybriddl.errors import UsageError


def load_data(spec: str, *, variant: str, image_size: int, classes: int | None = None,
              val_fraction: float = 0.2, progress: Progress | None = None,
              cache_dir: str | None = None,
              stop_signal: Callable[[], int | None] = lambda: None,
              strict: bool = False) -> DataSplit:
    """Load `--data SPEC`: "synthetic", "synthetic:N", "cifar10:DIR" or an ImageFolder.

    All but the embedded "synthetic" are streamed from a cache in `cache_dir` (built
    first when needed; see hybriddl.data.cache for `stop_signal`). Files that are no
    usable image are left out (see `data_notes`); with `strict` (--strict-data) any such
    file is a UsageError naming their list instead.
    """
    spec = settled_spec(spec)
    if spec == "synthetic":
        if classes is not None:
            raise UsageError("--classes applies to cifar10: data only; leave it out")
        split = synthetic_split(variant, progress=progress)
    else:
        split = streamed_split(spec, image_size=image_size, classes=classes,
                               val_fraction=val_fraction, cache_dir=cache_dir,
                               progress=progress, stop_signal=stop_signal, strict=strict)
    if len(split.classes) < 2:
        raise UsageError(f"{split.source} has {len(split.classes)} class; a classifier needs "
                         "at least 2 classes: add a subfolder of images for each class")
    if len(split.train) == 0 or len(split.val) == 0:
        raise UsageError(f"{split.source} has too few images for a train/validation split: "
                         "add images or lower --val-fraction")
    return split


def settled_spec(spec: str) -> str:
    """`--data SPEC` with its folder in one spelling: absolute, `~` expanded, symlinks
    resolved, no trailing slash.

    The cache is keyed, and its fingerprint taken, relative to the folder: `photos`,
    `./photos/`, `~/photos` and a link to it must name the same files and share one cache
    (a relative folder beside its resolved root made the fingerprint fail).
    """
    if spec == "synthetic" or spec.startswith("synthetic:"):
        return spec
    if spec.startswith("cifar10:"):
        return "cifar10:" + local_folder(spec[len("cifar10:"):])
    return local_folder(spec)


def local_folder(text: str) -> str:
    """A folder given on the command line, in the one spelling the data layer uses."""
    if not text:
        return text  # left as given, so the error names what was typed
    try:
        return str(Path(text).expanduser().resolve())
    except (RuntimeError, OSError) as exc:  # a symbolic link loop (RuntimeError before 3.13)
        raise UsageError(f"--data {text}: cannot follow it ({exc}); give a folder") from None


# --------------------------------------------------------------------------- streamed splits

def streamed_split(spec: str, *, image_size: int, classes: int | None, val_fraction: float,
                   cache_dir: str | Path | None = None, progress: Progress | None = None,
                   stop_signal: Callable[[], int | None] = lambda: None,
                   strict: bool = False) -> DataSplit:
    """`--data SPEC` for an ImageFolder, cifar10:DIR or synthetic:N, streamed from its cache."""
    if not spec.startswith("cifar10:"):
        if classes is not None:
            raise UsageError("--classes applies to cifar10: data only; leave it out")
        if not 0.0 < val_fraction < 1.0:
            raise UsageError(f"--val-fraction {val_fraction}: give a value between 0 and 1")
    source = source_for(spec, image_size)
    if isinstance(source, Cifar10Source):
        if classes is not None and not 2 <= classes <= len(source.classes):
            raise UsageError(f"--classes {classes}: give a number from 2 to {len(source.classes)}")
        if not 0.0 < val_fraction < 1.0 and not source.val_files:
            raise UsageError(f"--val-fraction {val_fraction}: give a value between 0 and 1")
    cache, every = open_cache(source, cache_dir, progress, stop_signal)
    summary = cache.summary()
    if summary is not None and strict:
        raise UsageError(f"--strict-data: {summary}; replace or remove those files, or leave "
                         "out --strict-data to train without them")
    counts = torch.bincount(every.labels, minlength=len(source.classes))
    empty = [name for name, count in zip(source.classes, counts.tolist()) if count == 0]
    if empty:
        raise UsageError(f"--data {spec}: class(es) {', '.join(map(repr, empty))} have no "
                         f"usable image; {summary or 'add images'}")
    if isinstance(source, Cifar10Source):
        return _cifar10_split(source, cache, every, classes, val_fraction)
    train_idx, val_idx = stratified_split(every.labels, val_fraction)
    return DataSplit(every.subset(train_idx), every.subset(val_idx), source.name)


def _cifar10_split(source: Cifar10Source, cache: CacheFile, every: StreamedImageSet,
                   classes: int | None, val_fraction: float) -> DataSplit:
    n_train = cache.header["extra"]["train_images"]
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


def data_notes(split: DataSplit) -> list[str]:
    """What the user should know about the data: files skipped (naming their list), images
    converted to RGB. Empty for the embedded set."""
    return image_notes(split.train)


def image_notes(images: ImageSet) -> list[str]:
    """`data_notes` for a set of images alone (what `hybriddl tune` measures on)."""
    cache = getattr(images.images, "cache", None)
    if not isinstance(cache, CacheFile):
        return []
    return [line for line in (cache.summary(), cache.converted()) if line]


def data_repairs(split: DataSplit) -> list[str]:
    """One line per cache row found damaged since loading, and rebuilt from its file."""
    cache = _cache_of(split)
    return list(cache.repairs) if cache else []


def _cache_of(split: DataSplit) -> CacheFile | None:
    cache = getattr(split.train.images, "cache", None)
    return cache if isinstance(cache, CacheFile) else None

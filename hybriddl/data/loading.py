"""`--data SPEC`, whatever it names: the embedded set in memory, everything else streamed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybriddl.data import DataSplit, Progress, synthetic_split
from hybriddl.data.cache import streamed_split
from hybriddl.errors import UsageError


def load_data(spec: str, *, variant: str, image_size: int, classes: int | None = None,
              val_fraction: float = 0.2, progress: Progress | None = None,
              cache_dir: str | None = None,
              stop_signal: Callable[[], int | None] = lambda: None) -> DataSplit:
    """Load `--data SPEC`: "synthetic", "synthetic:N", "cifar10:DIR" or an ImageFolder.

    All but the embedded "synthetic" are streamed from a cache in `cache_dir` (built
    first when needed; see hybriddl.data.cache for `stop_signal`).
    """
    spec = settled_spec(spec)
    if spec == "synthetic":
        if classes is not None:
            raise UsageError("--classes applies to cifar10: data only; leave it out")
        split = synthetic_split(variant, progress=progress)
    else:
        split = streamed_split(spec, image_size=image_size, classes=classes,
                               val_fraction=val_fraction, cache_dir=cache_dir,
                               progress=progress, stop_signal=stop_signal)
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
    return str(Path(text).expanduser().resolve())

"""Data sources, the train/validation split, and the deterministic batch stream.

Every source ends up as an `ImageSet`: uint8 images plus labels. The embedded set is
held in memory; every other source is streamed from its cache file on disk
(hybriddl.data.cache), so its size is bounded by the disk, not by RAM. The
paper's preprocessing is applied per batch by `BatchTransform` (scale to the model's
size, horizontal flip, normalisation, float tensor). The flip of each sample is drawn
from the seed and the epoch *before* a global batch is cut into host or worker
parts, so no strategy and no host count can change what a step sees.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms import v2

from hybriddl.data.sharding import split_bounds
from hybriddl.errors import UsageError
from hybriddl.usecases import RGB_MEAN, RGB_STD

Progress = Callable[[int, int], None]  # (done, total)

# Embedded data: (train images per class, validation images per class, native pixels).
SYNTHETIC_VARIANTS = {"small": (160, 40, 64), "big": (800, 100, 64)}
SYNTHETIC_CLASSES = ["fire", "smoke", "clear"]


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, N x 3 x H x W
    labels: torch.Tensor  # int64, N
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: torch.Tensor) -> ImageSet:
        return ImageSet(self.images[indices], self.labels[indices], self.classes)


@dataclass
class DataSplit:
    train: ImageSet
    val: ImageSet
    source: str

    @property
    def classes(self) -> list[str]:
        return self.train.classes


# --------------------------------------------------------------------------- sources

def synthetic_split(variant: str, *, progress: Progress | None = None) -> DataSplit:
    """The embedded, procedurally generated 3-class set (fire / smoke / clear scenes).

    The paper's fire and smoke images are not public; these stand in for them: the same
    number of classes, colour and texture cues of the same kind, learnable, and the same
    bytes on every machine (each image is drawn from its own index-seeded generator).
    """
    if variant not in SYNTHETIC_VARIANTS:
        raise UsageError(f"unknown synthetic variant {variant!r}: use one of "
                         f"{', '.join(SYNTHETIC_VARIANTS)}")
    per_class_train, per_class_val, size = SYNTHETIC_VARIANTS[variant]
    per_class = per_class_train + per_class_val
    total = per_class * len(SYNTHETIC_CLASSES)
    images = torch.empty(total, 3, size, size, dtype=torch.uint8)
    labels = torch.empty(total, dtype=torch.int64)
    for index in range(total):
        label = index % len(SYNTHETIC_CLASSES)
        images[index] = torch.from_numpy(render_synthetic(label, index, size))
        labels[index] = label
        if progress and ((index + 1) % 64 == 0 or index + 1 == total):
            progress(index + 1, total)
    n_val = per_class_val * len(SYNTHETIC_CLASSES)
    every = ImageSet(images, labels, list(SYNTHETIC_CLASSES))
    return DataSplit(every.subset(torch.arange(n_val, total)), every.subset(torch.arange(n_val)),
                     f"synthetic:{variant}")


def render_synthetic(label: int, index: int, size: int) -> np.ndarray:
    """One 3 x size x size uint8 image of class `label`, fully determined by `index`."""
    rng = np.random.default_rng([20220510, index])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    # A landscape-like background: vertical gradient between two random dull colours.
    top, bottom = rng.uniform(0.1, 0.6, 3), rng.uniform(0.1, 0.6, 3)
    image = top[:, None, None] * (1 - yy) + bottom[:, None, None] * yy
    blobs = np.zeros((size, size), np.float32)
    for _ in range(rng.integers(1, 4)):
        cx, cy = rng.uniform(0.2, 0.8, 2)
        radius = rng.uniform(0.08, 0.25)
        blobs += np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * radius ** 2))
    blobs = np.clip(blobs, 0, 1)
    if label == 0:  # fire: bright, saturated warm glow with flickering texture
        flicker = 0.75 + 0.25 * np.sin(rng.uniform(20, 40) * yy + rng.uniform(0, 6.3))
        colour = np.array([1.0, rng.uniform(0.3, 0.7), rng.uniform(0.0, 0.15)], np.float32)
        glow = blobs * flicker
        image = image * (1 - glow) + colour[:, None, None] * glow
    elif label == 1:  # smoke: wide, grey, low-contrast haze
        haze = np.clip(blobs * rng.uniform(0.6, 0.9) + 0.2 * rng.random((size, size)), 0, 1)
        grey = rng.uniform(0.55, 0.8)
        image = image * (1 - haze) + grey * haze
    # label 2, clear: the background alone.
    image = image + rng.normal(0, 0.04, image.shape)
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def stratified_split(labels: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same validation share from every class; fixed generator so the split never moves."""
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--val-fraction {val_fraction}: give a value between 0 and 1")
    generator = torch.Generator().manual_seed(0)
    train, val = [], []
    for label in labels.unique(sorted=True):
        members = torch.nonzero(labels == label).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_val = int(round(len(members) * val_fraction))
        if len(members) >= 2:
            n_val = min(max(n_val, 1), len(members) - 1)
        val.append(members[:n_val])
        train.append(members[n_val:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


# --------------------------------------------------------------------------- batches

class BatchTransform:
    """The paper's preprocessing on a whole batch: scale, flip, normalise, float tensor."""

    def __init__(self, image_size: int):
        self.image_size = image_size
        self.mean = torch.tensor(RGB_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(RGB_STD).view(1, 3, 1, 1)
        # (mean, std) per device, copied there once: a copy per batch made the host wait.
        self._normalisation = {self.mean.device: (self.mean, self.std)}

    def normalisation(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) on `device`."""
        if device not in self._normalisation:
            self._normalisation[device] = (self.mean.to(device), self.std.to(device))
        return self._normalisation[device]

    def __call__(self, images: torch.Tensor, flips: torch.Tensor | None = None) -> torch.Tensor:
        """The batch on `images`' device (uint8 rows copied to a GPU are augmented there)."""
        if images.shape[-1] != self.image_size or images.shape[-2] != self.image_size:
            images = v2.functional.resize(images, [self.image_size, self.image_size],
                                          antialias=True)
        if flips is not None and bool(flips.any()):
            flips = flips.to(images.device, non_blocking=True)
            images = torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images)
        mean, std = self.normalisation(images.device)
        return (images.float().div_(255.0) - mean) / std


@dataclass(frozen=True)
class GlobalBatch:
    """The samples of one optimizer step over all hosts, with their augmentation."""

    step: int  # index within the epoch
    indices: torch.Tensor
    flips: torch.Tensor

    def part(self, start: int, stop: int) -> GlobalBatch:
        return GlobalBatch(self.step, self.indices[start:stop], self.flips[start:stop])


@dataclass(frozen=True)
class HostShare:
    """One host's part of one global batch, decided once per step.

    The prefetcher loads `part`'s samples and the averaging weighs the host's gradient
    by samples / global_samples, both from this one value, so they cannot disagree.
    """

    batch: GlobalBatch
    part: GlobalBatch

    @classmethod
    def of(cls, batch: GlobalBatch, weights: list[float], rank: int) -> HostShare:
        """Rank `rank`'s slice of `batch`, proportional to its weight among `weights`."""
        start, stop = split_bounds(len(batch.indices), weights)[rank]
        return cls(batch, batch.part(start, stop))

    @classmethod
    def whole(cls, batch: GlobalBatch) -> HostShare:
        """The share of a host that is alone."""
        return cls(batch, batch)

    @property
    def samples(self) -> int:
        return len(self.part.indices)

    @property
    def global_samples(self) -> int:
        return len(self.batch.indices)


def epoch_batches(n_samples: int, batch_size: int, seed: int, epoch: int) -> list[GlobalBatch]:
    """The epoch's global batches: a seeded shuffle and per-sample flips, last batch short."""
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: give at least 1")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n_samples, generator=generator)
    flips = torch.rand(n_samples, generator=generator) < 0.5
    return [GlobalBatch(step, order[i:i + batch_size], flips[i:i + batch_size])
            for step, i in enumerate(range(0, n_samples, batch_size))]


def steps_per_epoch(n_samples: int, batch_size: int) -> int:
    return -(-n_samples // batch_size)


class BatchPrefetcher:
    """Assembles the next batches in a background thread so the step never waits on data.

    Iterating yields (HostShare, x, y): `share(batch)` says which part of each global
    batch is this host's, and x, y are that part's samples: its uint8 rows and labels
    gathered by `rows(source, indices)` (a GPU strategy gathers them into pinned memory),
    x made from the rows by `prepare(rows, flips, transform)` (by default the transform on
    the CPU; a GPU strategy copies the rows to its device and augments them there while the
    step before computes). `wait_seconds` adds up the time the training loop spent blocked
    here (the metric `data_wait_seconds`).
    """

    def __init__(self, images: ImageSet, batches: list[GlobalBatch], transform: BatchTransform,
                 share: Callable[[GlobalBatch], HostShare] = HostShare.whole, depth: int = 2,
                 prepare: Callable[[torch.Tensor, torch.Tensor, BatchTransform], torch.Tensor]
                 = lambda images, flips, transform: transform(images, flips),
                 rows: Callable[[object, torch.Tensor], torch.Tensor]
                 = lambda source, indices: source[indices]):
        self._images, self._batches, self._transform = images, batches, transform
        self._share, self._prepare, self._rows = share, prepare, rows
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._produce, name="hybriddl-prefetch",
                                        daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for batch in self._batches:
                share = self._share(batch)
                mine = share.part
                x = self._prepare(self._rows(self._images.images, mine.indices), mine.flips,
                                  self._transform)
                if not self._offer((share, x, self._rows(self._images.labels, mine.indices))):
                    return
            self._offer(None)
        except BaseException as exc:  # re-raised in the consumer, never lost in a thread
            self._offer(exc)

    def _offer(self, item) -> bool:
        """Queue `item` unless the consumer stopped listening (then never block on it)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[HostShare, torch.Tensor, torch.Tensor]]:
        while True:
            started = time.perf_counter()
            item = self._queue.get()
            self.wait_seconds += time.perf_counter() - started
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe(split: DataSplit) -> dict:
    return {"source": split.source, "classes": split.classes, "train_images": len(split.train),
            "val_images": len(split.val), "stored_size": list(split.train.images.shape[-2:])}

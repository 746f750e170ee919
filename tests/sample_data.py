"""Small data sets on disk, in the formats users bring: ImageFolder trees and CIFAR-10 batches."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                 "ship", "truck"]


class Python2Pickler(pickle._Pickler):
    """Pickles str and bytes as Python 2 byte strings, as the CIFAR-10 batches were written.

    Their keys (b'data', b'labels', b'label_names' under encoding='bytes') and numpy's
    array buffer are Python 2 str; torchvision reads them with encoding='latin1'.
    """

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_string(self, value: str | bytes) -> None:
        raw = value.encode("latin1") if isinstance(value, str) else value
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + len(raw).to_bytes(4, "little") + raw)
        self.memoize(value)

    # numpy's raw array buffer was a Python 2 str too.
    dispatch[str] = save_py2_string
    dispatch[bytes] = save_py2_string


def write_python2_pickle(path: Path, obj) -> None:
    with open(path, "wb") as handle:
        Python2Pickler(handle, protocol=2).dump(obj)


def cifar_batch(labels: list[int], seed: int) -> dict:
    """A batch in CIFAR-10's layout: uint8 N x 3072 rows (1024 R, 1024 G, 1024 B, row-major)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8)
    return {"batch_label": f"batch {seed}", "labels": list(labels), "data": data,
            "filenames": [f"img_{seed}_{i}.png" for i in range(len(labels))]}


def write_cifar10(root: Path, *, train_batches: int = 2, per_batch: int = 30, test: int = 20,
                  with_test: bool = True) -> dict[str, dict]:
    """root/cifar-10-batches-py with data_batch_1..N, test_batch and batches.meta."""
    folder = root / CIFAR_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    batches = {}
    for number in range(1, train_batches + 1):
        batches[f"data_batch_{number}"] = cifar_batch(
            [(i + number) % 10 for i in range(per_batch)], seed=number)
    if with_test:
        batches["test_batch"] = cifar_batch([i % 10 for i in range(test)], seed=100)
    for name, batch in batches.items():
        write_python2_pickle(folder / name, batch)
    write_python2_pickle(folder / "batches.meta", {"label_names": list(CIFAR_CLASSES),
                                                   "num_cases_per_batch": per_batch,
                                                   "num_vis": 3072})
    return batches


def write_image(path: Path, size: tuple[int, int], colour, mode: str = "RGB") -> Path:
    """A plain image of `size` (width, height); the suffix picks PNG or JPEG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def write_imagefolder(root: Path, per_class: int = 5,
                      classes: dict[str, tuple[int, int, int]] | None = None) -> Path:
    """One subfolder per class of PNG and JPEG files of several sizes, in a plain colour."""
    classes = classes or {"fire": (230, 80, 10), "smoke": (150, 150, 150)}
    sizes = [(40, 30), (30, 40), (64, 64), (17, 23), (100, 20)]
    for name, colour in classes.items():
        for i in range(per_class):
            suffix = ".png" if i % 2 == 0 else ".jpg"
            write_image(root / name / f"{i}{suffix}", sizes[i % len(sizes)], colour)
    return root


def write_tinted_classes(root: Path, per_class: int = 6, size: int = 32) -> Path:
    """3 classes of noise tinted by class colour: learnable, instant to load."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(["fire", "smoke", "clear"]):
        (root / name).mkdir()
        for i in range(per_class):
            pixels = (rng.random((size, size, 3)) * 120).astype(np.uint8)
            pixels[..., label] += 100
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def write_saturated_classes(root: Path, seed: int = 1, per_class: int = 8) -> Path:
    """fire/smoke/clear, `per_class` random 24 px images each with one channel saturated
    (3 x 8 = 24 images: batches of 8, 8 and a short one after the validation split)."""
    import torch
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    for label, name in enumerate(("fire", "smoke", "clear")):
        (root / name).mkdir()
        for i in range(per_class):
            pixels = torch.randint(0, 256, (24, 24, 3), generator=generator, dtype=torch.uint8)
            pixels[..., label] = 255
            Image.fromarray(pixels.numpy()).save(root / name / f"{i}.png")
    return root

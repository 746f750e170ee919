"""Image files read as training saw them, and the image files under folders."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

from hybriddl.errors import UsageError


class ImageReader:
    """Decodes a file to a 3 x S x S uint8 tensor: RGB, shorter side scaled to S,
    centre-cropped, as the data cache stores an ImageFolder's images for training."""

    def __init__(self, image_size: int):
        self._scale = v2.Compose([v2.PILToTensor(), v2.Resize(image_size, antialias=True),
                                  v2.CenterCrop(image_size)])

    def read(self, path: Path) -> torch.Tensor:
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise UsageError(f"{path} is not an image PIL can read ({type(exc).__name__}): "
                             "remove it or give image files only") from None
        return self._scale(rgb)

    def read_batch(self, paths: list[Path]) -> torch.Tensor:
        return torch.stack([self.read(path) for path in paths])


def is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMG_EXTENSIONS


def image_files(paths: Iterable[str | Path]) -> Iterator[Path]:
    """Every file named, and every image file (by its extension) under every folder named,
    in sorted order, found as they are needed: a folder of millions is never listed whole
    in memory, only one directory's names at a time."""
    for path in map(Path, paths):
        if path.is_dir():
            yield from _images_under(path)
        else:
            yield path


def check_exist(paths: Iterable[str | Path]) -> None:
    """Before any output: every path names a file or a folder."""
    for path in map(Path, paths):
        if not path.exists():
            raise UsageError(f"{path}: no such file or folder; give image files or folders "
                             "of images")


def _images_under(folder: Path) -> Iterator[Path]:
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if is_image_name(Path(name)):
                yield Path(top) / name

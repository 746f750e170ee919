"""Image files read as training saw them, and the image files under folders."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS

from hybriddl.data.images import UnusableImage, open_rgb, square_scaler
from hybriddl.errors import UsageError


class ImageReader:
    """Decodes a file to a 3 x S x S uint8 tensor exactly as the data cache decodes an
    ImageFolder's images for training (data/images.py: modes converted, 16-bit scaled,
    decompression bombs refused; shorter side scaled to S, centre-cropped)."""

    def __init__(self, image_size: int):
        self._scale = square_scaler(image_size)

    def read(self, path: Path) -> torch.Tensor:
        try:
            rgb, _ = open_rgb(path)
        except UnusableImage as exc:
            raise UsageError(f"{path}: {exc}; remove it or give image files only") from None
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
        if path.is_dir() and next(_images_under(path), None) is None:
            raise UsageError(f"{path}: no image files in this folder or below it; give image "
                             "files or folders of images")


def check_headers(paths: Iterable[str | Path]) -> None:
    """Before anything goes to stdout, where no row can be taken back: every image's header
    is read (its format and size, not its pixels), so that a file that is no image, or one
    too large to decode, is refused before the first row. Pixels damaged behind a sound
    header still stop the stream at that file (--output writes whole or not at all)."""
    for path in image_files(paths):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with open(path, "rb") as handle, Image.open(handle):
                    pass
        except Image.UnidentifiedImageError:
            raise UsageError(f"{path}: not an image file PIL can identify; remove it or give "
                             "image files only") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise UsageError(f"{path}: too many pixels, not decoded (PIL's "
                             f"Image.MAX_IMAGE_PIXELS is {Image.MAX_IMAGE_PIXELS:,}); remove "
                             "it or give image files only") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise UsageError(f"{path}: its header cannot be read ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else 'no reason given'}"
                             "); remove it or give image files only") from None


def _images_under(folder: Path) -> Iterator[Path]:
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if is_image_name(Path(name)):
                yield Path(top) / name

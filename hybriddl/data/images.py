"""Image files to RGB: what can be converted is, what cannot is named with its reason.

A real folder of photos holds greyscale scans, CMYK JPEGs from print workflows, PNGs with
alpha or a palette, 16-bit scientific images, and files that are no image at all. The
cache build goes through all of them in one pass: an image that can be converted to RGB
is (and its original mode counted), a file that cannot is reported as `UnusableImage`
with the reason, for the list the build keeps, and the build goes on.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import numpy as np
import torchvision
from PIL import Image
from torchvision.transforms import v2
from torchvision.datasets.folder import has_file_allowed_extension

from hybriddl.errors import UsageError


class UnusableImage(Exception):
    """A file that cannot become an RGB image; the message is the reason, for the list."""


# PIL opens 16-bit greyscale PNG and TIFF files as I;16 (older Pillow and some TIFFs as I).
# Its convert("RGB") clips those samples at 255, so nearly every pixel turns white: they are
# scaled to 8 bits here instead.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def open_rgb(path: str | Path) -> tuple[Image.Image, str | None]:
    """The file's first frame as an RGB image, and the mode it was converted from (None
    when it was RGB already); UnusableImage with the reason when that is impossible.

    Images with more pixels than PIL's decompression-bomb limit (Image.MAX_IMAGE_PIXELS)
    are refused from their header, before anything is decoded: a 100,000 x 100,000 PNG
    of a few kilobytes would otherwise take 30 GB.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise UnusableImage(f"broken symbolic link to {os.readlink(path)}") from None
        raise UnusableImage("the file disappeared while the folder was read") from None
    except OSError as exc:
        raise UnusableImage(f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        # Opening a FIFO named like an image would wait forever for a writer.
        raise UnusableImage("not a regular file")
    try:
        with warnings.catch_warnings():
            # PIL warns about what it repairs or ignores (EXIF, palette transparency):
            # library code does not print, and the image is still usable.
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with open(path, "rb") as handle, Image.open(handle) as image:
                image.load()
                mode = image.mode
                rgb = _to_rgb(image)
    except UnusableImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UnusableImage(f"too many pixels, not decoded: {_first_line(exc)} "
                            f"(PIL's Image.MAX_IMAGE_PIXELS is {Image.MAX_IMAGE_PIXELS:,})") from None
    except PermissionError:
        raise UnusableImage("cannot be read (permission denied)") from None
    except Image.UnidentifiedImageError:
        raise UnusableImage("not an image file PIL can identify") from None
    except MemoryError:
        raise UnusableImage("too large to decode in the memory available") from None
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ValueError...)
        raise UnusableImage(f"damaged image data ({type(exc).__name__}: {_first_line(exc)})") \
            from None
    return rgb, None if mode == "RGB" else mode


def square_scaler(image_size: int) -> v2.Compose:
    """An RGB image to a 3 x S x S uint8 tensor: shorter side scaled to S, centre-cropped.
    How the cache stores an image folder's images, and how `evaluate`/`predict` read a
    file: a model sees a file the same way in training and in use."""
    return v2.Compose([v2.PILToTensor(), v2.Resize(image_size, antialias=True),
                       v2.CenterCrop(image_size)])


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image.copy()  # the file closes when open_rgb returns
    if image.mode in SIXTEEN_BIT_MODES:
        samples = np.asarray(image).astype(np.int64).clip(0, 65535)
        grey = ((samples + 128) // 257).astype(np.uint8)  # 65535 -> 255, rounded
        return Image.fromarray(grey, mode="L").convert("RGB")
    if image.mode == "F":
        raise UnusableImage("32-bit floating-point pixels have no agreed range to scale to "
                            "8 bits; save the image as 8 or 16 bits per sample")
    try:
        # Alpha is dropped, not composited, as torchvision's loader and `hybriddl predict`
        # do: an image must read the same in training and in use.
        return image.convert("RGB")
    except ValueError:
        raise UnusableImage(f"PIL cannot convert mode {image.mode} to RGB") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else "no message"


class CheckedImageFolder(torchvision.datasets.ImageFolder):
    """torchvision's ImageFolder, with a walk that follows each folder once.

    torchvision walks with followlinks=True and no loop check: a link back to a parent
    folder made it list the same images again at every level, until the path grew too long
    (40 copies of every image, silently). Here a folder already read is not read again and
    becomes a line of `problems` (as does a folder that cannot be listed); a class left with
    no image file is refused with one line.
    """

    def __init__(self, root: str):
        self.problems: list[tuple[str, str]] = []  # (path, reason), set before the walk
        super().__init__(root, allow_empty=True)
        counts = np.bincount(self.targets, minlength=len(self.classes))
        empty = [name for name, count in zip(self.classes, counts) if count == 0]
        if empty:
            raise UsageError(f"--data {root}: class folder(s) {', '.join(map(repr, empty))} "
                             f"hold no image file (by extension: {' '.join(self.extensions)}); "
                             "add images there or remove the folder(s)")

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None,
                     allow_empty=False):
        samples = []
        for name in sorted(class_to_idx):
            entries = []
            for top, dirs, files in self._walk(os.path.join(directory, name)):
                entries.append((top, files))
            # torchvision's order (folders sorted by path, files by name): a cache or a
            # checkpoint's sample indices stay those of a plain ImageFolder.
            for top, files in sorted(entries):
                for file in sorted(files):
                    if has_file_allowed_extension(file, extensions):
                        samples.append((os.path.join(top, file), class_to_idx[name]))
        return samples

    def _walk(self, folder: str):
        def unlistable(exc: OSError) -> None:
            self.problems.append((str(exc.filename), f"folder cannot be listed ({exc.strerror})"))

        seen: dict[tuple[int, int], str] = {}
        for top, dirs, files in os.walk(folder, followlinks=True, onerror=unlistable):
            info = os.stat(top)
            seen.setdefault((info.st_dev, info.st_ino), top)
            dirs.sort()  # the first of two links to one folder is the one read, every time
            for name in list(dirs):
                path = os.path.join(top, name)
                try:
                    info = os.stat(path)
                except OSError as exc:
                    self.problems.append((path, f"folder cannot be read ({exc.strerror})"))
                    dirs.remove(name)
                    continue
                first = seen.get((info.st_dev, info.st_ino))
                if first is not None:
                    loop = os.path.commonpath([first, path]) == first
                    what = "symlink loop back to" if loop else "same folder as"
                    self.problems.append((path, f"{what} {first}: not read again"))
                    dirs.remove(name)
                else:
                    seen[(info.st_dev, info.st_ino)] = path
            yield top, dirs, files

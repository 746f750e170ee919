"""Write a real image set as an ImageFolder: scikit-learn's handwritten digits.

The accuracy benchmarks need real images, not the embedded procedurally generated set,
and this machine reaches no data set hub. scikit-learn ships the UCI optical-recognition
handwritten digits inside its wheel: 1,797 scanned digits of 43 writers, 8 x 8 pixels,
16 grey levels, 10 classes. Each becomes a PNG (grey level scaled to 0-255, RGB, enlarged
with nearest-neighbour so the pixels stay the scanned ones) in `OUT/<digit>/NNNN.png`;
hybriddl's `--data OUT` reads it like any ImageFolder and scales it to `--image-size`.

    pip install scikit-learn
    python scripts/digits_imagefolder.py /tmp/digits
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def write_digits(out: Path, size: int = 32) -> int:
    """The digits as PNG files under `out`, one folder per class; returns the count."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    scale = 255.0 / digits.images.max()
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        folder = out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        grey = Image.fromarray(np.round(image * scale).astype(np.uint8), mode="L")
        grey.resize((size, size), Image.NEAREST).convert("RGB").save(folder / f"{index:04d}.png")
    return len(digits.target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (must not hold images yet)")
    parser.add_argument("--size", type=int, default=32, help="side in pixels (default 32)")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"digits_imagefolder: {args.out} is not empty; name a new folder",
              file=sys.stderr)
        return 2
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print("digits_imagefolder: scikit-learn is not installed; run `pip install "
              "scikit-learn` first", file=sys.stderr)
        return 2
    count = write_digits(args.out, args.size)
    print(f"{count} images in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

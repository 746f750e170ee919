"""A finished run's model, rebuilt from its run directory: what evaluate and predict use."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hybriddl.data import BatchTransform
from hybriddl.errors import UsageError
from hybriddl.rundir import CHECKPOINT, MODEL, load_metrics
from hybriddl.run.weights import read_state_dict
from hybriddl.usecases import build_model


@dataclass
class TrainedModel:
    """The model of RUN_DIR in eval mode, the class names of its outputs, its image size."""

    run_dir: Path
    model_name: str
    model: nn.Module
    classes: list[str]
    image_size: int

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """N x classes softmax probabilities for N x 3 x S x S uint8 images."""
        with torch.inference_mode():
            return torch.softmax(self.model(self._transform(images)), dim=1)

    @property
    def _transform(self) -> BatchTransform:
        if getattr(self, "_batch_transform", None) is None:
            self._batch_transform = BatchTransform(self.image_size)
        return self._batch_transform


def load_trained(run_dir: str | Path) -> TrainedModel:
    """The model a run trained, from its metrics.json config and model.pt."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such directory; give the run directory of a "
                         "finished 'hybriddl train'")
    metrics = load_metrics(run_dir)
    config = metrics.get("config", {}) if isinstance(metrics, dict) else {}
    try:
        model_name, image_size = config["model"], int(config["image_size"])
        classes = [str(name) for name in config["data"]["classes"]]
    except (KeyError, TypeError, ValueError):
        image_size = 0
    if image_size < 1:
        raise UsageError(f"{run_dir}/metrics.json has no model, image size or class names in "
                         "its config: give a run directory made by 'hybriddl train'")
    if not (run_dir / MODEL).is_file():
        resume = (f"; it was interrupted: finish it with hybriddl train --resume {run_dir}"
                  if (run_dir / CHECKPOINT).is_file() else "")
        raise UsageError(f"{run_dir} has no {MODEL}, so no trained model to use{resume}")
    model = build_model(model_name, len(classes), config.get("dropout"))
    state = read_state_dict(run_dir / MODEL, flag="run")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError:
        raise UsageError(f"{run_dir}/{MODEL} does not fit a {model_name} for {len(classes)} "
                         "classes, as its metrics.json says: the run directory is damaged "
                         "or mixed with another run's") from None
    model.eval()
    return TrainedModel(run_dir, model_name, model, classes, image_size)


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of `size` items (the last may be shorter), taking only one list at a time."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

"""Weights from a file: a run's model.pt, or any torchvision state_dict (`train --weights`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from hybriddl.errors import UsageError
from hybriddl.run.checkpoint import load_state_dict_file


def read_state_dict(path: str | Path, flag: str = "--weights") -> dict[str, torch.Tensor]:
    """The state_dict in `path`, or a one-line UsageError saying why it cannot be used.

    weights_only: a .pt file from elsewhere is a pickle, and a pickle can run code.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file; give a state_dict such as a run's model.pt")
    return load_state_dict_file(path)  # no code in the file runs; one line if unusable


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_start_weights(model: nn.Module, path: str | Path, num_classes: int) -> dict:
    """Load `path` into `model` (freshly built for `num_classes`); returns the record the
    run keeps: file, sha256, and the head replaced, if any.

    A file made for another class count differs only in the final classifier layer; that
    layer keeps the model's fresh initialisation (fine-tuning on new classes), every other
    tensor must fit exactly.
    """
    state = read_state_dict(path)
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unknown or missing:
        raise UsageError(f"--weights {path} does not fit this model: {_some(unknown)} of the "
                         f"file have no place in it, {_some(missing)} of the model are not in "
                         "the file; give the weights of the same --model")
    different = sorted(name for name in own if own[name].shape != state[name].shape)
    head = replaced_head(different, own, state, num_classes)
    if different and head is None:
        shapes = ", ".join(f"{name} {tuple(state[name].shape)} vs {tuple(own[name].shape)}"
                           for name in different[:2])
        raise UsageError(f"--weights {path} does not fit this model: {len(different)} tensors "
                         f"differ in shape beyond the final classifier layer ({shapes}); give "
                         "the weights of the same --model")
    model.load_state_dict({name: value for name, value in state.items()
                           if name not in different}, strict=not different)
    record = {"file": str(path), "sha256": file_sha256(path), "replaced_head": None}
    if head is not None:
        record["replaced_head"] = {"layer": head, "file_classes": int(state[different[0]].shape[0]),
                                   "classes": num_classes}
    return record


def replaced_head(different: list[str], own: dict, state: dict, num_classes: int) -> str | None:
    """The final classifier layer's name when it is all that differs, and only in its
    class count (e.g. squeezenet's classifier.1, vgg16's classifier.6); else None."""
    layers = {name.rsplit(".", 1)[0] for name in different}
    if len(layers) != 1:
        return None
    return layers.pop() if all(
        own[name].shape[0] == num_classes and state[name].shape[1:] == own[name].shape[1:]
        for name in different) else None


def _some(names: list[str]) -> str:
    if not names:
        return "no tensors"
    return f"{len(names)} tensors (e.g. {names[0]})"

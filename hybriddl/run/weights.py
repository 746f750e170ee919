"""Weights to start from (`train --weights`): a state_dict file (a run's model.pt, any
torchvision state_dict), or weights torchvision lists for the model, named as torchvision
names them (`DEFAULT`, `IMAGENET1K_V1`, `AlexNet_Weights.IMAGENET1K_V1`) and read from torch's
cache, where torchvision's own `weights.get_state_dict()` keeps them."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from hybriddl.errors import UsageError
from hybriddl.run.resumption import load_state_dict_file


def read_state_dict(path: str | Path, flag: str = "--weights") -> dict[str, torch.Tensor]:
    """The state_dict in `path`, or a one-line UsageError saying why it cannot be used.

    weights_only: a .pt file from elsewhere is a pickle, and a pickle can run code.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file; give a state_dict such as a run's model.pt")
    return load_state_dict_file(path)  # no code in the file runs; one line if unusable


# Seconds a download of named weights may wait on the network before it counts as offline
# (urllib waits forever by default; a cluster's compute node often has no route out).
DOWNLOAD_TIMEOUT_SECONDS = 30
# What a --weights value that names no existing file ends with when it is meant as a file.
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def is_weights_name(value: str) -> bool:
    """Whether `--weights value` names torchvision weights rather than a file: it is no
    existing file and has neither a folder nor a file's suffix."""
    path = Path(value).expanduser()
    return not (path.exists() or len(path.parts) > 1 or value.startswith(("~", "."))
                or path.suffix.lower() in FILE_SUFFIXES)


def named_weights(model_name: str, value: str):
    """The torchvision weights enum member `value` names for `model_name` (a member name,
    `DEFAULT`, or `<Model>_Weights.<member>`), or a one-line UsageError listing them."""
    try:
        listed = torchvision.models.get_model_weights(model_name)
    except (ValueError, KeyError):
        listed = None
    members = list(listed) if listed is not None else []
    if not members:
        raise UsageError(f"--weights {value}: torchvision lists no weights for {model_name}; "
                         "give a state_dict file")
    prefix, _, member = value.rpartition(".")
    weights = None
    if not prefix or prefix.lower() == listed.__name__.lower():
        weights = listed.__members__.get(member.upper())
    if weights is None:
        names = ", ".join(["DEFAULT", *(w.name for w in members)])
        raise UsageError(f"--weights {value}: neither a file nor weights torchvision lists for "
                         f"{model_name}; give one of {names} (or as {listed.__name__}.NAME), "
                         "or a state_dict file's path")
    return weights


def cached_weights_file(weights, asked: str | None = None) -> Path:
    """Where torch's cache keeps `weights` (TORCH_HOME's hub/checkpoints, as
    torch.hub.load_state_dict_from_url names it), downloaded first if it is missing.
    Offline and missing: a one-line UsageError naming the file to place and where."""
    directory = Path(torch.hub.get_dir()) / "checkpoints"
    path = directory / Path(urlparse(weights.url).path).name
    if path.is_file():
        return path  # no network touched
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_SECONDS)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(weights.url, str(path), progress=False)
    except (OSError, RuntimeError) as exc:
        reason = str(getattr(exc, "reason", None) or exc).strip() or type(exc).__name__
        named = str(weights) if asked in (None, str(weights)) else f"{asked} ({weights})"
        raise UsageError(f"--weights {named}: {path.name} is not in torch's cache and could not "
                         f"be downloaded ({reason}); place it (from {weights.url}) in "
                         f"{directory}, or set TORCH_HOME to where it is") from None
    finally:
        socket.setdefaulttimeout(previous)
    return path


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_start_weights(model: nn.Module, value: str | Path, num_classes: int,
                       model_name: str | None = None) -> dict:
    """Load `value` (a file, or torchvision weights named for `model_name`) into `model`
    (freshly built for `num_classes`); returns the record the run keeps: the weights' name
    (None for a file), file, sha256, and the head replaced, if any.

    A file made for another class count differs only in the final classifier layer; that
    layer keeps the model's fresh initialisation (fine-tuning on new classes), every other
    tensor must fit exactly.
    """
    name = None
    path = Path(value)
    if model_name is not None and is_weights_name(str(value)):
        weights = named_weights(model_name, str(value))
        name, path = str(weights), cached_weights_file(weights, str(value))
    state = read_state_dict(path)
    shown = value if name else path
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unknown or missing:
        raise UsageError(f"--weights {shown} does not fit this model: {_some(unknown)} of the "
                         f"file have no place in it, {_some(missing)} of the model are not in "
                         "the file; give the weights of the same --model")
    different = sorted(name for name in own if own[name].shape != state[name].shape)
    head = replaced_head(different, own, state, num_classes)
    if different and head is None:
        shapes = ", ".join(f"{name} {tuple(state[name].shape)} vs {tuple(own[name].shape)}"
                           for name in different[:2])
        raise UsageError(f"--weights {shown} does not fit this model: {len(different)} tensors "
                         f"differ in shape beyond the final classifier layer ({shapes}); give "
                         "the weights of the same --model")
    model.load_state_dict({name: value for name, value in state.items()
                           if name not in different}, strict=not different)
    record = {"name": name, "file": str(path), "sha256": file_sha256(path), "replaced_head": None}
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
        own[name].dim() > 0 and state[name].dim() > 0  # a scalar has no class count
        and own[name].shape[0] == num_classes and state[name].shape[1:] == own[name].shape[1:]
        for name in different) else None


def _some(names: list[str]) -> str:
    if not names:
        return "no tensors"
    return f"{len(names)} tensors (e.g. {names[0]})"

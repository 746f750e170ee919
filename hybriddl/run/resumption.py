"""A run's saved state, and how a run continues from it.

A checkpoint holds the model and optimizer state, the position (epoch, next global
batch of that epoch, optimizer steps so far), the partial sums of the epoch in
progress, the RNG states (nothing in training draws from them any more: dropout is keyed
by sample, augmentation by seed and epoch; kept for code that may), the metrics so far, the strategy
and profile used, and the settings that make two runs "the same run". The data order
needs no state: `data.epoch_batches` is a pure function of (seed, epoch), so resuming
skips the batches already done.

Here: what a run directory holds (`run_state`), a checkpoint read back (`load`, with
`weights_only`, so no code in a user's file runs; a file cut short named with the last
good checkpoint), the settings a resumed run continues with, and the checks that it is
the same run on the same data with room for its checkpoints. On resume every rank reads
the same file, which therefore has to lie on a filesystem all hosts see (as SLURM
clusters provide). `run/checkpointer.py` writes the checkpoints.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import asdict, dataclass, fields
from collections.abc import Sequence
from pathlib import Path

import torch

from hybriddl.errors import UsageError
from hybriddl.rundir import CHECKPOINT, MODEL, errors_file

FORMAT = 1

# Settings that make a resumed run the same run; a difference is refused, not merged.
IDENTITY_FLAGS = {"usecase": "--usecase", "model": "--model", "batch_size": "--batch-size",
                  "image_size": "--image-size", "seed": "--seed", "data": "--data",
                  "classes": "--classes", "val_fraction": "--val-fraction"}
# What must match between the data the checkpoint saw and the data found on resume:
# the batch order is drawn over sample indices, so the same counts in the same classes.
DATA_IDENTITY = ("classes", "train_images", "val_images")


@dataclass
class Position:
    epoch: int = 0  # the epoch in progress, from 0
    step: int = 0  # the next global batch of that epoch
    steps_done: int = 0  # optimizer steps since the run began


@dataclass
class EpochProgress:
    """Sums over the steps done so far in the epoch in progress."""

    steps: int = 0
    global_samples: int = 0  # samples over all hosts (for images per second)
    samples: int = 0  # this host's samples
    # This host's sum of per-sample losses: while the epoch runs, a tensor on the device
    # that computed it may stand here (reading it back waits for the device); `settle`
    # makes it a float.
    loss_sum: float = 0.0
    seconds: float = 0.0
    data_wait_seconds: float = 0.0

    def add_step(self, global_samples: int, samples: int, loss_sum, seconds: float) -> None:
        self.steps += 1
        self.global_samples += global_samples
        self.samples += samples
        self.loss_sum = self.loss_sum + loss_sum
        self.seconds += seconds

    def settle(self) -> float:
        """The loss sum as a float (read back from its device where it is a tensor)."""
        self.loss_sum = float(self.loss_sum)
        return self.loss_sum


@dataclass
class Checkpoint:
    config: dict  # the TrainConfig fields as plain data; strategy_options is a dict
    identity: dict
    position: Position
    progress: EpochProgress  # over all hosts: rank 0 restores it, the others start at 0
    model: dict
    optimizer: dict
    rng: dict
    metrics: dict
    strategy: dict
    profile: dict | None = None
    # The gradient compression that ran and its state (hosts.compression_state: PowerSGD's
    # factors and rank 0's errors; each other host's errors in its own file beside it,
    # `ERRORS_APART`), so a compressed run resumes as if uninterrupted; None in checkpoints
    # written before it was kept (those before the errors were kept apart hold their sum).
    compression: dict | None = None
    format: int = FORMAT

    def to_payload(self) -> dict:
        # Not asdict(self): it deep-copies every tensor (1.1 GB for VGG16, while training
        # waits), where the staged state is already a copy of its own.
        payload = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**payload, "position": asdict(self.position), "progress": asdict(self.progress)}

    @classmethod
    def from_payload(cls, payload: dict) -> Checkpoint:
        return cls(**{**payload, "position": Position(**payload["position"]),
                      "progress": EpochProgress(**payload["progress"])})


# --------------------------------------------------------------------------- loading

def load(run_dir: str | Path) -> Checkpoint:
    """The checkpoint of RUN_DIR, or a UsageError saying why it cannot be resumed."""
    path = Path(run_dir) / CHECKPOINT
    if not Path(run_dir).is_dir():
        raise UsageError(f"--resume {run_dir}: no such directory; give the run directory of "
                         "an interrupted 'hybriddl train'")
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CHECKPOINT} there, so nothing to resume; "
                         "start a new run instead")
    try:
        checkpoint = _read_checkpoint(path)
    except UnreadableFile as exc:
        if exc.kind == HOSTILE:
            raise UsageError(f"--resume {run_dir}: {exc}") from None
        raise UsageError(f"--resume {run_dir}: {exc}; {_last_good(path)}") from None
    if checkpoint.format != FORMAT:
        raise UsageError(f"--resume {run_dir}: {CHECKPOINT} has format {checkpoint.format}, "
                         f"this hybriddl reads format {FORMAT}: resume it with the version "
                         "that wrote it")
    return checkpoint


def load_state_dict_file(path: str | Path) -> dict:
    """A state_dict (tensor names to tensors) from a file the user gave, e.g. `--weights`.

    Loaded so that no code in it can run; anything else is a one-line UsageError naming
    the file and what to give instead.
    """
    path = Path(path)
    try:
        state = safe_load(path)
    except UnreadableFile as exc:
        raise UsageError(f"{exc}; give a state_dict saved with torch.save, such as a run's "
                         "model.pt") from None
    if not isinstance(state, dict) or not state or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()):
        raise UsageError(f"{path}: not a state_dict (a mapping of names to tensors); give a "
                         "model's state_dict such as a run's model.pt")
    return state


# Why a file given by the user could not be loaded.
HOSTILE, TRUNCATED, FOREIGN = "hostile", "truncated", "foreign"


class UnreadableFile(Exception):
    """A file torch.load refused or failed on; `kind` is HOSTILE, TRUNCATED or FOREIGN."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def safe_load(path: Path):
    """torch.load of a file the user gave, with weights_only: tensors and plain data only.

    A .pt file is a pickle, and unpickling can call anything it names (os.system...):
    weights_only refuses every global but tensors' own, so such a file is refused before
    any of it runs. A hybriddl checkpoint needs no more than that (metrics are JSON types).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Weights only load failed" in text and "GLOBAL " in text:
            raise UnreadableFile(HOSTILE, f"{path} is refused: it asks to call "
                                 f"{_named_global(text)}, which a file of weights never needs "
                                 "(loading it could run any code); nothing of it was run") from None
        raise UnreadableFile(*_damaged(path, exc)) from None
    except MemoryError:
        raise UnreadableFile(FOREIGN, f"{path} is too large to load here") from None
    except Exception as exc:  # torch.load raises many types for damaged or foreign files
        raise UnreadableFile(*_damaged(path, exc)) from None


def _named_global(text: str) -> str:
    # torch names the refused callable as "Unsupported global: GLOBAL posix.system ...".
    for line in text.splitlines():
        if "GLOBAL " in line:
            return line.split("GLOBAL ", 1)[1].split()[0].rstrip(".,")
    return "a Python object other than tensors"


def _damaged(path: Path, exc: Exception) -> tuple[str, str]:
    if _cut_short(path, exc):
        return TRUNCATED, (f"{path} is cut short ({path.stat().st_size:,} bytes; an "
                           "interrupted copy or a full disk)")
    if isinstance(exc, OSError) and exc.strerror:
        return FOREIGN, f"{path} cannot be read ({exc.strerror})"
    return FOREIGN, f"{path} cannot be loaded: it is no PyTorch file ({type(exc).__name__})"


def _cut_short(path: Path, exc: Exception) -> bool:
    # torch.save writes a zip archive, whose directory is at its end: cut short, the file
    # still starts as a zip but is none (torch then reports EINVAL or a missing central
    # directory). A legacy pickle cut short ends in EOFError or "truncated".
    try:
        with open(path, "rb") as handle:
            zip_start = handle.read(4) == b"PK\x03\x04"
        if zip_start:
            return not zipfile.is_zipfile(path)
    except OSError:
        return False
    return isinstance(exc, EOFError) or "truncated" in str(exc)


def _read_checkpoint(path: Path) -> Checkpoint:
    payload = safe_load(path)
    try:
        return Checkpoint.from_payload(payload)
    except (TypeError, KeyError, AttributeError):
        raise UnreadableFile(FOREIGN, f"{path} cannot be loaded: it is a PyTorch file but "
                             "no hybriddl checkpoint") from None


def _last_good(damaged: Path) -> str:
    """Which other checkpoint of the run directory loads, newest first, to resume from."""
    others = sorted((p for p in damaged.parent.glob("checkpoint*.pt*")
                     if p != damaged and p.is_file()),
                    key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for other in others:
        try:
            checkpoint = _read_checkpoint(other)
        except UnreadableFile:
            continue
        position = checkpoint.position
        return (f"the last good checkpoint is {other} (epoch {position.epoch + 1}, step "
                f"{position.step}): copy it to {damaged} to resume from there, or start a "
                "new run")
    return "no other checkpoint is kept there: start a new run"


# What `train --resume-if-exists RUN_DIR` finds there (a job scheduler restarts the same
# command after a requeue, so one command must start, continue or leave alone a run).
FRESH, RESUMABLE, FINISHED = "fresh", "resumable", "finished"


def run_state(run_dir: str | Path) -> str:
    """FRESH (no checkpoint yet), RESUMABLE (a checkpoint to continue from), or FINISHED.

    A run has finished when its model.pt is at least as new as its checkpoint: the
    trainer writes model.pt once, after the last checkpoint of a complete run, and a
    finished run resumed to extend it writes newer checkpoints before a newer model.pt.
    """
    checkpoint, model = Path(run_dir) / CHECKPOINT, Path(run_dir) / MODEL
    if model.is_file() and (not checkpoint.is_file()
                            or model.stat().st_mtime_ns >= checkpoint.stat().st_mtime_ns):
        return FINISHED
    return RESUMABLE if checkpoint.is_file() else FRESH


def resumed_settings(checkpoint: Checkpoint, given: dict, run_dir: str | Path) -> dict:
    """TrainConfig fields for resuming: the checkpoint's, with the flags given on top.

    `given` holds only what the user typed. Identity settings may be repeated but not
    changed; the rest (epochs, max steps, lr, strategy, ...) may change, which is how a
    finished run is extended or a resumed one moved to another strategy.
    """
    saved = checkpoint.config
    changed = [f"{flag} {given[name]!r} (the checkpoint has {saved[name]!r})"
               for name, flag in IDENTITY_FLAGS.items()
               if name in given and given[name] != saved[name]]
    if changed:
        raise UsageError(f"--resume {run_dir}: {', '.join(changed)} would make another run; "
                         "leave these flags out, or start a new run with --run-dir")
    settings = {**saved, **given, "run_dir": str(run_dir)}
    options = dict(saved["strategy_options"])
    if "strategy" in given and given["strategy"] != saved["strategy"]:
        options = {}  # another strategy starts from its own defaults
    settings["strategy_options"] = {**options, **given.get("strategy_options", {})}
    return settings


# A compressed run's errors (PowerSGD's error feedback: the model's size on every host) are
# each host's own: a checkpoint keeps rank 0's in checkpoint.pt and every other host's in a
# file of its own beside it, written by that host, instead of summing them over the link
# (2.1 s of an AlexNet epoch's 5.4 s at a 10 ms host step over 1 Gbit/s). The checkpoint's
# state says how many hosts and which step (`ERRORS_APART`).
ERRORS_APART = "errors_apart"
ERRORS_KEPT = 3  # a host's newest error files kept: the checkpoint's, and those before it


def compression_for_host(checkpoint: Checkpoint, run_dir: str | Path, rank: int,
                         hosts: int) -> tuple[dict | None, bool | None, str | None]:
    """What host `rank` of `hosts` resumes its compression from: (the state, whether it
    holds errors (None: rank 0 alone, as in checkpoints that kept the errors summed), a
    line to show where a host's errors could not be read). On the host count that wrote
    it, each host takes its own errors; on another, rank 0 takes them all summed (every
    step is linear in them: the sum is what carries on) and the others none."""
    saved = checkpoint.compression
    apart = (saved or {}).get(ERRORS_APART)
    if not apart:
        return saved, None, None
    state = {key: value for key, value in saved.items() if key != ERRORS_APART}
    if hosts == apart["hosts"]:
        if rank == 0:
            return state, True, None
        total, others = None, [rank]
    elif rank != 0:
        return state, False, None
    else:
        total, others = [error.clone() for error in state["error"]], range(1, apart["hosts"])
    for other in others:
        path = Path(run_dir) / errors_file(other, apart["steps_done"])
        try:
            errors = safe_load(path)["error"]
        except (UnreadableFile, KeyError, TypeError) as exc:
            line = (f"--compression {state.get('name')}: the checkpoint's errors of host "
                    f"{other} could not be read ({path}: {exc}); they start at zero")
            return ({**state, "error": total}, True, line) if total else (state, False, line)
        total = errors if total is None else [a.add_(b) for a, b in zip(total, errors)]
    return {**state, "error": total}, True, None


def logical_count(checkpoint: Checkpoint) -> int | None:
    """The logical ranks a compressed checkpoint's errors are kept by (the host count its
    run started on), None where it kept none apart."""
    apart = (checkpoint.compression or {}).get(ERRORS_APART)
    return int(apart["hosts"]) if apart else None


def compression_by_logical_rank(checkpoint: Checkpoint, run_dir: str | Path,
                                ranks: Sequence[int]) -> tuple[dict, list, str | None]:
    """What a host that runs logical `ranks` (`Hosts.use_logical`) resumes its compression
    from: (the state, with its first rank's errors, or None; the other ranks' errors, in
    order, None for one that could not be read; a line to show where one could not)."""
    saved = checkpoint.compression
    apart = saved[ERRORS_APART]
    state = {key: value for key, value in saved.items() if key != ERRORS_APART}
    errors, line = [], None
    for rank in ranks:
        if rank == 0:
            errors.append(state["error"])
            continue
        path = Path(run_dir) / errors_file(rank, apart["steps_done"])
        try:
            errors.append(safe_load(path)["error"])
        except (UnreadableFile, KeyError, TypeError) as exc:
            errors.append(None)
            line = (f"--compression {state.get('name')}: the checkpoint's errors of logical "
                    f"rank {rank} could not be read ({path}: {exc}); they start at zero")
    return {**state, "error": errors[0]}, errors[1:], line


def check_same_data(checkpoint: Checkpoint, data: dict) -> None:
    """The data found on resume must be the data the checkpoint was trained on."""
    saved = checkpoint.identity["data"]
    for key in DATA_IDENTITY:
        if saved[key] != data[key]:
            raise UsageError(f"--resume: the data at {data['source']} now has {key} "
                             f"{data[key]!r} but the checkpoint was made with {saved[key]!r}; "
                             "restore that data or start a new run")


def run_identity(config: dict, data: dict) -> dict:
    return {**{name: config[name] for name in IDENTITY_FLAGS},
            "data": {key: data[key] for key in ("source", *DATA_IDENTITY)}}


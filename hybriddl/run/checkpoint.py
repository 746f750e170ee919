"""Checkpoints: what a run needs to continue as if it had never stopped.

A checkpoint holds the model and optimizer state, the position (epoch, next global
batch of that epoch, optimizer steps so far), the partial sums of the epoch in
progress, the RNG states (nothing in training draws from them any more: dropout is keyed
by sample, augmentation by seed and epoch; kept for code that may), the metrics so far, the strategy
and profile used, and the settings that make two runs "the same run". The data order
needs no state: `data.epoch_batches` is a pure function of (seed, epoch), so resuming
skips the batches already done.

Rank 0 writes `checkpoint.pt` atomically (temporary file, fsync, rename): a kill at
any moment, even during the write, leaves the previous checkpoint intact. The write is
off the training's critical path, as PyTorch's async checkpoint save does it: training
pauses only to copy the state into staging buffers (a memory copy), and a background
thread serialises and fsyncs that copy while the next steps run. One write at a time:
the next checkpoint, the end of the run, a stop and an error all wait for the one
under way, so a run never leaves without its last checkpoint complete. Parameters that
are not finite are never written, so the last good checkpoint survives a diverging run.
On resume every rank reads the same file, which therefore has to lie on a filesystem all
hosts see (as SLURM clusters provide).
"""

from __future__ import annotations

import json
import pickle
import random
import signal
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hybriddl.errors import StorageError, TrainingError, TrainingInterrupted, UsageError
from hybriddl.rundir import CHECKPOINT, MODEL, check_storage
from hybriddl.files import atomic_torch_save
from hybriddl.run.shutdown import StopRequest
from hybriddl.usecases import build_model

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
    # factors and its errors summed over hosts), so a compressed run resumes as if
    # uninterrupted; None in checkpoints written before it was kept.
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


# --------------------------------------------------------------------------- RNG

def capture_rng() -> dict:
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"] = {"key": numpy_state["state"]["key"].tolist(),
                            "pos": numpy_state["state"]["pos"]}
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {"key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32),
                            "pos": numpy_state["state"]["pos"]}
    np.random.set_state(numpy_state)
    random.setstate(state["python"])
    # A host resumed with another GPU count keeps its fresh CUDA states: they only drive
    # dropout on GPU, and a different device set cannot reproduce the old draws anyway.
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


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


# --------------------------------------------------------------------------- storage

# The head of a torchvision classifier grows with the class count, unknown before the
# data are read; torchvision's default of 1000 bounds the estimate for the usual cases.
ESTIMATE_CLASSES = 1000


def check_run_storage(run_dir: Path, model_name: str, classes: int | None = None) -> None:
    """Before data loading and tuning: RUN_DIR writable, room for two checkpoints.

    A checkpoint holds the model and its SGD momentum (2x the parameter bytes); at the
    peak the last one is kept while the next is written, so two. The model is built on
    PyTorch's meta device: sizes only, no memory, no random numbers drawn.
    """
    with torch.device("meta"):
        model = build_model(model_name, classes or ESTIMATE_CLASSES)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    existing = Path(run_dir) / CHECKPOINT
    held = existing.stat().st_size if existing.is_file() else 0  # a resumed run's, replaced
    check_storage(run_dir, max(0, 2 * 2 * state_bytes - held))


# --------------------------------------------------------------------------- saving

class Checkpointer:
    """Where the run stands, and the checkpoint that lets it go on from there.

    The trainer tells it when a step and an epoch are done; it writes a checkpoint at
    the end of every epoch, every `every` steps, and when a stop was requested on any
    host, in which case it raises TrainingInterrupted once the checkpoint is written.
    Every host calls it at the same steps: saving and the stop decision are collective.
    Writes run in the background (see the module's doc); use it as a context manager so
    that leaving the run, normally or not, waits for the write under way.
    With `writes` False (hybriddl compare's ranks, whose output is their step figures) it
    writes nothing and stages nothing: a stop still ends every host at the same step.
    """

    def __init__(self, run_dir: Path, hosts, stop: StopRequest, model: nn.Module,
                 optimizer: torch.optim.Optimizer, metrics: dict, about: dict,
                 every: int | None = None, layout=None, writes: bool = True):
        self.run_dir, self.hosts, self.stop = Path(run_dir), hosts, stop
        self.writes = writes
        # How the whole model's state is had from this host's (hybrid/parallel.py): the
        # hosts' scheme, or the model and optimizer as they are.
        self.layout = layout
        self.model, self.optimizer, self.metrics = model, optimizer, metrics
        self.about = about  # config, identity, strategy, profile: fixed for the run
        self.every = every
        self.position = Position()
        self._resumed_progress: EpochProgress | None = None
        self.saved: Position | None = None  # the last checkpoint complete on disk
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_position: Position | None = None
        self._staging = None  # reused copy of the state the writer reads from
        self._preparing: Future | None = None  # the staging buffers, allocated in the background
        self._staged_steps: int | None = None  # steps_done of the last state staged, every host

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is None:
                self.wait_for_write()
            else:  # already failing: finish the write, report the first error only
                self._collect()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def restore(self, checkpoint: Checkpoint, lr: float, momentum: float) -> None:
        """Optimizer, RNG and position from a checkpoint (the model was loaded in prepare)."""
        state = checkpoint.optimizer
        if self.layout is not None:
            state = self.layout.local_optimizer_state(state, self.model)
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:  # a resumed run may change these
            group["lr"], group["momentum"] = lr, momentum
        restore_rng(checkpoint.rng)
        self.position = Position(**asdict(checkpoint.position))
        progress = checkpoint.progress
        if self.hosts.rank != 0:  # the saved sums are over all hosts: count them once
            progress = EpochProgress(seconds=progress.seconds,
                                     data_wait_seconds=progress.data_wait_seconds,
                                     steps=progress.steps,
                                     global_samples=progress.global_samples)
        self._resumed_progress = progress
        self.saved = Position(**asdict(self.position))

    def epoch_progress(self, epoch: int) -> EpochProgress:
        """The sums to continue `epoch` from: the checkpoint's if it stopped inside it."""
        if self._resumed_progress is not None and epoch == self.position.epoch:
            progress, self._resumed_progress = self._resumed_progress, None
            return progress
        self.position = Position(epoch, 0, self.position.steps_done)
        return EpochProgress()

    def saves_next_step(self) -> bool:
        """True when the coming step_done writes a checkpoint for --checkpoint-every (a stop
        asked for may make it write one too)."""
        return self.every is not None and (self.position.steps_done + 1) % self.every == 0

    def step_done(self, progress: EpochProgress) -> None:
        self.position.step += 1
        self.position.steps_done += 1
        if self.writes and self._staging is None and self._preparing is None \
                and self.hosts.rank == 0 and getattr(self.layout, "name", "data") == "data":
            self._prepare_staging()
        due = self.every is not None and self.position.steps_done % self.every == 0
        if self._pending is not None and self._pending.done():
            self.wait_for_write()  # a failed write stops the run at once, not an epoch later
        stopping = self.hosts.any_true(self.stop.requested)
        if due or stopping:
            self.save(progress)
        if stopping:
            self._interrupted()

    def epoch_done(self, progress: EpochProgress, complete: bool) -> None:
        """After the epoch's record is in the metrics; `complete` unless --max-steps cut it."""
        if complete:
            self.position = Position(self.position.epoch + 1, 0, self.position.steps_done)
            self.save(EpochProgress())
        else:  # resumable inside the epoch; its record is made again when it completes
            self.save(progress, metrics={**self.metrics, "epochs": self.metrics["epochs"][:-1]})
        if self.hosts.any_true(self.stop.requested):
            self._interrupted()

    def kept(self) -> str:
        """Which checkpoint a failed run leaves behind, for the error message."""
        self._collect()
        if self.saved is None:
            return "no checkpoint was written yet"
        return (f"the last good checkpoint (epoch {self.saved.epoch + 1}, step "
                f"{self.saved.step}) is kept in {self.run_dir}")

    def _prepare_staging(self) -> None:
        """Allocate the staging buffers on the writer thread, once the optimizer has state.

        Fresh memory costs a page fault per page on first touch: 0.6 s for VGG16's
        1.1 GB of parameters and momentum, against 0.13 s to copy into buffers already
        mapped. Done here, after the first step, that cost runs beside training instead
        of inside the first checkpoint's pause.
        """
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        self._preparing = self._executor().submit(blank, state)

    def _executor(self) -> ThreadPoolExecutor:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="hybriddl-checkpoint")
        return self._writer

    def save(self, progress: EpochProgress, metrics: dict | None = None) -> None:
        if not self.writes:  # the same on every host: no collective is left half-entered
            return
        # Collective: every host contributes its loss sum, so rank 0 can store the total.
        mean_loss = self.hosts.mean_over_hosts(progress.settle(), progress.samples)
        self.wait_for_write()  # its staging buffers are about to be overwritten
        if self._preparing is not None:
            self._staging, self._preparing = self._preparing.result(), None
        whole = self._whole_state()  # collective where the model is split across hosts
        compression = self.hosts.compression_state()  # collective: the hosts' errors summed
        self._staged_steps = self.position.steps_done
        if self.hosts.rank != 0:
            self.check_finite(self.model.state_dict())
            self.saved = Position(**asdict(self.position))
            return
        self._staging = stage(self._staging, whole)
        self.check_finite(self._staging["model"])
        total = EpochProgress(steps=progress.steps, global_samples=progress.global_samples,
                              samples=progress.global_samples,
                              loss_sum=mean_loss * progress.global_samples,
                              seconds=progress.seconds,
                              data_wait_seconds=progress.data_wait_seconds)
        checkpoint = Checkpoint(
            config=self.about["config"], identity=self.about["identity"],
            position=Position(**asdict(self.position)), progress=total,
            model=self._staging["model"], optimizer=self._staging["optimizer"],
            rng=capture_rng(), metrics=plain(metrics if metrics is not None else self.metrics),
            strategy=self.about["strategy"], profile=self.about.get("profile"),
            compression=compression)
        self._pending = self._executor().submit(atomic_torch_save, self.run_dir / CHECKPOINT,
                                            checkpoint.to_payload())
        self._pending_position = checkpoint.position

    def holds_the_model(self) -> bool:
        """Whether the last checkpoint's staged state is the model as it is now (no step
        since): the same answer on every host, so the end of a run can skip a second gather
        of a classifier split across hosts (`staged_model`)."""
        return self._staged_steps is not None and self._staged_steps == self.position.steps_done

    def staged_model(self) -> dict | None:
        """The whole model as the last checkpoint staged it, on host memory (rank 0; None
        elsewhere). Valid while `holds_the_model()`."""
        return None if self._staging is None else self._staging["model"]

    def _whole_state(self) -> dict | None:
        """The whole model's and optimizer's state on rank 0 (None elsewhere)."""
        if self.layout is None:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()} \
                if self.hosts.rank == 0 else None
        model = self.layout.model_state(self.model, self.hosts)
        optimizer = self.layout.optimizer_state(self.optimizer, self.model, self.hosts)
        return {"model": model, "optimizer": optimizer} if self.hosts.rank == 0 else None

    def check_finite(self, state: dict) -> None:
        # aminmax: NaN and inf show in the extremes, at a tenth of isfinite().all()'s cost
        # (0.04 s against 1 s for VGG16's 138 M parameters).
        for tensor in state.values():
            if tensor.is_floating_point() and tensor.numel():
                low, high = tensor.aminmax()
                if not (torch.isfinite(low) and torch.isfinite(high)):
                    raise TrainingError(f"parameters became non-finite by epoch "
                                        f"{self.position.epoch + 1}, step {self.position.step}: "
                                        f"lower --lr; {self.kept()}")

    def wait_for_write(self) -> None:
        """Block until the checkpoint being written is on disk; raise if its write failed."""
        failure = self._collect()
        if failure is not None:
            raise StorageError(f"{failure}; {self.kept()}") from None

    def _collect(self) -> StorageError | None:
        """Wait for the write under way; its position becomes the kept one if it succeeded."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except StorageError as exc:
            return exc
        self.saved = self._pending_position
        return None

    def _interrupted(self) -> None:
        # Under mpirun the first rank to exit non-zero gets the others killed: none may
        # leave before rank 0's checkpoint is on disk.
        self.wait_for_write()
        self.hosts.barrier()
        # A host stopped because another one was signalled reports the usual SIGTERM.
        signum = self.stop.signum if self.stop.requested else int(signal.SIGTERM)
        raise TrainingInterrupted(self.run_dir, signum, self.position.epoch, self.position.step)


def stage(staging, state):
    """`state` with every tensor copied into `staging`'s tensor at the same place, in host
    memory whatever device the state is on.

    The buffers come from `blank` (or the first checkpoint) and are reused: copying into
    memory already mapped takes 0.08 s for VGG16's 528 MB, a fresh clone 0.26 s (page
    faults). A GPU's state goes to pinned host memory (copied by DMA), not to a copy on the
    GPU: that would hold the model and its momentum twice there (+1.1 GB for VGG16).
    """
    if isinstance(state, torch.Tensor):
        if not (isinstance(staging, torch.Tensor) and staging.device.type == "cpu"
                and staging.shape == state.shape and staging.dtype == state.dtype):
            staging = host_buffer(state)
        return staging.copy_(state.detach())
    if isinstance(state, dict):
        staging = staging if isinstance(staging, dict) else {}
        return {key: stage(staging.get(key), value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        if not isinstance(staging, (list, tuple)) or len(staging) != len(state):
            staging = [None] * len(state)
        return type(state)(stage(old, value) for old, value in zip(staging, state))
    return state  # numbers and strings: immutable, nothing to copy


def blank(state):
    """Zeroed host tensors shaped like `state`'s, at the same places: buffers for `stage`."""
    if isinstance(state, torch.Tensor):
        return host_buffer(state).zero_()  # zeroing maps every page now
    if isinstance(state, dict):
        return {key: blank(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(blank(value) for value in state)
    return state


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor laid out as `tensor` (its strides kept, so a copy is one memcpy),
    pinned where `tensor` is on a GPU."""
    pinned = tensor.device.type == "cuda"
    if tensor.is_contiguous() or (tensor.dim() == 4 and  # channels_last parameters
                                  tensor.is_contiguous(memory_format=torch.channels_last)):
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   pin_memory=pinned)
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)


def plain(metrics: dict) -> dict:
    """The metrics as the JSON types they are written as: loadable with weights_only=True."""
    return json.loads(json.dumps(metrics))

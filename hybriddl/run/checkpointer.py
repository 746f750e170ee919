"""Writing checkpoints: where a run stands, kept so that it can go on from there.

Rank 0 writes `checkpoint.pt` atomically (temporary file, fsync, rename): a kill at
any moment, even during the write, leaves the previous checkpoint intact. The write is
off the training's critical path, as PyTorch's async checkpoint save does it: training
pauses only to copy the state into staging buffers (a memory copy), and a background
thread serialises and fsyncs that copy while the next steps run. One write at a time:
the next checkpoint, the end of the run, a stop and an error all wait for the one
under way, so a run never leaves without its last checkpoint complete. Parameters that
are not finite are never written, so the last good checkpoint survives a diverging run.
What a checkpoint holds, and reading it back, is `run/resumption.py`.
"""

from __future__ import annotations

import json
import random
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hybriddl.errors import StorageError, TrainingError, TrainingInterrupted
from hybriddl.files import atomic_torch_save
from hybriddl.rundir import CHECKPOINT
from hybriddl.run.resumption import (ERRORS_APART, ERRORS_KEPT, Checkpoint, EpochProgress,
                                     Position, errors_file)
from hybriddl.run.shutdown import StopRequest

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
            for parameter in group["params"]:
                # A buffer saved in another memory layout (a run resumed with or without
                # --channels-last, or a pick of --strategy auto that changed it) is laid out
                # as its parameter: fused SGD pairs their elements in memory order
                # (step.py `unfuse_where_layouts_differ`), and would scramble the update.
                held = self.optimizer.state.get(parameter, {})
                buffer = held.get("momentum_buffer")
                if buffer is not None and buffer.stride() != parameter.stride():
                    held["momentum_buffer"] = torch.empty_like(parameter).copy_(buffer)
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
        compression = self.keep_errors_apart(self.hosts.compression_state())
        # Collective: every host contributes its loss sum, so rank 0 can store the total.
        # Past it, every host's errors of this step are on disk, before rank 0's checkpoint.
        mean_loss = self.hosts.mean_over_hosts(progress.settle(), progress.samples)
        self.wait_for_write()  # its staging buffers are about to be overwritten
        if self._preparing is not None:
            self._staging, self._preparing = self._preparing.result(), None
        if self.layout is not None:
            # BatchNorm's running statistics, each host's own till now: the checkpoint
            # keeps their mean, as validation sees it, not rank 0's (collective; linear
            # updates, so averaging now changes nothing any later validation sees).
            self.layout.average_statistics(self.model, self.hosts)
        whole = self._whole_state()  # collective where the model is split across hosts
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

    def keep_errors_apart(self, state: dict) -> dict:
        """A compressed run's state as rank 0's checkpoint keeps it: its own errors, and
        where the others' are (`resumption.ERRORS_APART`); every other host writes its
        errors to a file of its own, now, and keeps its newest few. No exchange: summing
        the errors over the link cost AlexNet's model size per host at every checkpoint."""
        if self.hosts.logical_count == 1 or "error" not in state:
            return state
        steps = self.position.steps_done
        # A host that runs several logical ranks (hosts `use_logical`) keeps each one's apart.
        for part, rank in enumerate(self.hosts.logical_ranks):
            if rank == 0:
                continue
            errors = state["error"] if part == 0 else self.hosts.compression.part_errors(part)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_torch_save(self.run_dir / errors_file(rank, steps),
                              {"error": errors, "steps_done": steps})
            written = sorted(int(path.stem.rsplit("step", 1)[1]) for path in
                             self.run_dir.glob(errors_file(rank, "*")))
            # Past this step: a crashed attempt's, written before its rank 0's checkpoint
            # completed. Kept, they would push out the one this run resumed from.
            past = [old for old in written if old > steps]
            kept = [old for old in written if old <= steps]
            for old in past + kept[:-ERRORS_KEPT]:
                (self.run_dir / errors_file(rank, old)).unlink(missing_ok=True)
        if self.hosts.rank == 0:
            return {**state, ERRORS_APART: {"hosts": self.hosts.logical_count,
                                            "steps_done": steps}}
        return state

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

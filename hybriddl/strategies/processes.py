"""The paper's fastest CPU strategy: persistent local worker processes on shared memory.

- Workers are started once, with the spawn context (never fork: forking a process that
  holds OpenMP or MPI state is unsafe), and live until close().
- The master parameters are moved to shared memory (model.share_memory()) before the
  workers start, so the workers see every optimizer update in place: no copy per step.
- Each worker's .grad fields are views of one flat shared-memory buffer, so its
  backward writes straight into memory the master reads; the master adds the buffers.
- Inputs travel through one shared input buffer; a step's message is four numbers.
- The master computes the first sub-batch itself: with K processes on K cores an idle
  master would waste one, and its share needs no gradient copy at all. K - 1 worker
  processes are started.
- Workers die with the master: they ignore SIGINT (the master stops them), and a closed
  pipe (the master ended, however it ended) makes them exit.
"""

from __future__ import annotations

import shutil
import signal
import time
import traceback

import torch
import torch.multiprocessing as mp

from hybriddl.dropout import current_keys
from hybriddl.errors import TrainingError, UsageError
from hybriddl.machine.hostinfo import usable_cores
from hybriddl.strategies.base import (CoreWorkersStrategy, StepStats, add_gradients,
                                      master_backward, sub_batch_backward, sub_batches)
from hybriddl.machine.allocator import keep_freed_memory
from hybriddl.machine.cpu_threads import set_torch_threads


SHARED_MEMORY = "/dev/shm"


class Processes(CoreWorkersStrategy):
    name = "processes"
    worker_processes = True
    summary = "K persistent worker processes, parameters and gradients in shared memory"

    def __init__(self, options):
        super().__init__(options)
        self.processes: list = []
        self.connections: list = []
        self.grad_buffers: list[torch.Tensor] = []
        self.grad_views: list[list[torch.Tensor]] = []  # each buffer, shaped as the parameters
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def setup(self, model) -> None:
        # Never more threads than cores this process may use (ranks sharing a machine
        # are pinned to their own cores): oversubscribed reductions crawl.
        self.reduce_threads = max(1, min(self.workers, usable_cores()))
        super().setup(model)
        set_torch_threads(1)
        numel = sum(p.numel() for p in _trained(model))
        dtype = next((p.dtype for p in _trained(model)), torch.float32)  # the model's own
        _check_shared_memory(model, numel * dtype.itemsize * (self.workers - 1))
        model.share_memory()
        context = mp.get_context("spawn")
        try:
            for rank in range(1, self.workers):
                grad_buffer = torch.zeros(numel, dtype=dtype).share_memory_()
                mine, theirs = context.Pipe()
                process = context.Process(target=_worker_main,
                                          args=(rank, theirs, model, grad_buffer, self.options),
                                          name=f"hybriddl-worker-{rank}", daemon=True)
                process.start()
                theirs.close()  # the worker's end lives in the worker only: EOF when we end
                self.processes.append(process)
                self.connections.append(mine)
                self.grad_buffers.append(grad_buffer)
                self.grad_views.append(_views(grad_buffer, model))
            for rank in range(1, self.workers):
                if isinstance(failure := self._reply(rank, "ready"), TrainingError):
                    raise failure
        except BaseException:
            self.close()
            raise

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        n = len(y)
        parts = sub_batches(n, self.workers)
        busy = list(range(1, len(parts)))  # ranks of the workers with a sub-batch
        if busy:
            self._share_inputs(x, y)
        for rank in busy:
            a, b = parts[rank]
            keys = current_keys(a, b)
            # Plain ints: a pickled tensor would travel through yet another shared segment.
            self._send(rank, ("step", a, b, n, None if keys is None else keys.tolist()))
        set_torch_threads(1)
        try:
            a, b = parts[0]
            loss_sum = master_backward(self.model, x[a:b], y[a:b], n, self.options, start=a)
        finally:
            # Every reply is read, even when the master's share failed: none is left
            # behind in a pipe to be mistaken for the next step's.
            replies = [self._reply(rank, "done") for rank in busy]
        failures = [reply for reply in replies if isinstance(reply, TrainingError)]
        if failures:
            raise failures[0]
        loss_sum += sum(replies)
        # The workers idle now: the reduction and the optimizer step may use every core.
        set_torch_threads(self.reduce_threads)
        with torch.no_grad():
            for rank in busy:
                add_gradients(_trained(self.model), self.grad_views[rank - 1])
        return StepStats(n, loss_sum, time.perf_counter() - started, {"parts": len(parts)})

    def _share_inputs(self, x, y) -> None:
        """Copy the batch into the shared input buffer; reallocate (and resend) it only
        when the image shape changes or the batch outgrows it."""
        fits = (self.inputs is not None and self.inputs[0].shape[1:] == x.shape[1:]
                and len(self.inputs[0]) >= len(x) and self.inputs[0].dtype == x.dtype)
        if not fits:
            self.inputs = (torch.empty_like(x).share_memory_(), torch.empty_like(y).share_memory_())
            for rank in range(1, len(self.connections) + 1):
                self._send(rank, ("inputs", *self.inputs))
        self.inputs[0][:len(x)].copy_(x)
        self.inputs[1][:len(y)].copy_(y)

    def _send(self, rank: int, message: tuple) -> None:
        """`message` to worker `rank`, or the TrainingError that says it died."""
        try:
            self.connections[rank - 1].send(message)
        except OSError:  # a broken pipe: the OOM killer took it between steps
            raise self._died(rank) from None

    def _died(self, rank: int) -> TrainingError:
        process = self.processes[rank - 1]
        process.join(timeout=1.0)
        return TrainingError(f"local worker process {rank} died (exit code "
                             f"{process.exitcode}): see its error above")

    def _reply(self, rank: int, what: str):
        """The worker's answer, or the TrainingError that says why there is none."""
        try:
            reply = self.connections[rank - 1].recv()
        except (EOFError, OSError):
            return self._died(rank)
        if reply[0] == "error":
            return TrainingError(f"local worker process {rank} failed: {reply[1]}")
        assert reply[0] == what, reply
        return reply[1] if len(reply) > 1 else None

    def close(self) -> None:
        for connection in self.connections:
            try:
                connection.send(("stop",))
            except OSError:
                pass
        # A worker told to stop returns at once, but its interpreter's teardown (torch's)
        # outlasts a second: every worker is killed after STOP_SECONDS in all (they ignore
        # SIGTERM, see _worker_main). A failing run's one line waits for this, and mpirun
        # kills the rank within about two seconds of another's death.
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self.connections:
            connection.close()
        self.processes, self.connections, self.inputs = [], [], None
        self.grad_buffers, self.grad_views = [], []


def _check_shared_memory(model, grad_bytes: int) -> None:
    """Shared tensors live in /dev/shm; a container's default (64 MiB) holds no VGG16."""
    need = grad_bytes + sum(t.numel() * t.element_size()
                            for t in (*model.parameters(), *model.buffers()))
    try:
        free = shutil.disk_usage(SHARED_MEMORY).free
    except OSError:
        return  # no /dev/shm to ask (not Linux): let PyTorch decide
    if need > free:
        raise UsageError(f"strategy 'processes' needs {need / 2**20:.0f} MiB of shared memory "
                         f"and {SHARED_MEMORY} has {free / 2**20:.0f} MiB free: enlarge it "
                         "(docker run --shm-size=...), lower --workers, or use --strategy threads")


def _trained(model):
    return [p for p in model.parameters() if p.requires_grad]


def _views(flat: torch.Tensor, model) -> list[torch.Tensor]:
    """flat, cut into tensors shaped like the model's trained parameters, in order.

    Each view takes its parameter's strides too (channels_last weights): autograd writes
    a gradient laid out unlike its parameter through an extra copy."""
    views, offset = [], 0
    for p in _trained(model):
        views.append(flat[offset:offset + p.numel()].as_strided(p.shape, p.stride()))
        offset += p.numel()
    return views


WORKER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
STOP_SECONDS = 0.2  # what `close` gives the workers to end before it kills them


def _worker_main(rank: int, connection, model, grad_buffer: torch.Tensor, options) -> None:
    """One local worker process: wait for a sub-batch, leave its gradient in grad_buffer."""
    # Ctrl-C, and a scheduler's SIGTERM or SIGUSR1 to the whole process group (scancel, a
    # time limit), reach the master too: it stops at the step's end and then stops us.
    for signum in WORKER_IGNORES:
        signal.signal(signum, signal.SIG_IGN)
    set_torch_threads(1)
    keep_freed_memory()
    for p, g in zip(_trained(model), _views(grad_buffer, model)):
        p.grad = g
    inputs = None
    try:
        connection.send(("ready",))
        while True:
            message = connection.recv()
            if message[0] == "stop":
                return
            if message[0] == "inputs":
                inputs = message[1:]
                continue
            _, a, b, n, keys = message
            try:
                grad_buffer.zero_()
                loss_sum = sub_batch_backward(
                    model, inputs[0][a:b], inputs[1][a:b], n, options,
                    None if keys is None else torch.tensor(keys, dtype=torch.int64))
                connection.send(("done", loss_sum))
            except Exception as exc:
                traceback.print_exc()  # the whole of it on the terminal; one line to the master
                connection.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0]))
    except (EOFError, OSError):
        return  # the master is gone

"""PyTorch DDP as a PyTorch user would run it: one gloo process group, a model wrapped in
DistributedDataParallel. The one DDP implementation behind `hybriddl compare`'s ddp
contender and the DDP peer of `scripts/bench_local.py` (`local_peers.measure_ddp`)."""

# No `from __future__ import annotations`: DDP checks the comm hook's annotation
# against dist.GradBucket itself, not a string.

import inspect
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from hybriddl.emulation.pace import Pace, pace
from hybriddl.hosts.compression import FP16Compression
from hybriddl.hosts.powersgd import PowerSGD
from hybriddl.machine.cpu_threads import set_torch_threads

# Buffers are not synchronised each step: the MPI contenders average gradients only,
# and so must this one. (Newer torch renamed the switch.)
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                  else {"broadcast_buffers": False})


# With error feedback or warm start (both on, as PowerSGD's authors and torch advise),
# torch refuses a start_powerSGD_iter below 2: the steps before it are vanilla allreduces.
POWERSGD_START_ITER = 2
MIN_COMPRESSION_RATE = 2  # PowerSGDState's default


@dataclass(frozen=True)
class CommHook:
    """Which of torch's DDP communication hooks averages the gradients: `allreduce` (DDP's
    default), `fp16` (fp16_compress_hook) or `powersgd` (powerSGD_hook at `rank`, compressing
    the matrices whose factors are more than `min_rate` times smaller: its
    min_compression_rate, 2 by default)."""

    name: str = "allreduce"
    rank: int | None = None
    min_rate: float = MIN_COMPRESSION_RATE

    @property
    def untimed_steps(self) -> int:
        """Steps to leave out of a timing so that every timed step runs compressed: the
        vanilla ones, and the first compressed one, which allocates P, Q and the error."""
        return POWERSGD_START_ITER + 1 if self.name == PowerSGD.name else 0

    def describe(self, model_bytes: int) -> dict:
        if self.name == PowerSGD.name:
            return {"hook": "powerSGD_hook", "matrix_approximation_rank": self.rank,
                    "start_powerSGD_iter": POWERSGD_START_ITER,
                    "min_compression_rate": self.min_rate,
                    "bucket_cap_mb": one_bucket_mb(model_bytes)}
        return {"hook": {"allreduce": "allreduce_hook",
                         FP16Compression.name: "fp16_compress_hook"}[self.name]}


@dataclass
class CountingHook:
    """DDP comm-hook state: the hook's own state (its process group, or a PowerSGDState)
    and the bytes handed to gloo so far."""

    state: object
    fp16: bool = False
    bytes_sent: int = 0
    # emulate --compression-seconds: powerSGD_hook's compute padded to the hosts' (else None).
    pace: Pace | None = None


def counting_allreduce_hook(counter: CountingHook, bucket: dist.GradBucket):
    """DDP's default averaging allreduce, or fp16_compress_hook, counting what it sends."""
    buffer = bucket.buffer()
    counter.bytes_sent += buffer.numel() * (2 if counter.fp16 else buffer.element_size())
    hook = default_hooks.fp16_compress_hook if counter.fp16 else default_hooks.allreduce_hook
    return hook(counter.state, bucket)


def counting_powersgd_hook(counter: CountingHook, bucket: dist.GradBucket):
    """powerSGD_hook, counting what it sends: the whole bucket while it warms up, then the
    elements its own statistics add up as it compresses (each compressed matrix's P and Q,
    the other tensors whole), before any of them is sent."""
    state = counter.state
    compressing = state.iter >= state.start_powerSGD_iter
    before = state.total_numel_after_compression
    started = time.process_time()
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    elements = (state.total_numel_after_compression - before if compressing
                else bucket.buffer().numel())
    counter.bytes_sent += elements * bucket.buffer().element_size()
    if counter.pace is None or not compressing:
        return future
    pace = counter.pace

    def paced(done: torch.futures.Future) -> torch.Tensor:
        # The hook's compute: this process's CPU time from the call to its last callback
        # (one bucket, one computing thread; gloo's own threads' work for the small P and
        # Q exchanges counts in too, so the pad errs short, never long).
        pace.add(time.process_time() - started)
        pace.end_step()
        return done.value()

    return future.then(paced)


def one_bucket_mb(model_bytes: int) -> int:
    """A bucket_cap_mb above the model's gradient: DDP then fills one bucket (and its first
    bucket is no smaller when a cap is given)."""
    return math.ceil(model_bytes / 2**20) + 1


@contextmanager
def gloo_group(rank: int, world: int, address: str, port: int, interface: str):
    """This process as rank `rank` of a gloo group over `interface`, one CPU thread."""
    set_torch_threads(1)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=interface)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, world: int,
         hook: CommHook = CommHook()) -> tuple[DistributedDataParallel, CountingHook]:
    """`model` under DDP, its gradients averaged by `hook`, counted.

    powerSGD_hook runs with one bucket: with DDP's 25 MB buckets it aborted at its first
    compressed step (torch 2.14.1, gloo: "Received data size doesn't match expected size";
    each bucket chains three allreduces, and the ranks ran the chains in different orders).
    """
    if hook.name == PowerSGD.name:
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ddp = DistributedDataParallel(model, bucket_cap_mb=one_bucket_mb(model_bytes),
                                      **NO_BUFFER_SYNC)
        counter = CountingHook(powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=hook.rank,
            start_powerSGD_iter=POWERSGD_START_ITER, min_compression_rate=hook.min_rate),
            pace=pace())
        ddp.register_comm_hook(counter, counting_powersgd_hook)
        return ddp, counter
    ddp = DistributedDataParallel(model, **NO_BUFFER_SYNC)
    counter = CountingHook(None, fp16=hook.name == FP16Compression.name)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    return ddp, counter

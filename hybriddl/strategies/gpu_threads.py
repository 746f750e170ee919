"""Data parallelism over the local GPUs: one replica and one thread per device.

The master parameters are the replica on the first device; the master thread computes
its sub-batch there, one pool thread per other device computes on that device's
replica. The other replicas' gradients (weighted by n_i / n, as in `threads`) are
added to the master's, and after the optimizer step the replicas copy the master
parameters back. The batch arrives as the gpu strategy's does (base.StagedBatches): made on
the first device by the prefetch thread, each other device's part copied from there. No
copy in the step makes the host wait, and each part's loss stays on the devices until
the trainer reads it. `--devices cpu,cpu` runs the same logic on the CPU (how CI tests it).
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from hybriddl.dropout import current_keys
from hybriddl.errors import UsageError
from hybriddl.strategies.base import (LocalStrategy, StagedBatches, StagedOnDevices, StepStats,
                                      add_gradients, sub_batches, to_device, weighted_loss)
from hybriddl.strategies.resources import parse_devices
from hybriddl.strategies.spec import StrategyOptions, StrategySpec


def _default_devices() -> tuple[str, ...]:
    return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))


class GpuThreads(StagedOnDevices, LocalStrategy):
    name = "gpu-threads"
    summary = "one model replica and one thread per GPU"
    needs_gpu = True
    example_options = StrategyOptions(devices=("cpu", "cpu"))
    honours_numerics = False

    @classmethod
    def tuning_candidates(cls, host, batch_size: int) -> list[StrategySpec]:
        return [StrategySpec(cls.name, devices=tuple(host.gpus))] if host.cuda_devices >= 2 else []

    @classmethod
    def check_feasible(cls, options) -> None:
        if not options.devices and not torch.cuda.is_available():
            raise UsageError("no CUDA device: strategy 'gpu-threads' needs GPUs (or --devices "
                             "cpu,cpu); use --strategy sequential/threads/processes")
        parse_devices(options, _default_devices())

    def __init__(self, options):
        super().__init__(options)
        self.devices = parse_devices(options, _default_devices())
        self.replicas: list[torch.nn.Module] = []
        self.pool: ThreadPoolExecutor | None = None
        self._batches = StagedBatches(torch.device("cpu"))  # the first device's, from setup on

    def describe(self) -> dict:
        return {"name": self.name, "devices": [str(d) for d in self.devices]}

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def setup(self, model) -> None:
        super().setup(model.to(self.devices[0]))
        self.replicas = [copy.deepcopy(model).to(d) for d in self.devices[1:]]
        self._batches = StagedBatches(self.devices[0])
        if self.replicas:
            self.pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="hybriddl-gpu")

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        n = len(y)
        parts = sub_batches(n, len(self.devices))
        # Before any part is copied: the first device's stream waits for the staged batch
        # (a replica's copy from it is queued on that stream too).
        self._batches.arrived(x)
        futures = [self.pool.submit(_part_gradients, replica, device, x[a:b], y[a:b], n,
                                    current_keys(a, b))
                   for replica, device, (a, b) in zip(self.replicas, self.devices[1:], parts[1:])]
        try:
            a, b = parts[0]
            loss_sum, _ = _part_gradients(self.model, self.devices[0], x[a:b], y[a:b], n,
                                          current_keys(a, b), into_grad=True)
        finally:
            wait(futures)
        with torch.no_grad():
            for future in futures:
                replica_loss_sum, grads = future.result()
                loss_sum = loss_sum + to_device(replica_loss_sum, self.devices[0])
                add_gradients(self.model.parameters(), grads)
        # The loss stays on the device: reading it would make the host wait for the step.
        return StepStats(n, loss_sum, time.perf_counter() - started, {"parts": len(parts)})

    def after_step(self) -> None:
        with torch.no_grad():
            for replica in self.replicas:
                for mine, master in zip(replica.parameters(), self.model.parameters()):
                    mine.copy_(master)
                for mine, master in zip(replica.buffers(), self.model.buffers()):
                    mine.copy_(master)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _part_gradients(model, device, x, y, n, keys, into_grad: bool = False):
    """One device's part of the batch: its sum of losses, left on the device, and its
    weighted gradients (added into `model`'s .grad where `into_grad`, the master's part)."""
    x, y, keys = to_device(x, device), to_device(y, device), to_device(keys, device)
    loss, weighted = weighted_loss(model, x, y, n, keys=keys)
    if into_grad:
        weighted.backward()
        grads = None
    else:
        grads = torch.autograd.grad(weighted, list(model.parameters()), allow_unused=True)
    return loss.detach() * len(y), grads

"""Data parallelism over the local GPUs: one replica and one thread per device.

The master parameters are the replica on the first device; the master thread computes
its sub-batch there, one pool thread per other device computes on that device's
replica. The other replicas' gradients (weighted by n_i / n, as in `threads`) are
added to the master's, and after the optimizer step the replicas copy the master
parameters back. `--devices cpu,cpu` runs the same logic on the CPU (how CI tests it).
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from hybriddl.dropout import current_keys
from hybriddl.errors import UsageError
from hybriddl.strategies.base import (LocalStrategy, StepStats, add_gradients, master_backward,
                                      sub_batches, worker_gradients)
from hybriddl.strategies.resources import parse_devices
from hybriddl.strategies.spec import StrategyOptions, StrategySpec


def _default_devices() -> tuple[str, ...]:
    return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))


class GpuThreads(LocalStrategy):
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

    def describe(self) -> dict:
        return {"name": self.name, "devices": [str(d) for d in self.devices]}

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def setup(self, model) -> None:
        super().setup(model.to(self.devices[0]))
        self.replicas = [copy.deepcopy(model).to(d) for d in self.devices[1:]]
        if self.replicas:
            self.pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="hybriddl-gpu")

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        n = len(y)
        parts = sub_batches(n, len(self.devices))
        futures = [self.pool.submit(_replica_gradients, replica, device, x[a:b], y[a:b], n,
                                    current_keys(a, b))
                   for replica, device, (a, b) in zip(self.replicas, self.devices[1:], parts[1:])]
        try:
            a, b = parts[0]
            device = self.devices[0]
            loss_sum = master_backward(self.model, x[a:b].to(device), y[a:b].to(device), n,
                                       start=a)
        finally:
            wait(futures)
        with torch.no_grad():
            for future in futures:
                replica_loss_sum, grads = future.result()
                loss_sum += replica_loss_sum
                add_gradients(self.model.parameters(), grads)
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


def _replica_gradients(replica, device, x, y, n, keys):
    return worker_gradients(replica, list(replica.parameters()), x.to(device), y.to(device), n,
                            keys=keys)

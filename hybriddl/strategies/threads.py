"""The paper's multithreaded data parallelism: K Python threads, each on a sub-batch.

The master thread computes the first sub-batch itself and K - 1 persistent pool threads
the others, all on the same parameters. Each sub-batch's loss is weighted by n_i / n,
so the sum of the sub-batch gradients is exactly the mean gradient of the host batch,
uneven splits included.

Concurrent backward() calls that accumulate into the same leaf's .grad race (PyTorch,
"Autograd mechanics", thread safety: "multiple threads may access and try to accumulate
the same .grad attribute ... this is technically not safe"). So only the master thread
accumulates into .grad; pool threads get their gradients from torch.autograd.grad and
the master adds them, in worker order, which also keeps the sum deterministic.

Modules with running statistics (BatchNorm) update them from every thread, as under
any data parallelism; VGG16 and AlexNet have none.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from hybriddl.dropout import current_keys

from hybriddl.machine.hostinfo import usable_cores
from hybriddl.strategies.base import (CoreWorkersStrategy, StepStats, add_gradients, master_backward,
                                      sub_batches, worker_gradients)
from hybriddl.machine.cpu_threads import set_torch_threads


class Threads(CoreWorkersStrategy):
    name = "threads"
    summary = "K sub-batches, one Python thread each, shared parameters"

    def __init__(self, options):
        super().__init__(options)
        self.pool: ThreadPoolExecutor | None = None

    def setup(self, model) -> None:
        # Never more threads than cores this process may use (ranks sharing a machine
        # are pinned to their own cores): oversubscribed reductions crawl.
        self.reduce_threads = max(1, min(self.workers, usable_cores()))
        super().setup(model)
        if self.workers > 1:
            self.pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="hybriddl-thread")

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        n = len(y)
        parts = sub_batches(n, self.workers)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # One core per local worker: an intra-op pool on top would fight the workers.
        set_torch_threads(1)
        futures = [self.pool.submit(_sub_batch_gradients, self.model, params, x[a:b], y[a:b], n,
                                   self.options, current_keys(a, b))
                   for a, b in parts[1:]]
        try:
            (a, b) = parts[0]
            loss_sum = master_backward(self.model, x[a:b], y[a:b], n, self.options, start=a)
        finally:
            wait(futures)  # no worker may still run when this step ends, even on error
        # The reduction (and the optimizer step after it) runs while the workers idle,
        # so it may use every core.
        set_torch_threads(self.reduce_threads)
        with torch.no_grad():
            for future in futures:
                worker_loss_sum, grads = future.result()
                loss_sum += worker_loss_sum
                add_gradients(params, grads)
        return StepStats(n, loss_sum, time.perf_counter() - started, {"parts": len(parts)})

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _sub_batch_gradients(model, params, x, y, n, options, keys):
    set_torch_threads(1)  # OpenMP thread counts are per calling thread
    return worker_gradients(model, params, x, y, n, options, keys)

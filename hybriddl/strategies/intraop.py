"""PyTorch's own intra-op parallelism: one plain loop, K threads inside each operator.

What a PyTorch user gets without doing anything (the default is one thread per core).
"""

from __future__ import annotations

import time

import torch

from hybriddl.strategies.base import LocalStrategy, StepStats, criterion
from hybriddl.strategies.resources import local_workers


class IntraOp(LocalStrategy):
    name = "intraop"
    writes_gradients_once = True  # one backward pass: buckets may leave during it

    @classmethod
    def check_feasible(cls, options) -> None:
        local_workers(options)

    def __init__(self, options):
        super().__init__(options)
        self.workers = local_workers(options)

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers}

    def setup(self, model) -> None:
        torch.set_num_threads(self.workers)
        super().setup(model)

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        loss = criterion(self.model(x), y)
        loss.backward()
        return StepStats(len(y), loss.item() * len(y), time.perf_counter() - started)

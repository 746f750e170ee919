"""PyTorch's own intra-op parallelism: one plain loop, K threads inside each operator.

What a PyTorch user gets without doing anything (the default is one thread per core).
"""

from __future__ import annotations

from hybriddl.strategies.base import CoreWorkersStrategy, PlainConvolutions, StepStats, plain_step
from hybriddl.machine.cpu_threads import set_torch_threads


class IntraOp(PlainConvolutions, CoreWorkersStrategy):
    name = "intraop"
    summary = "K CPU threads inside each operator (PyTorch's own intra-op parallelism)"
    splits_batch = False  # its K threads share every operator, not the batch
    writes_gradients_once = True  # one backward pass: buckets may leave during it

    def setup(self, model) -> None:
        set_torch_threads(self.workers)
        super().setup(model)

    def compute_gradients(self, x, y) -> StepStats:
        return plain_step(self.model, x, y, self.options)

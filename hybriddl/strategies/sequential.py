"""The baseline: a plain loop on one CPU core (the paper's sequential reference)."""

from __future__ import annotations

import torch

from hybriddl.strategies.base import LocalStrategy, StepStats, plain_step


class Sequential(LocalStrategy):
    name = "sequential"
    writes_gradients_once = True

    def setup(self, model) -> None:
        # One core, so the speedup of every other strategy is measured against it.
        torch.set_num_threads(1)
        super().setup(model)

    def compute_gradients(self, x, y) -> StepStats:
        return plain_step(self.model, x, y, self.options)

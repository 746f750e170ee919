"""The baseline: a plain loop on one CPU core (the paper's sequential reference)."""

from __future__ import annotations

import time

import torch

from hybriddl.strategies.base import LocalStrategy, StepStats, criterion


class Sequential(LocalStrategy):
    name = "sequential"
    writes_gradients_once = True

    def setup(self, model) -> None:
        # One core, so the speedup of every other strategy is measured against it.
        torch.set_num_threads(1)
        super().setup(model)

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        loss = criterion(self.model(x), y)
        loss.backward()
        return StepStats(len(y), loss.item() * len(y), time.perf_counter() - started)

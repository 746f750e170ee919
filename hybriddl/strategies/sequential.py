"""The baseline: a plain loop on one CPU core (the paper's sequential reference)."""

from __future__ import annotations

from hybriddl.strategies.base import LocalStrategy, PlainConvolutions, StepStats, plain_step
from hybriddl.strategies.spec import StrategySpec
from hybriddl.machine.cpu_threads import set_torch_threads


class Sequential(PlainConvolutions, LocalStrategy):
    name = "sequential"
    summary = "one CPU core, the plain loop: the baseline"
    writes_gradients_once = True

    @classmethod
    def tuning_candidates(cls, host, batch_size: int) -> list[StrategySpec]:
        return [StrategySpec(cls.name)]  # one CPU core: the paper's reference

    def setup(self, model) -> None:
        # One core, so the speedup of every other strategy is measured against it.
        set_torch_threads(1)
        super().setup(model)

    def compute_gradients(self, x, y) -> StepStats:
        return plain_step(self.model, x, y, self.options)

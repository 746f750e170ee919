"""One optimizer step, written once: training runs it and the tuner times it.

What is tuned is therefore exactly what is trained: zero the gradients, let the local
strategy leave the host's mean gradient in .grad, average it over hosts, update, resync.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.optim import Optimizer

from hybriddl.strategies import LocalStrategy, StepStats
from hybriddl.strategies.base import host_gradients


def optimizer_step(strategy: LocalStrategy, optimizer: Optimizer, x, y,
                   average: Callable[[StepStats], None] | None = None,
                   gradients: Callable[[LocalStrategy, object, object], StepStats] | None = None
                   ) -> StepStats:
    """One step on (x, y); `gradients` leaves the host's gradient in .grad (the hosts'
    scheme's, hybriddl.hybrid.parallel; by default the strategy's over the host batch),
    `average` turns it into the global one."""
    optimizer.zero_grad(set_to_none=False)
    if gradients is not None:
        stats = gradients(strategy, x, y)
    else:
        # A host whose share of a short batch is empty contributes a zero gradient.
        stats = host_gradients(strategy, x, y) if len(y) else StepStats(0, 0.0)
    if average is not None:
        average(stats)
    optimizer.step()
    strategy.after_step()
    return stats

"""Local strategies, by name. Adding one = a module here + one line in STRATEGIES."""

from __future__ import annotations

from hybriddl.errors import UsageError
from hybriddl.strategies.base import LocalStrategy, StepStats, criterion
from hybriddl.strategies.flat import Flat
from hybriddl.strategies.gpu import Gpu
from hybriddl.strategies.gpu_threads import GpuThreads
from hybriddl.strategies.intraop import IntraOp
from hybriddl.strategies.pipeline import Pipeline
from hybriddl.strategies.processes import Processes
from hybriddl.strategies.resources import HostResources
from hybriddl.strategies.sequential import Sequential
from hybriddl.strategies.spec import STRATEGIES, StrategyOptions, StrategySpec
from hybriddl.strategies.threads import Threads

STRATEGIES.update({cls.name: cls for cls in (
    Sequential,
    IntraOp,
    Threads,
    Processes,
    Gpu,
    Pipeline,
    GpuThreads,
    Flat,
)})


def make_strategy(name: str, options: StrategyOptions = StrategyOptions()) -> LocalStrategy:
    """The named strategy, after checking that this host can run it."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        known = ", ".join(STRATEGIES)
        raise UsageError(f"unknown strategy {name!r}: choose one of {known}") from None
    cls.check_feasible(options)
    return cls(options)


__all__ = ["Flat", "Gpu", "GpuThreads", "HostResources", "IntraOp", "LocalStrategy", "Pipeline",
           "Processes", "STRATEGIES", "Sequential", "StepStats", "StrategyOptions", "StrategySpec",
           "Threads", "criterion", "make_strategy"]

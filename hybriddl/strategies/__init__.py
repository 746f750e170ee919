"""Local strategies, by name: the registry.

Adding a strategy = its module here (its class names itself, its one-line `summary`, its
tuning candidates, `needs_gpu` and `example_options`), its import and its line in
`register(...)` below, and its own tests. Everything else (the command line's list, the
tuner's candidates, the equivalence tests, the benchmarks' rows) enumerates STRATEGIES.
"""

from __future__ import annotations

from hybriddl.errors import UsageError
from hybriddl.strategies.base import (CoreWorkersStrategy, LocalStrategy, StepStats,
                                      check_numerics, criterion)
from hybriddl.strategies.flat import Flat
from hybriddl.strategies.gpu import Gpu
from hybriddl.strategies.gpu_threads import GpuThreads
from hybriddl.strategies.intraop import IntraOp
from hybriddl.strategies.layerwise import LayerWise
from hybriddl.strategies.pipeline import Pipeline
from hybriddl.strategies.processes import Processes
from hybriddl.strategies.resources import HostResources
from hybriddl.strategies.sequential import Sequential
from hybriddl.strategies.spec import PRECISIONS, STRATEGIES, StrategyOptions, StrategySpec
from hybriddl.strategies.threads import Threads


def register(*classes: type[LocalStrategy]) -> None:
    """Add strategies to STRATEGIES under their names, in the order given."""
    for cls in classes:
        if not cls.name or not cls.summary:
            raise ValueError(f"{cls.__name__} needs a name and a one-line summary to be registered")
        if STRATEGIES.get(cls.name, cls) is not cls:
            raise ValueError(f"strategy {cls.name!r} is registered already "
                             f"({STRATEGIES[cls.name].__name__})")
        STRATEGIES[cls.name] = cls


# The order the command line lists them and the tuner measures them: the baseline first.
register(
    Sequential,
    IntraOp,
    Threads,
    Processes,
    LayerWise,
    Gpu,
    Pipeline,
    GpuThreads,
    Flat,
)


def strategy_summaries() -> list[tuple[str, str]]:
    """(name, one-line summary) of every registered strategy, in the registry's order."""
    return [(name, cls.summary) for name, cls in STRATEGIES.items()]


def cpu_strategies() -> list[str]:
    """The registered strategies a host without GPUs computes with, the baseline first:
    those the tuner has candidates of on such a host."""
    cpu_host = HostResources(cores=2)
    return [name for name, cls in STRATEGIES.items()
            if not cls.needs_gpu and cls.tuning_candidates(cpu_host, 2)]


def with_workers() -> str:
    """The strategies that have local workers (`--workers`), from the registry."""
    return ", ".join(name for name, cls in STRATEGIES.items() if issubclass(cls, CoreWorkersStrategy))


def idle_workers(strategy: str, workers: int | None) -> str | None:
    """The line that says --workers does nothing with `strategy` (None where it acts)."""
    cls = STRATEGIES.get(strategy)
    if workers is None or cls is None or issubclass(cls, CoreWorkersStrategy):
        return None
    return (f"--workers {workers} does nothing with --strategy {strategy}, which has no local "
            f"workers (these have: {with_workers()})")


def idle_devices(strategy: str, devices: tuple[str, ...] | None) -> str | None:
    """The line that says --devices does nothing with `strategy`, which computes on this
    host's CPU cores (None where it takes devices: the strategies that default to GPUs)."""
    cls = STRATEGIES.get(strategy)
    if not devices or cls is None or cls.needs_gpu:
        return None
    takes = ", ".join(name for name, c in STRATEGIES.items() if c.needs_gpu)
    return (f"--devices {','.join(devices)} does nothing with --strategy {strategy}, which "
            f"computes on this host's CPU cores (these take devices: {takes})")


def make_strategy(name: str, options: StrategyOptions = StrategyOptions()) -> LocalStrategy:
    """The named strategy, after checking that this host can run it."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        known = ", ".join(STRATEGIES)
        raise UsageError(f"unknown strategy {name!r}: choose one of {known}") from None
    check_numerics(cls, options)
    cls.check_feasible(options)
    return cls(options)


__all__ = ["PRECISIONS", "STRATEGIES", "HostResources", "LocalStrategy", "StepStats",
           "StrategyOptions", "StrategySpec", "cpu_strategies", "criterion", "make_strategy",
           "register", "strategy_summaries"]

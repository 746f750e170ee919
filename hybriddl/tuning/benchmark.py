"""Measuring a local strategy: warm-up steps, then the median of timed optimizer steps.

Shared by the tuner and `scripts/bench_local.py` (whose peers, hybriddl.compare.local_peers,
return the same StepTiming), so that every figure in a table was taken the same way
(speedup = t_baseline / t_strategy).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from hybriddl.data import BatchTransform, ImageSet
from hybriddl.dropout import dropout_keys, sample_keys
from hybriddl.errors import UsageError
from hybriddl.step import make_optimizer, optimizer_step
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.usecases import SGD_LR, SGD_MOMENTUM, build_model
from hybriddl.machine.allocator import give_back_freed_memory, reset_high_water_mark
from hybriddl.machine.cpu_threads import torch_threads


@dataclass
class StepTiming:
    strategy: dict  # the strategy's describe()
    batch_size: int
    seconds_per_step: float  # median of the timed steps; inf when none was timed
    step_seconds: list[float]  # the timed steps (fewer than asked when keep_going stopped them)
    peak_rss_bytes: int  # this process and its children, highest sample
    warmup_seconds: list[float] = field(default_factory=list)
    # RSS counts memory shared between processes (parameters in shared memory) once per
    # process; PSS splits it between them, so it compares processes with threads fairly.
    peak_pss_bytes: int = 0
    # The kernel's high-water mark (VmHWM) summed over the processes: a peak inside a step,
    # which samples between steps miss when the allocator gives memory back before the
    # sample. measure_strategy gives freed memory back and resets the mark first, so it
    # is the candidate's own peak (plus what the process held before it started).
    peak_hwm_bytes: int = 0

    @property
    def images_per_second(self) -> float:
        return self.batch_size / self.seconds_per_step


def tree_rss_bytes() -> int:
    """RSS of this process plus its live children (worker processes)."""
    return tree_memory()[0]


def tree_memory() -> tuple[int, int, int]:
    """(RSS, PSS, high-water mark) of this process plus its live children; PSS and the
    high-water mark are 0 where unknown."""
    me = psutil.Process()
    rss = pss = hwm = 0
    for process in (me, *me.children(recursive=True)):
        try:
            info = process.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", 0)
            hwm += _high_water_mark(process.pid)
        except psutil.AccessDenied:
            rss += process.memory_info().rss
        except psutil.Error:
            pass
    return rss, pss, hwm


def _high_water_mark(pid: int) -> int:
    """The process's peak resident set (VmHWM in /proc/PID/status), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def sample_batch(images: ImageSet, batch_size: int, image_size: int, seed: int = 0):
    """A real batch of the use case's data, preprocessed as in training."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(len(images), (batch_size,), generator=generator)
    return BatchTransform(image_size)(images.images[index]), images.labels[index]


def timing_model(name: str, num_classes: int, dropout: float | None = 0.0) -> torch.nn.Module:
    """The model at `dropout` (None: the model's own, as training runs it) where it has the
    option (resnets have none)."""
    try:
        return build_model(name, num_classes, dropout=dropout)
    except UsageError:
        return build_model(name, num_classes)


def measure_strategy(name: str, options: StrategyOptions, model_name: str, num_classes: int,
                     x: torch.Tensor, y: torch.Tensor, *, warmup: int = 1, steps: int = 5,
                     lr: float = SGD_LR, momentum: float = SGD_MOMENTUM, seed: int = 0,
                     keep_going: Callable[[int, float], bool] | None = None,
                     dropout: float | None = 0.0) -> StepTiming:
    """Time full optimizer steps (gradients + SGD update) of one strategy on one batch.

    `keep_going(step, seconds)` is asked after every step, warm-up included, whether to
    take the next one: the tuner's budget stops a slow candidate there. `dropout` None
    times the model's own dropout with keyed masks, each step's samples keyed as training
    keys them, so that drawing the masks counts (the tuner); 0 leaves it out (the peers of
    bench_local, which have none).
    """
    # This candidate's memory from here on, not what earlier ones in this process held.
    give_back_freed_memory()
    reset_high_water_mark()
    torch.manual_seed(seed)
    model = timing_model(model_name, num_classes, dropout)
    # Strategies pin threads; leave the caller as it was.
    with torch_threads(), make_strategy(name, options) as strategy:
        strategy.setup(model)
        optimizer = make_optimizer(model.parameters(), lr, momentum)
        warm, seconds, peak = [], [], tree_memory()
        x = strategy.stage_batch(x)  # on the device already, as training's prefetch leaves it
        strategy.synchronize()
        for step in range(warmup + steps):
            keys = sample_keys(seed, 0, torch.arange(step * len(y), (step + 1) * len(y)))
            started = time.perf_counter()
            with dropout_keys(keys):
                optimizer_step(strategy, optimizer, x, y)
            strategy.synchronize()  # a GPU step returns when it is queued
            elapsed = time.perf_counter() - started
            peak = tuple(map(max, peak, tree_memory()))
            if step >= warmup:
                seconds.append(elapsed)
            else:
                warm.append(elapsed)
            if keep_going is not None and not keep_going(step, elapsed):
                break
        description = strategy.describe()
    median = statistics.median(seconds) if seconds else math.inf
    return StepTiming(description, len(y), median, seconds, peak[0], warmup_seconds=warm,
                      peak_pss_bytes=peak[1], peak_hwm_bytes=peak[2])

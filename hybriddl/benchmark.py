"""Measuring a local strategy: warm-up steps, then the median of timed optimizer steps.

Shared by the tuner, `scripts/bench_local.py` and `hybriddl compare`, so that every
figure in a table was taken the same way (speedup = t_baseline / t_strategy).
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
from hybriddl.errors import UsageError
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.usecases import build_model


@dataclass
class StepTiming:
    strategy: dict  # the strategy's describe()
    batch_size: int
    seconds_per_step: float  # median of the timed steps; inf when none was timed
    step_seconds: list[float]  # the timed steps (fewer than asked when keep_going stopped them)
    peak_rss_bytes: int  # this process and its children, highest sample
    warmup_seconds: list[float] = field(default_factory=list)

    @property
    def images_per_second(self) -> float:
        return self.batch_size / self.seconds_per_step


def tree_rss_bytes() -> int:
    """RSS of this process plus its live children (worker processes)."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def sample_batch(images: ImageSet, batch_size: int, image_size: int, seed: int = 0):
    """A real batch of the use case's data, preprocessed as in training."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(len(images), (batch_size,), generator=generator)
    return BatchTransform(image_size)(images.images[index]), images.labels[index]


def timing_model(name: str, num_classes: int) -> torch.nn.Module:
    """The model with dropout 0 where it has the option (resnets have none)."""
    try:
        return build_model(name, num_classes, dropout=0.0)
    except UsageError:
        return build_model(name, num_classes)


def measure_strategy(name: str, options: StrategyOptions, model_name: str, num_classes: int,
                     x: torch.Tensor, y: torch.Tensor, *, warmup: int = 1, steps: int = 5,
                     lr: float = 0.001, momentum: float = 0.9, seed: int = 0,
                     keep_going: Callable[[int, float], bool] | None = None) -> StepTiming:
    """Time full optimizer steps (gradients + SGD update) of one strategy on one batch.

    `keep_going(step, seconds)` is asked after every step, warm-up included, whether to
    take the next one: the tuner's budget stops a slow candidate there.
    """
    torch.manual_seed(seed)
    model = timing_model(model_name, num_classes)
    threads = torch.get_num_threads()
    try:
        with make_strategy(name, options) as strategy:
            strategy.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            warm, seconds, peak = [], [], tree_rss_bytes()
            for step in range(warmup + steps):
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=False)
                strategy.compute_gradients(x, y)
                optimizer.step()
                strategy.after_step()
                elapsed = time.perf_counter() - started
                peak = max(peak, tree_rss_bytes())
                if step >= warmup:
                    seconds.append(elapsed)
                else:
                    warm.append(elapsed)
                if keep_going is not None and not keep_going(step, elapsed):
                    break
            description = strategy.describe()
    finally:
        torch.set_num_threads(threads)  # strategies pin threads; leave the caller as it was
    median = statistics.median(seconds) if seconds else math.inf
    return StepTiming(description, len(y), median, seconds, peak, warm)

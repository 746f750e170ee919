"""One host's step measured here: what `hybriddl emulate --host-step` divides by the step
of the host it emulates to find the speedup S.

A host of C cores computes with PyTorch's own intra-op threads (C of them: the local
strategy the scaling benchmarks give every contender), timed as the tuner times a
candidate (`measure_strategy`: warm-up steps, then full optimizer steps on a real batch).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

from hybriddl.strategies import IntraOp, StrategyOptions, StrategySpec
from hybriddl.tuning.benchmark import measure_strategy, sample_batch, timing_model
from hybriddl.tuning.tuner import embedded_images, tune_settings
from hybriddl.usecases import check_image_size

# Enough to see the spread of a step without spending the time of a run: the first step
# (allocations, oneDNN's kernel choices) untimed.
HOST_STEP_WARMUP = 1
HOST_STEP_STEPS = 3


@dataclass(frozen=True)
class HostStep:
    """A C-core host's step here: the median of the timed steps, and each of them."""

    usecase: str
    model: str
    image_size: int
    batch_size: int
    cores: int  # C, the host's cores
    threads: int  # what it ran on: C, or this machine's cores where it has fewer
    strategy: str  # the local strategy's label
    step_seconds: list[float]  # the timed steps, scaled to C cores (see measure_host_step)

    @property
    def seconds(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.step_seconds), max(self.step_seconds)

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds, "spread": list(self.spread)}


def measure_host_step(usecase: str, cores: int, *, model: str | None = None,
                      image_size: int | None = None, batch_size: int | None = None,
                      channels_last: bool = False, warmup: int = HOST_STEP_WARMUP,
                      steps: int = HOST_STEP_STEPS) -> HostStep:
    """Time `steps` optimizer steps of one host of `cores` cores on the use case's embedded
    images (its model, image size and per-host batch where left out). A host of more
    cores than this machine has runs on all of them, its steps scaled by threads / cores:
    compute is assumed to scale with cores, as the emulated hosts assume."""
    settings = tune_settings(usecase, model, image_size, batch_size)
    images = embedded_images(settings)
    # An image too small for the model is one line here, as in tune, not torch's error.
    check_image_size(timing_model(settings.model, len(images.classes)), settings.image_size,
                     len(images.classes))
    threads = min(cores, len(os.sched_getaffinity(0)))
    x, y = sample_batch(images, settings.batch_size, settings.image_size)
    timing = measure_strategy(IntraOp.name, StrategyOptions(workers=threads,
                                                            channels_last=channels_last),
                              settings.model, len(images.classes), x, y, warmup=warmup,
                              steps=steps, lr=settings.case.lr,
                              momentum=settings.case.momentum)
    label = StrategySpec.from_dict(timing.strategy).label
    return HostStep(usecase=settings.usecase, model=settings.model,
                    image_size=settings.image_size, batch_size=settings.batch_size,
                    cores=cores, threads=threads, strategy=label,
                    step_seconds=[s * threads / cores for s in timing.step_seconds])

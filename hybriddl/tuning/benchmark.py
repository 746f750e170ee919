"""Measuring a local strategy: warm-up steps, then the median of timed optimizer steps.

Shared by the tuner, `scripts/bench_local.py` and `hybriddl compare`, so that every
figure in a table was taken the same way (speedup = t_baseline / t_strategy).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from hybriddl.data import BatchTransform, ImageSet
from hybriddl.errors import UsageError
from hybriddl.data.sharding import split_bounds
from hybriddl.run.step import optimizer_step
from hybriddl.strategies import StrategyOptions, criterion, make_strategy
from hybriddl.strategies.base import prepare_model, run_forward
from hybriddl.usecases import build_model
from hybriddl.machine.allocator import (give_back_freed_memory, keep_freed_memory,
                                      reset_high_water_mark)
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
    # This candidate's memory from here on, not what earlier ones in this process held.
    give_back_freed_memory()
    reset_high_water_mark()
    torch.manual_seed(seed)
    model = timing_model(model_name, num_classes)
    # Strategies pin threads; leave the caller as it was.
    with torch_threads(), make_strategy(name, options) as strategy:
        strategy.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        warm, seconds, peak = [], [], tree_memory()
        for step in range(warmup + steps):
            started = time.perf_counter()
            optimizer_step(strategy, optimizer, x, y)
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


def measure_pytorch(threads: int, model_name: str, num_classes: int, x: torch.Tensor,
                    y: torch.Tensor, *, warmup: int = 1, steps: int = 5, lr: float = 0.001,
                    momentum: float = 0.9, seed: int = 0,
                    numerics: StrategyOptions = StrategyOptions(),
                    keep_memory: bool = False, compile: bool = False) -> StepTiming:
    """The PyTorch peer: the textbook loop, PyTorch's own intra-op threads (its default);
    with `numerics` bf16 / channels_last, the autocast loop of PyTorch's AMP recipe; with
    `keep_memory`, glibc told to keep freed memory as hybriddl's strategies do (call it
    in a fresh process: the setting stays for the process's life); with `compile`, the
    model under torch.compile (compiled in the first warm-up step). An allocator such as
    tcmalloc is the caller's: LD_PRELOAD in the fresh process's environment."""
    if keep_memory:
        keep_freed_memory()
    with torch_threads(threads):
        torch.manual_seed(seed)
        model = build_model(model_name, num_classes, dropout=0.0)
        prepare_model(model, numerics)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        seconds, peak = _timed_steps(torch.compile(model) if compile else model, optimizer,
                                     x, y, max(warmup, 1) if compile else warmup, steps,
                                     numerics=numerics)
    described = {"name": "pytorch", "threads": threads}
    if numerics != StrategyOptions():
        described.update(precision=numerics.precision, channels_last=numerics.channels_last)
    if keep_memory:
        described["freed_memory"] = "kept"
    if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        described["allocator"] = "tcmalloc"
    if compile:
        described["compiled"] = True
    return StepTiming(described, len(y), statistics.median(seconds), seconds, peak[0],
                      peak_pss_bytes=peak[1], peak_hwm_bytes=peak[2])


def measure_ddp(processes: int, model_name: str, num_classes: int, x: torch.Tensor,
                y: torch.Tensor, *, warmup: int = 1, steps: int = 5, lr: float = 0.001,
                momentum: float = 0.9, seed: int = 0) -> StepTiming:
    """The DDP peer: P spawned processes, one thread each, gloo over 127.0.0.1, each on
    its share of the batch. Rank 0's step times; memory summed over the ranks' peaks."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_loopback_port()
    # start_processes joins every rank and, if one fails, stops the others and raises.
    mp.start_processes(_ddp_rank, nprocs=processes, start_method="spawn",
                       args=(processes, port, results, model_name, num_classes, x, y, warmup,
                             steps, lr, momentum, seed))
    reports = sorted(results.get() for _ in range(processes))
    seconds = reports[0][1]
    here = tree_memory()
    rss, pss, hwm = (here[i] + sum(r[2 + i] for r in reports) for i in range(3))
    return StepTiming({"name": "ddp", "backend": "gloo", "processes": processes}, len(y),
                      statistics.median(seconds), seconds, rss, peak_pss_bytes=pss,
                      peak_hwm_bytes=hwm)


def _ddp_rank(rank, world, port, results, model_name, num_classes, x, y, warmup, steps, lr,
              momentum, seed) -> None:
    import torch.distributed as dist

    # The same DDP as `hybriddl compare`'s ddp contender.
    from hybriddl.compare.ddp_peer import gloo_group, wrap

    with gloo_group(rank, world, "127.0.0.1", port, "lo"):
        torch.manual_seed(seed)
        model, _ = wrap(build_model(model_name, num_classes, dropout=0.0), world)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        start, stop = split_bounds(len(y), [1.0] * world)[rank]
        seconds, peak = _timed_steps(model, optimizer, x[start:stop], y[start:stop], warmup, steps,
                                     before_step=dist.barrier)
        results.put((rank, seconds, *peak))


def _timed_steps(model, optimizer, x, y, warmup, steps, before_step=None,
                 numerics: StrategyOptions = StrategyOptions()):
    seconds, peak = [], tree_memory()
    for step in range(warmup + steps):
        if before_step is not None:
            before_step()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        criterion(run_forward(model, x, numerics), y).backward()
        optimizer.step()
        elapsed = time.perf_counter() - started
        peak = tuple(map(max, peak, tree_memory()))
        if step >= warmup:
            seconds.append(elapsed)
    return seconds, peak


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

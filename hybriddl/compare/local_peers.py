"""The peers a strategy is compared with on one host (`scripts/bench_local.py`): PyTorch's
textbook loop, as shipped or tuned, and DDP over loopback, timed as the tuner times a
strategy (hybriddl.tuning.benchmark) so that their StepTimings stand in one table."""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch

from hybriddl.data.sharding import split_bounds
from hybriddl.machine.allocator import keep_freed_memory
from hybriddl.machine.cpu_threads import torch_threads
from hybriddl.strategies import StrategyOptions, criterion
from hybriddl.strategies.base import prepare_model, run_forward
from hybriddl.tuning.benchmark import StepTiming, tree_memory
from hybriddl.usecases import SGD_LR, SGD_MOMENTUM, build_model


def measure_pytorch(threads: int, model_name: str, num_classes: int, x: torch.Tensor,
                    y: torch.Tensor, *, warmup: int = 1, steps: int = 5, lr: float = SGD_LR,
                    momentum: float = SGD_MOMENTUM, seed: int = 0,
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
                y: torch.Tensor, *, warmup: int = 1, steps: int = 5, lr: float = SGD_LR,
                momentum: float = SGD_MOMENTUM, seed: int = 0) -> StepTiming:
    """The DDP peer: P spawned processes, one thread each, gloo over 127.0.0.1, each on
    its share of the batch. Rank 0's step times; memory summed over the ranks' peaks."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_loopback_port()
    ranks = mp.start_processes(_ddp_rank, nprocs=processes, start_method="spawn", join=False,
                               args=(processes, port, results, model_name, num_classes, x, y,
                                     warmup, steps, lr, momentum, seed))
    reports = sorted(reports_while_joining(ranks, results))
    seconds = reports[0][1]
    here = tree_memory()
    rss, pss, hwm = (here[i] + sum(r[2 + i] for r in reports) for i in range(3))
    return StepTiming({"name": "ddp", "backend": "gloo", "processes": processes}, len(y),
                      statistics.median(seconds), seconds, rss, peak_pss_bytes=pss,
                      peak_hwm_bytes=hwm)


def reports_while_joining(ranks, results) -> list:
    """Every rank's report, read while the ranks are joined: a rank whose report fills the
    queue's pipe (64 KiB: thousands of steps' times) waits for it to be read before it
    can end. The join raises where a rank failed, having stopped the others."""
    reports = []
    while True:
        while not results.empty():
            reports.append(results.get())
        if ranks.join(timeout=0.1):
            break
    while not results.empty():
        reports.append(results.get())
    return reports


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

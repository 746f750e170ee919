"""What a strategy may use on this host: how many local workers, which devices.

Checked in `check_feasible`, before any worker, file or device is touched, so that an
impossible request ends with one line of advice instead of a half-started run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybriddl.errors import UsageError
from hybriddl.machine.hostinfo import usable_cores
from hybriddl.strategies.spec import StrategyOptions


def local_workers(options: StrategyOptions) -> int:
    """K: --workers, or one worker per usable core; never more than the cores unless asked."""
    cores = usable_cores()
    workers = cores if options.workers is None else options.workers
    if workers < 1:
        raise UsageError(f"--workers {workers}: give at least 1 local worker")
    if workers > cores and not options.oversubscribe:
        raise UsageError(f"--workers {workers} is more than the {cores} usable cores of this host: "
                         f"give --workers {cores} or less, or add --oversubscribe")
    return workers


def parse_device(name: str) -> torch.device:
    """A device this host has: 'cpu' or 'cuda:N' with N below the number of GPUs."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r}: use cpu or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise UsageError(f"unsupported device {name!r}: use cpu or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"device {name!r} asked for, but this host has no CUDA device: "
                         "use cpu devices or --strategy sequential/threads/processes")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UsageError(f"device {name!r} does not exist: this host has "
                         f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def parse_devices(options: StrategyOptions, default: tuple[str, ...]) -> list[torch.device]:
    return [parse_device(name) for name in (options.devices or default)]


def require_cuda(strategy: str) -> None:
    if not torch.cuda.is_available():
        raise UsageError(f"no CUDA device: strategy {strategy!r} needs one; "
                         "use --strategy sequential/threads/processes")


@dataclass(frozen=True)
class HostResources:
    """What tuning candidates are drawn from: usable CPU cores and CUDA devices."""

    cores: int
    cuda_devices: int = 0

    @classmethod
    def here(cls) -> HostResources:
        return cls(usable_cores(), torch.cuda.device_count() if torch.cuda.is_available() else 0)

    @property
    def gpus(self) -> list[str]:
        return [f"cuda:{i}" for i in range(self.cuda_devices)]


def worker_counts(cores: int) -> list[int]:
    """K = 2 .. cores; past 8, only doublings and the full count, each K costing a measurement."""
    counts = list(range(2, min(cores, 8) + 1))
    k = 16
    while k < cores:
        counts.append(k)
        k *= 2
    if cores > 8:
        counts.append(cores)
    return counts

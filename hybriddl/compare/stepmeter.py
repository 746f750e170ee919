"""What one rank of a contender measures over its timed steps (`hybriddl compare`).

Every contender (hybrid, flat, DDP) feeds the same meter, so every figure of the
comparison is taken the same way: seconds of each optimizer step after a warm-up,
bytes handed to the communication library, bytes this rank's host sent on its NIC, peak RSS.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import psutil

from hybriddl.tuning.benchmark import tree_rss_bytes
from hybriddl.files import atomic_write_json
from hybriddl.run.trainer import TrainingObserver

# An emulated host's one NIC (see hybriddl.emulation): it carries only what leaves the
# host, so its counter excludes what co-located ranks exchange through shared memory.
HOST_NIC = "eth0"


def nic_bytes_sent(interface: str = HOST_NIC) -> int:
    """Bytes this network namespace's `interface` has sent since it was made."""
    return psutil.net_io_counters(pernic=True)[interface].bytes_sent


def gradient_bytes(model) -> int:
    """Bytes of one full gradient: what each rank hands to an allreduce per step (fp32)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class StepMeter(TrainingObserver):
    """Times `steps` optimizer steps after `warmup` and counts the bytes they moved.

    The window opens and closes at step boundaries; every contender's step ends with
    a collective, so all ranks are within one step of each other there and what the
    window misses of the last step's tail it gained from the warm-up's.
    """

    def __init__(self, warmup: int, steps: int, comm_bytes: Callable[[], int],
                 interface: str = HOST_NIC, rss_bytes: Callable[[], int] = tree_rss_bytes):
        """`rss_bytes`: the memory this rank holds, by default its process and its children
        (a rank's worker processes)."""
        if warmup < 0 or steps < 1:
            raise ValueError(f"need warmup >= 0 and steps >= 1, got {warmup} and {steps}")
        self.warmup, self.steps = warmup, steps
        self._comm_bytes = comm_bytes
        self.interface = interface
        self.seen = 0
        self.step_seconds: list[float] = []
        self._rss_bytes = rss_bytes
        self.peak_rss_bytes = rss_bytes()
        self._opened = self._edge() if warmup == 0 else None
        self._closed: tuple[int, int] | None = None

    def _edge(self) -> tuple[int, int]:
        return nic_bytes_sent(self.interface), self._comm_bytes()

    @property
    def remaining(self) -> int:
        return self.warmup + self.steps - self.seen

    def on_step(self, epoch: int, step: int, samples: int, seconds: float, loss: float) -> None:
        self.seen += 1
        self.peak_rss_bytes = max(self.peak_rss_bytes, self._rss_bytes())
        if self.seen == self.warmup:
            self._opened = self._edge()
        elif self.warmup < self.seen <= self.warmup + self.steps:
            self.step_seconds.append(seconds)
            if self.seen == self.warmup + self.steps:
                self._closed = self._edge()

    def result(self) -> dict:
        """This rank's figures; raises if the timed steps did not all run."""
        if self._opened is None or self._closed is None:
            raise RuntimeError(f"only {self.seen} of {self.warmup + self.steps} steps ran")
        return {"timed_steps": self.steps, "step_seconds": self.step_seconds,
                "host": socket.gethostname(),
                "nic_bytes_sent": self._closed[0] - self._opened[0],
                "comm_bytes": self._closed[1] - self._opened[1],
                "peak_rss_bytes": self.peak_rss_bytes}


def rank_result_path(result_dir: Path, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.json"


def write_rank_result(result_dir: Path, rank: int, record: dict) -> None:
    atomic_write_json(rank_result_path(result_dir, rank), record)


def read_rank_results(result_dir: Path, ranks: int) -> list[dict]:
    """Every rank's record, in rank order; a missing one means that rank did not finish."""
    records = []
    for rank in range(ranks):
        path = rank_result_path(result_dir, rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: rank {rank} left no result")
        records.append(json.loads(path.read_text()))
    return records

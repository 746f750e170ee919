"""What one rank handed to MPI and how its steps split between computing and waiting.

These are the figures metrics.json records per epoch (`mpi_bytes_sent`, `comm_seconds`,
`compute_seconds`, their `per_step` lists and every rank's totals in `by_rank`): the
traffic the application asked for, set beside what each host's interface really sent.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil

STEP_FIGURES = ("mpi_bytes_sent", "nic_bytes_sent", "comm_seconds", "compute_seconds")


def interface_bytes_sent() -> int:
    """Bytes this host's network interfaces (loopback aside) have sent: what crossed the
    network, beside what the application handed to MPI. In an emulated host's namespace
    these are its own NIC's counters."""
    return sum(counters.bytes_sent for name, counters in
               psutil.net_io_counters(pernic=True).items() if name != "lo")


class TrafficMeter:
    """Bytes handed to MPI (cumulative, and per step and epoch) and each step's time split.

    `counts_buckets` adds `buckets_sent_in_backward` to the epoch's figures: the fusion
    buckets that left while backward still ran (overlap), meaningful only under MPI.
    """

    def __init__(self, counts_buckets: bool = False):
        self.bytes_sent = 0  # everything this rank handed to MPI, cumulative
        self.buckets_sent_in_backward = 0  # this epoch
        self._counts_buckets = counts_buckets
        self._steps: dict[str, list] = {name: [] for name in STEP_FIGURES}
        self._epoch_bytes_at = 0
        self._nic_at_last_step: int | None = None

    def sent(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)

    def begin_epoch(self) -> None:
        for values in self._steps.values():
            values.clear()
        self._epoch_bytes_at = self.bytes_sent
        self.buckets_sent_in_backward = 0
        self._nic_at_last_step = None

    def nic_step_start(self, now: int) -> int:
        """Where a step's count of the interface's bytes starts: the end of the epoch's
        previous step, so bytes that leave between steps (the tail of a step's messages,
        still queued in the kernel when its averaging returned: seen at 10 Gbit/s) are
        counted in the next step rather than lost; `now` for an epoch's first step."""
        return now if self._nic_at_last_step is None else self._nic_at_last_step

    def step_done(self, *, bytes_at_start: int, compute_seconds: float,
                  comm_seconds: float, nic_at_start: int = 0, nic_at_end: int = 0) -> None:
        """One step's figures; `bytes_at_start` is `bytes_sent` when the step began,
        `nic_at_start` (from `nic_step_start`) and `nic_at_end` the host's interface
        counter around it."""
        self._steps["mpi_bytes_sent"].append(self.bytes_sent - bytes_at_start)
        self._steps["nic_bytes_sent"].append(nic_at_end - nic_at_start)
        self._nic_at_last_step = nic_at_end
        self._steps["comm_seconds"].append(comm_seconds)
        self._steps["compute_seconds"].append(compute_seconds)

    def epoch_figures(self) -> dict:
        """This rank's totals over the epoch so far."""
        figures = {"mpi_bytes_sent": self.bytes_sent - self._epoch_bytes_at,
                   "nic_bytes_sent": sum(self._steps["nic_bytes_sent"]),
                   "comm_seconds": sum(self._steps["comm_seconds"]),
                   "compute_seconds": sum(self._steps["compute_seconds"])}
        if self._counts_buckets:
            figures["buckets_sent_in_backward"] = self.buckets_sent_in_backward
        return figures

    def epoch_record(self, allgather: Callable[[dict], list[dict]]) -> dict:
        """The epoch's figures, per step, and every rank's totals (`allgather` is the
        hosts' collective, so every host must call this at the same point)."""
        mine = self.epoch_figures()
        by_rank = allgather(mine)
        per_step = {key: [round(v, 6) if isinstance(v, float) else v for v in values]
                    for key, values in self._steps.items()}
        return {**mine, "per_step": per_step, "by_rank": by_rank}

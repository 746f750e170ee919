"""What the trainer asks of the hosts of a run, whichever they are (see cluster.connect)."""

from __future__ import annotations

import statistics
import time

from torch import nn

from hybriddl.data import GlobalBatch
from hybriddl.errors import UsageError
from hybriddl.data.sharding import split_bounds, split_counts
from hybriddl.hosts.naming import host_name

BALANCE_POLICIES = ("throughput", "even")
DEFAULT_TIMEOUT_SECONDS = 120.0


def host_weights(balance: str | None, throughputs: list[float | None]) -> tuple[list[float], str, str | None]:
    """Each host's weight in the split of a global batch, the policy used, and a note.

    `throughputs` are the hosts' images/s (from their profiles or --throughput), None
    where unknown. Without --balance, hosts whose figures differ get throughput
    shares, so a fast host does not wait for a slow one at every step.
    """
    if balance is not None and balance not in BALANCE_POLICIES:
        raise UsageError(f"--balance {balance}: choose one of {', '.join(BALANCE_POLICIES)}")
    for rank, figure in enumerate(throughputs):
        if figure is not None and not figure > 0:
            raise UsageError(f"--throughput {figure} on rank {rank}: give a positive images/s")
    hosts = len(throughputs)
    known = [t for t in throughputs if t is not None]
    if balance is None:
        balance = "throughput" if len(known) == hosts and len(set(known)) > 1 else "even"
    if balance == "even":
        return [1.0] * hosts, "even", None
    if not known:
        return [1.0] * hosts, "even", ("--balance throughput: no host knows its images/s (no "
                                       "profile, no --throughput), so shares stay even")
    fill = statistics.fmean(known)
    note = None
    if len(known) < hosts:
        missing = [r for r, t in enumerate(throughputs) if t is None]
        note = (f"--balance throughput: ranks {missing} have no images/s figure and count "
                f"as the others' mean ({fill:.1f} images/s)")
    return [fill if t is None else float(t) for t in throughputs], "throughput", note


class Hosts:
    """What the trainer asks of the hosts; the single-host case does no communication.

    Per step the trainer calls `begin_step(batch)` just before the local strategy
    computes and `average_gradients` just after, so the time between the two is
    computation and the time inside `average_gradients` is (exposed) communication.
    """

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.bytes_sent = 0  # everything this rank handed to MPI, cumulative
        self.notes: list[str] = []  # things the user should know, for the CLI to show
        self.weights = [1.0] * self.size
        self.balance = "even"
        self._step_share: tuple[int, int] | None = None  # (this host's samples, global samples)
        self._compute_started: float | None = None
        self._step_bytes_at = 0
        self._steps = {"mpi_bytes_sent": [], "comm_seconds": [], "compute_seconds": []}
        self._epoch_bytes_at = 0

    # ------------------------------------------------------------------ set-up
    def describe(self) -> dict:
        return {"count": self.size, "names": [host_name()], "balance": self.balance,
                "weights": self.weights, "notes": self.notes}

    def check_same(self, settings: dict) -> None:
        """Refuse to start when hosts were given different training settings."""
        everyone = self.allgather(settings)
        for key in settings:
            values = [host.get(key) for host in everyone]
            if any(v != values[0] for v in values):
                listed = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values))
                raise UsageError(f"hosts disagree on {key} ({listed}): give every host the "
                                 "same training options")

    def agree_shares(self, balance: str | None, throughput: float | None) -> None:
        """Decide, identically on every host, how global batches are split between hosts."""
        figures = self.allgather(throughput)
        policies = set(self.allgather(balance))
        if len(policies) > 1:
            raise UsageError(f"hosts disagree on --balance ({sorted(map(str, policies))}): "
                             "give every host the same --balance")
        self.weights, self.balance, note = host_weights(balance, figures)
        if note:
            self.notes.append(note)

    def attach(self, model: nn.Module, gradient_hooks: bool = False) -> None:
        """Prepare gradient averaging for `model` (after the strategy set it up)."""

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's initial parameters everywhere; alone, they already are."""

    def broadcast_object(self, value):
        """Rank 0's `value` on every host."""
        return value

    def allgather(self, value) -> list:
        """Every host's `value`, in rank order."""
        return [value]

    def barrier(self) -> None:
        """Return when every host has arrived."""

    # ------------------------------------------------------------------ one step
    def host_part(self, batch: GlobalBatch) -> GlobalBatch:
        """This host's slice of a global batch, proportional to its weight."""
        if self.size == 1:
            return batch
        start, stop = split_bounds(len(batch.indices), self.weights)[self.rank]
        return batch.part(start, stop)

    def begin_step(self, batch: GlobalBatch) -> None:
        """The local strategy is about to compute the gradient of this host's part."""
        total = len(batch.indices)
        mine = split_counts(total, self.weights)[self.rank] if self.size > 1 else total
        self._step_share = (mine, total)
        self._step_bytes_at = self.bytes_sent
        self._compute_started = time.perf_counter()

    def average_gradients(self, model: nn.Module, samples: int) -> None:
        """Leave the mean gradient over the global batch in every host's parameters."""
        entered = time.perf_counter()
        compute = entered - self._compute_started if self._compute_started is not None else 0.0
        if self._compute_started is None:
            self._step_bytes_at = self.bytes_sent
        self._average(model, samples)
        self._steps["comm_seconds"].append(time.perf_counter() - entered)
        self._steps["compute_seconds"].append(compute)
        self._steps["mpi_bytes_sent"].append(self.bytes_sent - self._step_bytes_at)
        self._compute_started = None
        self._step_share = None

    def _average(self, model: nn.Module, samples: int) -> None:
        """Alone, the host's mean gradient already is the global one."""

    def mean_over_hosts(self, total: float, samples: int) -> float:
        return total / max(samples, 1)

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` is true on any host: how all hosts agree to stop at the same step."""
        return bool(flag)

    # ------------------------------------------------------------------ accounting
    def begin_epoch(self) -> None:
        for values in self._steps.values():
            values.clear()
        self._epoch_bytes_at = self.bytes_sent

    def epoch_record(self) -> dict:
        """This epoch's traffic and time split, per step and per rank (collective)."""
        mine = self._epoch_figures()
        by_rank = self.allgather(mine)
        per_step = {key: [round(v, 6) if isinstance(v, float) else v for v in values]
                    for key, values in self._steps.items()}
        return {**mine, "per_step": per_step, "by_rank": by_rank}

    def _epoch_figures(self) -> dict:
        return {"mpi_bytes_sent": self.bytes_sent - self._epoch_bytes_at,
                "comm_seconds": sum(self._steps["comm_seconds"]),
                "compute_seconds": sum(self._steps["compute_seconds"])}

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Leave cleanly after a successful run."""

    def abort(self, exit_code: int) -> None:
        """Stop every host now (after a failure on this one)."""
        raise SystemExit(exit_code)

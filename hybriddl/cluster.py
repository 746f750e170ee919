"""The hosts of a run, as the trainer sees them. One host needs no MPI at all.

The MPI implementation (one rank per host) keeps the same small surface; the
trainer never imports mpi4py.
"""

from __future__ import annotations

import socket

from torch import nn

from hybriddl.data import GlobalBatch


class SingleHost:
    """A run on one host: every global batch is this host's, nothing to average."""

    rank = 0
    size = 1
    bytes_sent = 0

    def describe(self) -> dict:
        return {"count": 1, "names": [socket.gethostname()]}

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's initial parameters everywhere; alone, they already are."""

    def host_part(self, batch: GlobalBatch) -> GlobalBatch:
        return batch

    def average_gradients(self, model: nn.Module, samples: int) -> None:
        """The mean gradient over the global batch; alone, the host's mean is it."""

    def mean_over_hosts(self, total: float, samples: int) -> float:
        return total / max(samples, 1)

    def barrier(self) -> None:
        """Return when every host has arrived; alone, at once."""

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` is true on any host: how all hosts agree to stop at the same step."""
        return bool(flag)

"""Stop requests: SIGTERM (a SLURM time limit, preemption), SIGINT (Ctrl-C), SIGUSR1.

A signal handler only sets a flag. The trainer reads it between optimizer steps, so a
step is never cut in half, and asks the hosts whether *any* of them was signalled, so
every MPI rank stops at the same step and they all write the same checkpoint position.
A second signal while the first is being honoured abandons the run at once
(KeyboardInterrupt): the last checkpoint on disk is kept as it is.
"""

from __future__ import annotations

import signal

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hybriddl.machine.naming import host_name

# SIGUSR1 too, because Open MPI 5's mpirun (PRRTE 3) answers SIGTERM and SIGINT by killing
# the ranks itself: SIGCONT, 250 ms, SIGTERM, 250 ms, SIGKILL (odls_base_default_fns.c,
# hard-coded), which leaves no time for a checkpoint. It forwards SIGUSR1 untouched, so
# `kill -USR1 <mpirun>`, or SLURM's `#SBATCH --signal=B:USR1@300` with `exec mpirun ...`,
# stops every rank at one step with a checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """The signal that asked this process to stop, or None while nobody has."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum} while stopping")
        self.signum = signum

    def _handle(self, signum, frame) -> None:
        self.request(signum)

    @contextmanager
    def handling_signals(self) -> Iterator[StopRequest]:
        """Route the stop signals to this request; the previous handlers come back after."""
        previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)



def failure_exit_code(exc: BaseException) -> int:
    """The exit code of a run that ended with `exc`: 2 bad input, 130 interrupted, 1 else."""
    from hybriddl.errors import UsageError

    return 2 if isinstance(exc, UsageError) else 130 if isinstance(exc, KeyboardInterrupt) else 1


def stop_every_host(hosts, exc: BaseException, show: Callable[[str, BaseException], None]) -> None:
    """Under mpirun, have `show` say which rank failed and why, then take every rank down.

    One rank's failure must not leave the others waiting in a collective. Returns only
    for a single host, where the caller reports the error as usual.
    """
    from hybriddl.hosts.cluster import SingleHost

    if isinstance(hosts, SingleHost):
        return
    show(f"rank {hosts.rank} on {host_name()}", exc)
    hosts.abort(failure_exit_code(exc))

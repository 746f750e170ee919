"""What a run that stopped on a failure leaves for `hybriddl launch` in its run directory.

Under mpirun the survivors of a lost host stop with `HostFailure` and take every rank
down; mpirun's exit code then says only that something failed. So each rank that stops
on an error writes `rank<R>-failure.json`: the cause, the hosts named lost (rank and
name), and how far this attempt had come (optimizer steps, when the last one ended), from
which the launcher tells which host to drop and how many steps the relaunch redoes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hybriddl.errors import StorageError
from hybriddl.hosts.naming import host_name
from hybriddl.run.rundir import atomic_write_json

FAILURE_GLOB = "rank*-failure.json"
# Set by `hybriddl launch` for its ranks: a run started by hand leaves no such files.
LAUNCHED_ENV = "HYBRIDDL_LAUNCHED"
HOST_LOST, STORAGE, INTERRUPTED = "host lost", "storage", "interrupted"


class StepsSeen:
    """A training observer that counts this attempt's optimizer steps, passing every call
    on to the observer it wraps (the display)."""

    def __init__(self, observer):
        self._observer = observer
        self.steps = 0
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        self.step_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self._observer, name)

    def on_step(self, epoch: int, step: int, samples: int, seconds: float, loss: float) -> None:
        self.steps += 1
        self.last_step_at = time.time()
        self.first_step_at = self.first_step_at or self.last_step_at
        self.step_seconds += seconds
        self._observer.on_step(epoch, step, samples, seconds, loss)


def cause_of(exc: BaseException) -> str:
    if getattr(exc, "lost", None) is not None:  # HostFailure (hosts/mpi.py), even unnamed
        return HOST_LOST
    if isinstance(exc, StorageError):
        return STORAGE
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    return type(exc).__name__


def record_failure(run_dir: str | Path | None, rank: int, exc: BaseException,
                   steps: StepsSeen) -> None:
    """Under `hybriddl launch`, write `rank<R>-failure.json` in `run_dir`. Best effort: the
    disk may be what failed, and the error itself must still reach the user."""
    if not os.environ.get(LAUNCHED_ENV) or run_dir is None or not Path(run_dir).is_dir():
        return
    record = {"rank": rank, "host": host_name(), "cause": cause_of(exc),
              "lost": {str(r): name for r, name in sorted(getattr(exc, "lost", {}).items())},
              "message": str(exc), "at": time.time(), "steps": steps.steps,
              "first_step_at": steps.first_step_at, "last_step_at": steps.last_step_at,
              "mean_step_seconds": steps.step_seconds / steps.steps if steps.steps else None}
    try:
        atomic_write_json(Path(run_dir) / f"rank{rank}-failure.json", record)
    except (OSError, StorageError):
        pass


def read_failures(run_dir: str | Path) -> list[dict]:
    """Every rank's failure record in `run_dir`, by rank (unreadable ones skipped)."""
    records = []
    for path in sorted(Path(run_dir).glob(FAILURE_GLOB)):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            pass
    return sorted(records, key=lambda record: record.get("rank", 0))


def clear_failures(run_dir: str | Path) -> None:
    for path in Path(run_dir).glob(FAILURE_GLOB):
        path.unlink(missing_ok=True)

"""What a run that stopped on a failure leaves for `hybriddl launch` in its run directory.

Under mpirun the survivors of a lost host stop with `HostFailure` and take every rank
down; mpirun's exit code then says only that something failed. So each rank that stops
on an error writes `rank<R>-failure.json`: the cause, the hosts named lost (rank and
name), and how far this attempt had come (optimizer steps, when the last one ended), from
which the launcher tells which host to drop and how many steps the relaunch redoes. A
rank that stops on request (the launcher's SIGTERM or Ctrl-C, passed on as SIGUSR1) writes
`rank<R>-stopped.json` with the same progress, for what the stop cost.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hybriddl.errors import StorageError, UsageError
from hybriddl.machine.naming import host_name
from hybriddl.files import atomic_write_json

FAILURE_GLOB = "rank*-failure.json"
STOP_GLOB = "rank*-stopped.json"
# Set by `hybriddl launch` for its ranks, to the attempt's number (from 1): a run started by
# hand leaves no such files, and a record says which attempt wrote it.
LAUNCHED_ENV = "HYBRIDDL_LAUNCHED"
HOST_LOST, STORAGE, INTERRUPTED = "host lost", "storage", "interrupted"
# A rank refused its input (exit 2), whichever UsageError said so.
REFUSED = UsageError.__name__


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
    if isinstance(exc, UsageError):
        return REFUSED
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    return type(exc).__name__


def record_failure(run_dir: str | Path | None, rank: int, exc: BaseException,
                   steps: StepsSeen) -> None:
    """Under `hybriddl launch`, write `rank<R>-failure.json` in `run_dir`. Best effort: the
    disk may be what failed, and the error itself must still reach the user."""
    _write(run_dir, f"rank{rank}-failure.json", {
        "rank": rank, "host": host_name(), "cause": cause_of(exc),
        "lost": {str(r): name for r, name in sorted(getattr(exc, "lost", {}).items())},
        "message": str(exc), **_progress(steps)})


def record_stop(run_dir: str | Path | None, rank: int, steps: StepsSeen) -> None:
    """Under `hybriddl launch`, write `rank<R>-stopped.json`: this rank stopped on request
    (its checkpoint is written), and how far it had come."""
    _write(run_dir, f"rank{rank}-stopped.json", {
        "rank": rank, "host": host_name(), "cause": "stopped", "lost": {}, "message": "",
        **_progress(steps)})


def _progress(steps: StepsSeen) -> dict:
    return {"at": time.time(), "steps": steps.steps, "first_step_at": steps.first_step_at,
            "last_step_at": steps.last_step_at,
            "mean_step_seconds": steps.step_seconds / steps.steps if steps.steps else None}


def _write(run_dir: str | Path | None, name: str, record: dict) -> None:
    """Best effort: the disk may be what failed, and the error itself must still reach
    the user."""
    if not os.environ.get(LAUNCHED_ENV) or run_dir is None or not Path(run_dir).is_dir():
        return
    try:
        atomic_write_json(Path(run_dir) / name, {**record, "attempt": launch_attempt()})
    except (OSError, StorageError):
        pass


def launch_attempt() -> int | None:
    """The launch attempt this rank belongs to (LAUNCHED_ENV), None outside a launch."""
    try:
        return int(os.environ.get(LAUNCHED_ENV, ""))
    except ValueError:
        return None


def read_failures(run_dir: str | Path, pattern: str = FAILURE_GLOB,
                  attempt: int | None = None) -> list[dict]:
    """Every rank's failure record (or with STOP_GLOB, stop record) in `run_dir`, by rank
    (unreadable ones skipped); with `attempt`, only that attempt's: a cut-off host's ranks
    of an earlier attempt may still write theirs, late, into a shared run directory."""
    records = []
    for path in sorted(Path(run_dir).glob(pattern)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if attempt is None or record.get("attempt") in (None, attempt):
            records.append(record)
    return sorted(records, key=lambda record: record.get("rank", 0))


def clear_failures(run_dir: str | Path) -> None:
    """Delete the failure and stop records of an earlier attempt."""
    for pattern in (FAILURE_GLOB, STOP_GLOB):
        for path in Path(run_dir).glob(pattern):
            path.unlink(missing_ok=True)

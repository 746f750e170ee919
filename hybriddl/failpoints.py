"""Faults the code injects into itself, as etcd's gofail and TiKV's fail-rs do: named points,
switched on by one environment variable, `HYBRIDDL_FAILPOINTS`, read once per process, and
free when it is unset (one dictionary lookup where a point sits).

    HYBRIDDL_FAILPOINTS="stall-exchange=1@3,drift=0@2"

- `stall-start=R`: host R never comes to the first exchange between hosts (the heartbeat's
  set-up), as a host whose start hangs;
- `stall-heartbeat=R`: host R answers the others' roll call, then never comes to the
  heartbeat's set-up (its addresses exchanged between hosts): a host that hangs in between;
- `die-data=R`: host R's process is killed (SIGKILL) once its data is loaded, before the
  hosts agree that every host's data is ready: a host lost during the run's set-up;
- `stall-exchange=R@N`: host R stops entering exchanges after its step N, while its
  heartbeat goes on beating: a host alive that no longer takes part;
- `drift=R@N`: after step N, host R adds one unit in the last place to the first element
  of its first parameter: hosts no longer hold the same model;
- `stall-inside=R@N`: after step N, host R enters its next exchange (its beats say so) and
  never drives it: an exchange every host is inside in which nothing moves;
- `stall-ahead=R@N`: after step N, host R says it entered the exchange after its next one
  and never drives either: hosts inside different exchanges (a collective they entered
  differently), in which nothing moves;
- `busy=R@N:SECONDS`: after step N, host R spends SECONDS in one C call that holds
  Python's GIL (libc's sleep through ctypes.PyDLL): no thread of it runs meanwhile, as in a
  long call of a library that keeps the GIL.

Several are separated by commas. `hybriddl emulate` and `hybriddl launch` pass the variable
to every host (mpirun -x), SLURM's srun passes the job's environment. docs/faults.md says
what each looks like from outside.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from hybriddl.errors import UsageError

VARIABLE = "HYBRIDDL_FAILPOINTS"
# name -> (pattern of its value, an example)
POINTS = {"stall-start": (r"(\d+)", "stall-start=1"),
          "stall-heartbeat": (r"(\d+)", "stall-heartbeat=1"),
          "die-data": (r"(\d+)", "die-data=1"),
          "stall-exchange": (r"(\d+)@(\d+)", "stall-exchange=1@3"),
          "drift": (r"(\d+)@(\d+)", "drift=1@2"),
          "busy": (r"(\d+)@(\d+):(\d+)", "busy=1@2:30"),
          "stall-inside": (r"(\d+)@(\d+)", "stall-inside=1@2"),
          "stall-ahead": (r"(\d+)@(\d+)", "stall-ahead=1@2")}


@dataclass(frozen=True)
class Failpoint:
    name: str
    rank: int
    step: int | None = None
    seconds: int | None = None  # busy's


def parse(text: str) -> dict[str, Failpoint]:
    """The failpoints `text` names; UsageError (one line) for anything else."""
    points: dict[str, Failpoint] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in POINTS:
            raise UsageError(f"{VARIABLE}: unknown failpoint {name!r}; choose from "
                             f"{', '.join(POINTS)} (e.g. {POINTS['stall-exchange'][1]})")
        pattern, example = POINTS[name]
        match = re.fullmatch(pattern, value.strip())
        if match is None:
            raise UsageError(f"{VARIABLE}: {item!r}: give it as {example}")
        numbers = [int(g) for g in match.groups()]
        points[name] = Failpoint(name, *numbers)
    return points


_ACTIVE: dict[str, Failpoint] | None = None


def active() -> dict[str, Failpoint]:
    """The failpoints of this process, read from the environment once."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = parse(os.environ.get(VARIABLE, ""))
    return _ACTIVE


def fires(name: str, rank: int, step: int | None = None) -> bool:
    """Whether failpoint `name` fires on host `rank` (after step `step`, where it has one)."""
    point = active().get(name)
    return point is not None and point.rank == rank and (point.step is None
                                                         or point.step == step)


_ARMED: set[str] = set()


def arm(name: str) -> None:
    """Let failpoint `name` fire where it sits (a point in another layer, armed at a step)."""
    _ARMED.add(name)


def armed(name: str) -> bool:
    return name in _ARMED


def seconds(name: str) -> int | None:
    """The seconds a failpoint of this process gives (busy's), None where it gives none."""
    point = active().get(name)
    return point.seconds if point is not None else None


def hold_the_gil(seconds: int) -> None:
    """Sleep `seconds` in libc, called with the GIL held (ctypes.PyDLL keeps it): every
    other thread of this process waits, the heartbeat's among them."""
    import ctypes
    ctypes.PyDLL(None).sleep(ctypes.c_uint(seconds))


def die() -> None:
    """This process is killed, as by the kernel's OOM killer: nothing of it runs after."""
    os.kill(os.getpid(), signal.SIGKILL)


def stall_for_ever() -> None:
    """This thread waits for ever (other threads, the heartbeat's among them, go on)."""
    while True:
        time.sleep(3600)

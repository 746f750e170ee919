"""Which of this machine's cores a rank computes on.

mpirun binds ranks to one core by default when there are few of them, but a host's local
strategy needs all of its cores: the rank takes back the cores its launcher (the MPI
daemon, our parent) may use, all of the machine's or an emulated host's own. Ranks that
share a machine (tests, emulation) divide those cores between them.
"""

from __future__ import annotations

import os
from typing import Callable

import psutil

from hybriddl.machine.cpu_threads import set_torch_threads

PRODUCTION_HINT = "production runs use one rank per host (mpirun -npernode 1)"


def take_cores(sharing: int, position: int, gather: Callable[[list[int]], list[list[int]]],
               host: str, rank: int) -> tuple[list[int], list[str]]:
    """Pin this process to its part of the machine's usable cores and give torch as many
    threads; returns the cores and a note for each thing a user should know.

    `sharing` ranks share the machine, this one at `position`; `gather` collects every
    sharing rank's usable cores (an allgather on the machine's communicator).
    """
    bound_to = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, launcher_cores())
    except OSError:
        pass
    usable = sorted(os.sched_getaffinity(0))
    notes = []
    if sharing > 1:
        usable = sorted(set().union(*map(set, gather(usable))))
        if len(usable) >= sharing:
            n = len(usable)
            mine = usable[position * n // sharing:(position + 1) * n // sharing]
            each = sorted({(i + 1) * n // sharing - i * n // sharing for i in range(sharing)})
            notes.append(f"{sharing} ranks share host {host} ({n} cores): "
                         f"{'-'.join(map(str, each))} core(s) each; {PRODUCTION_HINT}")
        else:
            mine = [usable[position % len(usable)]]
            notes.append(f"{sharing} ranks share host {host} with only {len(usable)} cores: "
                         f"they are oversubscribed; {PRODUCTION_HINT}")
    else:
        mine = usable
        if len(bound_to) < len(usable):
            notes.append(f"mpirun had bound rank {rank} to cores {bound_to}; alone on its "
                         f"host, it uses all {len(usable)} cores")
    os.sched_setaffinity(0, mine)
    set_torch_threads(len(mine))
    return mine, notes


def launcher_cores() -> list[int]:
    """The cores this process's parent may use (every core when that cannot be read)."""
    try:
        return psutil.Process(os.getppid()).cpu_affinity() or list(range(os.cpu_count() or 1))
    except psutil.Error:
        return list(range(os.cpu_count() or 1))

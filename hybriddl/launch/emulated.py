"""`hybriddl launch` on emulated hosts: the launcher on host 0, the hosts reached through
their rsh agent, exactly as on machines reached by ssh.

`hybriddl emulate` runs its command under mpirun on every host; a launcher must instead
run once, where mpirun would (host 0: only there are the hosts' addresses reachable), and
start mpirun itself. This gives its argv and environment.
"""

from __future__ import annotations

import os
import sys

from hybriddl.emulation.hosts import MPI_TRANSPORT, EmulatedHosts


def launch_on(cluster: EmulatedHosts, launch_args: list[str]) -> tuple[list[str], dict]:
    """argv and environment of `hybriddl launch LAUNCH_ARGS...` on `cluster`'s host 0,
    with a hostfile of every host (their addresses, in order) and their rsh agent."""
    hostfile = cluster.folder / "launch-hostfile"
    hostfile.write_text("".join(f"{address}\n" for address in cluster.addresses))
    mca = [word for key, value in MPI_TRANSPORT.items() for word in ("--mca", key, value)]
    argv = cluster.on_host(0, [sys.executable, "-m", "hybriddl", "launch", "--hostfile",
                               str(hostfile), "--rsh-agent", str(cluster.folder / "agent"),
                               *mca, *launch_args])
    # Emulating hosts needs root, so the ranks run as root too.
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return argv, env

"""mpirun for the tests that stand for several hosts: across emulated hosts (one network
namespace each, see hybriddl.emulation) where this machine lets the tests make them,
otherwise every rank on this machine over loopback TCP, as real hosts cannot be had."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybriddl.emulation import EmulatedHosts

MPIRUN = Path(sys.executable).parent / "mpirun"
LOOPBACK = ["--oversubscribe", "--bind-to", "none", "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", "lo"]


@dataclass(frozen=True)
class Launcher:
    """mpirun and its options (append `-np N COMMAND`); rank r runs on host r."""

    argv: list[str]
    hostnames: list[str]  # what a rank's socket.gethostname() says
    nodes: list[str]      # what mpirun calls the host in its messages
    emulated: bool
    cluster: EmulatedHosts | None = None

    def cut_link(self, rank: int) -> None:
        """Take the network link of rank `rank`'s host down (emulated hosts only)."""
        self.cluster.set_link(rank % len(self.nodes), up=False)

    def hostname(self, rank: int) -> str:
        return self.hostnames[rank % len(self.hostnames)]

    def node(self, rank: int) -> str:
        return self.nodes[rank % len(self.nodes)]

    def place(self, first_rank: int, ranks: int) -> list[str]:
        """Options of one app (MPMD `:`) putting its ranks on hosts first_rank, ...: mpirun
        maps each app from the first host again."""
        if not self.emulated:
            return []
        return ["--host", ",".join(self.node(r) for r in range(first_rank, first_rank + ranks))]


def can_emulate() -> bool:
    return os.geteuid() == 0 and all(map(shutil.which, ("ip", "tc", "unshare")))


@contextmanager
def hosts_launcher(hosts: int = 3):
    if not can_emulate():
        name = socket.gethostname()
        yield Launcher([str(MPIRUN), *LOOPBACK], [name], [name], emulated=False)
        return
    with EmulatedHosts(hosts=hosts) as cluster:
        yield Launcher(cluster.mpirun_options(), cluster.names, cluster.addresses,
                       emulated=True, cluster=cluster)

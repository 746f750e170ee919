"""How a host is named in logs, metrics and profiles."""

from __future__ import annotations

import os
import socket


def host_name() -> str:
    """This host's name in logs, metrics and profiles: SLURM's node name when SLURM started us.

    Under SLURM the node name is how users and `squeue` know a host, and it stays distinct
    where several slurmd nodes share one machine (and so one real hostname).
    """
    # slurm: SLURMD_NODENAME is set by slurmd for every task of a job or step.
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()

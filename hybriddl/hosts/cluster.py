"""The hosts of a run, as the trainer sees them. One host needs no MPI at all.

`connect()` gives `SingleHost` when the process was not started by mpirun, and
`hybriddl.hosts.mpi.MPIHosts` (one rank per host) when it was. Both keep the same small
surface, so the trainer never imports mpi4py and never asks which one it holds.
"""

from __future__ import annotations

import os

from hybriddl.hosts.base import DEFAULT_PROGRESS_SECONDS, DEFAULT_TIMEOUT_SECONDS, Hosts
from hybriddl.hosts.compression import Compression
from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES

# Set by Open MPI (mpirun/prterun), PMIx launchers (srun --mpi=pmix) and MPICH's hydra.
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")


def launched_by_mpirun(environ=os.environ) -> bool:
    return any(name in environ for name in LAUNCHER_VARIABLES)


def connect(*, overlap: bool = False, compression=Compression.none,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            timeout: float = DEFAULT_TIMEOUT_SECONDS,
            progress_timeout: float = DEFAULT_PROGRESS_SECONDS) -> Hosts:
    """The hosts of this run. MPI is initialised only when a launcher started us.

    Without mpirun nothing touches MPI, so `hybriddl train` on one machine (and the
    worker processes that strategies spawn) never pays for it or depends on it.
    """
    if not launched_by_mpirun():
        return SingleHost(compression=compression)
    from hybriddl.hosts.mpi import MPIHosts

    return MPIHosts(overlap=overlap, compression=compression, bucket_bytes=bucket_bytes,
                    timeout=timeout, progress_timeout=progress_timeout)


class SingleHost(Hosts):
    """A run on one host: every global batch is this host's, nothing to average."""

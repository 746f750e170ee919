"""What this machine is: the facts `hybriddl info` shows and profiles fingerprint (the MPI
library's version is the host layer's: hybriddl.hosts.mpi.library_versions)."""

from __future__ import annotations

import os
import platform

import psutil

from hybriddl import __version__
from hybriddl.machine.naming import host_name


def usable_cores() -> int:
    """Cores this process may run on (affinity, cgroup-limited launchers such as mpirun)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return psutil.cpu_count(logical=True) or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[dict]:
    import torch  # here, not above: the commands that only start processes never load torch

    if not torch.cuda.is_available():
        return []
    return [{"index": i, "name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]


def host_info() -> dict:
    import torch
    import torchvision

    memory = psutil.virtual_memory()
    return {
        "host": host_name(),
        "cpu_model": cpu_model(),
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_usable": usable_cores(),
        "ram_gib": round(memory.total / 2**30, 1),
        "ram_available_gib": round(memory.available / 2**30, 1),
        "gpus": gpus(),
        "hybriddl": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "torch_threads": torch.get_num_threads(),
    }

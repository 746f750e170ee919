"""Freed memory kept for the next step (hosts/allocator.py): a large tensor allocated again
touches no new pages, so a step pays no page faults for memory the last step freed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import hybriddl_env

# In a child: the setting is for the life of a process, and this one must stay as it was.
SECOND_ALLOCATION_FAULTS = """
import resource, torch
from hybriddl.hosts.allocator import keep_freed_memory
kept = keep_freed_memory()
def fill():
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB, far above glibc's largest mmap threshold
fill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_allocation(**env: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", SECOND_ALLOCATION_FAULTS], capture_output=True,
                          text=True, timeout=120, env=hybriddl_env(**env))
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_freed_large_tensor_is_reused_without_page_faults():
    kept, faults = second_allocation()
    assert kept == "True" and faults < 1000  # 64 MiB in 4 KiB pages would be 16,384
    # The opt-out leaves glibc's defaults: the same allocation faults every page in again.
    kept, faults = second_allocation(HYBRIDDL_MALLOC="system")
    assert kept == "False" and faults > 8000

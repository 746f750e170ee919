"""Freed memory kept for the next step (machine/allocator.py): once the heap holds what a step
needs, a step pays no page faults for memory the last step freed, and the heap stops growing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import hybriddl_env

# In a child: the setting is for the life of a process, and this one must stay as it was.
# A step's large temporaries, freed together at its end, far above glibc's largest mmap
# threshold (32 MiB); after a few steps the heap holds what a step needs. Steady state is
# judged on the median of 5 measured steps: on CI one step in 3 once faulted one 40 MiB
# block in again (glibc placing a block in a new spot), which a single window reads as
# "no reuse", though the other steps faulted nothing.
STEADY_STEP_FAULTS = """
import resource, torch
from hybriddl.machine.allocator import keep_freed_memory
kept = keep_freed_memory()
def step():
    a = torch.empty(12 * 2**20).fill_(1.0)  # 48 MiB
    b = torch.empty(10 * 2**20).fill_(2.0)  # 40 MiB
    (a[: 10 * 2**20] * b).sum()
for _ in range(5):
    step()
faults, growth = [], []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF)
    step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults.append(after.ru_minflt - before.ru_minflt)
    growth.append(after.ru_maxrss - before.ru_maxrss)
print(kept, sorted(faults)[2], sorted(growth)[2])
"""


def steady_step(**env: str) -> tuple[str, int, int]:
    """(kept?, median page faults of steps 6-10, median growth of the peak RSS in kB)."""
    done = subprocess.run([sys.executable, "-c", STEADY_STEP_FAULTS], capture_output=True,
                          text=True, timeout=120, env=hybriddl_env(**env))
    assert done.returncode == 0, done.stderr
    kept, faults, growth = done.stdout.split()
    return kept, int(faults), int(growth)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_steps_freed_memory_is_reused_without_page_faults_or_growth():
    kept, faults, growth = steady_step()
    # 88 MiB in 4 KiB pages would be 22,528 faults a step; the heap does not grow either.
    assert kept == "True" and faults < 1000 and growth < 1024
    # The opt-out leaves glibc's defaults: the same step faults every page in again.
    kept, faults, growth = steady_step(HYBRIDDL_MALLOC="system")
    assert kept == "False" and faults > 20000


PEAK_INSIDE_A_STEP = """
import torch
from hybriddl.tuning.benchmark import tree_memory
torch.empty(64 * 2**20).fill_(1.0)  # 256 MiB, touched, freed: glibc unmaps it at once
rss, pss, hwm = tree_memory()
print(rss, hwm)
"""


def test_the_high_water_mark_sees_a_peak_that_was_given_back_before_the_sample():
    done = subprocess.run([sys.executable, "-c", PEAK_INSIDE_A_STEP], capture_output=True,
                          text=True, timeout=120, env=hybriddl_env())
    assert done.returncode == 0, done.stderr
    rss, hwm = map(int, done.stdout.split())
    assert hwm - rss > 200 * 2**20  # the sampled RSS no longer holds the 256 MiB


# With freed memory kept, a 256 MiB block freed stays resident (and in the high-water
# mark); giving it back and resetting the mark starts the next measurement from what is live.
GIVE_BACK = """
import torch
from hybriddl.machine.allocator import (give_back_freed_memory, keep_freed_memory,
                                        reset_high_water_mark)
from hybriddl.tuning.benchmark import tree_memory
assert keep_freed_memory()
block = torch.ones(64 * 2**20)  # 256 MiB
del block
rss_kept, _, hwm_kept = tree_memory()
print(give_back_freed_memory(), reset_high_water_mark())
rss, _, hwm = tree_memory()
print((rss_kept - rss) // 2**20, (hwm_kept - hwm) // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")
def test_a_measurement_starts_from_what_is_live_not_what_was_kept():
    done = subprocess.run([sys.executable, "-c", GIVE_BACK], capture_output=True, text=True,
                          timeout=120, env=hybriddl_env())
    assert done.returncode == 0, done.stderr
    flags, drops = done.stdout.splitlines()
    assert flags == "True True"
    rss_drop, hwm_drop = map(int, drops.split())
    assert rss_drop > 200 and hwm_drop > 200  # MiB of the 256 MiB block

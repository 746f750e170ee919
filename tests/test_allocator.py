"""Freed memory kept for the next step (hosts/allocator.py): a large tensor allocated again
touches no new pages, so a step pays no page faults for memory the last step freed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, hybriddl_env

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


def test_bench_memory_reuse_measures_both_modes_in_alternating_rounds(tmp_path):
    output = tmp_path / "reuse.json"
    done = subprocess.run([sys.executable, "scripts/bench_memory_reuse.py", "--model",
                           "squeezenet1_1", "--image-size", "32", "--batch-size", "4",
                           "--rounds", "2", "--steps", "2", "--warmup", "1",
                           "--output", str(output)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=hybriddl_env())
    assert done.returncode == 0, done.stderr
    result = json.loads(output.read_text())
    # Round 1 runs system first, round 2 keep first: neither mode always comes warm.
    assert [list(r) for r in result["rounds"]] == [["system", "keep"], ["keep", "system"]]
    assert all(len(r[m]["step_seconds"]) == 2 for r in result["rounds"] for m in r)
    ratio = result["summary"]["ratio_system_over_keep"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]


def test_bench_memory_reuse_refuses_a_strategy_with_worker_processes(tmp_path):
    output = tmp_path / "reuse.json"
    done = subprocess.run([sys.executable, "scripts/bench_memory_reuse.py", "--strategy",
                           "processes", "--output", str(output)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=hybriddl_env())
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    assert done.stdout.strip().startswith("bench_memory_reuse: error: --strategy processes")
    assert not output.exists()


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

"""scripts/chaos.py, shortened: a run on 3 emulated hosts under `hybriddl launch` gets its
disk filled before a checkpoint and a SIGTERM to the launcher (then the same command
again), finishes with the parameters of the uninterrupted run, and leaves nothing behind:
no process, namespace, cgroup, mount, /dev/shm file or temporary file. The full schedule
(five faults, 48 steps) is `sudo python scripts/chaos.py`."""

from __future__ import annotations

import importlib.util
import os

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("chaos", REPO / "scripts" / "chaos.py")
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts and a tmpfs for the full disk "
                       "need root"),
    pytest.mark.root, pytest.mark.emulated, pytest.mark.mpi, pytest.mark.slow,
]


def test_schedule_is_seeded_and_each_fault_lands_between_checkpoints():
    plan = chaos.schedule(__import__("random").Random(3), list(chaos.FAULTS), 48)
    assert plan == chaos.schedule(__import__("random").Random(3), list(chaos.FAULTS), 48)
    assert sorted(kind for kind, _, _ in plan) == sorted(chaos.FAULTS)
    steps = [step for _, step, _ in plan]
    assert steps == sorted(steps) and steps[-1] < 48 and len(set(steps)) == len(steps)


def test_the_host_counts_of_a_run_are_read_from_the_resumes_its_checkpoints_kept():
    # A compressed chaos run's resumes: a host lost at step 16, two more losses on 2
    # hosts, SIGTERM and the same command on 3 hosts at 58, a full disk at 72.
    metrics = {"config": {"hosts": {"count": 3}},
               "resumes": [{"steps_done": s, "hosts": {"count": c}}
                           for s, c in ((16, 2), (36, 2), (40, 2), (58, 3), (72, 3))]}
    assert chaos.host_counts(metrics, 96) == [(0, 16, 3), (16, 58, 2), (58, 96, 3)]
    # A launch that kept no step leaves no stretch, and its neighbours join.
    metrics["resumes"][1:1] = [{"steps_done": 36, "hosts": {"count": 3}}]
    metrics["resumes"][3:3] = [{"steps_done": 40, "hosts": {"count": 3}}]
    assert chaos.host_counts(metrics, 96) == [(0, 16, 3), (16, 58, 2), (58, 96, 3)]
    assert chaos.host_counts({"config": {"hosts": {"count": 3}}}, 96) == [(0, 96, 3)]


def test_a_full_disk_and_a_stopped_launcher_still_end_as_uninterrupted(tmp_path):
    result = chaos.chaos(seed=1, steps=24, kinds=["disk", "sigterm"],
                         log_path=tmp_path / "log.txt")
    log = (tmp_path / "log.txt").read_text()[-3000:]
    assert result["finished"] and result["exit_code"] == 0, log
    assert [f["kind"] for f in result["faults"]] in (["disk", "sigterm"], ["sigterm", "disk"])
    causes = {f["kind"]: f["cause"] for f in result["faults"]}
    # A full disk stops the run where it is noticed: rank 0's checkpoint write (storage),
    # or another rank's check for room (UsageError: free some space).
    assert causes["disk"] in ("storage", "UsageError"), log
    assert causes["sigterm"] == "stopped by SIGTERM", log
    # The ranks stopped together after one step and checkpointed it: nothing to redo, and
    # the stop cost the time from that step to the end plus a start.
    stopped = next(f for f in result["faults"] if f["kind"] == "sigterm")
    assert stopped["steps_redone"] == 0 and stopped["seconds_lost"] > 0, stopped
    assert 143 in result["launcher_exit_codes"]
    assert result["max_abs_diff"] <= 1e-5
    # The host count never changed: nothing to judge apart from its rounding.
    assert result["host_counts"] == [[0, 24, 3]] and result["same_host_counts_diff"] is None
    assert result["checkpoint_bytes_written"] > 0
    assert result["left_behind"] == []
    for key in ("cpu_model", "cores", "torch", "git_commit", "command"):
        assert result[key]

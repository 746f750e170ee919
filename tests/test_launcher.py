"""`hybriddl launch` on 3 emulated hosts: a host whose rank is killed is left out of the
relaunch, the run goes on from its checkpoint on the 2 others, the host is taken back at
the next relaunch, and the run ends with the parameters of an uninterrupted run; nothing
is left behind."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import REPO, hybriddl_env, run_cli
from emulated import can_emulate
from hybriddl.emulation import EmulatedHosts
from hybriddl.cli.launch import split_training
from hybriddl.launch.emulated import launch_on
from hybriddl.launch.launcher import EVENTS, read_hostfile
from hybriddl.errors import UsageError
from hybriddl.rundir import MODEL

spec = importlib.util.spec_from_file_location("chaos", REPO / "scripts" / "chaos.py")
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)

STEPS = 24
LOST_HOST_SIZE = chaos.image_size_for(["kill"])  # another host count: 32 px


def test_the_training_must_name_one_run_directory():
    assert split_training(["--", "train", "--run-dir=a", "--max-steps", "3"]) == \
        (["train", "--max-steps", "3"], Path("a").resolve())
    for command in (["train", "--max-steps", "3"], ["tune"],
                    ["train", "--run-dir", "a", "--resume", "b"]):
        with pytest.raises(UsageError):
            split_training(command)


def test_hostfile_lines_are_hosts_in_order(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode2 slots=4\n\nnode1  # spare\n")
    assert read_hostfile(hostfile) == ["node2", "node1"]


def test_bad_launch_input_is_one_line_and_exit_2(tmp_path):
    done = run_cli("launch", "--hostfile", str(tmp_path / "none"), "--", "train",
                   "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not can_emulate(), reason="emulated hosts need root, ip, tc and unshare")
@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
def test_a_lost_host_sits_out_one_relaunch_and_the_run_ends_as_uninterrupted(tmp_path):
    before_shm = set(os.listdir("/dev/shm"))
    reference = tmp_path / "reference"
    # The uninterrupted run trains meanwhile, in one process: nothing here is timed, and
    # the launcher's relaunches leave the cores idle part of the time.
    uninterrupted = subprocess.Popen(
        [sys.executable, "-m", "hybriddl", *chaos.train_args(reference, STEPS, LOST_HOST_SIZE)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=hybriddl_env())
    run_dir = tmp_path / "run"
    log = open(tmp_path / "log.txt", "w")
    with EmulatedHosts(hosts=3) as cluster:
        argv, env = launch_on(cluster, chaos.launch_args(run_dir, STEPS, LOST_HOST_SIZE))
        env["PYTHONPATH"] = str(REPO)
        launcher = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        watch = chaos.CheckpointWatch(run_dir)
        seen: set[int] = set()
        try:
            for host, after_step, on_hosts in ((2, 4, {0, 1, 2}), (1, 12, {0, 1})):
                def ready():
                    assert launcher.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
                    ranks = chaos.rank_processes(psutil.Process(launcher.pid))
                    fresh = ranks and not {p.pid for p in ranks.values()} & seen
                    return fresh and watch.steps >= after_step and len(ranks) == len(on_hosts)
                chaos.wait_until(ready, f"a checkpoint of step {after_step}", 300)
                ranks = chaos.rank_processes(psutil.Process(launcher.pid))
                placed = {chaos.host_of(p, cluster): p for p in ranks.values()}
                assert set(placed) == on_hosts
                seen.update(p.pid for p in ranks.values())
                placed[host].kill()
            assert launcher.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]
            # The ranks write into the launcher's log: told it is no terminal, no colours.
            assert "\x1b[" not in (tmp_path / "log.txt").read_text()
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            watch.close()
            log.close()
            try:
                _, reference_stderr = uninterrupted.communicate(timeout=300)
            finally:
                if uninterrupted.poll() is None:
                    uninterrupted.kill()
                    uninterrupted.communicate()
        names = dict(zip(cluster.addresses, cluster.names))
    assert uninterrupted.returncode == 0, reference_stderr[-2000:]
    events = [json.loads(line) for line in (run_dir / EVENTS).read_text().splitlines()]
    assert [(names[e["host"]], e["cause"]) for e in events] == [("h2", "host lost"),
                                                                ("h1", "host lost")]
    assert events[0]["action"].startswith("relaunch on 198.18.0.1,198.18.0.2 ")
    assert events[1]["action"].startswith("relaunch on 198.18.0.1,198.18.0.3 ")
    assert "take back 198.18.0.3" in events[1]["action"]
    assert all(e["steps_redone"] is not None and e["seconds_lost"] > 0 for e in events)
    difference = chaos.final_difference(run_dir / MODEL, reference / MODEL)
    assert difference <= 1e-5, difference
    assert not list(run_dir.glob("rank*-failure.json"))
    assert chaos.leftovers(before_shm, os.getpid(), tmp_path / "nothing") == []

"""`hybriddl launch` on 3 emulated hosts: a host whose rank is killed is left out of the
relaunch, the run goes on from its checkpoint on the 2 others, the host is taken back at
the next relaunch, and the run ends with the parameters of an uninterrupted run; nothing
is left behind."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
from hybriddl.launch.launcher import EVENTS, LaunchConfig, Launcher, read_hostfile
from hybriddl.run.failure_record import REFUSED
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


def test_a_missing_agent_mpirun_or_a_binary_hostfile_is_one_line_and_exit_2(cli_here, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1\n")
    run = ["--", "train", "--run-dir", str(tmp_path / "run")]
    done = cli_here("launch", "--hostfile", str(hosts), "--rsh-agent", "no-such-agent -x", *run)
    assert done.returncode == 2 and "--rsh-agent 'no-such-agent -x'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    with pytest.raises(UsageError, match="mpirun not found"):
        LaunchConfig(["node1"], ["train"], tmp_path / "run", rsh_agent="true",
                     mpirun=str(tmp_path / "no-mpirun")).checked()
    for flags, says in ((["--rsh-agent", "ssh -o 'X"], "No closing quotation"),
                        (["--retry-delay", "inf"], "give 0 or more seconds")):
        done = cli_here("launch", "--hostfile", str(hosts), *flags, *run)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = cli_here("launch", "--hostfile", str(hosts), "--rsh-agent", "true", "--", "train",
                    "--run-dir=")  # not the current directory
    assert done.returncode == 2 and "--run-dir needs a directory" in done.stderr, done.stderr
    hosts.write_bytes(b"\xff\xfe\x00binary")
    done = cli_here("launch", "--hostfile", str(hosts), "--rsh-agent", "true", *run)
    assert done.returncode == 2 and "not a text file" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def quiet_launcher(run_dir: Path, attempts, restarts: int = 3) -> Launcher:
    """A Launcher on two hosts that always answer, whose launches are `attempts`: each
    writes the ranks' records it returns into the run directory and exits with its code."""
    config = LaunchConfig(["h0", "h1"], ["train"], run_dir, restarts=restarts,
                          rsh_agent="true", mpirun=shutil.which("true"), retry_delay=0)
    launcher = Launcher(config)
    results = iter(attempts)

    def attempt(number, hosts):
        code, records = next(results)
        run_dir.mkdir(exist_ok=True)
        for record in records:
            (run_dir / f"rank{record['rank']}-failure.json").write_text(json.dumps(
                {"host": hosts[record["rank"]], "lost": {}, "at": 0.0, "steps": 0,
                 "first_step_at": None, "last_step_at": None, "mean_step_seconds": None,
                 **record}))
        return code

    launcher._attempt = attempt
    return launcher


def refused(rank: int, message: str) -> dict:
    return {"rank": rank, "cause": REFUSED, "message": message}


def test_a_refusal_after_the_hosts_started_is_tried_once_more_and_stops_when_repeated(
        monkeypatch, tmp_path):
    """Bad input that only the started hosts see (a checkpoint that does not match the
    flags) stops at the second identical refusal, not after every restart; a refusal that
    goes away (room freed on a full disk) is relaunched as before."""
    from hybriddl.launch import launcher as module

    monkeypatch.setattr(module, "answering", lambda hosts, agent, seconds: dict.fromkeys(hosts, True))
    changed = [refused(0, "--resume run: --batch-size would make another run"),
               refused(1, "--resume run: --batch-size would make another run")]
    launcher = quiet_launcher(tmp_path / "changed", [(2, changed)] * 4)
    assert launcher.run() == 2
    assert [e.attempt for e in launcher.events] == [1, 2]
    assert launcher.events[0].action.startswith("relaunch on h0,h1")
    assert launcher.events[1].action == "stop: the training refused its input again the same way (exit 2)"
    full = [refused(1, "--run-dir run: 1.0 MB free there; free some space")]
    launcher = quiet_launcher(tmp_path / "full", [(2, full), (0, [])])
    assert launcher.run() == 0 and len(launcher.events) == 1
    # A launch whose mpirun the launcher had to end (a signal) exits as a shell says so.
    launcher = quiet_launcher(tmp_path / "killed", [(-9, [{"rank": 0, "cause": "RuntimeError",
                                                          "message": "boom"}])], restarts=0)
    assert launcher.run() == 128 + 9
    assert launcher.events[0].action == "stop: --restarts 0 spent"


def test_a_record_an_earlier_attempt_wrote_late_is_not_read_as_this_ones(monkeypatch, tmp_path):
    """A cut-off host's ranks of the attempt before may still write their record into a
    shared run directory after the relaunch cleared it: each record says its attempt, and
    the launcher reads only the failed attempt's."""
    from hybriddl.launch import launcher as module
    from hybriddl.run.failure_record import LAUNCHED_ENV, StepsSeen, read_failures, record_failure

    monkeypatch.setattr(module, "answering", lambda hosts, agent, seconds: dict.fromkeys(hosts, True))
    # Attempt 2: rank 1 killed (no record of its own), rank 0 names it; rank 1's file is
    # attempt 1's, written late by the cut-off host, which named rank 0 silent earlier.
    named = {"rank": 0, "cause": "host lost", "lost": {"1": "h1"}, "message": "rank 1 silent",
             "attempt": 2, "at": 20.0}
    stale = {"rank": 1, "cause": "host lost", "lost": {"0": "h0"}, "message": "rank 0 silent",
             "attempt": 1, "at": 10.0}
    launcher = quiet_launcher(tmp_path / "run", [(1, []), (1, [named, stale])], restarts=1)
    assert launcher.run() == 1
    assert [(e.attempt, e.cause, e.host) for e in launcher.events] == [
        (1, "exit 1", None), (2, "host lost", "h1")]
    assert launcher.events[1].detail == "rank 1 silent"
    # Ranks write the attempt the launcher gave them.
    run_dir = tmp_path / "written"
    run_dir.mkdir()
    monkeypatch.setenv(LAUNCHED_ENV, "3")
    record_failure(run_dir, 0, RuntimeError("boom"), StepsSeen(None))
    assert [r["attempt"] for r in read_failures(run_dir)] == [3]
    assert read_failures(run_dir, attempt=2) == [] and len(read_failures(run_dir, attempt=3)) == 1


def test_a_stop_while_a_launch_is_prepared_starts_no_mpirun(monkeypatch, tmp_path):
    """Ctrl-C or SIGTERM while the launcher reads the checkpoint or clears the run directory
    ends the launch there: an mpirun started then would get the stop before its ranks could
    take it (killed by it, or training on without a checkpoint)."""
    import signal as signals

    from hybriddl.launch import launcher as module

    monkeypatch.setattr(module, "answering", lambda hosts, agent, seconds: dict.fromkeys(hosts, True))
    started = []
    monkeypatch.setattr(module.subprocess, "Popen", lambda *args, **kwargs: started.append(args))
    config = LaunchConfig(["h0", "h1"], ["train"], tmp_path / "run", restarts=3,
                          rsh_agent="true", mpirun=shutil.which("true"), retry_delay=0)
    launcher = Launcher(config)

    def steps_as_the_stop_comes(run_dir):
        launcher.request_stop(signals.SIGTERM)
        return 0

    monkeypatch.setattr(module, "checkpoint_steps", steps_as_the_stop_comes)
    assert launcher.run() == 128 + signals.SIGTERM and started == []
    assert [e.cause for e in launcher.events] == ["stopped by SIGTERM"]


def test_a_failed_starts_files_are_cleared_only_where_a_launch_ran(tmp_path):
    """Before a launch, the files a failed first attempt left (no checkpoint yet), a
    compressed run's other hosts' errors among them, go, so that the fresh start is
    accepted; but not in a directory no launch ran in, such as a --measure-only run's:
    the trainer refuses it, and nothing of it is lost."""
    launcher = quiet_launcher(tmp_path / "any", [])
    measured = tmp_path / "measured"
    measured.mkdir()
    kept = {"metrics.json", "rank0-pidstat.csv", "rank0-sar.csv"}
    for name in kept:
        (measured / name).write_text("x")
    launcher._prepare_run_dir(measured, 1)
    assert {p.name for p in measured.iterdir()} == kept
    launched = tmp_path / "launched"
    launched.mkdir()
    left = {"metrics.json", "rank1-sar.csv", "rank1-failure.json", "compression-rank1-step50.pt"}
    for name in left | {EVENTS}:
        (launched / name).write_text("{}\n")
    launcher._prepare_run_dir(launched, 1)
    assert list(launched.iterdir()) == [] and launcher._unwritten == ["{}\n"]
    # This launcher's own failed first attempt, which left no record (its ranks killed).
    launcher._prepare_run_dir(measured, 2)
    assert list(measured.iterdir()) == []


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

"""Faults injected by HYBRIDDL_FAILPOINTS (hybriddl/failpoints.py), two ranks over loopback:
a host that drifts one unit in the last place is named and given rank 0's parameters (or,
--strict-equal, stops the run); a host that never starts is named by the first exchange;
a host alive that stops coming to the exchanges is named at --host-timeout, and the run
resumed from what it left equals the run nothing interrupted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import hybriddl_env
from reference_run import ReferenceRun
from sample_data import write_saturated_classes
from test_failpoints import TRAIN as TWO_EPOCHS
from hybriddl.rundir import CHECKPOINT, METRICS, MODEL

MPIRUN = Path(sys.executable).parent / "mpirun"
# One epoch of 3 steps.
TRAIN = [*TWO_EPOCHS, "--epochs", "1"]
LOOPBACK = ["--oversubscribe", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_saturated_classes(tmp_path_factory.mktemp("images"), seed=1)


def two_ranks(*args: str, faults: str = "", timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(MPIRUN), *LOOPBACK, "-np", "2", sys.executable, "-m", "hybriddl",
                           *args], capture_output=True, text=True, timeout=timeout,
                          env=hybriddl_env(HYBRIDDL_FAILPOINTS=faults))


pytestmark = [pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}"),
              pytest.mark.mpi, pytest.mark.slow]
# tests/two_at_once.py: the roll call's test and the busy rank's mostly wait (20 s for a
# rank that never comes, 30 s for one holding the GIL), assert bounds with room and check
# only the ranks they started. They come first: the module begins beside other tests, and
# its tests alone run in one stretch (one wait for the other worker's test, not two).


@pytest.mark.beside
def test_a_host_that_never_starts_is_named_by_the_first_exchange(images, tmp_path):
    started = time.monotonic()
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(tmp_path / "run"),
                     "--host-timeout", "5", faults="stall-start=1", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    # At least 20 s however short --host-timeout: starts take seconds.
    assert re.search(r"no answer from rank 1 for 20 s while starting the heartbeat between "
                     r"hosts", output), output[-3000:]
    assert time.monotonic() - started < 90


@pytest.mark.beside
def test_a_host_that_hangs_after_the_roll_call_is_not_waited_for_for_ever(images, tmp_path):
    """Between the roll call and the heartbeat no beat is heard yet: the heartbeat's own
    exchange of addresses waits within the roll call's deadline, and the run stops."""
    started = time.monotonic()
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(tmp_path / "run"),
                     "--host-timeout", "5", faults="stall-heartbeat=1", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert re.search(r"no answer from the other hosts for 20 s while exchanging settings",
                     output), output[-3000:]
    assert time.monotonic() - started < 90


def test_a_host_lost_while_the_hosts_agree_on_the_data_is_named_by_the_other(images, tmp_path):
    """The agreement after each host's data (a stop in one host's cache build ends every
    host) waits like every exchange of the set-up: a host that died there is named."""
    started = time.monotonic()
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(tmp_path / "run"),
                     faults="die-data=1", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert re.search(r"rank 1 on host \S+ failed while exchanging settings", output), \
        output[-3000:]
    assert time.monotonic() - started < 90
    assert not (tmp_path / "run" / MODEL).exists()


@pytest.mark.beside
def test_a_rank_holding_the_gil_for_30_s_is_not_named_lost(images, tmp_path):
    """No thread of rank 1 runs for 30 s (twice the 15 s of silence that names a host
    lost): its beats come from a process of its own (hosts/beater.py), so rank 0 waits
    for it within --host-timeout's 120 s, and the run ends as if nothing happened."""
    started = time.monotonic()
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(tmp_path / "run"),
                     faults="busy=1@1:30")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert time.monotonic() - started > 30  # it was held
    assert "lost" not in output and "silent" not in output, output[-3000:]


@pytest.mark.parametrize("compression", ["none", "powersgd:2"])
def test_a_drifted_host_is_named_and_given_rank_0s_parameters(images, tmp_path, compression):
    run_dir = tmp_path / "run"
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                     "--compression", compression, "--check-every", "1", faults="drift=1@2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert re.search(r"hosts differ after step 2: rank 1 on host \S+ hold other values than "
                     r"rank 0, first in features\.0\.weight \(largest difference [0-9.e-]+\); "
                     r"every host now holds rank 0's", output), output[-3000:]
    replicas = json.loads((run_dir / METRICS).read_text())["replicas"]
    assert len(replicas["mismatches"]) == 1  # resynced: every later check found them equal
    assert replicas["check_every"] == 1 and replicas["checks"] == 3 + 1  # steps, epoch's end


def test_strict_equal_stops_where_hosts_differ_and_keeps_the_checkpoint(images, tmp_path):
    run_dir = tmp_path / "run"
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                     "--check-every", "1", "--checkpoint-every", "1", "--strict-equal",
                     faults="drift=1@2")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert re.search(r"hosts differ after step 2: .* first in features\.0\.weight .*"
                     r"--strict-equal stops the run", output), output[-3000:]
    assert (run_dir / CHECKPOINT).is_file() and not (run_dir / MODEL).exists()


@pytest.fixture(scope="module")
def uninterrupted(images, tmp_path_factory):
    """The run nothing interrupts, which the runs resumed after a fault must equal. It
    trains while the first test's faulted run does (which mostly waits for its deadline)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    with ReferenceRun([str(MPIRUN), *LOOPBACK, "-np", "2", sys.executable, "-m", "hybriddl",
                       *TRAIN, "--data", str(images), "--run-dir", str(run_dir)], run_dir,
                      timeout=240) as run:
        yield run


def assert_resumes_to(run_dir: Path, uninterrupted: ReferenceRun) -> None:
    assert two_ranks("train", "--resume", str(run_dir)).returncode == 0
    got, want = torch.load(run_dir / MODEL), torch.load(uninterrupted.run_dir() / MODEL)
    assert max(float((got[k] - want[k]).abs().max()) for k in want if want[k].numel()) <= 1e-6


def stopped_by(images, run_dir: Path, deadline: str, fault: str) -> str:
    """A run with a checkpoint every step, `deadline` (a flag) at 5 s and `fault`: it must
    stop (exit 1) within 90 s; its output."""
    started = time.monotonic()
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                     "--checkpoint-every", "1", deadline, "5", faults=fault)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert time.monotonic() - started < 90
    return output


def test_a_host_alive_that_stops_exchanging_is_named_and_the_resumed_run_is_the_same(
        images, tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    output = stopped_by(images, run_dir, "--host-timeout", "stall-exchange=1@2")
    assert re.search(r"rank 1 on host \S+ runs \(its heartbeat is heard\) but has not come to "
                     r"this exchange", output), output[-3000:]
    assert_resumes_to(run_dir, uninterrupted)


def test_an_exchange_every_host_is_inside_and_nothing_moves_stops_at_the_progress_timeout(
        images, tmp_path, uninterrupted):
    """Rank 1 enters the exchange after step 2 (its beats say so) and never drives it: both
    hosts alive, inside the same exchange, nothing completes. Rank 0 names the exchange and
    each host's state after --progress-timeout; the last checkpoint resumes the run."""
    run_dir = tmp_path / "run"
    output = stopped_by(images, run_dir, "--progress-timeout", "stall-inside=1@2")
    assert re.search(r"nothing of exchange (\d+) \(averaging gradients\) completed for [5-9] s "
                     r"while every host is alive and inside it \(rank 0 on host \S+: inside "
                     r"exchange \1; rank 1 on host \S+: inside exchange \1 .*\): likely a "
                     r"collective the hosts entered differently", output), output[-3000:]
    assert_resumes_to(run_dir, uninterrupted)


def test_a_compressed_exchange_every_host_is_inside_stops_at_the_progress_timeout(
        images, tmp_path):
    """PowerSGD's exchange (its wires summed in logical-rank order: an alltoallv, then an
    allgatherv) is bounded as every exchange is: rank 1 inside it and never driving it, rank
    0 names it after --progress-timeout and the run stops with its checkpoint."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = two_ranks(*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                     "--compression", "powersgd:2", "--checkpoint-every", "1",
                     "--progress-timeout", "5", faults="stall-inside=1@2")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert time.monotonic() - started < 90
    assert re.search(r"nothing of exchange (\d+) \(averaging gradients\) completed for [5-9] s "
                     r"while every host is alive and inside it", output), output[-3000:]
    assert (run_dir / CHECKPOINT).is_file()


def test_hosts_inside_different_exchanges_and_nothing_moves_stop_at_the_progress_timeout(
        images, tmp_path, uninterrupted):
    """Rank 1 says it entered the exchange after rank 0's (as a host that skipped a
    collective) and drives neither: rank 0, behind, inside an exchange nothing of which
    completes while every other host is inside a later one, names both after
    --progress-timeout; the last checkpoint resumes the run."""
    run_dir = tmp_path / "run"
    output = stopped_by(images, run_dir, "--progress-timeout", "stall-ahead=1@2")
    assert re.search(r"nothing of exchange (\d+) \(averaging gradients\) completed for [5-9] s "
                     r"while every host is alive and inside it or a later one \(rank 0 on host "
                     r"\S+: inside exchange (\d+); rank 1 on host \S+: inside exchange (\d+) .*"
                     r"\): likely hosts that entered different collectives", output), \
        output[-3000:]
    found = re.search(r"inside exchange (\d+); rank 1 on host \S+: inside exchange (\d+)", output)
    assert int(found.group(2)) == int(found.group(1)) + 1, found.group(0)
    assert_resumes_to(run_dir, uninterrupted)

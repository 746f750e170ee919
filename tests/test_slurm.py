"""Under a real SLURM cluster (two slurmd nodes on this machine, scripts/slurm/cluster.sh):
srun --mpi=pmix trains what one process trains, the job script's SIGUSR1 -> checkpoint ->
requeue -> resume ends where an uninterrupted run ends, and a killed task fails the job,
named, with nothing left running.

Runs are the tiny ones of test_checkpoint (squeezenet1_1, 32 px, 12 training images, global
batch 4: 3 steps an epoch). Jobs are polled through scontrol against deadlines; held_run.py
holds the ranks at a known step, so nothing here waits on a guess of how long a step takes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO, hybriddl_env
from held_run import SCRIPT as HELD_RUN
from sample_data import write_tinted_classes
from hybriddl.cli import main
from hybriddl.rundir import METRICS, MODEL

CLUSTER = REPO / "scripts" / "slurm" / "cluster.sh"
JOB = REPO / "scripts" / "slurm" / "train.sbatch"
DEADLINE_SECONDS = 180
# A job that ended one way or the other; RUNNING, PENDING, REQUEUED, COMPLETING are on the way.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def cluster_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (it starts munged, slurmctld and slurmd)"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    return None


pytestmark = [
    pytest.mark.skipif(cluster_unavailable() is not None, reason=cluster_unavailable() or ""),
    pytest.mark.root, pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow,
    # Mostly waits (a requeue's credential expiry, SLURM's scheduling) and checks only the
    # processes of its own jobs: beside other tests (tests/two_at_once.py).
    pytest.mark.beside,
]


@pytest.fixture(scope="module")
def slurm():
    """Two nodes, node1 and node2; the environment every test's SLURM command runs with."""
    started = subprocess.run([str(CLUSTER), "start", "--nodes", "2"], capture_output=True,
                             text=True, timeout=600)
    assert started.returncode == 0, started.stderr
    conf = re.search(r"SLURM_CONF=(\S+)", started.stdout).group(1)
    try:
        yield hybriddl_env(SLURM_CONF=conf, HYBRIDDL_PROFILES=os.environ["HYBRIDDL_PROFILES"])
    finally:
        stopped = subprocess.run([str(CLUSTER), "stop"], capture_output=True, text=True,
                                 timeout=120)
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_tinted_classes(tmp_path_factory.mktemp("images"))


def train_args(images: Path) -> list[str]:
    return ["--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2", "--dropout", "0",
            "--strategy", "sequential", "--monitor-interval", "0"]


@pytest.fixture(scope="module")
def one_process(images, tmp_path_factory) -> Path:
    """The same 2 epochs in one process, no MPI, never interrupted (global batch 4)."""
    run_dir = tmp_path_factory.mktemp("one-process") / "run"
    assert main(["train", *train_args(images), "--run-dir", str(run_dir)]) == 0
    return run_dir


def assert_same_parameters(run_dir: Path, reference: Path) -> None:
    got = torch.load(run_dir / MODEL, weights_only=True)
    want = torch.load(reference / MODEL, weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-12)
        error = float((got[name] - want[name]).abs().max() / scale)
        assert error <= 1e-5, f"{name}: relative difference {error:.2e}"


def job_fields(job_id: str, env: dict) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                           text=True, timeout=30, env=env)
    assert shown.returncode == 0, shown.stderr
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_for_job(job_id: str, env: dict, done) -> dict:
    """Poll the job until `done(fields)`; fail if it ends otherwise or at the deadline."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        fields = job_fields(job_id, env)
        if done(fields):
            return fields
        if fields["JobState"] in ENDED:
            pytest.fail(f"job {job_id} ended {fields['JobState']} "
                        f"(restarts {fields.get('Restarts')}):\n{job_output(fields)[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {fields['JobState']} after {DEADLINE_SECONDS} s")
        time.sleep(0.1)


def wait_for_file(path: Path, job_id: str, env: dict) -> None:
    wait_for_job(job_id, env, lambda fields: path.exists() and path.read_text())


def job_output(fields: dict) -> str:
    path = Path(fields.get("StdOut", ""))
    return path.read_text() if path.is_file() else ""


def submit(env: dict, tmp_path: Path, run_dir: Path, command: str, args: list[str]) -> str:
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes", "2", "--time", "30", "--output",
         str(tmp_path / "job-%j.out"), str(JOB), *args],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
        env={**env, "HYBRIDDL_RUN_DIR": str(run_dir), "HYBRIDDL": command,
             "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",  # mpirun
             "HYBRIDDL_LAUNCHER_ARGS": "--mca btl tcp,self --mca btl_tcp_if_include lo"})
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def held(paused: Path, go: Path, step: int) -> str:
    """The job's hybriddl command: every rank waits at the start of optimizer step `step`."""
    return f"{sys.executable} {HELD_RUN} {paused} {go} {step} step"


def processes_of_job(job_id: str) -> list[psutil.Process]:
    """Live processes (not zombies) that SLURM started for the job."""
    found = []
    for process in psutil.process_iter():
        try:
            if (process.environ().get("SLURM_JOB_ID") == job_id
                    and process.status() != psutil.STATUS_ZOMBIE):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_srun_with_pmix_on_two_nodes_matches_one_process(slurm, images, one_process, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(["srun", "--nodes", "2", "--ntasks-per-node", "1", "--mpi=pmix",
                           sys.executable, "-m", "hybriddl", "train", *train_args(images),
                           "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS, env=slurm)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_parameters(run_dir, one_process)
    hosts = json.loads((run_dir / METRICS).read_text())["config"]["hosts"]
    # Rank and size came from PMIx; the hosts are SLURM's nodes, not this machine's name.
    assert hosts["count"] == 2 and hosts["names"] == ["node1", "node2"]
    assert "2 hosts (node1, node2)" in done.stderr


def test_usr1_checkpoints_requeues_and_the_next_allocation_resumes_exactly(
        slurm, images, one_process, tmp_path):
    run_dir, paused, go = tmp_path / "run", tmp_path / "paused", tmp_path / "go"
    job_id = submit(slurm, tmp_path, run_dir, held(paused, go, 2), train_args(images))
    for rank in (0, 1):  # both hosts inside the epoch, at step 2 of 6
        wait_for_file(paused.with_name(f"paused.rank{rank}"), job_id, slurm)
    # What SLURM does at --signal=B:USR1@LEAD before the time limit.
    signalled = subprocess.run(["scancel", "--signal=USR1", "--batch", job_id],
                               capture_output=True, text=True, timeout=30, env=slurm)
    assert signalled.returncode == 0, signalled.stderr
    wait_for_job(job_id, slurm, lambda fields: "asking hybriddl for a checkpoint"
                 in job_output(fields))
    go.touch()
    fields = wait_for_job(job_id, slurm, lambda fields: fields["JobState"] == "COMPLETED")
    assert fields["Restarts"] == "1", job_output(fields)
    assert_same_parameters(run_dir, one_process)
    resumes = json.loads((run_dir / METRICS).read_text())["resumes"]
    assert len(resumes) == 1 and 2 <= resumes[0]["steps_done"] < 6
    assert resumes[0]["hosts"]["names"] == ["node1", "node2"]
    output = job_output(fields)
    assert "requeueing job" in output and "restart 1" in output
    # mpirun gives each rank a terminal, but the job's log is a file: no colour codes.
    assert "Epochs" in output and "\x1b[" not in output

    # The finished job submitted again does not train again.
    model_written = (run_dir / MODEL).stat().st_mtime_ns
    again = submit(slurm, tmp_path, run_dir, f"{sys.executable} -m hybriddl",
                   train_args(images))
    fields = wait_for_job(again, slurm, lambda fields: fields["JobState"] == "COMPLETED")
    assert "has finished; nothing to do" in job_output(fields)
    assert (run_dir / MODEL).stat().st_mtime_ns == model_written


def test_a_killed_task_fails_the_job_naming_its_node_and_nothing_is_left(
        slurm, images, tmp_path):
    run_dir, paused, go = tmp_path / "run", tmp_path / "paused", tmp_path / "go"
    job_id = submit(slurm, tmp_path, run_dir, held(paused, go, 2),
                    [*train_args(images), "--host-timeout", "60"])
    markers = [paused.with_name(f"paused.rank{rank}") for rank in (0, 1)]
    for marker in markers:
        wait_for_file(marker, job_id, slurm)
    os.kill(int(markers[1].read_text()), signal.SIGKILL)
    go.touch()
    fields = wait_for_job(job_id, slurm, lambda fields: fields["JobState"] in ENDED)
    output = job_output(fields)
    assert fields["JobState"] == "FAILED", output
    assert fields["Restarts"] == "0"  # a failure is not requeued: it would fail again
    # hybriddl on node1 names the lost host, or mpirun does if it noticed first.
    assert re.search(r"rank 1 on host node2 failed|rank 1 with PID \d+ on node node2", output), \
        output
    deadline = time.monotonic() + 30
    while processes_of_job(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_of_job(job_id)

"""Under mpirun, every rank stops at the same step with one checkpoint, and none outlives it.

The stop decision is `hosts.any_true(flag)` after every step (an allreduce under MPI), so
a signal that reaches one rank, or reaches them at different moments, stops all of them
after the same step. Open MPI 5's mpirun (PRRTE 3) answers SIGTERM/SIGINT by killing its
ranks itself, 250 ms after a SIGTERM of its own (hard-coded), which is too short for any
step; it forwards SIGUSR1 instead, so SIGUSR1 is how a job under mpirun is stopped with a
checkpoint (SLURM: `#SBATCH --signal=B:USR1@300` with `exec mpirun ...`), and a SIGTERM
to mpirun must at least keep the last checkpoint and leave no rank behind.

These tests need hybriddl.hosts.mpi.MPIHosts (branch `mpi`) with `any_true`; they are skipped
until it is there.
"""

from __future__ import annotations

import ast
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO, hybriddl_env
from emulated import hosts_launcher
from held_run import Held
from held_fixtures import images, no_held_run_left  # noqa: F401  (fixtures)
from hybriddl.run import resumption
from hybriddl.run.resumption import Position
from hybriddl.cli import main
from hybriddl.rundir import METRICS, MODEL

MPIRUN = Path(sys.executable).parent / "mpirun"
LAUNCH = [str(MPIRUN), "-np", "2", "--oversubscribe", "--mca", "btl", "tcp,self",
          "--mca", "btl_tcp_if_include", "lo"]
STEPS_PER_EPOCH = 3


def has_mpi_hosts() -> bool:
    tree = ast.parse((REPO / "hybriddl" / "hosts" / "mpi.py").read_text())
    return any(isinstance(node, ast.ClassDef) and node.name == "MPIHosts" for node in tree.body)


pytestmark = [
    pytest.mark.skipif(not (MPIRUN.exists() and has_mpi_hosts()),
                       reason="needs mpirun and hybriddl.hosts.mpi.MPIHosts (branch mpi)"),
    pytest.mark.mpi, pytest.mark.emulated, pytest.mark.slow,
]


def train_args(images: Path, run_dir: Path) -> list[str]:
    return ["train", "--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2",
            "--strategy", "sequential", "--run-dir", str(run_dir)]


@pytest.fixture(scope="module")
def uninterrupted(images, tmp_path_factory) -> Path:
    """The same 2 epochs on one host, never interrupted (global batch 4 either way)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert main(train_args(images, run_dir)) == 0
    return run_dir


def held_ranks(tmp_path: Path, images: Path, run_dir: Path, launch: list[str] = LAUNCH,
               **hold) -> tuple[Held, list]:
    held = Held(tmp_path, train_args(images, run_dir), launcher=launch, ranks=2,
                env=hybriddl_env(), **hold)
    everything = psutil.Process(held.process.pid).children(recursive=True)
    assert {held.pid(0), held.pid(1)} <= {p.pid for p in everything}
    return held, everything


def assert_all_gone(processes: list) -> None:
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert alive == [], f"outlived the run: {[p.pid for p in alive]}"


def assert_same_model(run_dir: Path, reference: Path, rtol: float = 1e-5) -> None:
    # Across hosts the allreduce sums in another order than one host does: not bitwise.
    got = torch.load(run_dir / MODEL, weights_only=True)
    want = torch.load(reference / MODEL, weights_only=True)
    assert got.keys() == want.keys()
    for name, value in want.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert float((got[name] - value).abs().max() / scale) <= rtol, name


def resume_under_mpirun(run_dir: Path, ranks: int = 2) -> None:
    launch = [str(MPIRUN), "-np", str(ranks), *LAUNCH[3:]]
    done = subprocess.run([*launch, sys.executable, "-m", "hybriddl", "train", "--resume",
                           str(run_dir)], capture_output=True, text=True, timeout=600,
                          env=hybriddl_env())
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def stopped_on_two_hosts(images, tmp_path_factory) -> Path:
    """A run on 2 hosts stopped (SIGUSR1 to mpirun) after step 4 of 6, as a lost host leaves
    its last checkpoint; tests resume copies of it."""
    tmp = tmp_path_factory.mktemp("stopped")
    run_dir = tmp / "run"
    held, _ = held_ranks(tmp, images, run_dir, pause_at=STEPS_PER_EPOCH + 1, where="step")
    held.process.send_signal(signal.SIGUSR1)
    held.release()
    code, err = held.finish()
    assert code != 0, err
    assert resumption.load(run_dir).position == Position(1, 1, STEPS_PER_EPOCH + 1)
    return run_dir


@pytest.mark.parametrize("hosts", [1, 3], ids=["one_host", "three_hosts"])
def test_a_run_stopped_on_two_hosts_resumed_on_another_host_count_ends_as_uninterrupted(
        stopped_on_two_hosts, uninterrupted, tmp_path, hosts):
    """The way to go on after losing a machine: --resume on the hosts that remain (or more)."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_on_two_hosts, run_dir)
    if hosts == 1:
        assert main(["train", "--resume", str(run_dir)]) == 0
    else:
        resume_under_mpirun(run_dir, ranks=hosts)
    assert_same_model(run_dir, uninterrupted)
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [r["steps"] for r in metrics["epochs"]] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH]
    assert metrics["config"]["hosts"]["count"] == 2
    assert metrics["resumes"][-1]["hosts"]["count"] == hosts
    assert metrics["resumes"][-1]["steps_done"] == STEPS_PER_EPOCH + 1


def test_sigusr1_to_mpirun_stops_every_rank_at_one_step_with_a_checkpoint(images, tmp_path,
                                                                          uninterrupted):
    run_dir = tmp_path / "run"
    with hosts_launcher(2) as launcher:  # two emulated hosts where this machine allows
        held, processes = held_ranks(tmp_path, images, run_dir, [*launcher.argv, "-np", "2"],
                                     pause_at=STEPS_PER_EPOCH + 1, where="step")
        assert resumption.load(run_dir).position == Position(1, 0, STEPS_PER_EPOCH)
        held.process.send_signal(signal.SIGUSR1)
        held.release()
        code, err = held.finish()
        assert_all_gone(processes)  # before the emulated hosts' teardown could end them
    assert code != 0
    assert f"hybriddl train --resume {run_dir}" in err
    assert resumption.load(run_dir).position == Position(1, 1, STEPS_PER_EPOCH + 1)

    resume_under_mpirun(run_dir)
    assert_same_model(run_dir, uninterrupted)
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [r["steps"] for r in metrics["epochs"]] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH]


def test_sigterm_to_one_rank_stops_both_ranks_after_the_same_step(images, tmp_path):
    run_dir = tmp_path / "run"
    held, processes = held_ranks(tmp_path, images, run_dir, pause_at=STEPS_PER_EPOCH + 1,
                                 where="step")
    # As a SLURM time limit does to srun-launched ranks, but to rank 1 only: rank 0 must
    # learn it from the allreduce and stop after the same step.
    psutil.Process(held.pid(1)).send_signal(signal.SIGTERM)
    held.release()
    code, err = held.finish()
    assert code != 0
    assert f"hybriddl train --resume {run_dir}" in err
    assert resumption.load(run_dir).position == Position(1, 1, STEPS_PER_EPOCH + 1)
    assert_all_gone(processes)


def test_sigterm_to_mpirun_keeps_the_last_checkpoint_and_leaves_no_rank(images, tmp_path,
                                                                        uninterrupted):
    run_dir = tmp_path / "run"
    # Both ranks held at the start of epoch 2, so epoch 1's checkpoint is on disk.
    held, processes = held_ranks(tmp_path, images, run_dir, pause_at=STEPS_PER_EPOCH + 1,
                                 where="step")
    held.process.send_signal(signal.SIGTERM)
    code, _ = held.finish()
    assert code != 0
    assert_all_gone(processes)
    assert resumption.load(run_dir).position == Position(1, 0, STEPS_PER_EPOCH)

    resume_under_mpirun(run_dir)
    assert_same_model(run_dir, uninterrupted)

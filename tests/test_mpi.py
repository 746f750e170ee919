"""Across hosts, through mpirun: H ranks train exactly what one sequential run with the
global batch trains, and a rank that fails or stops coming to the steps takes the run down,
named. (Hosts lost to a kill, SIGSTOP or a cut link: test_heartbeat_hosts.py.)"""

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
from emulated import hosts_launcher
from sample_data import write_saturated_classes
from hybriddl.rundir import METRICS, MODEL

MPIRUN = Path(sys.executable).parent / "mpirun"
LOOPBACK = ["--oversubscribe", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
# squeezenet1_1: small (0.7 M parameters), no batch normalisation, so a host's part of a
# batch gives exactly its share of the global gradient.
TRAIN = ["train", "--model", "squeezenet1_1", "--image-size", "32",
         "--batch-size", "8", "--epochs", "1", "--strategy", "sequential"]
PARAMETERS = 724_035

pytestmark = [
    pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}"),
    pytest.mark.mpi, pytest.mark.emulated, pytest.mark.slow,
    pytest.mark.holds_hosts,  # the module's launcher: three emulated hosts
]


@pytest.fixture(scope="module")
def launcher():
    """Three emulated hosts where this machine allows (ranks 0..2 on h0..h2), else lo."""
    with hosts_launcher(3) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """3 classes x 8 images: 18 train images, so batches of 8, 8 and a short last one of 2."""
    return write_saturated_classes(tmp_path_factory.mktemp("images"), seed=1)


@pytest.fixture(scope="module")
def sequential(images, tmp_path_factory) -> Path:
    """One sequential run (no mpirun) of the whole epoch with global batch 8."""
    run_dir = tmp_path_factory.mktemp("sequential") / "run"
    done = subprocess.run([sys.executable, "-m", "hybriddl", *TRAIN, "--data", str(images),
                           "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=300, env=hybriddl_env())
    assert done.returncode == 0, done.stderr
    assert json.loads((run_dir / METRICS).read_text())["epochs"][0]["steps"] == 3
    return run_dir


def mpirun(*apps: tuple[int, list[str]], timeout: float = 300,
           launcher=None) -> subprocess.CompletedProcess:
    """mpirun over loopback TCP (or `launcher`'s hosts); each app is (ranks, hybriddl
    arguments) (MPMD with ':')."""
    command = [*launcher.argv] if launcher else [str(MPIRUN), *LOOPBACK]
    first = 0
    for i, (ranks, args) in enumerate(apps):
        place = launcher.place(first, ranks) if launcher else []
        command += ([":"] if i else []) + ["-np", str(ranks), *place, sys.executable, "-m",
                                           "hybriddl", *args]
        first += ranks
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=hybriddl_env())


def assert_same_model(run_dir: Path, reference: Path, rtol: float = 1e-5) -> None:
    got = torch.load(run_dir / MODEL)
    want = torch.load(reference / MODEL)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-12)
        error = float((got[name] - want[name]).abs().max() / scale)
        assert error <= rtol, f"{name}: relative difference {error:.2e}"


def epoch_of(run_dir: Path) -> tuple[dict, dict]:
    metrics = json.loads((run_dir / METRICS).read_text())
    return metrics["config"], metrics["epochs"][0]


def test_two_hosts_match_sequential_with_the_global_batch(images, sequential, tmp_path):
    run_dir = tmp_path / "run"
    done = mpirun((2, [*TRAIN, "--data", str(images), "--run-dir", str(run_dir)]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_model(run_dir, sequential)
    config, epoch = epoch_of(run_dir)
    hosts = config["hosts"]
    assert hosts["count"] == 2 and hosts["weights"] == [1.0, 1.0]
    # Both ranks share this machine: they were detected, split its cores and warned.
    assert hosts["ranks_per_machine"] == 2
    assert not set(hosts["cores"][0]) & set(hosts["cores"][1])
    assert "-npernode 1" in done.stderr
    # One fused exchange of every float32 gradient per step, nothing else.
    assert epoch["per_step"]["mpi_bytes_sent"] == [4 * PARAMETERS] * 3
    assert [r["mpi_bytes_sent"] for r in epoch["by_rank"]] == [epoch["mpi_bytes_sent"]] * 2
    assert epoch["comm_seconds"] > 0 and epoch["compute_seconds"] > 0
    # Only rank 0 reports progress.
    assert done.stderr.count("epoch 1:") == 1
    # Each host validated its half of the images: the same accuracy as one host's whole.
    assert epoch["val_accuracy"] == epoch_of(sequential)[1]["val_accuracy"]


def test_two_hosts_of_a_batchnorm_model_are_not_named_as_differing(images, tmp_path):
    """Each host's BatchNorm running statistics come from its own rows: the replica check
    named the hosts as differing at every check, and --strict-equal stopped the run at
    its first. They are averaged over the hosts before each validation instead."""
    run_dir = tmp_path / "run"  # 18 images: 3 steps of 3 rows per host
    done = mpirun((2, ["train", "--model", "resnet18", "--image-size", "32", "--batch-size",
                       "6", "--epochs", "1", "--strategy", "sequential", "--check-every", "1",
                       "--strict-equal", "--data", str(images), "--run-dir", str(run_dir)]))
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = json.loads((run_dir / METRICS).read_text())
    assert metrics["replicas"]["checks"] >= 3 and metrics["replicas"]["mismatches"] == []
    assert metrics["epochs"][0]["val_accuracy"] is not None


@pytest.mark.parametrize("layouts", ["both channels_last", "rank 0 only", "one rank"])
def test_two_hosts_with_channels_last_weights_match_sequential(images, sequential, tmp_path,
                                                              layouts):
    """A channels_last weight's gradient lives in its fusion bucket (hosts/fusion.py) laid
    out as the weight, so autograd writes it without a copy and torch's fused SGD (which
    pairs elements in memory order) updates it right. Hosts whose local strategies hold
    the weights in other formats sum their buckets in logical order (contiguous slots,
    and step.py's unfuse_where_layouts_differ). One rank under mpirun (`hybriddl emulate
    --hosts 1`, a benchmark's one-host reference) averages nothing: its mean gradient is
    the global one, so it sends nothing and lays out no buckets (they cost 1.4x an
    AlexNet step at 64 px there; before 007d08e they scrambled its update too, which
    voided a time-to-accuracy reference)."""
    run_dir = tmp_path / "run"
    args = [*TRAIN, "--data", str(images), "--run-dir", str(run_dir)]
    apps = {"both channels_last": [(2, [*args, "--channels-last"])],
            "rank 0 only": [(1, [*args, "--channels-last"]), (1, args)],
            "one rank": [(1, [*args, "--channels-last", "--overlap"])]}[layouts]
    done = mpirun(*apps)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_model(run_dir, sequential)
    if layouts == "both channels_last":
        assert "gradient layout contract" not in done.stderr
    if layouts == "one rank":
        config, epoch = epoch_of(run_dir)
        assert config["hosts"]["fusion_buckets"] is None
        assert epoch["per_step"]["mpi_bytes_sent"] == [0] * 3
        assert epoch["comm_seconds"] < 0.01 * epoch["compute_seconds"]


def test_three_overlapping_hosts_with_uneven_shares_match_sequential(images, sequential,
                                                                     tmp_path, launcher):
    """8 = 3 + 3 + 2, and the last batch of 2 leaves rank 2 with no sample at all."""
    run_dir = tmp_path / "run"
    done = mpirun((3, [*TRAIN, "--data", str(images), "--run-dir", str(run_dir), "--overlap",
                       "--fusion-mib", "0.5"]), launcher=launcher)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_model(run_dir, sequential)
    config, epoch = epoch_of(run_dir)
    assert config["hosts"]["overlap"] == [True, True, True]
    buckets = config["hosts"]["fusion_buckets"]
    assert buckets > 3
    # Ranks 0 and 1 computed every step, so every bucket left during backward; rank 2 had
    # nothing to compute in the last step and sent its zeros after it.
    assert [r["buckets_sent_in_backward"] for r in epoch["by_rank"]] == [3 * buckets] * 2 + \
        [2 * buckets]
    assert config["hosts"]["gradient_bytes_per_step"] == 4 * PARAMETERS


def test_throughput_balanced_hosts_one_overlapping_match_sequential(images, sequential,
                                                                    tmp_path, launcher):
    run_dir = tmp_path / "run"
    common = [*TRAIN, "--data", str(images), "--run-dir", str(run_dir), "--balance",
              "throughput", "--fusion-mib", "0.5"]
    done = mpirun((1, [*common, "--throughput", "30", "--overlap"]),
                  (1, [*common, "--throughput", "10"]), launcher=launcher)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_model(run_dir, sequential)
    config, epoch = epoch_of(run_dir)
    assert config["hosts"]["balance"] == "throughput"
    assert config["hosts"]["weights"] == [30.0, 10.0]  # 6 + 2 samples of each batch of 8
    assert config["hosts"]["overlap"] == [True, False]
    sent_early = [r["buckets_sent_in_backward"] for r in epoch["by_rank"]]
    assert sent_early[0] == 3 * config["hosts"]["fusion_buckets"] and sent_early[1] == 0


def test_threads_and_accumulating_sequential_hosts_match_sequential(images, sequential, tmp_path, launcher):
    run_dir = tmp_path / "run"
    common = [*TRAIN, "--data", str(images), "--run-dir", str(run_dir)]
    done = mpirun((1, [*common, "--strategy", "threads", "--workers", "2", "--oversubscribe"]),
                  # Gradient accumulation on one host: its share of 4 in chunks of 2, 1, 1,
                  # into .grad fields that are views of the fusion buffers.
                  (1, [*common, "--strategy", "sequential", "--accumulate", "3"]),
                  launcher=launcher)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_model(run_dir, sequential)
    config, _ = epoch_of(run_dir)
    assert config["strategy"]["name"] == "threads"  # rank 0's record


def test_fp16_allreduce_hands_half_the_bytes_to_mpi(images, sequential, tmp_path, launcher):
    run_dir = tmp_path / "run"
    done = mpirun((2, [*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                       "--fp16-allreduce"]), launcher=launcher)
    assert done.returncode == 0, done.stdout + done.stderr
    config, epoch = epoch_of(run_dir)
    assert config["hosts"]["compression"] == "fp16"
    assert epoch["per_step"]["mpi_bytes_sent"] == [2 * PARAMETERS] * 3
    assert_same_model(run_dir, sequential, rtol=1e-2)


def test_a_rank_that_fails_stops_every_rank_and_names_itself(images, tmp_path, launcher):
    run_dir = tmp_path / "run"
    common = [*TRAIN, "--data", str(images), "--run-dir", str(run_dir)]
    done = mpirun((1, common), (1, [*common, "--strategy", "no-such-strategy"]), timeout=120,
                  launcher=launcher)
    assert done.returncode == 2
    assert re.search(rf"rank 1 on {re.escape(launcher.hostname(1))}: unknown strategy",
                     done.stderr + done.stdout)
    assert not run_dir.exists()


def test_a_rank_that_stops_coming_to_the_steps_ends_the_run_at_the_host_timeout(tmp_path,
                                                                              launcher):
    """Rank 1's main thread is held before a step while its heartbeat still beats, so only
    the deadline can tell: rank 0 stops after --host-timeout, naming the wait."""
    paused, go = tmp_path / "paused", tmp_path / "go"
    common = [*TRAIN, "--epochs", "3", "--host-timeout", "5", "--run-dir", str(tmp_path / "run")]
    command = [*launcher.argv, "-np", "1", *launcher.place(0, 1), sys.executable, "-m",
               "hybriddl", *common, ":", "-np", "1", *launcher.place(1, 1), sys.executable,
               str(Path(__file__).with_name("held_run.py")), str(paused), str(go), "3", "step",
               *common]
    mpirun = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=hybriddl_env())
    try:
        held_at = poll_for(lambda: paused.with_name("paused.rank1").exists(), mpirun)
        output, _ = mpirun.communicate(timeout=60)
        ended_after = time.monotonic() - held_at
    finally:
        go.touch()
        if mpirun.poll() is None:
            mpirun.kill()
            mpirun.communicate()
    assert mpirun.returncode == 1
    assert re.search(rf"rank 0 on {re.escape(launcher.hostname(0))}: no answer from the other "
                     r"hosts for 5 s while averaging gradients", output), output
    assert ended_after < 30


def test_hosts_wait_for_one_still_preparing_beyond_the_host_timeout(tmp_path, launcher):
    """Before training, a host may build a data cache or tune for minutes: while its
    heartbeat beats, the others wait for it past --host-timeout and the run goes on."""
    paused, go = tmp_path / "paused", tmp_path / "go"
    common = [*TRAIN, "--host-timeout", "3", "--max-steps", "1",
              "--run-dir", str(tmp_path / "run")]
    command = [*launcher.argv, "-np", "1", *launcher.place(0, 1), sys.executable, "-m",
               "hybriddl", *common, ":", "-np", "1", *launcher.place(1, 1), sys.executable,
               str(Path(__file__).with_name("held_run.py")), str(paused), str(go), "1",
               "prepare", *common]
    mpirun = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=hybriddl_env())
    try:
        held_at = poll_for(lambda: paused.with_name("paused.rank1").exists(), mpirun)
        # The span under test, not a synchronisation: twice the deadline, held.
        time.sleep(6)
        go.touch()
        output, _ = mpirun.communicate(timeout=120)
    finally:
        go.touch()
        if mpirun.poll() is None:
            mpirun.kill()
            mpirun.communicate()
    assert mpirun.returncode == 0, output
    assert time.monotonic() - held_at > 6
    assert json.loads((tmp_path / "run" / METRICS).read_text())["epochs"][0]["steps"] == 1
    # Said while it waits, once: who, and that nothing bounds the wait but the heartbeat.
    said = [line for line in output.splitlines() if "still preparing" in line]
    assert len(said) == 1 and "for rank 1 on host" in said[0], output


def poll_for(condition, process: subprocess.Popen) -> float:
    """When `condition` first held (time.monotonic()); fails if `process` ends first."""
    deadline = time.monotonic() + 240
    while not condition():
        assert process.poll() is None, f"the run ended first:\n{process.communicate()[0]}"
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)
    return time.monotonic()

"""The classifier split across hosts (--host-parallel hybrid) trains exactly what sequential
SGD on the global batch trains: on 2 and 3 hosts, with keyed dropout, uneven shares, an
empty share, --accumulate, --overlap; its checkpoints and model.pt are the whole torchvision
state_dict, so a run resumes on another host count and in the other scheme; --host-parallel
auto decides from the measured link. (One host, the split itself and the planner's
prediction: tests/test_hybrid_one_host.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import hybriddl_env
from emulated import hosts_launcher
from hybriddl.usecases import build_model
from test_hybrid_one_host import (TRAIN, assert_same_model, images,  # noqa: F401 (fixtures)
                                  metrics_of, sequential)

MPIRUN = Path(sys.executable).parent / "mpirun"
pytestmark = pytest.mark.holds_hosts  # the module's launcher: three emulated hosts


# --------------------------------------------------------------------------- across hosts

needs_mpi = pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")


@pytest.fixture(scope="module")
def launcher():
    with hosts_launcher(3) as launcher:
        yield launcher


def mpirun(launcher, hosts: int, args: list[str]) -> subprocess.CompletedProcess:
    command = [*launcher.argv, "-np", str(hosts), *launcher.place(0, hosts), sys.executable,
               "-m", "hybriddl", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env=hybriddl_env())


@needs_mpi
@pytest.mark.parametrize("hosts, strategy", [(2, ["--strategy", "layerwise", "--workers", "1"]),
                                             # hybrid's default: the convolutions' buckets
                                             # leave during their backward, the features'
                                             # gradient beside the first layer's weight's
                                             (2, ["--strategy", "sequential"]),
                                             (3, ["--strategy", "sequential", "--accumulate", "2",
                                                  "--overlap"])])
@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.slow
def test_hybrid_across_hosts_matches_sequential(hosts, strategy, images, sequential, tmp_path,
                                                launcher):
    """At 3 hosts 8 = 3 + 3 + 2, and the short last batch of 2 leaves one host empty."""
    run_dir = tmp_path / "run"
    done = mpirun(launcher, hosts, [*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                                    "--host-parallel", "hybrid", *strategy])
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_model(run_dir, sequential)
    metrics = metrics_of(run_dir)
    record = metrics["config"]["host_parallel"]
    assert record["scheme"] == "hybrid"
    # Validation shared by the hosts as well (a sample's convolutions, about 0.3 ms, outlast
    # its 37 kB of features on the link): each host's rows through the convolutions, every
    # host's features through the classifier's slices; sequential's accuracy.
    assert metrics["epochs"][0]["validation_shared_by"] == hosts
    assert metrics["epochs"][0]["val_accuracy"] == \
        metrics_of(sequential)["epochs"][0]["val_accuracy"]
    # Without --overlap, where one backward writes each gradient once: the convolutions'
    # buckets left during it (layerwise and --accumulate 2 write gradients more than once).
    overlapped = strategy == ["--strategy", "sequential"]
    assert metrics["config"]["hosts"]["overlap"] == [overlapped] * hosts
    assert (metrics["epochs"][0]["buckets_sent_in_backward"] > 0) == overlapped
    if launcher.emulated:
        # Bytes on the network: what host 0's own interface sent in the epoch's steps
        # (18 images: batches of 8, 8 and 2), against the scheme's theory;
        # summed, since a step's last bytes can leave after rank 0's counter read (they
        # count in the next step, and the last step's after the epoch in none); data
        # parallelism would send 23x more.
        theory = record["theory_bytes_per_host_per_step"]
        sent = metrics["epochs"][0]["per_step"]["nic_bytes_sent"]
        batches = [8, 8, 18 - 16]
        expected = sum(theory["hybrid_convolutions"] + theory["hybrid_activations"] * b / 8
                       for b in batches)
        assert len(sent) == 3 and abs(sum(sent) - expected) <= 0.1 * expected, (sent, theory)
        assert max(sent) < theory["data"] / 8
    # Rank 0 holds its share (the first, the largest: 4096 = 1366 + 1365 + 1365) of the
    # split layers' 4096 units: rows of 4096 x 9216 and their biases, columns of
    # 4096 x 4096; the second layer's bias and the last layer (3 x 4096) whole.
    share = -(-4096 // hosts)
    assert record["held_parameter_bytes"]["classifier"] == \
        4 * (share * 9216 + share + 4096 * share + 4096 + 3 * 4096 + 3)
    # ... and, measured at the end, 1/H of their momentum too (a data run holds it all).
    held = metrics["memory"]
    assert held["parameters"] == {"classifier": record["held_parameter_bytes"]["classifier"],
                                  "other": record["held_parameter_bytes"]["other"]}
    assert held["optimizer_state"]["classifier"] == held["parameters"]["classifier"]
    assert held["peak_rss_bytes"] > held["parameters"]["other"]
    # Checkpoint: the whole torchvision state_dict and momentum, not this host's slices.
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    fresh = build_model("alexnet", 3).state_dict()
    assert {k: v.shape for k, v in checkpoint["model"].items()} == \
        {k: v.shape for k, v in fresh.items()}
    momentum = checkpoint["optimizer"]["state"][10]["momentum_buffer"]  # classifier.1.weight
    assert momentum.shape == (4096, 9216)


@needs_mpi
@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.slow
def test_a_hybrid_run_resumes_on_another_host_count_and_as_data(images, sequential, tmp_path,
                                                              launcher):
    run_dir = tmp_path / "run"
    done = mpirun(launcher, 2, [*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                                "--strategy", "sequential", "--host-parallel", "hybrid",
                                "--max-steps", "1"])
    assert done.returncode == 0, done.stdout + done.stderr
    done = mpirun(launcher, 3, ["train", "--resume", str(run_dir), "--max-steps", "2",
                                "--host-parallel", "hybrid"])
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "hybriddl", "train", "--resume", str(run_dir),
                           "--max-steps", "3", "--host-parallel", "data"],
                          capture_output=True, text=True, timeout=300, env=hybriddl_env())
    assert done.returncode == 0, done.stderr
    assert_same_model(run_dir, sequential)
    resumes = metrics_of(run_dir)["resumes"]
    assert [r["host_parallel"]["scheme"] for r in resumes] == ["hybrid", "data"]
    assert [r["hosts"]["count"] for r in resumes] == [3, 1]


@needs_mpi
@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.slow
def test_auto_decides_from_the_measured_link_and_says_why(images, tmp_path, launcher):
    run_dir = tmp_path / "run"
    done = mpirun(launcher, 2, [*TRAIN, "--data", str(images), "--run-dir", str(run_dir),
                                "--strategy", "sequential", "--max-steps", "1"])
    assert done.returncode == 0, done.stdout + done.stderr
    record = metrics_of(run_dir)["config"]["host_parallel"]
    assert record["asked"] == "auto" and record["scheme"] in ("data", "hybrid")
    assert record["link_bytes_per_second"] > 0
    assert "predicted step" in record["reason"] and "measured link" in record["reason"]
    theory = record["theory_bytes_per_host_per_step"]
    assert theory["hybrid"] < theory["data"] / 5

"""Hosts that build the initial model from the run's seed compare a digest instead of
receiving rank 0's parameters (issue 38: AlexNet's 244 MB took 31 s at 62.5 Mbit/s); where
the digests differ, rank 0's parameters are sent, and a note says why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hybriddl_env

MPIRUN = Path(sys.executable).parent / "mpirun"
LOOPBACK = ["--oversubscribe", "--bind-to", "none", "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", "lo"]

pytestmark = [
    pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}"),
    pytest.mark.mpi, pytest.mark.slow,
]

# Each rank builds SimpleBig's AlexNet as the trainer does (hybriddl.usecases.build_model
# after torch.manual_seed), with another number of threads on each rank, then agrees on
# the initial parameters twice: as built, and with rank 1's altered (FORCE_MISMATCH).
RANK = r"""
import hashlib, json, sys
import torch
from hybriddl.hosts.cluster import connect
from hybriddl.hosts.mpi import parameters_digest
from hybriddl.usecases import build_model, get_usecase

hosts = connect()
torch.set_num_threads(hosts.rank + 1)
torch.manual_seed(5)
model = build_model(get_usecase("SimpleBig").model, 3)
rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
before = hosts.traffic.bytes_sent
hosts.broadcast_parameters(model, built_from_seed=True)
agreed = {"sent": hosts.traffic.bytes_sent - before, "how": hosts.initial_parameters,
          "rng": rng, "notes": list(hosts.notes)}
with torch.no_grad():
    if hosts.rank == 1:
        next(model.parameters()).add_(1.0)
before = hosts.traffic.bytes_sent
hosts.broadcast_parameters(model, built_from_seed=True)
forced = {"sent": hosts.traffic.bytes_sent - before, "how": hosts.initial_parameters,
          "digest": parameters_digest(model), "notes": list(hosts.notes),
          "size": sum(t.numel() * t.element_size() for t in [*model.parameters(),
                                                             *model.buffers()])}
everyone = hosts.allgather({"agreed": agreed, "forced": forced})
if hosts.rank == 0:
    print(json.dumps(everyone))
hosts.close()
"""


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    done = subprocess.run([str(MPIRUN), *LOOPBACK, "-np", "2", sys.executable, "-c", RANK],
                          capture_output=True, text=True, timeout=300, env=hybriddl_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hosts_that_built_the_model_from_the_seed_send_a_digest_not_the_model(ranks):
    for rank in ranks:
        assert rank["agreed"]["how"].startswith("built from the seed")
        # A barrier and a 64-character digest, pickled: not AlexNet's 244 MB.
        assert rank["agreed"]["sent"] < 1000, rank["agreed"]["sent"]
        assert not any("initial parameters" in note for note in rank["agreed"]["notes"])
    # Building the model drew the same numbers on every rank, whatever its threads.
    assert ranks[0]["agreed"]["rng"] == ranks[1]["agreed"]["rng"]


def test_hosts_whose_digests_differ_get_rank_0s_parameters_and_a_note_says_why(ranks):
    assert ranks[0]["forced"]["digest"] == ranks[1]["forced"]["digest"]
    assert ranks[0]["forced"]["sent"] >= ranks[0]["forced"]["size"]  # the model went out
    for rank in ranks:
        assert rank["forced"]["how"] == "rank 0's, sent to every host"
        note, = [n for n in rank["forced"]["notes"] if "initial parameters" in n]
        assert note.startswith("rank 1 on host ") and "from the same seed" in note

"""HYBRIDDL_FAILPOINTS (hybriddl/failpoints.py) parsed as docs/faults.md says, and the
replicas' checksum; the faults themselves on two ranks: tests/test_failpoints_hosts.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import hybriddl_env
from hybriddl import failpoints
from hybriddl.errors import UsageError

# 18 training images in batches of 8: 3 steps an epoch.
TRAIN = ["train", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "8",
         "--epochs", "2", "--strategy", "sequential", "--monitor-interval", "0"]


def test_failpoints_parse_what_the_docs_name_and_refuse_the_rest():
    points = failpoints.parse("stall-exchange=1@3, drift=0@2,stall-start=1,busy=1@2:30")
    assert points["busy"] == failpoints.Failpoint("busy", 1, 2, 30)
    assert points["stall-exchange"] == failpoints.Failpoint("stall-exchange", 1, 3)
    assert points["drift"] == failpoints.Failpoint("drift", 0, 2)
    assert points["stall-start"] == failpoints.Failpoint("stall-start", 1, None)
    assert failpoints.parse("") == {}
    for bad in ("explode=1@2", "drift=1", "stall-exchange=one@2", "busy=1@2", "busy=1@2:1.5"):
        with pytest.raises(UsageError) as refused:
            failpoints.parse(bad)
        assert len(str(refused.value).splitlines()) == 1


def test_an_unknown_failpoint_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hybriddl", *TRAIN, "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True,
                          env=hybriddl_env(HYBRIDDL_FAILPOINTS="explode=1@2"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "explode" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_checksum_changes_with_one_unit_in_the_last_place():
    from hybriddl.hosts.replicas import checksums

    tensor = torch.randn(1000)
    before = checksums([tensor, torch.arange(3)])
    tensor[517] = torch.nextafter(tensor[517], torch.tensor(float("inf")))
    assert checksums([tensor, torch.arange(3)])[0] != before[0]
    assert checksums([tensor, torch.arange(3)])[1] == before[1]

"""The DDP peer of scripts/time_to_accuracy.py: `python -m hybriddl.cli.compare_ddp --epochs N
--target-accuracy A --stop-at-target` trains PyTorch DDP (here with torch's powerSGD_hook)
to a target, validated as `train --target-accuracy` validates, and records the same
`target` as metrics.json does. Two gloo processes on loopback, on its fixed port: alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, hybriddl_env
from held_fixtures import images  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.alone]


def test_the_ddp_peer_trains_to_its_target_and_stops_there(images, tmp_path):
    result = tmp_path / "result"
    done = subprocess.run(
        [sys.executable, "-m", "hybriddl.cli.compare_ddp", "--processes", "2",
         "--result-dir", str(result), "--model", "squeezenet1_1", "--data", str(images),
         "--image-size", "32", "--batch-size", "4", "--powersgd-rank", "1", "--epochs", "3",
         "--lr", "0.05", "--eval-every", "1", "--target-accuracy", "0.5", "--stop-at-target"],
        capture_output=True, text=True, cwd=REPO, env=hybriddl_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((result / "rank0.json").read_text())
    target, evaluations = record["target"], record["target"]["evaluations"]
    assert record["comm_hook"]["hook"] == "powerSGD_hook"
    assert [e["step"] for e in evaluations] == list(range(1, len(evaluations) + 1))
    clock = [e["emulated_seconds"] for e in evaluations]
    assert clock == sorted(clock) and clock[0] > 0
    reaching = [e for e in evaluations if e["accuracy"] >= 0.5]
    assert target["reached"] == bool(reaching)
    if reaching:  # stopped at the first evaluation that reached it
        assert evaluations[-1]["step"] == reaching[0]["step"]
        assert target["step"] == reaching[0]["step"]
    else:  # went on to the epoch cap
        assert evaluations[-1]["epochs"] == 3
    assert [e["epoch"] for e in record["epochs"]] == list(range(1, len(record["epochs"]) + 1))

"""`hybriddl compare`, the flat (Horovod) strategy, the DDP peer and the step meter."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from hybriddl.compare.compare import REPORT, RESULT, ring_allreduce_wire_bytes
from hybriddl.errors import UsageError
from hybriddl.run.stepmeter import StepMeter
from hybriddl.strategies import StrategyOptions, make_strategy

# squeezenet1_1 has 0.7 M parameters and takes 32 px images: seconds per run, not minutes.
SMALL = ("--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "8",
         "--warmup", "1", "--steps", "2")


@pytest.fixture(scope="module")
def tiny_images(tmp_path_factory):
    """An ImageFolder of 3 classes x 10 images: loads in no time, 24 train images."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for label in ("fire", "smoke", "clear"):
        (root / label).mkdir()
        for i in range(10):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i}.png")
    return str(root)


def compare(cli, output, data, *args):
    done = cli("compare", *SMALL, "--data", data, "--output", str(output), *args, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    for written in (REPORT, "images_per_second.png", "wire_bytes_per_step.png"):
        assert (output / written).stat().st_size > 0
    return {r["name"]: r for r in json.loads((output / RESULT).read_text())["contenders"]}


def test_flat_is_horovods_model_one_sequential_worker_per_rank():
    with make_strategy("flat") as flat:
        assert "Horovod" in flat.describe()["model"]
    with pytest.raises(UsageError, match="one worker per MPI rank"):
        make_strategy("flat", StrategyOptions(workers=2))


def test_flat_matches_sequential():
    def train(name):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
        generator = torch.Generator().manual_seed(1)
        with make_strategy(name) as local:
            local.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _ in range(3):
                optimizer.zero_grad(set_to_none=False)
                local.compute_gradients(torch.randn(5, 12, generator=generator),
                                        torch.randint(3, (5,), generator=generator))
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    for flat, sequential in zip(train("flat"), train("sequential"), strict=True):
        assert torch.equal(flat, sequential)


def test_ring_allreduce_sends_2_p_minus_1_gradients():
    assert ring_allreduce_wire_bytes(100, 1) == 0
    assert ring_allreduce_wire_bytes(100, 2) == 200
    assert ring_allreduce_wire_bytes(100, 4) == 600


def test_step_meter_counts_only_the_timed_steps():
    handed = {"bytes": 0}
    meter = StepMeter(warmup=1, steps=2, comm_bytes=lambda: handed["bytes"])
    for step, seconds in enumerate((9.0, 1.0, 2.0)):
        handed["bytes"] += 100 * (step + 1)  # the warm-up's 100 bytes fall outside
        meter.on_step(0, step, 8, seconds, 1.0)
    result = meter.result()
    assert meter.remaining == 0
    assert result["step_seconds"] == [1.0, 2.0]
    assert result["comm_bytes"] == 200 + 300


def test_step_meter_refuses_a_result_before_the_last_timed_step():
    meter = StepMeter(warmup=1, steps=2, comm_bytes=lambda: 0)
    meter.on_step(0, 0, 8, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="1 of 3 steps"):
        meter.result()


def test_ddp_hands_one_gradient_per_rank_and_wire_follows_ring_theory(cli, tmp_path, tiny_images):
    ddp = compare(cli, tmp_path / "out", tiny_images, "--contenders", "ddp", "--hosts", "2",
                  "--workers-per-host", "1", "--local-strategy", "sequential")["ddp"]
    assert ddp["ranks"] == 2
    assert ddp["comm_bytes_per_step"] == 2 * ddp["gradient_bytes"]
    # The payload plus TCP/IP headers and gloo's few control messages.
    assert ddp["theory_wire_bytes_per_step"] <= ddp["wire_bytes_per_step"]
    assert ddp["wire_bytes_per_step"] <= 1.05 * ddp["theory_wire_bytes_per_step"]


def test_hybrid_puts_at_most_a_kth_of_flats_bytes_on_the_wire(cli, tmp_path, tiny_images):
    """The paper's claim at H=2, K=2, measured on lo; float16 halves the hybrid's bytes."""
    hosts = ("--hosts", "2", "--workers-per-host", "2", "--local-strategy", "threads")
    fp32 = compare(cli, tmp_path / "fp32", tiny_images, *hosts, "--contenders", "hybrid,flat")
    hybrid, flat = fp32["hybrid"], fp32["flat"]
    assert (hybrid["ranks"], flat["ranks"]) == (2, 4)
    assert hybrid["wire_bytes_per_step"] <= 1.05 * flat["wire_bytes_per_step"] / 2
    assert hybrid["wire_bytes_per_step"] >= hybrid["theory_wire_bytes_per_step"]
    fp16 = compare(cli, tmp_path / "fp16", tiny_images, *hosts, "--contenders", "hybrid",
                   "--fp16-allreduce")["hybrid"]
    assert fp16["wire_bytes_per_step"] <= 0.55 * hybrid["wire_bytes_per_step"]


def test_compare_refuses_fewer_samples_than_workers_and_writes_nothing(cli, tmp_path):
    output = tmp_path / "out"
    done = cli("compare", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "3",
               "--hosts", "2", "--workers-per-host", "2", "--local-strategy", "sequential",
               "--contenders", "ddp", "--output", str(output))
    assert done.returncode == 2
    assert "smaller than the 4 workers" in done.stderr
    assert not output.exists()

"""Checkpoints written in the background: training goes on, kills and errors lose nothing.

The same tiny runs as test_checkpoint.py (squeezenet1_1, 32 px, 3 steps per epoch), held
by tests/held_run.py inside the background write so that "training went on while the
checkpoint was being written" is observed, not timed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from held_run import Held, wait_for
from held_fixtures import images, no_held_run_left  # noqa: F401  (fixtures)
from hybriddl.run import resumption
from hybriddl.hosts.cluster import SingleHost
from hybriddl.run.checkpointer import Checkpointer, capture_rng, stage
from hybriddl.run.resumption import Checkpoint, EpochProgress, Position
from hybriddl.run.shutdown import StopRequest
from hybriddl.cli import main
from hybriddl.rundir import CHECKPOINT, METRICS
from hybriddl.files import PARTIAL_GLOB

STEPS_PER_EPOCH = 3


def train_args(images: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2", "--dropout", "0",
            "--strategy", "sequential", "--monitor-interval", "0", "--run-dir", str(run_dir),
            *extra]


def epochs_recorded(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / METRICS).read_text())["epochs"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@pytest.mark.slow
def test_training_goes_on_while_the_checkpoint_is_written(images, tmp_path):
    run_dir = tmp_path / "run"
    # The writer is held inside epoch 1's checkpoint, before its rename.
    child = Held(tmp_path, train_args(images, run_dir), pause_at=1, where="inside-write")
    # Epoch 2 trains and validates meanwhile; only its own checkpoint must wait.
    wait_for(lambda: epochs_recorded(run_dir) == 2, "epoch 2 recorded", child.process)
    assert not (run_dir / CHECKPOINT).exists()
    assert len(list(run_dir.glob(PARTIAL_GLOB))) == 1
    child.release()
    code, err = child.finish()
    assert code == 0, err
    assert resumption.load(run_dir).position == Position(2, 0, 2 * STEPS_PER_EPOCH)
    assert list(run_dir.glob(PARTIAL_GLOB)) == []


@pytest.mark.slow
def test_kill_during_background_write_keeps_previous_and_next_start_removes_the_partial_file(
        images, tmp_path, capsys):
    run_dir = tmp_path / "run"
    child = Held(tmp_path, train_args(images, run_dir), pause_at=2, where="inside-write")
    child.process.send_signal(signal.SIGKILL)
    assert child.finish()[0] == -signal.SIGKILL
    [partial] = run_dir.glob(PARTIAL_GLOB)
    assert partial.stat().st_size > 0
    assert resumption.load(run_dir).position == Position(1, 0, STEPS_PER_EPOCH)

    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    assert not partial.exists() and list(run_dir.glob(PARTIAL_GLOB)) == []
    assert resumption.load(run_dir).position == Position(2, 0, 2 * STEPS_PER_EPOCH)


@pytest.mark.slow
def test_stop_signal_while_a_write_is_under_way_leaves_both_checkpoints_complete(images,
                                                                                 tmp_path):
    run_dir = tmp_path / "run"
    child = Held(tmp_path, train_args(images, run_dir, "--checkpoint-every", "1"), pause_at=1,
                 where="inside-write")
    child.process.send_signal(signal.SIGTERM)  # the next step stops, after the held write
    child.release()
    code, err = child.finish()
    assert code == 128 + signal.SIGTERM, err
    assert "checkpoint written; continue with" in err.strip().splitlines()[-1]
    assert resumption.load(run_dir).position.steps_done >= 1
    assert list(run_dir.glob(PARTIAL_GLOB)) == []


@pytest.mark.slow
def test_non_finite_loss_is_one_line_exit_1_and_the_last_checkpoint_stays_good(images, tmp_path,
                                                                              cli):
    run_dir = tmp_path / "run"
    done = cli(*train_args(images, run_dir, "--lr", "1e30", "--checkpoint-every", "1"))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]  # after the progress display
    assert line.startswith("hybriddl: training stopped: ")
    assert "at epoch 1, step 2: lower --lr" in line  # the step, and the loss it reached
    assert ("loss became nan" in line or "loss became inf" in line
            or "parameters became non-finite" in line), line
    kept = resumption.load(run_dir)
    assert f"the last good checkpoint (epoch 1, step {kept.position.step}) is kept" in line
    assert all(torch.isfinite(t).all() for t in kept.model.values() if t.is_floating_point())
    assert list(run_dir.glob(PARTIAL_GLOB)) == []


def test_staged_state_is_a_copy_and_reuses_its_buffers():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    first = stage(None, state)
    before = {k: v.clone() for k, v in first["model"].items()}
    buffers = {k: v.data_ptr() for k, v in first["model"].items()}
    optimizer.step()  # the training thread goes on while the writer reads `first`
    assert all(torch.equal(first["model"][k], before[k]) for k in before)
    second = stage(first, state)
    assert {k: v.data_ptr() for k, v in second["model"].items()} == buffers
    assert all(torch.equal(second["model"][k], v) for k, v in model.state_dict().items())
    momentum = second["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_staging_buffers_are_made_beside_the_first_step_and_the_checkpoint_copies_into_them(
        tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    about = {"config": {}, "identity": {}, "strategy": {}}
    with Checkpointer(tmp_path, SingleHost(), StopRequest(), model, optimizer,
                      {"epochs": []}, about) as keeper:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        keeper.step_done(EpochProgress())
        prepared = keeper._preparing.result()  # made on the writer thread
        assert all(not v.any() for v in prepared["model"].values())
        buffers = {k: v.data_ptr() for k, v in prepared["model"].items()}
        keeper.save(EpochProgress())
        staged = keeper._staging["model"]
        assert {k: v.data_ptr() for k, v in staged.items()} == buffers
        assert all(torch.equal(staged[k], v) for k, v in model.state_dict().items())
    assert torch.equal(resumption.load(tmp_path).model["weight"], model.weight.detach())


def test_the_payload_holds_the_staged_tensors_themselves_not_copies():
    staged = {"weight": torch.ones(4)}
    payload = Checkpoint(config={}, identity={}, position=Position(), progress=EpochProgress(),
                         model=staged, optimizer={}, rng={}, metrics={},
                         strategy={}).to_payload()
    assert payload["model"]["weight"] is staged["weight"]
    assert payload["position"] == {"epoch": 0, "step": 0, "steps_done": 0}


def test_a_checkpoint_keeps_the_hosts_mean_of_batchnorms_running_statistics(tmp_path):
    """Each host updates BatchNorm's running statistics from its own rows; a checkpoint
    kept rank 0's own, so a resumed run validated (and kept in model.pt) other statistics
    than the uninterrupted one, whose validation averages them over the hosts first."""
    from hybriddl.hybrid.parallel import DataParallel

    class TwoHosts(SingleHost):
        rank, size = 0, 2

        def allreduce_sum(self, tensor, what=""):  # the other host's statistics are 4 more
            return tensor + (tensor + 4)

        def mean_over_hosts(self, value, samples):
            return value / max(samples, 1)

    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2))
    model(torch.randn(4, 3, 2, 2))  # rank 0's own statistics
    own = model[1].running_mean.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    about = {"config": {}, "identity": {}, "strategy": {}}
    with Checkpointer(tmp_path, TwoHosts(), StopRequest(), model, optimizer, {"epochs": []},
                      about, layout=DataParallel()) as keeper:
        keeper.save(EpochProgress())
    saved = resumption.load(tmp_path).model
    assert torch.allclose(saved["1.running_mean"], own + 2)
    assert torch.allclose(saved["1.running_var"], model[1].running_var)  # the live model's too


def test_a_resumed_momentum_buffer_is_laid_out_as_its_parameter(tmp_path):
    """A checkpoint of a run without --channels-last resumed with it (or the reverse, or an
    auto pick that changed it): load_state_dict kept the saved buffer's layout, and torch's
    fused SGD, which pairs elements in memory order, applied the momentum to other
    elements at the first step."""
    torch.manual_seed(0)
    plain = nn.Conv2d(3, 4, 3)
    saved_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.randn(2, 3, 5, 5)).sum().backward()
    saved_optimizer.step()  # a momentum buffer in the default layout
    checkpoint = Checkpoint(config={}, identity={}, position=Position(0, 1, 1),
                            progress=EpochProgress(), model=plain.state_dict(),
                            optimizer=saved_optimizer.state_dict(), rng=capture_rng(),
                            metrics={}, strategy={})

    def resumed(channels_last: bool) -> torch.Tensor:
        model = nn.Conv2d(3, 4, 3)
        model.load_state_dict(plain.state_dict())
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        about = {"config": {}, "identity": {}, "strategy": {}}
        with Checkpointer(tmp_path / str(channels_last), SingleHost(), StopRequest(), model,
                          optimizer, {"epochs": []}, about, writes=False) as keeper:
            keeper.restore(checkpoint, 0.1, 0.9)
        buffer = optimizer.state[model.weight]["momentum_buffer"]
        assert buffer.stride() == model.weight.stride()
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        return model.weight.detach().contiguous()

    assert torch.equal(resumed(True), resumed(False))

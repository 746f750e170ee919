"""Checkpoints survive kills, resumed runs equal uninterrupted ones, stops are clean.

Runs are tiny: squeezenet1_1 (0.7 M parameters) at 32 px on a 3-class ImageFolder of
18 images the tests draw, so an epoch is 3 steps of 4 images; the short epochs come
from the data, not from a test-only flag. Interrupted runs are child processes held
still at a known point by tests/held_run.py (after the checkpoint of epoch 1, inside
a checkpoint write, at the start of a step) until the test has signalled or killed
them: "interrupted after epoch 1" is exact, with no sleep or timing.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

from held_run import Held
from held_fixtures import images, no_held_run_left  # noqa: F401  (fixtures)
from hybriddl.dropout import MASKS
from hybriddl.run import resumption
from hybriddl.run.checkpointer import Checkpointer
from hybriddl.run.resumption import EpochProgress, Position
from hybriddl.cli import main
from hybriddl.hosts.cluster import SingleHost
from hybriddl.errors import TrainingError, UsageError
from hybriddl.rundir import CHECKPOINT, METRICS, MODEL
from hybriddl.run.shutdown import StopRequest
from hybriddl.strategies import STRATEGIES, cpu_strategies
from hybriddl.usecases import build_model

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 3


def train_args(images: Path, run_dir: Path, dropout: float | None, *extra: str) -> list[str]:
    args = ["train", "--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2", "--strategy", "sequential",
            "--run-dir", str(run_dir)]
    if dropout is not None:
        args += ["--dropout", str(dropout)]
    return args + list(extra)


def final_parameters(run_dir: Path) -> dict:
    return torch.load(run_dir / MODEL, weights_only=True)


def max_abs_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


@pytest.fixture(scope="module")
def uninterrupted(images, tmp_path_factory):
    """The 2-epoch run nothing interrupts, made once per dropout setting."""
    done: dict = {}

    def run(dropout: float | None) -> Path:
        if dropout not in done:
            run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
            assert main(train_args(images, run_dir, dropout)) == 0
            done[dropout] = run_dir
        return done[dropout]

    return run


# --------------------------------------------------------------------------- exact resume

@pytest.mark.parametrize("dropout", [0.0, None], ids=["dropout0", "default-dropout"])
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_resume_after_interruption_matches_uninterrupted_run(stop, dropout, images, tmp_path,
                                                             uninterrupted, capsys):
    run_dir = tmp_path / "run"
    if stop == "SIGKILL":  # held just after writing the checkpoint of epoch 1
        child = Held(tmp_path, train_args(images, run_dir, dropout))
    else:  # held at the start of epoch 2's first step, so the signal comes inside a step
        child = Held(tmp_path, train_args(images, run_dir, dropout),
                       pause_at=STEPS_PER_EPOCH + 1, where="step")
    epoch_one = resumption.load(run_dir)
    assert epoch_one.position == Position(epoch=1, step=0, steps_done=STEPS_PER_EPOCH)

    if stop == "SIGKILL":
        child.process.kill()
        code, _ = child.finish()
        assert code == -signal.SIGKILL
        resumed_at = epoch_one.position
    else:
        child.process.send_signal(signal.SIGTERM)
        child.release()
        code, err = child.finish()
        assert code == 128 + signal.SIGTERM, err
        message = err.strip().splitlines()[-1]
        assert "stopped by SIGTERM at epoch 2, step 1" in message
        assert message.endswith(f"continue with: hybriddl train --resume {run_dir}")
        resumed_at = resumption.load(run_dir).position
        # The step under way when the signal came was finished, then checkpointed.
        assert resumed_at == Position(epoch=1, step=1, steps_done=STEPS_PER_EPOCH + 1)

    # Omitting the flags and repeating them must both continue the same run.
    again = (["train", "--resume", str(run_dir)] if dropout is None else
             train_args(images, run_dir, dropout, "--resume", str(run_dir)))
    assert main(again) == 0, capsys.readouterr().err

    reference = uninterrupted(dropout)
    assert max_abs_difference(final_parameters(run_dir), final_parameters(reference)) <= 1e-6
    metrics = json.loads((run_dir / METRICS).read_text())
    expected = json.loads((reference / METRICS).read_text())
    assert [r["epoch"] for r in metrics["epochs"]] == [1, 2]
    assert [r["steps"] for r in metrics["epochs"]] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH]
    assert [r["train_loss"] for r in metrics["epochs"]] == pytest.approx(
        [r["train_loss"] for r in expected["epochs"]], rel=1e-6)
    assert metrics["resumes"][0]["epoch"] == resumed_at.epoch + 1
    assert metrics["resumes"][0]["step"] == resumed_at.step
    # Same mask generator before and after: no note that the resume changed the draws.
    assert metrics["config"]["dropout_masks"] == MASKS and "note" not in metrics["resumes"][0]
    assert resumption.load(run_dir).position == Position(2, 0, 2 * STEPS_PER_EPOCH)


def runs_squeezenet(cls) -> bool:
    try:
        cls.check_model(build_model("squeezenet1_1", 3))
    except UsageError:
        return False
    return True


# Every CPU strategy with local workers of its own: a run killed in the middle of an epoch
# under any of them resumes to the uninterrupted sequential run, default dropout. (One that
# cannot run these tests' SqueezeNet, layerwise, has its exactness with default dropout in
# its own tests.)
KILLED_UNDER = [name for name in cpu_strategies() if STRATEGIES[name].example_options.workers
                and runs_squeezenet(STRATEGIES[name])]


@pytest.mark.parametrize("strategy", KILLED_UNDER)
def test_sigkill_mid_epoch_under_each_cpu_strategy_resumes_to_the_uninterrupted_run(
        strategy, images, tmp_path, uninterrupted, capsys):
    run_dir = tmp_path / "run"
    flags = ("--strategy", strategy, "--workers", "2", "--oversubscribe")
    # Held at the start of epoch 2's second step: one step past the last checkpoint.
    child = Held(tmp_path, train_args(images, run_dir, None, *flags),
                 pause_at=STEPS_PER_EPOCH + 2, where="any-step")
    child.process.kill()
    assert child.finish()[0] == -signal.SIGKILL
    assert resumption.load(run_dir).position == Position(epoch=1, step=0,
                                                         steps_done=STEPS_PER_EPOCH)
    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    assert json.loads((run_dir / METRICS).read_text())["config"]["strategy"]["name"] == strategy
    assert max_abs_difference(final_parameters(run_dir),
                              final_parameters(uninterrupted(None))) <= 1e-5


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(images, tmp_path, uninterrupted,
                                                                capsys):
    run_dir = tmp_path / "run"
    # Held inside the second write (end of epoch 2), its bytes written but not renamed.
    child = Held(tmp_path, train_args(images, run_dir, 0.0), pause_at=2, where="inside-write")
    partial = list(run_dir.glob(f".{CHECKPOINT}.tmp-*"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    child.process.kill()
    assert child.finish()[0] == -signal.SIGKILL

    survivor = resumption.load(run_dir)
    assert survivor.position == Position(epoch=1, step=0, steps_done=STEPS_PER_EPOCH)
    assert [r["epoch"] for r in survivor.metrics["epochs"]] == [1]

    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    assert max_abs_difference(final_parameters(run_dir),
                              final_parameters(uninterrupted(0.0))) <= 1e-6
    assert resumption.load(run_dir).position == Position(2, 0, 2 * STEPS_PER_EPOCH)


def test_sigint_stops_after_the_step_with_exit_code_130(images, tmp_path):
    run_dir = tmp_path / "run"
    child = Held(tmp_path, train_args(images, run_dir, 0.0), pause_at=STEPS_PER_EPOCH + 1,
                 where="step")
    child.process.send_signal(signal.SIGINT)
    child.release()
    code, err = child.finish()
    assert code == 128 + signal.SIGINT, err
    assert "stopped by SIGINT at epoch 2, step 1" in err.strip().splitlines()[-1]
    assert resumption.load(run_dir).position == Position(1, 1, STEPS_PER_EPOCH + 1)


def test_second_signal_abandons_the_step_and_keeps_the_last_checkpoint(images, tmp_path):
    run_dir = tmp_path / "run"
    child = Held(tmp_path, train_args(images, run_dir, 0.0), pause_at=STEPS_PER_EPOCH + 1,
                 where="step")
    child.process.send_signal(signal.SIGINT)
    child.process.send_signal(signal.SIGTERM)  # never released: the step is abandoned
    code, err = child.finish()
    assert code == 130, err
    assert resumption.load(run_dir).position == Position(1, 0, STEPS_PER_EPOCH)


def test_interrupted_run_leaves_no_worker_process(images, tmp_path, uninterrupted, capsys):
    run_dir = tmp_path / "run"
    processes = ("--strategy", "processes", "--workers", "2", "--oversubscribe")
    child = Held(tmp_path, train_args(images, run_dir, 0.0, *processes))
    workers = psutil.Process(child.process.pid).children(recursive=True)
    assert len(workers) >= 2
    child.process.send_signal(signal.SIGTERM)  # while epoch 1's checkpoint is being written
    child.release()
    code, err = child.finish()
    assert code == 128 + signal.SIGTERM, err
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == []
    assert resumption.load(run_dir).position == Position(1, 0, STEPS_PER_EPOCH)

    # The workers of the resumed run start from the checkpoint's parameters.
    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    got, want = final_parameters(run_dir), final_parameters(uninterrupted(0.0))
    for name, value in want.items():  # workers sum in another order: not bitwise
        scale = value.abs().max().clamp_min(1e-12)
        assert float((got[name] - value).abs().max() / scale) <= 1e-5, name


# --------------------------------------------------------------------------- divergence

def test_non_finite_loss_names_its_step_and_keeps_last_good_checkpoint(images, tmp_path, capsys):
    messages = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        code = main(train_args(images, run_dir, 0.0, "--lr", "1e6", "--checkpoint-every", "1"))
        err = capsys.readouterr().err
        assert code == 1
        messages.append(err.strip().splitlines()[-1].replace(str(run_dir), "RUN"))
    assert messages[0] == messages[1]  # deterministic: same step, same words
    assert "at epoch 1, step 2: lower --lr" in messages[0]
    assert "the last good checkpoint (epoch 1, step 1) is kept in RUN" in messages[0]

    kept = resumption.load(run_dir)
    assert kept.position == Position(epoch=0, step=1, steps_done=1)
    assert all(torch.isfinite(t).all() for t in kept.model.values() if t.is_floating_point())
    # Resuming it replays the same divergence at the same step: its RNG and state are exact.
    assert main(["train", "--resume", str(run_dir)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].replace(str(run_dir), "RUN") \
        == messages[0]


def test_checkpoint_never_overwritten_with_non_finite_parameters(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    about = {"config": {}, "identity": {}, "strategy": {"name": "sequential"}}
    keeper = Checkpointer(tmp_path, SingleHost(), StopRequest(), model, optimizer,
                          {"config": {}, "epochs": []}, about)
    keeper.save(EpochProgress())
    keeper.wait_for_write()  # written in the background
    good = (tmp_path / CHECKPOINT).read_bytes()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(TrainingError, match="non-finite"):
        keeper.save(EpochProgress())
    assert (tmp_path / CHECKPOINT).read_bytes() == good


def test_the_model_file_is_the_last_checkpoints_model_without_a_second_gather(
        images, tmp_path, monkeypatch):
    """model.pt after a run's last checkpoint is that checkpoint's staged model: the model is
    not assembled again (for a classifier split across hosts, a second gather of its shards:
    AlexNet's 109 MB per host at 1 Gbit/s, about 1 s)."""
    from hybriddl.hybrid.parallel import DataParallel
    gathers, saves = [], []
    model_state, save = DataParallel.model_state, Checkpointer.save
    monkeypatch.setattr(DataParallel, "model_state",
                        lambda self, *a: gathers.append(1) or model_state(self, *a))
    monkeypatch.setattr(Checkpointer, "save", lambda self, *a, **k: saves.append(1) or
                        save(self, *a, **k))
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, 0.0)) == 0
    assert len(saves) == 2 and len(gathers) == 2  # one per checkpoint, none more at the end
    kept = resumption.load(run_dir)
    assert max_abs_difference(final_parameters(run_dir), kept.model) == 0.0


def test_the_keeper_holds_the_model_only_until_the_next_step(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    about = {"config": {}, "identity": {}, "strategy": {"name": "sequential"}}
    with Checkpointer(tmp_path, SingleHost(), StopRequest(), model, optimizer,
                      {"config": {}, "epochs": []}, about) as keeper:
        assert not keeper.holds_the_model()
        keeper.save(EpochProgress())
        assert keeper.holds_the_model()
        assert torch.equal(keeper.staged_model()["weight"], model.weight)
        keeper.step_done(EpochProgress())
        assert not keeper.holds_the_model()


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("flags, named", [
    (["--batch-size", "8"], "--batch-size 8"),
    (["--usecase", "SimpleBig"], "--usecase 'SimpleBig'"),
    (["--model", "alexnet"], "--model 'alexnet'"),
    (["--seed", "1"], "--seed 1"),
])
def test_resume_refuses_another_run(flags, named, uninterrupted, capsys):
    run_dir = uninterrupted(0.0)
    before = (run_dir / CHECKPOINT).read_bytes()
    assert main(["train", "--resume", str(run_dir), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "start a new run" in err
    assert (run_dir / CHECKPOINT).read_bytes() == before


def test_resume_refuses_a_directory_without_a_loadable_checkpoint(tmp_path, capsys):
    cases = {"missing": tmp_path / "missing", "empty": tmp_path / "empty",
             "damaged": tmp_path / "damaged"}
    cases["empty"].mkdir()
    cases["damaged"].mkdir()
    (cases["damaged"] / CHECKPOINT).write_bytes(b"PK\x03\x04 not a checkpoint")
    for name, run_dir in cases.items():
        assert main(["train", "--resume", str(run_dir)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(run_dir) in err, err
    assert not (cases["empty"] / METRICS).exists()


def test_resume_continues_a_finished_run_when_given_more_epochs(uninterrupted, tmp_path, capsys):
    run_dir = tmp_path / "run"
    source = uninterrupted(0.0)
    run_dir.mkdir()
    for name in (CHECKPOINT, METRICS, MODEL):
        (run_dir / name).write_bytes((source / name).read_bytes())
    assert main(["train", "--resume", str(run_dir), "--epochs", "3"]) == 0, capsys.readouterr().err
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [r["epoch"] for r in metrics["epochs"]] == [1, 2, 3]
    assert metrics["config"]["epochs"] == 3
    assert resumption.load(run_dir).position == Position(3, 0, 3 * STEPS_PER_EPOCH)
    assert max_abs_difference(final_parameters(run_dir), final_parameters(source)) > 0


def test_checkpoint_every_n_steps_is_resumable_inside_an_epoch(images, tmp_path, capsys):
    run_dir = tmp_path / "run"
    child = Held(tmp_path, train_args(images, run_dir, 0.0, "--checkpoint-every", "2"))
    saved = resumption.load(run_dir)
    assert saved.position == Position(epoch=0, step=2, steps_done=2)
    assert saved.progress.steps == 2 and saved.progress.global_samples == 8
    child.process.kill()
    child.finish()
    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [(r["epoch"], r["steps"], r["samples"]) for r in metrics["epochs"]] == \
        [(1, STEPS_PER_EPOCH, 12), (2, STEPS_PER_EPOCH, 12)]


def test_resume_with_more_max_steps_continues_inside_the_cut_epoch(images, tmp_path,
                                                                   uninterrupted, capsys):
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, 0.0, "--max-steps", str(STEPS_PER_EPOCH + 1))) == 0
    cut = resumption.load(run_dir)
    assert cut.position == Position(1, 1, STEPS_PER_EPOCH + 1)
    assert [r["epoch"] for r in cut.metrics["epochs"]] == [1]  # epoch 2 is not finished
    assert main(["train", "--resume", str(run_dir), "--max-steps", "6"]) == 0, \
        capsys.readouterr().err
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [(r["epoch"], r["steps"]) for r in metrics["epochs"]] == [(1, 3), (2, 3)]
    assert max_abs_difference(final_parameters(run_dir),
                              final_parameters(uninterrupted(0.0))) <= 1e-6



def test_an_interruption_inside_an_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """Ctrl-C during `predict --output`'s write (the whole prediction runs inside it)."""
    from hybriddl.files import atomic_write_bytes, write_atomically

    path = tmp_path / "predictions.csv"
    atomic_write_bytes(path, b"old\n")

    def interrupted(handle):
        handle.write(b"half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, interrupted)
    assert [p.name for p in tmp_path.iterdir()] == ["predictions.csv"]
    assert path.read_bytes() == b"old\n"


def test_a_stop_while_auto_tunes_ends_the_tune_at_its_step_and_writes_nothing(images, tmp_path):
    """The signal handler only sets a flag: the tune used to go on to its budget, then
    train a step, before the run stopped (under SLURM, SIGKILL came first)."""
    run_dir, profiles = tmp_path / "run", tmp_path / "profiles"
    args = train_args(images, run_dir, None, "--profile-dir", str(profiles),
                      "--tune-budget", "600")
    args[args.index("sequential")] = "auto"
    child = Held(tmp_path, args, pause_at=2, where="tune")  # before the second visit
    child.process.send_signal(signal.SIGTERM)
    child.release()
    code, err = child.finish()
    assert code == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].endswith(
        "stopped by SIGTERM while tuning this host's strategy, before any step: no profile or "
        "run was written; run the same command again"), err
    assert not run_dir.exists() and not list(profiles.glob("**/*.json"))

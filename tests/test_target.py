"""`train --target-accuracy A`: the step, epoch, wall and emulated seconds at which validation
first reaches A, recorded in metrics.json; `--stop-at-target` ends the run there,
checkpointed and finished; a run cut short and resumed is timed as one.

Runs are the checkpoint tests' tiny ones (squeezenet1_1, 32 px, 18 tinted images, 3 steps
an epoch) in this process, validated after every step (`--eval-every 1`). The target is
taken from a first run's own evaluations, so it is reached at a known step whatever this
machine's arithmetic makes of the tiny model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from held_fixtures import images  # noqa: F401  (fixture)
from hybriddl.cli import main
from hybriddl.run import resumption
from hybriddl.run.resumption import Position
from hybriddl.rundir import METRICS, MODEL

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 3


def train_args(images: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2", "--strategy",
            "sequential", "--dropout", "0", "--lr", "0.05", "--monitor-interval", "0",
            "--run-dir", str(run_dir), *extra]


def target_of(run_dir: Path) -> dict:
    return json.loads((run_dir / METRICS).read_text())["target"]


@pytest.fixture(scope="module")
def every_step(images, tmp_path_factory) -> dict:
    """Two epochs validated after every step, with a target no run reaches twice over."""
    run_dir = tmp_path_factory.mktemp("every-step") / "run"
    assert main(train_args(images, run_dir, "--eval-every", "1", "--target-accuracy", "1")) == 0
    return target_of(run_dir)


def first_reaching(evaluations: list[dict]) -> tuple[float, int]:
    """A target some evaluation after the first reaches: (accuracy, the step it first does)."""
    best = max(e["accuracy"] for e in evaluations[1:])
    step = next(e["step"] for e in evaluations if e["accuracy"] >= best)
    return best, step


def test_every_evaluation_is_recorded_with_its_step_epoch_and_clock(every_step):
    evaluations = every_step["evaluations"]
    assert [e["step"] for e in evaluations] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert [e["epoch"] for e in evaluations] == [1, 1, 1, 2, 2, 2]
    assert [e["epochs"] for e in evaluations] == pytest.approx(
        [s / STEPS_PER_EPOCH for s in range(1, 7)], abs=1e-3)
    clock = [e["wall_seconds"] for e in evaluations]
    assert clock == sorted(clock) and clock[0] > 0
    # Not under emulation: emulated seconds are wall seconds.
    assert [e["emulated_seconds"] for e in evaluations] == clock
    assert every_step["accuracy"] == 1
    reached = [e for e in evaluations if e["accuracy"] >= 1]
    assert every_step["reached"] == bool(reached)
    if not reached:  # "never did" is said with nulls, not left out
        assert every_step["step"] is None and every_step["wall_seconds"] is None


def test_stop_at_target_ends_the_run_there_checkpointed_and_finished(images, every_step,
                                                                    tmp_path, monkeypatch,
                                                                    capsys):
    accuracy, step = first_reaching(every_step["evaluations"])
    monkeypatch.setenv("HYBRIDDL_TIME_SCALE", "4")  # as emulate --speedup 4 sets it
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--eval-every", "1", "--target-accuracy",
                           str(accuracy), "--stop-at-target")) == 0
    target = target_of(run_dir)
    assert target["reached"] is True
    # Said when reached and again under the epochs' table, with the emulated clock.
    said = f"target: val accuracy {accuracy:g} reached at step {step} ("
    printed = capsys.readouterr()
    assert said in printed.err and said in printed.out and "emulated)" in printed.out
    assert (target["step"], target["epoch"]) == (step, (step - 1) // STEPS_PER_EPOCH + 1)
    assert target["epochs"] == pytest.approx(step / STEPS_PER_EPOCH, abs=1e-3)
    # Both are stored rounded to 1e-6 s: on a run this short, that rounding is the tolerance.
    assert target["emulated_seconds"] == pytest.approx(target["wall_seconds"] / 4, rel=1e-4,
                                                       abs=1e-6)
    # The same steps as the run that went on: the same accuracies up to the target.
    assert [e["accuracy"] for e in target["evaluations"]] == \
        [e["accuracy"] for e in every_step["evaluations"][:step]]
    assert resumption.load(run_dir).position.steps_done == step
    assert (run_dir / MODEL).is_file()
    assert resumption.run_state(run_dir) == resumption.FINISHED
    # Resumed as it is, it has nothing left to do: no step more.
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert resumption.load(run_dir).position.steps_done == step
    assert len(target_of(run_dir)["evaluations"]) == step


def test_a_run_cut_short_and_resumed_reaches_the_target_on_one_clock(images, every_step,
                                                                     tmp_path):
    accuracy, step = first_reaching(every_step["evaluations"])
    run_dir = tmp_path / "run"
    flags = ["--eval-every", "1", "--target-accuracy", str(accuracy)]
    assert main(train_args(images, run_dir, *flags, "--max-steps", "1")) == 0
    cut = target_of(run_dir)
    assert resumption.load(run_dir).position == Position(0, 1, 1)
    assert main(["train", "--resume", str(run_dir), "--max-steps", "6"]) == 0
    target = target_of(run_dir)
    assert [e["step"] for e in target["evaluations"]] == list(range(1, 7))
    # Where its own evaluations first reach the target (a resumed run equals the run that
    # went on to 1e-6, not bit for bit: an accuracy of 6 images may differ by a near-tie).
    first = next(e for e in target["evaluations"] if e["accuracy"] >= accuracy)
    assert (target["reached"], target["step"]) == (True, first["step"])
    # One clock: the resumed attempt's evaluations come after the first attempt's time.
    assert target["evaluations"][0] == cut["evaluations"][0]
    assert target["evaluations"][1]["wall_seconds"] > cut["clock"]["wall_seconds"] > 0
    assert target["wall_seconds"] == first["wall_seconds"]


def test_a_run_that_misses_its_target_ends_saying_its_best_and_shows_each_validation(
        images, every_step, tmp_path, capsys):
    assert main(train_args(images, tmp_path / "run", "--eval-every", "1", "--target-accuracy",
                           "1", "--max-steps", "4")) == 0
    printed = capsys.readouterr()
    evaluations = every_step["evaluations"][:4]  # the same steps
    best = max(evaluations, key=lambda e: e["accuracy"])
    assert (f"target: val accuracy 1 not reached in 4 validations (best {best['accuracy']:.3f} "
            f"at step {best['step']}), after ") in printed.out
    # A line for each validation inside an epoch; the epoch's last is on the epoch's line.
    shown = [line.split()[1] for line in printed.err.splitlines()
             if line.strip().startswith("step ") and "val accuracy" in line]
    assert shown == ["1", "2", "4"]


def test_a_resume_asked_to_stop_before_where_the_run_is_is_refused_and_changes_nothing(
        images, tmp_path, capsys):
    """Not a whole epoch more (a negative count of steps left once trained on)."""
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir)) == 0  # 2 epochs, 6 steps
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    for flags, said in ((["--max-steps", "4"], "--max-steps 4: the run in"),
                        (["--epochs", "1"], "--epochs 1: the run in")):
        assert main(["train", "--resume", str(run_dir), *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and "has done" in err and len(err.splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_resume_asked_for_the_epochs_a_run_has_trained_past_is_refused(images, tmp_path,
                                                                        capsys):
    """A run cut inside its second epoch, resumed with --epochs 1: the loop had nothing to
    do, and the run counted as finished with a step of epoch 2 in its model."""
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--max-steps", str(STEPS_PER_EPOCH + 1))) == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "--epochs 1: the run in" in err and "1 step(s) into epoch 2" in err, err
    assert len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_without_a_target_every_epochs_validation_is_on_the_clock(images, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir)) == 0
    assert "target:" not in capsys.readouterr().out
    target = target_of(run_dir)
    assert (target["accuracy"], target["reached"], target["step"]) == (None, False, None)
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [e["accuracy"] for e in target["evaluations"]] == \
        [e["val_accuracy"] for e in metrics["epochs"]]
    assert [e["step"] for e in target["evaluations"]] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]


def test_a_validation_due_at_a_stopped_step_is_kept_by_its_checkpoint(images, every_step,
                                                                      tmp_path):
    """A stop (SIGTERM) during a step validation is due at: its checkpoint came before the
    validation and the run stopped there, so the resumed run, starting at the next step,
    never made that one (step 2 missing from a record the run that went on has)."""
    import signal

    from held_run import Held

    run_dir = tmp_path / "run"
    args = train_args(images, run_dir, "--eval-every", "1", "--target-accuracy", "1")
    held = Held(tmp_path, args, pause_at=2, where="step")
    os.kill(held.pid(), signal.SIGTERM)
    held.release()
    code, err = held.finish()
    assert code == 128 + signal.SIGTERM, err[-2000:]
    saved = resumption.load(run_dir)
    assert saved.position.steps_done == 2
    assert [e["step"] for e in saved.metrics["target"]["evaluations"]] == [1, 2]
    assert main(["train", "--resume", str(run_dir)]) == 0
    evaluations = target_of(run_dir)["evaluations"]
    assert [e["step"] for e in evaluations] == list(range(1, 2 * STEPS_PER_EPOCH + 1))


def test_a_resume_records_the_settings_it_changed_from_what_to_what(images, tmp_path):
    """--lr, --momentum, --dropout given at a resume: the config record took the new lr and
    momentum (the steps before lost theirs) and kept the old dropout the model no longer
    had."""
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--epochs", "1")) == 0
    assert main(["train", "--resume", str(run_dir), "--epochs", "2", "--lr", "0.01",
                 "--dropout", "0.3"]) == 0
    metrics = json.loads((run_dir / METRICS).read_text())
    assert metrics["resumes"][0]["changed"] == {"epochs": [1, 2], "lr": [0.05, 0.01],
                                                "dropout": [0.0, 0.3]}
    assert (metrics["config"]["lr"], metrics["config"]["dropout"]) == (0.01, 0.3)


def test_resuming_a_run_that_stopped_at_its_target_changes_nothing(images, every_step,
                                                                  tmp_path):
    """Its checkpoint leaves out the epoch it stopped inside (to resume inside it), and the
    resume rewrote metrics.json from it: the epoch in which the target was reached was gone,
    and a resume that trained nothing was recorded."""
    accuracy, step = first_reaching(every_step["evaluations"])
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--eval-every", "1", "--target-accuracy",
                           str(accuracy), "--stop-at-target")) == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_resuming_a_run_with_no_step_left_writes_nothing_and_says_so(images, tmp_path,
                                                                     capsys):
    """A run cut by --max-steps inside an epoch, resumed as it is: it validated once more
    (a second evaluation at the same step) and rewrote metrics.json from its checkpoint,
    which leaves out the epoch it was cut inside."""
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--eval-every", "1", "--max-steps", "2")) == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "has done its 2 steps (--max-steps): nothing left to train, nothing written" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_an_epoch_resumed_inside_says_where_its_per_step_figures_begin(images, tmp_path):
    """Its steps, samples, seconds and loss sum the whole epoch; its per-step figures are
    the last attempt's alone, which nothing said."""
    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--max-steps", "1")) == 0
    assert main(["train", "--resume", str(run_dir), "--max-steps", str(2 * STEPS_PER_EPOCH)]) == 0
    first, second = json.loads((run_dir / METRICS).read_text())["epochs"]
    assert (first["steps"], first["resumed_after_step"]) == (STEPS_PER_EPOCH, 1)
    assert len(first["per_step"]["seconds"]) == STEPS_PER_EPOCH - 1
    assert "resumed_after_step" not in second


def test_a_cut_off_the_validation_grid_is_not_in_the_targets_record(images, every_step,
                                                                    tmp_path):
    """--max-steps cut an epoch between two of its validations: the cut's own validation
    (the epoch line's accuracy) went into the target's record, so a run cut and resumed had
    an evaluation, and could reach its target at a step, that the run that went on had not."""
    run_dir = tmp_path / "run"
    flags = ["--eval-every", "2", "--target-accuracy", "1"]
    assert main(train_args(images, run_dir, *flags, "--max-steps", "1")) == 0
    metrics = json.loads((run_dir / METRICS).read_text())
    assert metrics["epochs"][0]["val_accuracy"] is not None  # the epoch line still has it
    assert metrics["target"]["evaluations"] == []
    assert main(["train", "--resume", str(run_dir), "--max-steps", str(2 * STEPS_PER_EPOCH)]) == 0
    steps = [e["step"] for e in target_of(run_dir)["evaluations"]]
    assert steps == [2, 3, 4, 6]  # every second step and each epoch's end, as uncut


def test_hosts_resumed_with_other_settings_are_refused_even_with_no_step_left(images, tmp_path):
    """A run with no step left under one host's --max-steps returned before the hosts
    agreed, while a host given more steps went on into `settle`'s agreement: split, they
    waited on each other. Every host agrees first, and a difference is refused."""
    from hybriddl.errors import UsageError
    from hybriddl.hosts.cluster import SingleHost
    from hybriddl.run import trainer
    from hybriddl.run.settings import settled_config

    class TwoHosts(SingleHost):
        rank, size = 0, 2

        def allgather(self, value):  # the other host was given --max-steps 4
            return [value, {**value, "max_steps": 4} if isinstance(value, dict) else value]

    run_dir = tmp_path / "run"
    assert main(train_args(images, run_dir, "--max-steps", "2")) == 0
    config, resume, _ = settled_config({}, str(run_dir))
    prepared = trainer.prepare(config, resume=resume)
    with pytest.raises(UsageError, match="hosts disagree on max_steps"):
        trainer.run(prepared, hosts=TwoHosts())

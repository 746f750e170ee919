"""`train --resume-if-exists RUN_DIR`: the one command a requeued job runs every time.

It starts a new run in RUN_DIR, continues the run there from its checkpoint, or, if that
run has finished, does nothing and exits 0. Runs are the tiny ones of test_checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sample_data import write_tinted_classes
from hybriddl.run import resumption
from hybriddl.cli import main
from hybriddl.rundir import CHECKPOINT, MODEL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_tinted_classes(tmp_path_factory.mktemp("images"))


def args(images: Path, *extra: str) -> list[str]:
    return ["train", "--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--dropout", "0",
            "--strategy", "sequential", "--monitor-interval", "0", *extra]


def parameters(run_dir: Path) -> dict:
    return torch.load(run_dir / MODEL, weights_only=True)


def test_starts_then_continues_then_leaves_a_finished_run_alone(images, tmp_path, capsys):
    reference = tmp_path / "reference"
    assert main(args(images, "--epochs", "2", "--run-dir", str(reference))) == 0

    run_dir = tmp_path / "run"
    assert resumption.run_state(run_dir) == resumption.FRESH
    assert main(args(images, "--epochs", "1", "--resume-if-exists", str(run_dir))) == 0
    assert resumption.run_state(run_dir) == resumption.FINISHED
    # What a run killed just after epoch 1's checkpoint leaves: a checkpoint, no model.
    (run_dir / MODEL).unlink()
    assert resumption.run_state(run_dir) == resumption.RESUMABLE
    assert main(args(images, "--epochs", "2", "--resume-if-exists", str(run_dir))) == 0
    finished = parameters(run_dir)
    for name, value in parameters(reference).items():
        assert torch.allclose(finished[name], value, rtol=1e-5, atol=1e-7), name

    model_written = (run_dir / MODEL).stat().st_mtime_ns
    capsys.readouterr()
    assert main(args(images, "--epochs", "2", "--resume-if-exists", str(run_dir))) == 0
    assert "has finished; nothing to do" in capsys.readouterr().err
    assert (run_dir / MODEL).stat().st_mtime_ns == model_written


def test_a_newer_checkpoint_than_the_model_is_resumable(tmp_path):
    """A finished run extended with --resume and interrupted: its checkpoint is newer."""
    (tmp_path / MODEL).write_bytes(b"old")
    (tmp_path / CHECKPOINT).write_bytes(b"new")
    model_time = (tmp_path / MODEL).stat().st_mtime_ns
    os.utime(tmp_path / CHECKPOINT, ns=(model_time + 10**9, model_time + 10**9))
    assert resumption.run_state(tmp_path) == resumption.RESUMABLE


def test_naming_another_run_directory_too_is_refused(images, tmp_path, capsys):
    code = main(args(images, "--resume-if-exists", str(tmp_path / "a"),
                     "--run-dir", str(tmp_path / "b")))
    assert code == 2
    assert "leave --resume and --run-dir out" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

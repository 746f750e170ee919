"""Storage faults: a full disk or a read-only run directory is one line, never a traceback.

At start a run directory without room for two checkpoints, or not writable, is refused
(exit 2) before data are read. A write that fails mid-run (disk full, read-only) stops
the run with one line naming the file and the free space (exit 1), keeps the previous
checkpoint and leaves no temporary file. The file systems are real: a small tmpfs and
a read-only bind mount, so these tests need root (to mount) and unmount on teardown.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from held_run import Held
from held_fixtures import images, no_held_run_left  # noqa: F401  (fixtures)
from hybriddl.run import resumption
from hybriddl.run.resumption import Position
from hybriddl.rundir import CHECKPOINT
from hybriddl.files import PARTIAL_GLOB

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="mounting a tmpfs or a read-only bind mount needs root"),
    pytest.mark.root, pytest.mark.slow,
    # Its mounts are its own (under tmp_path): beside other tests (tests/two_at_once.py).
    pytest.mark.beside,
]

STEPS_PER_EPOCH = 3
MB = 2**20


@pytest.fixture
def mounts():
    """mount(args..., target): mounts for this test, unmounted (innermost first) after it."""
    targets: list[Path] = []

    def mount(*args: str, target: Path) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", *args, str(target)], check=True, capture_output=True)
        targets.append(target)
        return target

    yield mount
    for target in reversed(targets):
        subprocess.run(["umount", str(target)], check=True, capture_output=True)


def small_disk(mounts, where: Path, size_mb: int) -> Path:
    return mounts("-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", target=where)


def read_only_view(mounts, source: Path, where: Path) -> Path:
    view = mounts("--bind", str(source), target=where)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True,
                   capture_output=True)
    return view


def train_args(data: Path | str, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--model", "squeezenet1_1", "--data", str(data), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2", "--dropout", "0",
            "--strategy", "sequential", "--monitor-interval", "0", "--run-dir", str(run_dir),
            *extra]


def one_line(stderr: str, started: bool = False) -> str:
    """The error line; a run that had started shows its progress display before it."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert started or len(lines) == 1, stderr
    return lines[-1]


# --------------------------------------------------------------------------- at start

def test_run_dir_without_room_for_two_checkpoints_is_refused_before_reading_data(
        mounts, tmp_path, cli):
    disk = small_disk(mounts, tmp_path / "disk", 4)
    run_dir = disk / "run"
    # The data do not exist: the storage check comes first, so it is the one reported.
    done = cli(*train_args(tmp_path / "no-such-data", run_dir))
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--run-dir {run_dir}" in line and "free there" in line, line
    free = shutil.disk_usage(disk).free
    assert f"({free} bytes) free" in line, line
    needed = int(line.split("needs about ")[1].split("(")[1].split(" bytes")[0])
    assert needed > free
    assert not run_dir.exists()


def test_read_only_run_dir_is_refused_at_start(mounts, tmp_path, images, cli):
    (tmp_path / "source").mkdir()
    view = read_only_view(mounts, tmp_path / "source", tmp_path / "view")
    done = cli(*train_args(images, view / "run"))
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert str(view) in line and "read-only file system" in line, line


# --------------------------------------------------------------------------- mid-run

def test_disk_full_during_checkpoint_write_is_one_line_and_keeps_the_previous(
        mounts, tmp_path, images):
    disk = small_disk(mounts, tmp_path / "disk", 40)
    run_dir = disk / "run"
    child = Held(tmp_path, train_args(images, run_dir))  # after epoch 1's checkpoint
    before = (run_dir / CHECKPOINT).read_bytes()
    # Leave 1 MB: metrics.json still fits, epoch 2's 6 MB checkpoint does not.
    ballast = disk / "ballast"
    with open(ballast, "wb") as handle:
        handle.write(b"\0" * (shutil.disk_usage(disk).free - MB))
    child.release()
    code, err = child.finish()
    assert code == 1, err
    line = one_line(err, started=True)
    assert f"writing {run_dir / CHECKPOINT} failed: No space left on device" in line, line
    assert "MB free there" in line, line
    assert f"the last good checkpoint (epoch 2, step 0) is kept in {run_dir}" in line, line
    assert (run_dir / CHECKPOINT).read_bytes() == before
    assert resumption.load(run_dir).position == Position(1, 0, STEPS_PER_EPOCH)
    assert list(run_dir.glob(PARTIAL_GLOB)) == []


def test_run_dir_turned_read_only_mid_run_is_one_line_and_keeps_the_checkpoint(
        mounts, tmp_path, images):
    (tmp_path / "source").mkdir()
    view = mounts("--bind", str(tmp_path / "source"), target=tmp_path / "view")
    run_dir = view / "run"
    child = Held(tmp_path, train_args(images, run_dir))  # after epoch 1's checkpoint
    before = (run_dir / CHECKPOINT).read_bytes()
    subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True,
                   capture_output=True)
    child.release()
    code, err = child.finish()
    assert code == 1, err
    line = one_line(err, started=True)
    # Epoch 2's record (metrics.json) is the first write to fail.
    assert f"writing {run_dir}/" in line and "failed: Read-only file system" in line, line
    assert (run_dir / CHECKPOINT).read_bytes() == before
    assert list(run_dir.glob(PARTIAL_GLOB)) == []

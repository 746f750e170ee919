"""`train --weights FILE`: a run that starts from another run's (or any) state_dict."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torchvision

from hybriddl.rundir import METRICS, MODEL
from sample_data import write_tinted_classes
from test_evaluate_predict import PER_CLASS, TRAIN, one_line_refusal

pytestmark = pytest.mark.slow

# One step at a learning rate that moves no weight measurably: what run B's first
# validation sees is the model it started from.
STILL = ["--max-steps", "1", "--lr", "1e-9"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data") / "photos"
    root.mkdir()
    return write_tinted_classes(root, per_class=PER_CLASS)


@pytest.fixture(scope="module")
def run_a(photos, tmp_path_factory) -> Path:
    from conftest import run_cli

    run_dir = tmp_path_factory.mktemp("a") / "run"
    done = run_cli("train", "--data", str(photos), *TRAIN, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def test_a_run_started_from_another_runs_model_starts_at_its_accuracy(cli, photos, run_a,
                                                                      tmp_path):
    accuracy_a = json.loads((run_a / METRICS).read_text())["epochs"][-1]["val_accuracy"]
    assert accuracy_a >= 0.6  # a fresh model scores about 1/3: the comparison can fail
    run_b = tmp_path / "b"
    train = with_flag(TRAIN, "--lr", STILL[3]) + STILL[:2]
    done = cli("train", "--data", str(photos), *train, "--weights", str(run_a / MODEL),
               "--run-dir", str(run_b))
    assert done.returncode == 0, done.stderr
    metrics = json.loads((run_b / METRICS).read_text())
    assert metrics["epochs"][0]["val_accuracy"] == pytest.approx(accuracy_a, abs=0.02)
    weights = metrics["config"]["weights"]
    assert weights["sha256"] == hashlib.sha256((run_a / MODEL).read_bytes()).hexdigest()
    assert weights["replaced_head"] is None
    assert str(run_a / MODEL) in done.stderr


def test_a_head_of_another_class_count_is_replaced_and_named(cli, photos, run_a, tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    for name in ("fire", "smoke"):
        shutil.copytree(photos / name, two / name)
    run_c = tmp_path / "c"
    done = cli("train", "--data", str(two), *with_flag(TRAIN, "--lr", STILL[3]), *STILL[:2],
               "--weights", str(run_a / MODEL), "--run-dir", str(run_c))
    assert done.returncode == 0, done.stderr
    named = [line for line in done.stderr.splitlines() if "classifier.1" in line]
    assert len(named) == 1 and "re-initialised" in named[0]
    head = json.loads((run_c / METRICS).read_text())["config"]["weights"]["replaced_head"]
    assert head == {"layer": "classifier.1", "file_classes": 3, "classes": 2}
    a = torch.load(run_a / MODEL, weights_only=True)
    c = torch.load(run_c / MODEL, weights_only=True)
    assert c["classifier.1.weight"].shape[0] == 2
    for name, tensor in a.items():
        if not name.startswith("classifier.1."):
            torch.testing.assert_close(c[name], tensor, atol=1e-6, rtol=0)


def bad_weights(tmp: Path) -> tuple[Path, str]:
    return tmp / "nowhere.pt", "no such file"


def not_torch(tmp: Path) -> tuple[Path, str]:
    (tmp / "notes.pt").write_text("not weights")
    return tmp / "notes.pt", "cannot be loaded"


def not_a_state_dict(tmp: Path) -> tuple[Path, str]:
    torch.save({"epoch": 3}, tmp / "other.pt")
    return tmp / "other.pt", "not a state_dict"


def another_model(tmp: Path) -> tuple[Path, str]:
    torch.save(torchvision.models.squeezenet1_0(num_classes=3).state_dict(), tmp / "sq10.pt")
    return tmp / "sq10.pt", "does not fit"


@pytest.mark.parametrize("case", [bad_weights, not_torch, not_a_state_dict, another_model],
                         ids=lambda f: f.__name__)
def test_weights_that_cannot_be_used_are_one_line(cli_here, photos, tmp_path, case):
    path, words = case(tmp_path)
    done = cli_here("train", "--data", str(photos), *TRAIN, *STILL[:2],
                    "--weights", str(path), "--run-dir", str(tmp_path / "run"))
    line = one_line_refusal(done)
    assert words in line and str(path) in line
    assert not (tmp_path / "run").exists()

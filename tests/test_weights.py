"""`train --weights FILE|NAME`: a run that starts from another run's (or any) state_dict, or
from weights torchvision lists for the model, read from torch's cache (TORCH_HOME), offline."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torchvision

from hybriddl.errors import UsageError
from hybriddl.rundir import METRICS, MODEL
from hybriddl.run.weights import cached_weights_file, is_weights_name, named_weights
from sample_data import write_tinted_classes
from test_evaluate_predict import PER_CLASS, TRAIN, one_line_refusal

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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --------------------------------------------------------------------------- named weights
# README quick start 1's fine-tuning: AlexNet (SimpleBig) at 64 px from ImageNet weights.
ALEXNET = ["--model", "alexnet", "--image-size", "64", "--batch-size", "8", "--epochs", "1",
           "--dropout", "0", "--strategy", "sequential", "--monitor-interval", "0"]
ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # the name torch.hub gives AlexNet_Weights' URL


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    """An empty torch cache (TORCH_HOME) and no network: every download goes to a proxy
    that refuses connections. Returns the cache's checkpoints folder, not yet made."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "torch" / "hub" / "checkpoints"


def test_every_name_torchvision_gives_its_weights_resolves_to_them():
    for value in ("DEFAULT", "IMAGENET1K_V1", "imagenet1k_v1", "AlexNet_Weights.IMAGENET1K_V1"):
        assert is_weights_name(value)
        assert str(named_weights("alexnet", value)) == "AlexNet_Weights.IMAGENET1K_V1"
    assert str(named_weights("vgg16", "IMAGENET1K_FEATURES")) == "VGG16_Weights.IMAGENET1K_FEATURES"
    # Files, existing or not, stay files.
    for value in ("model.pt", "runs/a/model.pt", "./IMAGENET1K_V1", "~/weights", __file__):
        assert not is_weights_name(value)


@pytest.mark.parametrize("value", ["IMAGENET1K_V9", "VGG16_Weights.IMAGENET1K_V1"])
def test_a_name_torchvision_does_not_list_for_the_model_lists_those_it_does(value):
    with pytest.raises(UsageError) as refused:
        named_weights("alexnet", value)
    line = str(refused.value)
    assert "\n" not in line and value in line
    assert "DEFAULT, IMAGENET1K_V1" in line and "AlexNet_Weights" in line


def test_named_weights_in_torchs_cache_are_read_without_the_network(offline):
    offline.mkdir(parents=True)
    (offline / ALEXNET_FILE).write_bytes(b"cached")
    assert cached_weights_file(named_weights("alexnet", "DEFAULT")) == offline / ALEXNET_FILE


def test_named_weights_neither_cached_nor_reachable_say_what_to_place_where(offline):
    with pytest.raises(UsageError) as refused:
        cached_weights_file(named_weights("alexnet", "DEFAULT"))
    line = str(refused.value)
    assert "\n" not in line
    assert ALEXNET_FILE in line and str(offline) in line
    assert "https://download.pytorch.org/models/" + ALEXNET_FILE in line
    assert not offline.exists() or list(offline.iterdir()) == []  # no partial download left


@pytest.mark.slow
def test_training_from_named_weights_reads_torchs_cache_and_records_them(photos, offline,
                                                                         tmp_path):
    from conftest import run_cli

    imagenet = torchvision.models.alexnet(num_classes=1000).state_dict()
    offline.mkdir(parents=True)
    torch.save(imagenet, offline / ALEXNET_FILE)
    run_dir = tmp_path / "run"
    done = run_cli("train", "--data", str(photos), *ALEXNET, *STILL, "--weights",
                   "IMAGENET1K_V1", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    weights = json.loads((run_dir / METRICS).read_text())["config"]["weights"]
    assert weights["name"] == "AlexNet_Weights.IMAGENET1K_V1"
    assert weights["file"] == str(offline / ALEXNET_FILE)
    assert weights["sha256"] == hashlib.sha256((offline / ALEXNET_FILE).read_bytes()).hexdigest()
    assert weights["replaced_head"] == {"layer": "classifier.6", "file_classes": 1000,
                                        "classes": 3}
    assert "AlexNet_Weights.IMAGENET1K_V1" in done.stderr
    trained = torch.load(run_dir / MODEL, weights_only=True)
    assert trained["classifier.6.weight"].shape[0] == 3
    for name in ("features.0.weight", "classifier.4.weight"):  # lr 1e-9: still the file's
        torch.testing.assert_close(trained[name], imagenet[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("value, words", [("IMAGENET1K_V1", ALEXNET_FILE),
                                          ("IMAGENET_V9", "DEFAULT, IMAGENET1K_V1")])
def test_named_weights_that_cannot_be_used_are_one_line(cli_here, photos, offline, tmp_path,
                                                        value, words):
    done = cli_here("train", "--data", str(photos), *ALEXNET, *STILL, "--weights", value,
                    "--run-dir", str(tmp_path / "run"))
    line = one_line_refusal(done)
    assert words in line and value in line
    assert not (tmp_path / "run").exists()


def test_a_scalar_that_differs_in_shape_is_named_not_an_index_error():
    import torch

    from hybriddl.run.weights import replaced_head

    own = {"bn.num_batches_tracked": torch.tensor(0), "fc.weight": torch.zeros(2, 4)}
    state = {"bn.num_batches_tracked": torch.zeros(1), "fc.weight": torch.zeros(2, 4)}
    assert replaced_head(["bn.num_batches_tracked"], own, state, 2) is None
    assert replaced_head(["bn.num_batches_tracked"], state, own, 1) is None
    state = {"fc.weight": torch.zeros(5, 4), "fc.bias": torch.zeros(5)}
    own = {"fc.weight": torch.zeros(2, 4), "fc.bias": torch.zeros(2)}
    assert replaced_head(["fc.bias", "fc.weight"], own, state, 2) == "fc"

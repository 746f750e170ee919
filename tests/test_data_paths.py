"""`--data DIR` spelled any way a user types it names one folder and one cache."""

from __future__ import annotations

import json

import pytest

from hybriddl.data.loading import load_data
from hybriddl.rundir import METRICS
from sample_data import write_tinted_classes


@pytest.fixture
def photos(tmp_path):
    """A folder `photos` under a home directory of its own, and a link to it."""
    (tmp_path / "home" / "photos").mkdir(parents=True)
    root = write_tinted_classes(tmp_path / "home" / "photos")
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    return tmp_path, root


SPELLINGS = {
    "relative": lambda base, root: "home/photos",
    "dot_relative_trailing_slash": lambda base, root: "./home/photos/",
    "absolute": lambda base, root: str(root),
    "absolute_trailing_slash": lambda base, root: f"{root}/",
    "home": lambda base, root: "~/photos",
    "symlink": lambda base, root: "link",
    "symlink_absolute": lambda base, root: str(base / "link") + "/",
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_of_a_folder_loads_it(photos, monkeypatch, spelling):
    base, root = photos
    monkeypatch.chdir(base)
    monkeypatch.setenv("HOME", str(base / "home"))
    split = load_data(SPELLINGS[spelling](base, root), variant="small", image_size=16,
                      cache_dir=str(base / "cache"))
    assert split.source == f"imagefolder:{root.resolve()}"
    assert split.classes == ["clear", "fire", "smoke"]
    assert len(split.train) + len(split.val) == 18


def test_all_spellings_share_one_cache(photos, monkeypatch):
    base, root = photos
    monkeypatch.chdir(base)
    monkeypatch.setenv("HOME", str(base / "home"))
    cache = base / "cache"
    sources = {load_data(spell(base, root), variant="small", image_size=16,
                         cache_dir=str(cache)).source for spell in SPELLINGS.values()}
    assert len(sources) == 1
    assert len(list(cache.glob("*.cache"))) == 1


def test_cifar10_folder_from_home(tmp_path, monkeypatch):
    from sample_data import write_cifar10

    write_cifar10(tmp_path / "home" / "cifar", train_batches=1, per_batch=20, test=10)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for spec in ("cifar10:~/cifar", "cifar10:home/cifar/"):
        split = load_data(spec, variant="small", image_size=32, cache_dir=str(tmp_path / "cache"))
        assert split.source == f"cifar10:{(tmp_path / 'home' / 'cifar').resolve()}"
    assert len(list((tmp_path / "cache").glob("*.cache"))) == 1


@pytest.mark.slow
def test_train_with_a_relative_data_folder(cli, tmp_path):
    # The command of the bug report: a relative folder ended in a ValueError traceback.
    (tmp_path / "photos").mkdir()
    write_tinted_classes(tmp_path / "photos")
    done = cli("train", "--data", "photos", "--model", "squeezenet1_1", "--image-size", "32",
               "--batch-size", "4", "--max-steps", "1", "--strategy", "sequential",
               "--monitor-interval", "0", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    source = json.loads((tmp_path / "run" / METRICS).read_text())["config"]["data"]["source"]
    assert source == f"imagefolder:{(tmp_path / 'photos').resolve()}"


def test_a_symbolic_link_loop_is_one_line_for_train_and_evaluate(cli_here, tmp_path):
    from hybriddl.errors import UsageError
    from hybriddl.inference.evaluate import labelled_images

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    done = cli_here("train", "--data", str(loop), "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert f"--data {loop}: cannot follow it" in done.stderr
    with pytest.raises(UsageError, match="cannot follow it"):
        labelled_images(loop, ["a", "b"])  # evaluate's, once the run's model is read

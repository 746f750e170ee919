"""Files given by the user that would run code when loaded, or are cut short: refused in one
line, exit code 2, nothing run, nothing that was saved before lost."""

import os
import pickle

import pytest
import torch
from sample_data import CIFAR_FOLDER, write_cifar10, write_imagefolder

from hybriddl.run import resumption
from hybriddl.run.resumption import Checkpoint, EpochProgress, Position
from hybriddl.rundir import CHECKPOINT
from hybriddl.errors import UsageError


class CreatesAFile:
    """Unpickled, this would create `path`: the mark of code run from a file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class RunsAShell:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def as_torch_file(path, payload):
    torch.save(payload, path)


def as_plain_pickle(path, payload):
    path.write_bytes(pickle.dumps(payload, protocol=2))


HOSTILE = {
    "torch_zip_open": (as_torch_file, CreatesAFile),
    "plain_pickle_open": (as_plain_pickle, CreatesAFile),
    "torch_zip_os_system": (as_torch_file, RunsAShell),
}


def hostile_file(path, marker, case):
    write, payload = HOSTILE[case]
    write(path, {"model": {"weight": payload(marker)}, "format": 1})
    return path


def assert_refused_in_one_line(done, marker, *named):
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for text in named:
        assert text in lines[0], lines[0]
    assert not marker.exists(), "the file's code ran"


@pytest.mark.parametrize("case", list(HOSTILE))
def test_resume_refuses_a_checkpoint_that_would_run_code(cli_here, tmp_path, case):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    marker = tmp_path / "ran"
    hostile_file(run_dir / CHECKPOINT, marker, case)
    before = (run_dir / CHECKPOINT).read_bytes()
    done = cli_here("train", "--resume", str(run_dir))
    assert_refused_in_one_line(done, marker, str(run_dir / CHECKPOINT), "refused",
                               "nothing of it was run")
    assert (run_dir / CHECKPOINT).read_bytes() == before


@pytest.mark.parametrize("case", list(HOSTILE))
def test_weights_refuses_a_file_that_would_run_code(cli_here, tmp_path, case):
    marker = tmp_path / "ran"
    weights = hostile_file(tmp_path / "weights.pt", marker, case)
    photos = write_imagefolder(tmp_path / "photos", per_class=3)
    done = cli_here("train", "--data", str(photos), "--data-cache", str(tmp_path / "cache"),
                    "--model", "squeezenet1_1", "--image-size", "32", "--strategy",
                    "sequential", "--batch-size", "2", "--weights", str(weights), "--run-dir", str(tmp_path / "run"))
    assert_refused_in_one_line(done, marker, str(weights), "refused")
    assert not (tmp_path / "run").exists()


def test_a_cifar_batch_that_would_run_code_is_refused(cli_here, tmp_path):
    marker = tmp_path / "ran"
    write_cifar10(tmp_path / "cifar", train_batches=2)
    batch = tmp_path / "cifar" / CIFAR_FOLDER / "data_batch_2"
    batch.write_bytes(pickle.dumps({"data": CreatesAFile(marker), "labels": [0]}, protocol=2))
    done = cli_here("train", "--data", f"cifar10:{tmp_path / 'cifar'}", "--data-cache",
                    str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run"))
    assert_refused_in_one_line(done, marker, "data_batch_2", "refused without running it")


# --------------------------------------------------------------------------- cut short

def small_checkpoint(path, epoch):
    payload = Checkpoint(config={}, identity={}, position=Position(epoch, 0, 3 * epoch),
                         progress=EpochProgress(), model={"weight": torch.ones(64, 64)},
                         optimizer={}, rng={}, metrics={}, strategy={}).to_payload()
    torch.save(payload, path)
    return path


def cut_short(path):
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    return path.read_bytes()


def test_a_truncated_checkpoint_names_the_file_and_the_last_good_one(cli_here, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    older = small_checkpoint(run_dir / "checkpoint-epoch1.pt", epoch=1)
    cut = cut_short(small_checkpoint(run_dir / CHECKPOINT, epoch=2))
    done = cli_here("train", "--resume", str(run_dir))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"{run_dir / CHECKPOINT} is cut short" in lines[0]
    assert f"the last good checkpoint is {older} (epoch 2, step 0)" in lines[0]
    assert (run_dir / CHECKPOINT).read_bytes() == cut


def test_a_truncated_checkpoint_without_an_older_one_says_so(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cut_short(small_checkpoint(run_dir / CHECKPOINT, epoch=2))
    with pytest.raises(UsageError, match="cut short.*no other checkpoint is kept there"):
        resumption.load(run_dir)


# --------------------------------------------------------------------------- the helper

def test_load_state_dict_file_reads_a_state_dict_and_refuses_the_rest(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"conv.weight": torch.ones(2, 3)}, good)
    assert torch.equal(resumption.load_state_dict_file(good)["conv.weight"], torch.ones(2, 3))
    marker = tmp_path / "ran"
    cases = {"hostile": (hostile_file(tmp_path / "hostile.pt", marker, "torch_zip_open"),
                         "is refused"),
             "cut": (tmp_path / "cut.pt", "is cut short"),
             "text": (tmp_path / "notes.pt", "cannot be loaded: it is no PyTorch file"),
             "a list": (tmp_path / "list.pt", "not a state_dict")}
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:200])
    (tmp_path / "notes.pt").write_text("not weights\n")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    for name, (path, words) in cases.items():
        with pytest.raises(UsageError) as refused:
            resumption.load_state_dict_file(path)
        message = str(refused.value)
        assert str(path) in message and words in message and "\n" not in message, (name, message)
    assert not marker.exists()

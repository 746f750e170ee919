"""`hybriddl train` end to end: the embedded data is learnable and the run directory keeps its contract."""

import json

import pytest
import torch
import torchvision
from sample_data import write_cifar10, write_imagefolder

from hybriddl import data
from hybriddl.rundir import METRICS, MODEL

EPOCH_KEYS = {"seconds", "images_per_second", "train_loss", "val_accuracy", "data_wait_seconds",
              "mpi_bytes_sent"}
CONFIG_KEYS = {"usecase", "model", "strategy", "hosts", "global_batch", "image_size", "seed",
               "data", "epochs", "lr", "momentum", "dropout"}

# A small torchvision model at a small size learns the embedded data in a few epochs;
# the paper's VGG16 at lr 0.001 needs minutes for the same (see the README's main job).
LEARNING_RUN = ["--usecase", "ComplexSmall", "--model", "resnet18", "--image-size", "32",
                "--lr", "0.01", "--epochs", "3", "--strategy", "sequential"]


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    from conftest import run_cli

    run_dir = tmp_path_factory.mktemp("learning") / "run"
    done = run_cli("train", *LEARNING_RUN, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir, json.loads((run_dir / METRICS).read_text()), done


@pytest.mark.slow
def test_embedded_data_is_learnable_in_a_few_epochs(learning_run):
    _, metrics, _ = learning_run
    accuracies = [e["val_accuracy"] for e in metrics["epochs"]]
    assert len(accuracies) == 3
    assert accuracies[-1] >= 0.8, accuracies
    assert metrics["epochs"][-1]["train_loss"] < metrics["epochs"][0]["train_loss"]


@pytest.mark.slow
def test_metrics_record_the_configuration(learning_run):
    _, metrics, _ = learning_run
    config = metrics["config"]
    assert CONFIG_KEYS <= set(config)
    assert (config["usecase"], config["model"], config["image_size"]) == ("ComplexSmall", "resnet18", 32)
    assert (config["global_batch"], config["lr"], config["momentum"], config["seed"]) == (16, 0.01, 0.9, 0)
    assert config["strategy"]["name"] == "sequential"
    assert config["hosts"]["count"] == 1
    per_class_train, per_class_val, _ = data.SYNTHETIC_VARIANTS["small"]
    assert config["data"]["source"] == "synthetic:small"
    assert config["data"]["classes"] == ["fire", "smoke", "clear"]
    assert (config["data"]["train_images"], config["data"]["val_images"]) == \
        (3 * per_class_train, 3 * per_class_val)


@pytest.mark.slow
def test_metrics_hold_one_sensible_record_per_epoch(learning_run):
    _, metrics, _ = learning_run
    train_images = metrics["config"]["data"]["train_images"]
    for number, record in enumerate(metrics["epochs"], start=1):
        assert EPOCH_KEYS <= set(record)
        assert record["epoch"] == number
        assert record["samples"] == train_images
        assert record["steps"] == data.steps_per_epoch(train_images, 16)
        assert record["seconds"] > 0
        assert record["images_per_second"] == pytest.approx(train_images / record["seconds"])
        assert 0.0 <= record["data_wait_seconds"] < record["seconds"]
        assert record["mpi_bytes_sent"] == 0  # one host: nothing handed to MPI
        assert 0.0 <= record["val_accuracy"] <= 1.0
        assert record["train_loss"] > 0


@pytest.mark.slow
def test_model_file_loads_into_the_torchvision_model(learning_run):
    run_dir, _, _ = learning_run
    state = torch.load(run_dir / MODEL, weights_only=True)
    model = torchvision.models.get_model("resnet18", weights=None, num_classes=3)
    model.load_state_dict(state, strict=True)
    assert not torch.equal(model.fc.weight, torchvision.models.get_model(
        "resnet18", weights=None, num_classes=3).fc.weight)


@pytest.mark.slow
def test_run_directory_holds_only_finished_files(learning_run):
    run_dir, _, _ = learning_run
    names = {p.name for p in run_dir.iterdir()}
    assert {METRICS, MODEL} <= names
    assert not [n for n in names if ".tmp" in n]


@pytest.mark.slow
def test_train_prints_the_epoch_table(learning_run):
    run_dir, _, done = learning_run
    assert "val accuracy" in done.stdout
    assert str(run_dir) in done.stdout.replace("\n", "")


@pytest.mark.slow
def test_max_steps_stops_across_epochs(cli, tmp_path):
    run_dir = tmp_path / "run"
    done = cli("train", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "4",
               "--max-steps", "2", "--epochs", "3", "--dropout", "0", "--strategy", "sequential",
               "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    metrics = json.loads((run_dir / METRICS).read_text())
    assert [e["steps"] for e in metrics["epochs"]] == [2]
    assert metrics["epochs"][0]["samples"] == 8
    assert metrics["config"]["dropout"] == 0.0
    model = torchvision.models.get_model("squeezenet1_1", weights=None, num_classes=3, dropout=0.0)
    model.load_state_dict(torch.load(run_dir / MODEL, weights_only=True), strict=True)


@pytest.mark.slow
def test_measure_only_times_the_steps_and_leaves_out_checkpoint_validation_and_model(
        cli, cli_here, tmp_path):
    run_dir = tmp_path / "run"
    done = cli("train", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "4",
               "--max-steps", "2", "--epochs", "3", "--strategy", "sequential",
               "--checkpoint-every", "1", "--measure-only", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    metrics = json.loads((run_dir / METRICS).read_text())
    assert metrics["config"]["measure_only"] == "no checkpoint, validation pass or model.pt"
    assert [(e["steps"], e["val_accuracy"]) for e in metrics["epochs"]] == [(2, None)]
    assert metrics["epochs"][0]["seconds"] > 0
    assert sorted(p.name for p in run_dir.iterdir() if p.suffix == ".pt") == []
    refused = cli_here("train", "--measure-only", "--resume-if-exists", str(tmp_path / "r"))
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "--measure-only writes no checkpoint" in \
        refused.stderr


@pytest.mark.slow
def test_train_records_the_numerics_it_ran_in(cli, tmp_path):
    run_dir = tmp_path / "run"
    # Batch 8: two chunks of 4 over 2 workers leave BatchNorm 2 samples per worker.
    done = cli("train", "--model", "mobilenet_v3_small", "--image-size", "32", "--batch-size", "8",
               "--max-steps", "1", "--strategy", "layerwise", "--workers", "2", "--oversubscribe",
               "--precision", "bf16", "--channels-last", "--accumulate", "2",
               "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    strategy = json.loads((run_dir / METRICS).read_text())["config"]["strategy"]
    assert (strategy["precision"], strategy["channels_last"]) == ("bf16", True)
    assert strategy["accumulate"] == 2
    state = torch.load(run_dir / MODEL, weights_only=True)
    assert all(t.dtype != torch.bfloat16 for t in state.values())  # float32 master weights


@pytest.mark.slow
def test_train_on_an_imagefolder(cli, tmp_path):
    root = write_imagefolder(tmp_path / "images", per_class=6,
                             classes={"fire": (230, 80, 10), "smoke": (150, 150, 150),
                                      "clear": (40, 90, 200)})
    run_dir = tmp_path / "run"
    done = cli("train", "--data", str(root), "--model", "squeezenet1_1", "--image-size", "32",
               "--batch-size", "4", "--epochs", "1", "--val-fraction", "0.34",
               "--strategy", "sequential", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    config = json.loads((run_dir / METRICS).read_text())["config"]
    assert config["data"]["classes"] == ["clear", "fire", "smoke"]
    assert (config["data"]["train_images"], config["data"]["val_images"]) == (12, 6)
    assert config["data"]["stored_size"] == [32, 32]


@pytest.mark.slow
def test_train_on_cifar10_batches_with_fewer_classes(cli, tmp_path):
    write_cifar10(tmp_path / "cifar", train_batches=2, per_batch=30, test=20)
    run_dir = tmp_path / "run"
    done = cli("train", "--data", f"cifar10:{tmp_path / 'cifar'}", "--classes", "4",
               "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "8",
               "--epochs", "1", "--strategy", "sequential", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    metrics = json.loads((run_dir / METRICS).read_text())
    assert metrics["config"]["data"]["classes"] == ["airplane", "automobile", "bird", "cat"]
    assert (metrics["config"]["data"]["train_images"], metrics["config"]["data"]["val_images"]) == (24, 8)
    assert metrics["epochs"][0]["steps"] == 3
    state = torch.load(run_dir / MODEL, weights_only=True)
    torchvision.models.get_model("squeezenet1_1", weights=None, num_classes=4).load_state_dict(
        state, strict=True)


def test_info_names_host_cores_ram_gpus_and_library_versions(cli):
    done = cli("info", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert {"host", "cpu_model", "cores_logical", "cores_usable", "ram_gib", "gpus", "torch",
            "torchvision", "mpi4py", "mpi_library"} <= set(info)
    assert info["torch"] == torch.__version__
    assert info["torchvision"] == torchvision.__version__
    assert 1 <= info["cores_usable"] <= info["cores_logical"]
    assert info["ram_gib"] > 0
    assert isinstance(info["gpus"], list) and len(info["gpus"]) == torch.cuda.device_count()
    import mpi4py

    assert info["mpi4py"] == mpi4py.__version__
    assert "MPI" in info["mpi_library"]


def test_info_table_lists_the_same_facts(cli):
    done = cli("info")
    assert done.returncode == 0, done.stderr
    for word in ("host", "cores usable", "ram gib", "gpus", "torch", "torchvision", "mpi4py",
                 "mpi library"):
        assert word in done.stdout


def test_python_m_hybriddl_help_lists_the_subcommands(cli, cli_here):
    done = cli("--help")
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout and "info" in done.stdout
    train_help = cli_here("train", "--help")  # the same main(), without a second start
    for flag in ("--usecase", "--model", "--image-size", "--batch-size", "--epochs", "--lr",
                 "--momentum", "--dropout", "--seed", "--max-steps", "--data", "--run-dir",
                 "--classes", "--precision", "--channels-last", "--accumulate"):
        assert flag in train_help.stdout



@pytest.mark.slow
def test_a_one_sample_forward_through_batchnorm_is_one_line(cli, tmp_path):
    """Batch 2 over 2 worker threads: each forward pass has one sample, which BatchNorm
    cannot train on; the user gets what to change, not torch's traceback."""
    done = cli("train", "--model", "mobilenet_v3_small", "--image-size", "32", "--batch-size", "2",
               "--max-steps", "1", "--strategy", "threads", "--workers", "2", "--oversubscribe",
               "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert "a forward pass of one sample reached BatchNorm" in lines[-1]
    assert "fewer --workers or --accumulate chunks" in lines[-1]


@pytest.mark.parametrize(("error", "says"), [
    (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
                                    "has a total capacity of 79.11 GiB\nmore"), "GPU"),
    (lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                          "can't allocate memory: you tried to allocate 4194304000 bytes."),
     "host"),
])
def test_running_out_of_memory_mid_run_is_one_line_saying_what_to_lower(tmp_path, monkeypatch,
                                                                        capsys, error, says):
    from hybriddl.cli import main
    from hybriddl.strategies.sequential import Sequential

    real, steps = Sequential.compute_gradients, []

    def out_of_memory(self, x, y):  # the second step does not fit
        steps.append(1)
        if len(steps) == 2:
            raise error()
        return real(self, x, y)
    monkeypatch.setattr(Sequential, "compute_gradients", out_of_memory)
    run_dir = tmp_path / "run"
    assert main(["train", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "4",
                 "--epochs", "1", "--strategy", "sequential", "--checkpoint-every", "1",
                 "--monitor-interval", "0", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip()  # the progress bar's lines, then one
    assert "Traceback" not in err and "\nmore" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith(f"hybriddl: training stopped: out of {says} memory (")
    assert "lower --batch-size, or give --accumulate N" in last
    assert (run_dir / "checkpoint.pt").exists()  # the first step's, kept

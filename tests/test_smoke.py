import json

from hybriddl.rundir import METRICS, MODEL


def test_train_writes_run_directory(cli, tmp_path):
    run_dir = tmp_path / "run"
    done = cli("train", "--usecase", "ComplexSmall", "--image-size", "32", "--max-steps", "2",
               "--strategy", "sequential",
               "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    metrics = json.loads((run_dir / METRICS).read_text())
    assert metrics["config"]["model"] == "vgg16"
    assert metrics["epochs"][0]["steps"] == 2
    assert (run_dir / MODEL).is_file()

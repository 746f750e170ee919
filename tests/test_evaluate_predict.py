"""`hybriddl evaluate` and `hybriddl predict` on a tiny trained run."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest

from hybriddl.inference.predict import predict
from hybriddl.inference.trained import load_trained
from hybriddl.rundir import METRICS, MODEL
from sample_data import write_tinted_classes

pytestmark = pytest.mark.slow

CLASSES = ["clear", "fire", "smoke"]
PER_CLASS = 20
# squeezenet learns the tinted classes at this lr in 3 epochs (val accuracy ~0.9, 0.33 at start).
TRAIN = ["--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "8", "--epochs", "3",
         "--lr", "0.001", "--dropout", "0", "--strategy", "sequential", "--monitor-interval", "0"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data") / "photos"
    root.mkdir()
    return write_tinted_classes(root, per_class=PER_CLASS)


@pytest.fixture(scope="module")
def run_dir(photos, tmp_path_factory) -> Path:
    from conftest import run_cli

    run_dir = tmp_path_factory.mktemp("run") / "run"
    done = run_cli("train", "--data", str(photos), *TRAIN, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir


def one_line_refusal(done) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# --------------------------------------------------------------------------- evaluate

def test_evaluate_writes_scores_matrix_and_chart_in_the_run(cli, run_dir, photos):
    done = cli("evaluate", str(run_dir), "--data", str(photos))
    assert done.returncode == 0, done.stderr
    result = json.loads((run_dir / "evaluation" / "evaluation.json").read_text())
    assert result["classes"] == CLASSES and result["images"] == 3 * PER_CLASS
    matrix = result["confusion_matrix"]
    assert [sum(row) for row in matrix] == [PER_CLASS] * 3
    assert result["accuracy"] == pytest.approx(sum(matrix[k][k] for k in range(3)) / (3 * PER_CLASS))
    assert result["accuracy"] >= 0.6  # the trained model, not a fresh one (about 0.33)
    for k, scores in enumerate(result["per_class"]):
        assert scores["name"] == CLASSES[k] and scores["support"] == PER_CLASS
        assert scores["recall"] == pytest.approx(matrix[k][k] / PER_CLASS)
        predicted = sum(row[k] for row in matrix)
        if predicted:
            assert scores["precision"] == pytest.approx(matrix[k][k] / predicted)
    png = (run_dir / "evaluation" / "confusion_matrix.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert f"{result['accuracy']:.3f}" in done.stdout
    assert all(name in done.stdout for name in CLASSES)
    assert not list((run_dir / "evaluation").glob(".*tmp*"))


def test_evaluate_a_folder_with_fewer_classes_into_another_output(cli_here, run_dir, photos,
                                                                  tmp_path):
    shutil.copytree(photos / "fire", tmp_path / "only" / "fire")
    done = cli_here("evaluate", str(run_dir), "--data", str(tmp_path / "only"),
                    "--output", str(tmp_path / "out"), "--batch-size", "7")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    supports = {s["name"]: s["support"] for s in result["per_class"]}
    assert supports == {"clear": 0, "fire": PER_CLASS, "smoke": 0}
    assert [s["recall"] for s in result["per_class"] if s["name"] != "fire"] == [None, None]
    assert result["data"] == str((tmp_path / "only").resolve())


# --------------------------------------------------------------------------- predict

def csv_rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_predict_gives_one_csv_line_per_image_agreeing_with_evaluate(cli, run_dir, photos,
                                                                      tmp_path):
    done = cli("predict", str(run_dir), str(photos), str(photos / "fire" / "0.png"),
               "--batch-size", "16")
    assert done.returncode == 0, done.stderr
    rows = csv_rows(done.stdout)
    assert list(rows[0]) == ["file", "class", "probability"]
    assert len(rows) == 3 * PER_CLASS + 1
    assert rows[-1]["file"] == str(photos / "fire" / "0.png")
    assert all(row["class"] in CLASSES and 1 / 3 <= float(row["probability"]) <= 1 for row in rows)
    folder_rows = rows[:-1]
    assert sorted(row["file"] for row in folder_rows) == sorted(
        str(p) for p in photos.rglob("*.png"))
    # The same model on the same images: predict's hits are evaluate's accuracy.
    evaluated = cli("evaluate", str(run_dir), "--data", str(photos), "--output", str(tmp_path))
    assert evaluated.returncode == 0, evaluated.stderr
    accuracy = json.loads((tmp_path / "evaluation.json").read_text())["accuracy"]
    hits = sum(Path(row["file"]).parent.name == row["class"] for row in folder_rows)
    assert hits / len(folder_rows) == pytest.approx(accuracy)


def test_predict_writes_json_or_csv_by_the_output_extension(cli_here, run_dir, photos, tmp_path):
    for name in ("p.json", "p.csv"):
        done = cli_here("predict", str(run_dir), str(photos / "smoke"), "--output",
                        str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        assert f"{PER_CLASS} predictions written" in done.stdout
    as_json = json.loads((tmp_path / "p.json").read_text())
    as_csv = csv_rows((tmp_path / "p.csv").read_text())
    assert len(as_json) == PER_CLASS
    assert [r["file"] for r in as_json] == [r["file"] for r in as_csv]
    assert [r["class"] for r in as_json] == [r["class"] for r in as_csv]
    assert all(abs(r["probability"] - float(c["probability"])) < 1e-6
               for r, c in zip(as_json, as_csv))


def test_predict_reads_a_batch_at_a_time(run_dir, photos):
    # Streamed: the first predictions come before the rest of the files are even listed.
    listed = []

    def files():
        for path in sorted(photos.rglob("*.png")):
            listed.append(path)
            yield str(path)

    predictions = predict(load_trained(run_dir), files(), batch_size=4)
    first = next(predictions)
    assert first.file == str(sorted(photos.rglob("*.png"))[0])
    assert len(listed) <= 5
    assert len(list(predictions)) == 3 * PER_CLASS - 1


# --------------------------------------------------------------------------- bad input

def test_classes_that_do_not_match_are_refused(cli_here, run_dir, tmp_path):
    (tmp_path / "other").mkdir()
    write_tinted_classes(tmp_path / "other", per_class=1)
    (tmp_path / "other" / "fire").rename(tmp_path / "other" / "rain")
    line = one_line_refusal(cli_here("evaluate", str(run_dir), "--data", str(tmp_path / "other")))
    assert "rain" in line and "clear, fire, smoke" in line


def test_a_file_that_is_not_an_image_is_refused(cli_here, run_dir, photos, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    line = one_line_refusal(cli_here("predict", str(run_dir), str(text)))
    assert str(text) in line and "not an image" in line
    fake = tmp_path / "folder" / "fire" / "fake.png"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    line = one_line_refusal(cli_here("evaluate", str(run_dir), "--data", str(tmp_path / "folder"),
                                     "--output", str(tmp_path / "out")))
    assert str(fake) in line
    assert not (tmp_path / "out" / "evaluation.json").exists()


def test_a_run_without_model_pt_is_refused(cli_here, run_dir, photos, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(run_dir / METRICS, unfinished / METRICS)
    for command in (["predict", str(unfinished), str(photos)],
                    ["evaluate", str(unfinished), "--data", str(photos)]):
        line = one_line_refusal(cli_here(*command))
        assert MODEL in line and str(unfinished) in line


def test_a_bad_image_is_named_as_such_also_when_writing_to_a_file(cli_here, run_dir, photos,
                                                                   tmp_path):
    """Not as a failed write of --output (PIL's error is an OSError), and no file is left."""
    folder = tmp_path / "folder"
    shutil.copytree(photos, folder)
    (folder / "zzz.png").write_bytes(b"not an image")
    line = one_line_refusal(cli_here("predict", str(run_dir), str(folder), "--output",
                                     str(tmp_path / "p.csv")))
    assert "zzz.png" in line and "writing" not in line
    assert not (tmp_path / "p.csv").exists()
    (tmp_path / "empty").mkdir()
    line = one_line_refusal(cli_here("predict", str(run_dir), str(tmp_path / "empty")))
    assert "no image files in this folder" in line


def test_predict_to_stdout_writes_no_row_before_a_file_that_is_no_image(cli_here, run_dir, photos,
                                                                        tmp_path):
    """stdout cannot be taken back: the images' headers are read before the first row, so a
    file that is no image, sorted after good ones (a batch each), leaves stdout empty."""
    folder = tmp_path / "folder"
    shutil.copytree(photos, folder)
    (folder / "zzz.png").write_bytes(b"not an image")
    result = cli_here("predict", str(run_dir), str(folder), "--batch-size", "1")
    line = one_line_refusal(result)
    assert "zzz.png" in line and "not an image file" in line
    assert result.stdout == ""


@pytest.mark.parametrize("case", ["no_run", "missing_image", "bad_output", "output_a_folder",
                                  "metrics_not_an_object", "bad_batch"])
def test_other_bad_input_is_one_line(cli_here, run_dir, photos, tmp_path, case):
    (tmp_path / "out.csv").mkdir()
    listed = tmp_path / "listed"  # a run whose metrics.json is JSON, but not an object
    listed.mkdir()
    (listed / "metrics.json").write_text("[]")
    command = {
        "no_run": ["predict", str(tmp_path), str(photos)],
        "missing_image": ["predict", str(run_dir), str(tmp_path / "nowhere.png")],
        "bad_output": ["predict", str(run_dir), str(photos), "--output", str(tmp_path / "p.txt")],
        # refused before the images are read, not after (exit 1, the work lost)
        "output_a_folder": ["predict", str(run_dir), str(photos), "--output",
                            str(tmp_path / "out.csv")],
        "metrics_not_an_object": ["predict", str(listed), str(photos)],
        "bad_batch": ["evaluate", str(run_dir), "--data", str(photos), "--batch-size", "0"],
    }[case]
    one_line_refusal(cli_here(*command))


def test_a_16_bit_image_reads_in_use_as_in_training(tmp_path):
    """PIL's convert("RGB") clips 16-bit samples at 255 (a white image); predict and
    evaluate read a file through the cache's own decoding, which scales them."""
    import numpy as np
    import torch
    from PIL import Image

    from hybriddl.data.images import open_rgb, square_scaler
    from hybriddl.inference.images import ImageReader

    ramp = np.tile(np.linspace(0, 65535, 40, dtype=np.uint16), (40, 1))
    path = tmp_path / "scan.png"
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode.startswith("I")
    seen = ImageReader(32).read(path)
    trained_on = square_scaler(32)(open_rgb(path)[0])
    assert torch.equal(seen, trained_on)
    assert 100 < float(seen.float().mean()) < 155  # a ramp from black to white, not white


def test_a_data_folder_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch):
    from hybriddl.errors import UsageError
    from hybriddl.inference import evaluate

    def unreadable(root):  # what a folder of another user's, mode 0700, gives (root reads all)
        raise PermissionError(13, "Permission denied", str(root))
    monkeypatch.setattr(evaluate, "find_classes", unreadable)
    with pytest.raises(UsageError, match="--data .*: cannot read it \\(Permission denied\\)"):
        evaluate.labelled_images(tmp_path, ["a", "b"])


def test_the_confusion_chart_of_a_thousand_classes_keeps_a_readable_size():
    """0.6 inch per class drew 1,000 classes (ImageNet's) at 66,000 px a side with a million
    counts: it ran out of memory after the evaluation was done."""
    import time

    from matplotlib.image import imread

    from hybriddl.inference.evaluate import MOST_LABELLED, Evaluation, confusion_chart

    n = 1000
    matrix = [[(i == j) * 3 + (j == (i + 1) % n) for j in range(n)] for i in range(n)]
    evaluation = Evaluation("run", "data", "alexnet", 224, 4 * n, 0.75,
                            [f"class{i}" for i in range(n)], [], matrix)
    started = time.monotonic()
    png = confusion_chart(evaluation)
    assert time.monotonic() - started < 60
    height, width, _ = imread(io.BytesIO(png)).shape
    side = round((1.6 + 0.6 * MOST_LABELLED) * 110)
    assert height <= side and width <= side + 1.2 * 110 + 1

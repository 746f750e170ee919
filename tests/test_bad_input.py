"""Every bad input gets one line naming the problem, exit code 2, and leaves no run behind."""

from pathlib import Path

import pytest
from sample_data import CIFAR_FOLDER, write_cifar10, write_image, write_imagefolder


def empty_dir(tmp: Path) -> list[str]:
    (tmp / "empty").mkdir()
    return ["--data", str(tmp / "empty")]


def class_without_images(tmp: Path) -> list[str]:
    write_imagefolder(tmp / "images", per_class=2)
    (tmp / "images" / "clear").mkdir()
    (tmp / "images" / "clear" / "notes.txt").write_text("not an image")
    return ["--data", str(tmp / "images")]


def corrupt_image(tmp: Path) -> list[str]:
    write_imagefolder(tmp / "images", per_class=2)
    (tmp / "images" / "smoke" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    # Without --strict-data such a file is left out and listed (tests/test_bad_images.py).
    return ["--data", str(tmp / "images"), "--strict-data"]


def truncated_jpeg(tmp: Path) -> list[str]:
    write_imagefolder(tmp / "images", per_class=2)
    good = write_image(tmp / "images" / "fire" / "big.jpg", (200, 200), (200, 10, 10))
    good.write_bytes(good.read_bytes()[:300])
    return ["--data", str(tmp / "images"), "--strict-data"]


def one_class(tmp: Path) -> list[str]:
    write_imagefolder(tmp / "images", per_class=4, classes={"fire": (255, 0, 0)})
    return ["--data", str(tmp / "images")]


def data_is_a_file(tmp: Path) -> list[str]:
    (tmp / "images.zip").write_bytes(b"PK")
    return ["--data", str(tmp / "images.zip")]


def cifar_without_folder(tmp: Path) -> list[str]:
    (tmp / "cifar").mkdir()
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def cifar_without_meta(tmp: Path) -> list[str]:
    write_cifar10(tmp / "cifar", train_batches=1)
    (tmp / "cifar" / CIFAR_FOLDER / "batches.meta").unlink()
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def cifar_without_batches(tmp: Path) -> list[str]:
    write_cifar10(tmp / "cifar", train_batches=1)
    (tmp / "cifar" / CIFAR_FOLDER / "data_batch_1").unlink()
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def cifar_garbage_batch(tmp: Path) -> list[str]:
    write_cifar10(tmp / "cifar", train_batches=2)
    (tmp / "cifar" / CIFAR_FOLDER / "data_batch_2").write_bytes(b"this is not a pickle\n" * 20)
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def cifar_truncated_batch(tmp: Path) -> list[str]:
    write_cifar10(tmp / "cifar", train_batches=1)
    batch = tmp / "cifar" / CIFAR_FOLDER / "data_batch_1"
    batch.write_bytes(batch.read_bytes()[:1000])
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def cifar_garbage_meta(tmp: Path) -> list[str]:
    write_cifar10(tmp / "cifar", train_batches=1)
    (tmp / "cifar" / CIFAR_FOLDER / "batches.meta").write_bytes(b"\x80\x02}q\x00.")  # {}
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def cifar_labels_out_of_range(tmp: Path) -> list[str]:
    import pickle

    write_cifar10(tmp / "cifar", train_batches=1, per_batch=4)
    batch = tmp / "cifar" / CIFAR_FOLDER / "data_batch_1"
    entry = pickle.loads(batch.read_bytes(), encoding="latin1")
    entry["labels"] = [0, 1, 2, 12]
    batch.write_bytes(pickle.dumps(entry, protocol=2))
    return ["--data", f"cifar10:{tmp / 'cifar'}"]


def flags(*args: str):
    return lambda tmp: list(args)


CASES = {
    "missing_directory": (lambda tmp: ["--data", str(tmp / "nowhere")], "no such directory"),
    "data_is_a_file": (data_is_a_file, "images.zip"),
    "empty_directory": (empty_dir, "class folder"),
    "class_folder_without_images": (class_without_images, "clear"),
    "corrupt_image": (corrupt_image, "broken.png"),
    "truncated_jpeg": (truncated_jpeg, "big.jpg"),
    "fewer_than_two_classes": (one_class, "at least 2 classes"),
    "unknown_usecase": (flags("--usecase", "ComplexHuge"), "unknown use case 'ComplexHuge'"),
    "unknown_model": (flags("--model", "resnet1000"), "unknown model 'resnet1000'"),
    "batch_size_zero": (flags("--batch-size", "0"), "--batch-size 0"),
    "batch_size_not_a_number": (flags("--batch-size", "many"), "--batch-size"),
    "image_size_too_small_for_alexnet": (flags("--model", "alexnet", "--image-size", "32"),
                                         "--image-size 32"),
    "image_size_zero": (flags("--image-size", "0"), "--image-size 0"),
    # One 3 x 200000^2 float image is 480 GB: no size the model refuses, one memory refuses.
    "image_size_beyond_memory": (flags("--model", "alexnet", "--image-size", "200000"),
                                 "does not fit this host's memory"),
    "epochs_zero": (flags("--epochs", "0"), "--epochs 0"),
    "lr_nan": (flags("--lr", "nan"), "--lr nan"),
    "lr_inf": (flags("--lr", "inf"), "--lr inf"),
    "momentum_nan": (flags("--momentum", "nan"), "--momentum nan"),
    "batch_larger_than_the_data": (flags("--batch-size", "5000"), "larger than the 480 training"),
    "dropout_on_a_model_without_it": (flags("--model", "resnet18", "--dropout", "0"),
                                      "no dropout option"),
    "classes_with_synthetic_data": (flags("--classes", "2"), "--classes"),
    "precision_unknown": (flags("--precision", "fp8"), "--precision"),
    "precision_auto_with_a_named_strategy": (flags("--strategy", "threads", "--precision", "auto"),
                                             "--strategy auto"),
    "accumulate_zero": (flags("--accumulate", "0"), "--accumulate 0: give 1 to the batch size"),
    "accumulate_above_the_batch": (flags("--batch-size", "4", "--accumulate", "5"),
                                   "--accumulate 5: give 1 to the batch size (4)"),
    "channels_last_with_auto": (flags("--channels-last"), "--channels-last go with a named"),
    "bf16_on_the_pipeline": (flags("--strategy", "pipeline", "--devices", "cpu,cpu",
                                   "--precision", "bf16"), "float32"),
    "layerwise_on_a_model_without_the_cut": (flags("--model", "resnet18", "--strategy",
                                                   "layerwise"), "features -> avgpool"),
    # ":two:" is an emoji code to rich: the line must show what the user typed.
    "compression_rank_not_a_number": (flags("--compression", "powersgd:two"), "powersgd:two"),
    "target_accuracy_zero": (flags("--target-accuracy", "0"), "--target-accuracy 0"),
    "target_accuracy_above_one": (flags("--target-accuracy", "1.5"), "(0, 1]"),
    "target_accuracy_nan": (flags("--target-accuracy", "nan"), "--target-accuracy nan"),
    "stop_at_target_without_a_target": (flags("--stop-at-target"), "--target-accuracy A"),
    "eval_every_zero": (flags("--eval-every", "0"), "--eval-every 0"),
    "progress_timeout_zero": (flags("--progress-timeout", "0"), "--progress-timeout 0"),
    "progress_timeout_negative": (flags("--progress-timeout", "-5"), "--progress-timeout -5"),
    "target_with_measure_only": (flags("--measure-only", "--target-accuracy", "0.9"),
                                 "--measure-only runs no validation"),
    "measure_only_resuming": (flags("--measure-only", "--resume", "somewhere"),
                              "cannot continue the run in somewhere"),
    "seed_beyond_64_bits": (flags("--seed", str(2 ** 64)), "--seed 18446744073709551616"),
    "tune_budget_nan": (flags("--tune-budget", "nan"), "--tune-budget nan"),
    "fusion_mib_nan": (flags("--fusion-mib", "nan"), "--fusion-mib nan"),
    "fusion_mib_inf": (flags("--fusion-mib", "inf"), "--fusion-mib inf"),
    "weights_empty": (flags("--weights", ""), "--weights '': give a state_dict"),
    # /proc takes no file, even from root, whom the access check lets through.
    "profile_dir_not_writable": (flags("--profile-dir", "/proc/hybriddl-profiles"),
                                 "--profile-dir /proc/hybriddl-profiles/"),
    "cifar10_without_batches_folder": (cifar_without_folder, CIFAR_FOLDER),
    "cifar10_without_meta": (cifar_without_meta, "batches.meta"),
    "cifar10_without_data_batches": (cifar_without_batches, "data_batch_"),
    "cifar10_garbage_batch": (cifar_garbage_batch, "data_batch_2"),
    "cifar10_truncated_batch": (cifar_truncated_batch, "data_batch_1"),
    "cifar10_garbage_meta": (cifar_garbage_meta, "batches.meta"),
    "cifar10_labels_out_of_range": (cifar_labels_out_of_range, "data_batch_1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_code_2_and_no_run_directory(cli_here, tmp_path, case):
    make_args, names_problem = CASES[case]
    run_dir = tmp_path / "run"
    done = cli_here("train", *make_args(tmp_path), "--run-dir", str(run_dir), cwd=tmp_path)
    lines = done.stderr.splitlines()  # no empty line before it either
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hybriddl")
    assert names_problem in lines[0]
    assert not run_dir.exists()
    assert not (tmp_path / "runs").exists()


# Where each command writes, tried before its work (tuning, charts, hosts started).
OUTPUTS = {
    "tune_profile_dir": (["tune", "--budget", "3", "--profile-dir", "/proc/hybriddl-x"],
                         "--profile-dir /proc/hybriddl-x/"),
    "report_output": (["report", "RUN", "--output", "/proc/hybriddl-x"],
                      "--output /proc/hybriddl-x: cannot write in /proc"),
    "emulate_report": (["emulate", "--hosts", "2", "--report", "/proc/hybriddl-x.json", "--",
                        "true"], "--report /proc/hybriddl-x.json: cannot write in /proc"),
    "emulate_report_a_folder": (["emulate", "--hosts", "2", "--report", "TMP", "--", "true"],
                                "is a folder: give a file path"),
    "compare_output": (["compare", "--hosts", "2", "--steps", "1", "--output",
                        "/proc/hybriddl-x"], "--output /proc/hybriddl-x: cannot write in /proc"),
    "train_run_dir": (["train", "--max-steps", "1", "--run-dir", "/proc/hybriddl-x"],
                      "--run-dir /proc/hybriddl-x: cannot write in /proc"),
    # and what is not a place at all
    "train_run_dir_empty": (["train", "--max-steps", "1", "--run-dir", ""],
                            "--run-dir '': give a directory"),
    # a name the file system refuses to look up (as a folder this user cannot search)
    "train_run_dir_name_too_long": (["train", "--max-steps", "1", "--run-dir", "TMP/" + "r" * 300],
                                    "cannot look in it (File name too long)"),
    "report_output_name_too_long": (["report", "RUN", "--output", "TMP/" + "o" * 300],
                                    "cannot look there (File name too long)"),
    "emulate_command_missing": (["emulate", "--hosts", "1", "--", "/nonexistent/hybriddl-cmd"],
                                "/nonexistent/hybriddl-cmd: no such command"),
    "evaluate_output": (["evaluate", "RUN", "--data", "RUN", "--output", "/proc/hybriddl-x"],
                        "--output /proc/hybriddl-x: cannot write in /proc"),
    # an empty path names the current directory: the run's, the images', the data's
    "predict_image_empty": (["predict", "RUN", ""], "argument IMAGE_OR_DIR: invalid path"),
    "predict_output_empty": (["predict", "RUN", "RUN", "--output", ""],
                             "argument --output: invalid path"),
    "evaluate_data_empty": (["evaluate", "RUN", "--data", ""], "argument --data: invalid path"),
    "evaluate_run_dir_empty": (["evaluate", "", "--data", "RUN"], "argument RUN_DIR: invalid path"),
    "report_run_dir_empty": (["report", ""], "argument RUN_DIR: invalid path"),
    "launch_probe_seconds_zero": (["launch", "--hostfile", "/nonexistent", "--probe-seconds", "0",
                                   "--", "train", "--run-dir", "TMP/run"],
                                  "--probe-seconds 0.0: give a positive number"),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_a_place_that_cannot_be_written_is_refused_before_the_work(cli_here, tmp_path, case):
    """Each command's output (and a missing command or an empty path) refused first."""
    argv, said = OUTPUTS[case]
    argv = [word.replace("TMP", str(tmp_path)) if word.startswith("TMP") else
            str(tmp_path) if word == "RUN" else word for word in argv]
    done = cli_here(*argv, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert list(tmp_path.iterdir()) == []


def test_bad_input_without_run_dir_creates_no_default_run_directory(cli, tmp_path):
    done = cli("train", "--batch-size", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_run_dir_that_already_holds_a_run_is_refused_and_left_alone(cli, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text("{}")
    done = cli("train", "--run-dir", str(run_dir), "--max-steps", "1")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "already holds files" in done.stderr
    assert [p.name for p in run_dir.iterdir()] == ["metrics.json"]
    assert (run_dir / "metrics.json").read_text() == "{}"


# A flag that does nothing in the given setting: a one-line warning, never silence.
IGNORED = {
    "val_fraction_with_synthetic_data": (["--val-fraction", "0.5"], "--val-fraction does "
                                         "nothing with --data synthetic, whose validation "
                                         "images are fixed"),
    "workers_with_sequential": (["--strategy", "sequential", "--workers", "2"],
                                "--workers 2 does nothing with --strategy sequential, which has "
                                "no local workers (these have: intraop, threads, processes, "
                                "layerwise)"),
    "devices_with_a_cpu_strategy": (["--devices", "cpu"], "--devices cpu does nothing with "
                                    "--strategy sequential, which computes on this host's CPU "
                                    "cores (these take devices: gpu, pipeline, gpu-threads)"),
    "checkpoint_every_measuring_only": (["--measure-only", "--checkpoint-every", "1"],
                                        "--checkpoint-every 1 does nothing with --measure-only, "
                                        "which writes no checkpoint"),
    "overlap_on_one_host": (["--overlap"], "--overlap does nothing on a single host"),
    "fp16_allreduce_on_one_host": (["--fp16-allreduce"], "--fp16-allreduce does nothing on a "
                                                         "single host"),
    "fusion_mib_on_one_host": (["--fusion-mib", "8"], "--fusion-mib does nothing on a single host"),
    "host_timeout_on_one_host": (["--host-timeout", "30"], "--host-timeout does nothing on a "
                                                           "single host"),
    "balance_on_one_host": (["--balance", "even"], "--balance does nothing on a single host"),
    "throughput_on_one_host": (["--throughput", "20"], "--throughput does nothing on a single "
                                                       "host"),
}


def ignored(argv: list[str], hosts: int) -> list[str]:
    from hybriddl.cli import build_parser
    from hybriddl.cli.settings import train_flags
    from hybriddl.run.settings import settled_config

    flags = train_flags(build_parser().parse_args(["train", *argv]))
    _, _, idle = settled_config(flags.given, flags.resume)
    return [*idle, *flags.idle, *(flags.alone if hosts == 1 else ())]


@pytest.mark.parametrize("case", list(IGNORED))
def test_a_flag_that_does_nothing_here_is_warned_about(case):
    argv, warning = IGNORED[case]
    lines = ignored(["--strategy", "sequential", *argv], hosts=1)
    assert len(lines) == 1 and lines[0].startswith(warning), lines


def test_flags_that_act_are_not_warned_about():
    assert ignored(["--strategy", "intraop", "--workers", "2"], hosts=1) == []
    # The host flags act on 2 hosts (the others do nothing whatever the hosts).
    across = [flag for _, (argv, _) in IGNORED.items() for flag in argv
              if argv[0] not in ("--strategy", "--val-fraction", "--devices", "--measure-only")]
    assert ignored(["--strategy", "pipeline", "--devices", "cpu,cpu"], hosts=1) == []
    assert ignored(["--strategy", "sequential", *across], hosts=2) == []


@pytest.mark.slow
def test_the_warnings_reach_the_user_and_the_run_goes_on(cli, tmp_path):
    done = cli("train", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "4",
               "--max-steps", "1", "--strategy", "sequential", "--workers", "2",
               "--fusion-mib", "8", "--monitor-interval", "0", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert [line.split(" does nothing")[0] for line in warnings] == [
        "hybriddl: warning: --workers 2", "hybriddl: warning: --fusion-mib"]

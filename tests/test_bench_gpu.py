"""scripts/bench_gpu.py: its rows run (here on the CPU, standing in for the GPU), and
without a CUDA device it writes no figure."""

import importlib.util
import json
import subprocess
import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_interleave_and_compare_with_the_fastest_peer(bench_gpu):
    args = bench_gpu.parse_args(["--warmup", "1", "--steps", "1", "--micro-batches", "2"])
    cpu = torch.device("cpu")
    x, y = torch.randn(4, 3, 64, 64), torch.randint(3, (4,))
    rows = [bench_gpu.hybriddl_row("alexnet", 3, x, y, cpu, "fp32", None, args),
            bench_gpu.pytorch_row("alexnet", 3, x, y, cpu, "fp32", args),
            bench_gpu.pipeline_row("alexnet", 3, x, y, cpu, args)]
    visits = []
    try:
        bench_gpu.measure(rows, 2, lambda n, row, s: visits.append((n, row.strategy)))
    finally:
        for row in rows:
            row.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("hybriddl-pipeline")]
    assert visits == [(0, "gpu"), (0, "pytorch"), (0, "pipeline"),
                      (1, "gpu"), (1, "pytorch"), (1, "pipeline")]
    summary = bench_gpu.summarise(rows)
    assert [r["strategy"] for r in summary] == ["gpu", "pytorch", "pipeline"]
    for r in summary:
        assert r["seconds_per_step"] > 0 and len(r["round_seconds"]) == 2 and r["vs_fastest_peer"] > 0
    assert summary[1]["vs_fastest_peer"] == 1.0
    stages = summary[2]["stages"]
    assert stages["stage1_busy_ms"] > 0 and stages["stage2_busy_ms"] > 0
    assert stages["step_ms"] >= max(stages["stage1_busy_ms"], stages["stage2_busy_ms"]) * 0.99


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the script runs")
def test_without_cuda_nothing_is_written(bench_gpu, tmp_path, capsys):
    output = tmp_path / "bench.json"
    assert bench_gpu.main(["--output", str(output)]) == 2
    assert not output.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the script runs")
def test_gpu_tests_records_nothing_without_cuda(capsys):
    spec = importlib.util.spec_from_file_location("gpu_tests", REPO / "scripts" / "gpu_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = (REPO / "results" / "gpu_tests.json").exists()
    assert module.main([]) == 2
    assert (REPO / "results" / "gpu_tests.json").exists() == before
    assert "no CUDA device" in capsys.readouterr().err


def test_the_peer_updates_with_hybriddls_fused_sgd(bench_gpu):
    args = bench_gpu.parse_args(["--warmup", "0", "--steps", "1"])
    row = bench_gpu.pytorch_row("alexnet", 3, torch.randn(2, 3, 64, 64), torch.randint(3, (2,)),
                                torch.device("cpu"), "fp32", args)
    row.visit()
    assert row.state["optimizer"].defaults["fused"] is True


def small_run(bench_gpu, tmp_path, monkeypatch, *flags):
    """measure_and_write on the CPU (standing in for the GPU) at AlexNet 64 px, batch 2, in
    float32 only (the other numerics are the same rows in another StrategyOptions)."""
    from hybriddl.usecases import get_usecase

    monkeypatch.setattr(bench_gpu, "NUMERICS", {"fp32": bench_gpu.NUMERICS["fp32"]})

    output = tmp_path / "bench.json"
    args = bench_gpu.parse_args(["--rounds", "2", "--warmup", "0", "--steps", "1",
                                 "--micro-batches", "2", "--image-size", "64",
                                 "--output", str(output), *flags])
    code = bench_gpu.measure_and_write(args, torch.device("cpu"), "a CPU standing in",
                                       get_usecase("SimpleBig"), "alexnet", 64, 2)
    return code, output


@pytest.mark.slow
def test_rows_are_written_before_the_training_run_and_kept_when_it_fails(
        bench_gpu, tmp_path, monkeypatch, capsys):
    seen = {}

    def failing_training(*args):
        seen["rows"] = json.loads((tmp_path / "bench.json").read_text())["rows"]
        raise RuntimeError("hybriddl train exited 1: CUDA error: an illegal memory access")

    monkeypatch.setattr(bench_gpu, "train_data_wait", failing_training)
    monkeypatch.setattr(torch, "compile", lambda model: model)  # the row, not the compiler
    code, output = small_run(bench_gpu, tmp_path, monkeypatch, "--train-steps", "5",
                             "--compile-peer", "--no-graph")
    assert code == 1
    written = json.loads(output.read_text())
    # keyed and dropout-0 hybriddl, the peer, the pipeline, the compiled peer
    assert len(seen["rows"]) == len(written["rows"]) == 5
    assert written["train"] == {"failed": "hybriddl train exited 1: CUDA error: an illegal "
                                          "memory access"}
    assert "the rows are kept in" in capsys.readouterr().err
    # The compiled peer is timed in the same rounds as every other row.
    compiled = [r for r in written["rows"] if r["variant"].endswith("-compile")]
    assert len(compiled) == 1 and all(len(r["round_seconds"]) == 2 for r in written["rows"])
    assert written["gpu_name"] == "a CPU standing in" and written["commit"]


def test_graph_rows_time_the_whole_step_and_a_failed_capture_is_recorded(bench_gpu,
                                                                         monkeypatch):
    """The CUDA-graph rows (on the CPU the step itself stands in for its replay): hybriddl's
    model with keyed dropout against the eager and the graphed peers; a capture that
    fails is one line in its row, and the other rows are still timed."""
    from hybriddl.dropout import KeyedDropout

    args = bench_gpu.parse_args(["--warmup", "0", "--steps", "1"])
    cpu = torch.device("cpu")
    x, y = torch.randn(2, 3, 64, 64), torch.randint(3, (2,))
    rows = [bench_gpu.graph_row("alexnet", 3, x, y, cpu, "fp32", True, args),
            bench_gpu.graph_row("alexnet", 3, x, y, cpu, "fp32", False, args),
            bench_gpu.pytorch_row("alexnet", 3, x, y, cpu, "fp32", args)]

    def no_capture(step, device):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel "
                           "errors might be asynchronously reported")

    monkeypatch.setattr(bench_gpu, "graphed", no_capture)
    rows.append(bench_gpu.graph_row("alexnet", 3, x, y, cpu, "fp32-cl", True, args))
    bench_gpu.measure(rows[3:], 1)  # captures, and fails
    monkeypatch.undo()
    bench_gpu.measure(rows[:3], 2)
    bench_gpu.measure(rows[3:], 1)  # failed once: not tried again
    assert any(isinstance(m, KeyedDropout) for m in rows[0].state["model"].modules())
    assert not any(isinstance(m, KeyedDropout) for m in rows[1].state["model"].modules())
    keyed, peer, eager, failed = bench_gpu.summarise(rows)
    assert (keyed["strategy"], peer["strategy"]) == ("gpu-graph", "pytorch-graph")
    assert len(keyed["round_seconds"]) == 2 and keyed["vs_fastest_peer"] > 0
    assert keyed["vs_fastest_graph_peer"] > 0 and peer["vs_fastest_graph_peer"] == 1.0
    assert eager["vs_fastest_peer"] == 1.0 and "vs_fastest_graph_peer" not in eager
    assert failed == {"strategy": "gpu-graph", "variant": "fp32-cl", "dropout": 0.5,
                      "failed": "capture failed: operation not permitted when stream is "
                                "capturing"}
    table = bench_gpu.bench_gpu_table({"rows": [keyed, failed]})
    assert "the fastest pytorch-graph)" in table
    assert "| gpu-graph | fp32-cl | 0.5 | capture failed: operation not permitted" in table


def test_the_training_run_counts_every_step_it_ran(bench_gpu, monkeypatch):
    """The data wait of --train-steps steps over several epochs, not of the first epoch."""
    epochs = [{"steps": 75, "samples": 2400, "seconds": 3.0, "data_wait_seconds": 0.3},
              {"steps": 25, "samples": 800, "seconds": 1.0, "data_wait_seconds": 0.5}]

    def fake_train(command, **kwargs):
        run_dir = Path(command[command.index("--run-dir") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.json").write_text(json.dumps({"epochs": epochs}))
        assert command[command.index("--max-steps") + 1] == "100"
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench_gpu.subprocess, "run", fake_train)
    record = bench_gpu.train_data_wait("SimpleBig", 224, 32, "fp32", 100, "cuda:0")
    assert (record["steps"], record["epochs"], record["seconds"]) == (100, 2, 4.0)
    assert record["images_per_second"] == 800.0 and record["data_wait_share"] == 0.2


@pytest.fixture(scope="module")
def gpu_tests():
    spec = importlib.util.spec_from_file_location("gpu_tests", REPO / "scripts" / "gpu_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_tests_records_a_pytest_that_dies_before_its_report(gpu_tests, tmp_path, capsys):
    output = tmp_path / "gpu_tests.json"
    dies = ["-c", "import os; print('collected 9 items'); print('Fatal Python error: "
                  "Segmentation fault', flush=True); os._exit(139)"]
    assert gpu_tests.run_and_record(dies, output, "a GPU", 1, []) == 139
    record = json.loads(output.read_text())
    assert record["exit_code"] == 139 and record["rows"] == [] and record["passed"] == 0
    assert record["failure"].startswith("pytest ended (exit code 139) without its report")
    assert record["last_lines"][-1] == "Fatal Python error: Segmentation fault"
    assert "Segmentation fault" in capsys.readouterr().out  # echoed as it ran


def test_gpu_tests_stops_pytest_at_its_limit_and_records_it(gpu_tests, tmp_path):
    output = tmp_path / "gpu_tests.json"
    hangs = ["-c", "import time; print('running', flush=True); time.sleep(60)"]
    assert gpu_tests.run_and_record(hangs, output, "a GPU", 1, [], timeout=1) != 0
    record = json.loads(output.read_text())
    assert "stopped at its limit of 1 s" in record["failure"]
    assert record["last_lines"] == ["running"]


def test_gpu_tests_records_each_outcome_from_the_report(gpu_tests, tmp_path):
    output = tmp_path / "gpu_tests.json"
    test_file = tmp_path / "test_sample.py"
    test_file.write_text("import pytest\n\ndef test_ok():\n    pass\n\n"
                         "@pytest.mark.skip(reason='no GPU')\ndef test_skipped():\n    pass\n")
    assert gpu_tests.run_and_record(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     str(test_file)], output, "a GPU", 1, []) == 0
    record = json.loads(output.read_text())
    assert (record["passed"], record["skipped"], record["failed"]) == (1, 1, 0)
    assert "failure" not in record and record["exit_code"] == 0


def test_the_loader_peer_trains_the_embedded_images_from_a_dataloader(bench_gpu):
    """The real-loader peer on the CPU (standing in for the GPU): the steps asked, over
    epochs of the embedded set, its images/s after the first epoch."""
    # ComplexSmall's embedded set (160 training images a class, 3 classes: 5 batches of
    # 96), trained with ResNet-18 at 32 px for speed: 7 steps are an epoch of 5 and 2.
    record = bench_gpu.loader_peer("ComplexSmall", "resnet18", 32, 96, "fp32", 7, "cpu", 0)
    assert record["steps"] == 7 and record["epochs"] == 2
    epochs = record["epoch_records"]
    assert [(e["steps"], e["samples"]) for e in epochs] == [(5, 480), (2, 192)]
    assert record["steady_images_per_second"] == 192 / epochs[1]["seconds"]


def test_loader_rounds_alternate_and_take_the_median_ratio(bench_gpu, monkeypatch):
    order = []
    ours, theirs = iter([100.0, 90.0, 120.0]), iter([100.0, 100.0, 100.0])

    def fake_train(*args):
        order.append("hybriddl")
        return {"steady_images_per_second": next(ours)}

    def fake_peer(*args):
        order.append("pytorch")
        return {"steady_images_per_second": next(theirs)}

    monkeypatch.setattr(bench_gpu, "train_data_wait", fake_train)
    monkeypatch.setattr(bench_gpu, "loader_peer", fake_peer)
    from hybriddl.usecases import get_usecase
    args = bench_gpu.parse_args(["--loader-rounds", "3", "--train-steps", "50"])
    record = bench_gpu.loader_rounds(get_usecase("SimpleBig"), "alexnet", 224, 32, "fp32", args)
    assert order == ["hybriddl", "pytorch"] * 3
    assert record["ratio"] == 1.0 and record["spread"]["min"] == 0.9
    assert record["spread"]["max"] == 1.2 and record["steps"] == 50
    line = bench_gpu.bench_gpu_table({"rows": [], "loader_peer": {
        **record, "rounds": [{"hybriddl": {"steady_images_per_second": 100.0},
                              "pytorch_loader": {"steady_images_per_second": 100.0}}]}})
    assert "plain PyTorch with a DataLoader (4 workers" in line and "**1.00×**" in line


def test_steady_rate_sets_the_first_epoch_apart(bench_gpu):
    epochs = [{"samples": 100, "seconds": 10.0}, {"samples": 300, "seconds": 1.0},
              {"samples": 300, "seconds": 2.0}]
    assert bench_gpu.steady_rate(epochs) == 200.0
    assert bench_gpu.steady_rate(epochs[:1]) == 10.0

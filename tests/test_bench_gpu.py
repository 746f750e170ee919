"""scripts/bench_gpu.py: its rows run (here on the CPU, standing in for the GPU), and
without a CUDA device it writes no figure."""

import importlib.util
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

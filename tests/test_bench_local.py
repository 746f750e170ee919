"""scripts/bench_local.py interleaves its rows in rounds and reports medians and spread."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO, hybriddl_env
from hybriddl.tuning.benchmark import StepTiming


def load_bench_local():
    spec = importlib.util.spec_from_file_location("bench_local", REPO / "scripts" / "bench_local.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench_local = load_bench_local()

# Seconds per step of each row in each of 3 rounds (round 2 is a slow round for all).
SECONDS = {("sequential", "fp32"): [4.0, 8.0, 4.4], ("layerwise", "fp32"): [2.0, 4.0, 2.0],
           ("layerwise", "bf16-cl"): [1.0, 2.5, 1.1], ("pytorch", "fp32"): [2.2, 4.0, 2.4],
           ("ddp", "fp32"): [3.0, 3.0, 3.0], ("pytorch", "bf16-cl"): [1.5, 3.0, 1.5],
           # Faster than both peers in every round, yet no peer: the ratios must ignore it.
           ("pytorch", "fp32-kept"): [1.0, 1.0, 1.0]}


# Plain PyTorch peaks at twice every other row's high-water mark.
MEMORY = {("pytorch", "fp32"): 2}


def fake_run(monkeypatch, tmp_path, *flags):
    order = []
    rounds_seen = {}

    def measure(row, common):
        key = (row.name, row.variant)
        round_ = rounds_seen.get(key, 0)
        rounds_seen[key] = round_ + 1
        order.append(key)
        seconds = SECONDS[key][round_]
        return StepTiming({"name": row.name}, 16, seconds, [seconds] * common["steps"],
                          peak_rss_bytes=2**30 * (1 + round_), peak_pss_bytes=2**29,
                          peak_hwm_bytes=2**31 * (1 + round_) * MEMORY.get(key, 1))

    monkeypatch.setattr(bench_local.Row, "measure", measure)
    output = tmp_path / "bench.json"
    code = bench_local.main(["--usecase", "ComplexSmall", "--image-size", "32", "--workers", "2",
                             "--rounds", "3", "--steps", "2", "--strategies", "layerwise",
                             "--variants", "fp32,bf16-cl", "--output", str(output), *flags])
    assert code == 0
    return order, json.loads(output.read_text())


def test_rows_are_interleaved_round_after_round(monkeypatch, tmp_path):
    order, _ = fake_run(monkeypatch, tmp_path)
    one_round = [("sequential", "fp32"), ("layerwise", "fp32"), ("layerwise", "bf16-cl"),
                 ("pytorch", "fp32"), ("ddp", "fp32"), ("pytorch", "fp32-kept"),
                 ("pytorch", "bf16-cl")]
    assert order == one_round * 3


def test_rows_report_median_spread_and_ratios_within_rounds(monkeypatch, tmp_path):
    _, result = fake_run(monkeypatch, tmp_path)
    rows = {(r["name"], r["variant"]): r for r in result["rows"]}
    layerwise = rows[("layerwise", "fp32")]
    assert layerwise["seconds_per_step"] == 2.0
    assert (layerwise["seconds_min"], layerwise["seconds_max"]) == (2.0, 4.0)
    assert layerwise["speedup"] == pytest.approx(2.0)  # 4/2, 8/4, 4.4/2: median 2.0
    # The faster peer per round: pytorch 2.2, ddp 3.0, pytorch 2.4.
    assert layerwise["vs_faster_peer"] == pytest.approx(1.1)
    assert layerwise["vs_faster_peer_min"] == pytest.approx(0.75)
    assert rows[("layerwise", "bf16-cl")]["vs_faster_peer"] == pytest.approx(2.4 / 1.1)
    assert layerwise["peak_rss_bytes"] == 3 * 2**30  # the highest of the rounds
    assert layerwise["peak_hwm_bytes"] == 3 * 2**31
    # Memory against the peer faster over the rounds (pytorch, median 2.4 s against 3.0 s),
    # its highest peak, 6 * 2**31; not against DDP's 3 * 2**31.
    assert layerwise["hwm_vs_faster_peer"] == pytest.approx(0.5)
    assert result["rounds"] == 3


def test_unknown_variant_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_local.py"),
                           "--image-size", "32", "--variants", "fp32,fp8"],
                          capture_output=True, text=True, env=hybriddl_env(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bench_local: error: --variants fp8: choose from fp32, fp32-cl, bf16, bf16-cl, "
        "fp32-cl-acc2, fp32-cl-acc4"]

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
SLOW = [9.0, 9.0, 9.0]
SECONDS = {("sequential", "fp32"): [4.0, 8.0, 4.4], ("layerwise", "fp32"): [2.0, 4.0, 2.0],
           ("layerwise", "bf16-cl"): [1.0, 2.5, 1.1], ("pytorch", "fp32"): [2.6, 4.0, 2.6],
           ("ddp", "fp32"): [3.0, 3.0, 3.0], ("pytorch", "fp32-kept"): SLOW,
           ("pytorch", "fp32-kept-cl"): SLOW, ("pytorch", "fp32-tcmalloc"): SLOW,
           # Tuned PyTorch: the fastest plain row, so the peer in rounds 1 and 3.
           ("pytorch", "fp32-tcmalloc-cl"): [2.2, 4.0, 2.4],
           # Faster than every peer in every round, yet no peer (bf16): ratios ignore it.
           ("pytorch", "bf16-cl"): [1.0, 1.0, 1.0]}


# Tuned PyTorch peaks at twice every other row's high-water mark.
MEMORY = {("pytorch", "fp32-tcmalloc-cl"): 2}


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
    monkeypatch.setattr(bench_local, "tcmalloc_path", lambda: "/lib/libtcmalloc_minimal.so.4")
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
                 ("pytorch", "fp32-kept-cl"), ("pytorch", "fp32-tcmalloc"),
                 ("pytorch", "fp32-tcmalloc-cl"), ("pytorch", "bf16-cl")]
    assert order == one_round * 3


def test_rows_report_median_spread_and_ratios_within_rounds(monkeypatch, tmp_path):
    _, result = fake_run(monkeypatch, tmp_path)
    rows = {(r["name"], r["variant"]): r for r in result["rows"]}
    layerwise = rows[("layerwise", "fp32")]
    assert layerwise["seconds_per_step"] == 2.0
    assert (layerwise["seconds_min"], layerwise["seconds_max"]) == (2.0, 4.0)
    assert layerwise["speedup"] == pytest.approx(2.0)  # 4/2, 8/4, 4.4/2: median 2.0
    # The fastest peer per round: tuned PyTorch 2.2, ddp 3.0, tuned PyTorch 2.4.
    assert layerwise["vs_faster_peer"] == pytest.approx(1.1)
    assert layerwise["vs_faster_peer_min"] == pytest.approx(0.75)
    assert rows[("layerwise", "bf16-cl")]["vs_faster_peer"] == pytest.approx(2.4 / 1.1)
    assert layerwise["peak_rss_bytes"] == 3 * 2**30  # the highest of the rounds
    assert layerwise["peak_hwm_bytes"] == 3 * 2**31
    # Memory against the peer fastest over the rounds (tcmalloc-cl, median 2.4 s against
    # DDP's 3.0 s), its highest peak, 6 * 2**31; not against DDP's 3 * 2**31.
    assert layerwise["hwm_vs_faster_peer"] == pytest.approx(0.5)
    assert result["rounds"] == 3
    assert result["tuned_pytorch"] == "fp32-tcmalloc-cl"
    assert result["fastest_peer"] == "pytorch fp32-tcmalloc-cl"
    assert result["notes"] == []


def test_the_tcmalloc_peers_preload_it_in_their_own_process_and_say_when_missing(
        monkeypatch, tmp_path):
    args = bench_local.parse_args(["--image-size", "32", "--workers", "2"])
    monkeypatch.setattr(bench_local, "tcmalloc_path", lambda: "/lib/libtcmalloc_minimal.so.4")
    rows = bench_local.plan_rows(args, "alexnet", 3, None, None)
    env = {row.variant: dict(row.env) for row in rows if row.name == "pytorch"}
    assert env["fp32-tcmalloc-cl"] == {"LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4"}
    assert env["fp32-kept"] == {} and "fp32-kept-compile" not in env
    monkeypatch.setattr(bench_local, "tcmalloc_path", lambda: None)
    rows = bench_local.plan_rows(args, "alexnet", 3, None, None)
    assert not any("tcmalloc" in row.variant for row in rows)


def test_a_preloaded_allocator_reaches_the_fresh_process_only():
    import os
    seen = bench_local.in_fresh_process(os.getenv, "LD_PRELOAD",
                                        env={"LD_PRELOAD": ""})
    assert seen == ""
    assert "HYBRIDDL_PROBE" not in os.environ
    assert bench_local.in_fresh_process(os.getenv, "HYBRIDDL_PROBE",
                                        env={"HYBRIDDL_PROBE": "1"}) == "1"
    assert "HYBRIDDL_PROBE" not in os.environ


def test_unknown_variant_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_local.py"),
                           "--image-size", "32", "--variants", "fp32,fp8"],
                          capture_output=True, text=True, env=hybriddl_env(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bench_local: error: --variants fp8: choose from fp32, fp32-cl, bf16, bf16-cl, "
        "fp32-cl-acc2, fp32-cl-acc4"]


def test_the_hybriddl_rows_run_on_hybriddls_allocator_and_the_peers_on_theirs(monkeypatch):
    from hybriddl.machine import allocator

    args = bench_local.parse_args(["--image-size", "32", "--workers", "2"])
    monkeypatch.setattr(bench_local, "tcmalloc_path", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "library_path",
                        lambda name: None if name == "glibc" else f"/lib/{name}.so")
    rows = bench_local.plan_rows(args, "alexnet", 3, None, None, "jemalloc")
    ours = [row for row in rows if row.name not in ("pytorch", "ddp")]
    assert ours and all(dict(row.env) == {"LD_PRELOAD": "/lib/jemalloc.so",
                                          allocator.PRELOADED_ENV: "jemalloc"}
                        and row.allocator == "jemalloc" for row in ours)
    peers = {row.variant: row.allocator for row in rows if row.name == "pytorch"}
    assert peers["fp32-tcmalloc"] == "tcmalloc" and peers["fp32-kept"] == "glibc"
    # glibc: an inherited preload is taken out of the hybriddl rows' processes.
    glibc = bench_local.plan_rows(args, "alexnet", 3, None, None, "glibc")[0]
    assert dict(glibc.env)["LD_PRELOAD"] == "" and glibc.allocator == "glibc"


def test_the_result_says_which_allocator_the_hybriddl_rows_ran_on(monkeypatch, tmp_path):
    _, result = fake_run(monkeypatch, tmp_path)  # conftest: HYBRIDDL_ALLOCATOR=glibc
    assert result["hybriddl_allocator"] == {"name": "glibc", "how": "asked"}
    assert {r["allocator"] for r in result["rows"] if r["name"] == "layerwise"} == {"glibc"}

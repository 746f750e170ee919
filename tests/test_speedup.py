"""`hybriddl emulate --speedup S` / `--host-step`: hosts that stand for hosts S times faster.

The arithmetic (rates, latencies, emulated seconds, CPU quotas) is checked without making
any namespace; bad input goes through the command line; one emulated run checks the rate
tc really set and the report's emulated seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hybriddl_env
from hybriddl.emulation.hosts import (PREFIX, Dilation, EmulatedHosts, EmulatedRun,
                                      cpu_hierarchy, duration_seconds, quota_of,
                                      speedup_for_step)
from hybriddl.errors import UsageError
from hybriddl.tuning.host_step import HostStep

MACHINE_CORES = len(os.sched_getaffinity(0))


def two_emulated_hosts_at_a_speedup(test):
    """What a test that runs 2 emulated hosts of 1 core at a speedup needs, as marks."""
    for mark in (
            pytest.mark.root, pytest.mark.emulated, pytest.mark.mpi,
            pytest.mark.skipif(os.geteuid() != 0,
                               reason="emulated hosts need root (network namespaces)"),
            pytest.mark.skipif(not all(map(shutil.which, ("ip", "tc", "unshare"))),
                               reason="emulated hosts need ip, tc (iproute2) and unshare"),
            pytest.mark.skipif(MACHINE_CORES < 2 and cpu_hierarchy() is None,
                               reason="2 hosts on 1 core at a speedup need a CPU quota "
                                      "(cgroup cpu)")):
        test = mark(test)
    return test


def test_a_speedup_divides_rates_and_emulated_seconds_and_multiplies_latencies():
    fast = Dilation(speedup=4)
    assert fast.factor == 4
    assert fast.link_rate(100e6) == 25e6
    assert fast.link_delay(0.5e-3) == 2e-3
    assert fast.emulated(10.0) == 2.5
    # Hosts held to C/D cores by a quota run D times slower again: S x D.
    held = Dilation(speedup=20, time_scale=2)
    assert held.factor == 40
    assert held.link_rate(1e9) == 25e6
    assert held.emulated(80.0) == 2.0
    assert EmulatedRun(0, 12.0, [], speedup=4, time_scale=3).emulated_seconds == 1.0
    assert EmulatedRun(0, 12.0, [], speedup=4, time_scale=3).dilation == 12


def test_hosts_at_a_speedup_never_take_turns_and_are_held_by_a_quota_where_they_do_not_fit():
    side_by_side = EmulatedHosts(hosts=2, cores_per_host=1, bandwidth="100mbit", speedup=4)
    if MACHINE_CORES >= 2:
        assert (side_by_side.time_scale, side_by_side.quota_cores) == (1, None)
    assert side_by_side.dilation.factor == 4 * side_by_side.time_scale
    assert not side_by_side.takes_turns
    crowded = EmulatedHosts(hosts=4 * MACHINE_CORES, cores_per_host=1, speedup=20)
    assert not crowded.takes_turns
    assert crowded.time_scale == 4
    assert crowded.quota_cores == 0.25
    assert crowded.dilation.factor == 80
    assert any("quota" in note for note in crowded.notes)
    # The same hosts without a speedup take turns, as before.
    assert EmulatedHosts(hosts=4 * MACHINE_CORES, cores_per_host=1, time_scale=None).takes_turns


def test_a_quota_has_a_short_period_stretched_only_below_the_kernels_least():
    assert quota_of(0.5) == (5000, 10000)  # half a core over 10 ms
    assert quota_of(1.0) == (10000, 10000)
    assert quota_of(0.05) == (1000, 20000)  # 1 ms is the least quota


def test_durations_and_the_speedup_a_host_step_gives():
    assert duration_seconds("10ms", "--host-step") == pytest.approx(0.01)
    assert duration_seconds("0.01s", "--host-step") == pytest.approx(0.01)
    assert duration_seconds("1.5s", "--host-step") == 1.5
    assert duration_seconds("500us", "--host-step") == pytest.approx(5e-4)
    for bad in ("fast", "10", "-1ms", "0s"):
        with pytest.raises(UsageError, match="--host-step"):
            duration_seconds(bad, "--host-step")
    assert speedup_for_step(1.2, 0.01) == pytest.approx(120)
    with pytest.raises(UsageError, match="at most 0.5"):
        speedup_for_step(0.5, 1.0)
    step = HostStep("SimpleBig", "alexnet", 224, 32, 1, 1, "intraop K=1", [1.0, 1.2, 0.9])
    assert (step.seconds, step.spread) == (1.0, (0.9, 1.2))
    assert step.as_dict()["seconds"] == 1.0


def test_a_speedup_refuses_a_forced_time_scale_and_values_below_one():
    with pytest.raises(UsageError, match="--speedup 0.5"):
        EmulatedHosts(hosts=2, speedup=0.5)
    with pytest.raises(UsageError, match="--time-scale 3"):
        EmulatedHosts(hosts=2, cores_per_host=1, speedup=2, time_scale=3)


@pytest.mark.parametrize("args, says", [
    (["--speedup", "0.5"], "--speedup 0.5"),
    (["--speedup", "2", "--host-step", "10ms", "--usecase", "SimpleBig"], "not both"),
    (["--host-step", "10ms"], "--usecase"),
    (["--speedup", "2", "--time-scale", "2"], "--time-scale"),
    (["--host-step", "ten", "--usecase", "SimpleBig"], "--host-step 'ten'"),
    (["--usecase", "SimpleBig"], "--host-step"),
])
def test_bad_speed_flags_are_one_line_and_exit_2(cli_here, args, says):
    done = cli_here("emulate", "--hosts", "2", *args, "--", "true")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr


def tc_rates(namespace: str) -> list[str]:
    """The tbf rates tc shows on a namespace's interfaces."""
    shown = subprocess.run(["tc", "-n", namespace, "-j", "qdisc", "show"], capture_output=True,
                           text=True).stdout
    return [q["options"]["rate"] for q in json.loads(shown or "[]") if q.get("kind") == "tbf"]


@two_emulated_hosts_at_a_speedup
def test_two_hosts_at_speedup_4_run_links_at_a_quarter_and_report_a_quarter_of_wall(tmp_path):
    report = tmp_path / "report.json"
    # Each rank reads the tbf rate on its own NIC while the hosts are up.
    program = ("import json, subprocess; shown = subprocess.run(['tc', '-j', 'qdisc', 'show', "
               "'dev', 'eth0'], capture_output=True, text=True).stdout; "
               "print('RATES', json.dumps([q['options'] for q in json.loads(shown) "
               "if q.get('kind') == 'tbf']))")
    done = subprocess.run(
        [sys.executable, "-m", "hybriddl", "emulate", "--hosts", "2", "--cores-per-host", "1",
         "--speedup", "4", "--bandwidth", "100mbit", "--report", str(report), "--",
         sys.executable, "-c", program],
        capture_output=True, text=True, timeout=120, env=hybriddl_env())
    assert done.returncode == 0, done.stderr
    rates = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith("RATES ")]
    assert len(rates) == 2 and all(len(shown) == 1 for shown in rates)
    tbf = [shown[0] for shown in rates]
    # tc shows bytes per second: 25 Mbit/s is 3,125,000 B/s on each host's link.
    assert [q["rate"] for q in tbf] == [25e6 / 8] * 2
    # The queue holds the bytes of 100 ms at the emulated 100 Mbit/s (1.25 MB), as a link at
    # full speed: tc shows it as the wall time it takes to leave, 0.4 s at 25 Mbit/s (100 ms
    # of wall time, 312.5 KB, would overflow where a full-speed link's queue does not).
    for q in tbf:
        assert q["lat"] / 1e6 * q["rate"] + q["burst"] == pytest.approx(100e6 / 8 * 0.1, rel=0.01)
    written = json.loads(report.read_text())
    assert written["speedup"] == 4 and written["time_scale"] == 1 and written["dilation"] == 4
    assert written["turns"] is False
    assert written["emulated_seconds"] == pytest.approx(written["seconds"] / 4, abs=1e-3)
    assert "speedup 4" in done.stderr


@two_emulated_hosts_at_a_speedup
def test_an_exchange_after_compute_takes_its_bytes_over_the_rate_at_a_high_speedup():
    """A rate limit's token bucket fills while a host computes and is then sent at once.
    At S = 200 the 1 Gbit/s link runs at 5 Mbit/s of wall time; a 64 KiB bucket let an
    allreduce of 64 KiB after 0.3 s of compute through in 5 ms instead of its 105 ms, so
    PowerSGD's small exchanges looked far faster than a real link carries them."""
    program = ("import time, numpy; from mpi4py import MPI; c = MPI.COMM_WORLD; "
               "a = numpy.ones(16384, numpy.float32); b = numpy.empty_like(a); "
               "c.Allreduce(a, b); seconds = []\n"
               "for _ in range(3):\n"
               "    c.Barrier(); time.sleep(0.3); c.Barrier(); t = time.perf_counter(); "
               "c.Allreduce(a, b); seconds.append(time.perf_counter() - t)\n"
               "print('SECONDS', min(seconds))")
    done = subprocess.run(
        [sys.executable, "-m", "hybriddl", "emulate", "--hosts", "2", "--cores-per-host", "1",
         "--speedup", "200", "--bandwidth", "1gbit", "--", sys.executable, "-c", program],
        capture_output=True, text=True, timeout=120, env=hybriddl_env())
    assert done.returncode == 0, done.stderr[-3000:]
    seconds = [float(line.split()[1]) for line in done.stdout.splitlines()
               if line.startswith("SECONDS ")]
    wire = 65536 * 8 / (1e9 / 200)  # 0.105 s: each host sends its 64 KiB once
    assert len(seconds) == 2 and min(seconds) >= 0.8 * wire, seconds


def test_scaling_e2e_passes_the_speedup_and_records_it_with_the_emulated_one_host_step():
    import bench_common
    import scaling_e2e

    args = scaling_e2e.parse_args(["--output", "x.json", "--speedup", "20"])
    assert scaling_e2e.speed_flags(args) == ["--speedup", "20.0"]
    def ran(report: dict) -> bench_common.Emulated:
        return bench_common.Emulated(["hybriddl", "emulate"], 0, "", report, 1.0)

    assert ran({"speedup": 20, "time_scale": 2, "dilation": 40}).dilation == 40
    assert ran({"time_scale": 2}).dilation == 2  # reports from before --speedup
    cell = {"contender": "data", "bandwidth": "1gbit", "median_nic_bytes_per_step": None,
            "host_parallel": None}
    cells = [{**cell, "hosts": 1, "speedup": 20.0, "images_per_second": 100.0,
              "emulated_step_seconds": [0.3, 0.32]},
             {**cell, "hosts": 2, "speedup": 20.0, "images_per_second": 150.0,
              "emulated_step_seconds": [0.4], "median_nic_bytes_per_step": 5},
             # The same cell at another speedup is another row, with its own reference.
             {**cell, "hosts": 2, "speedup": 1.0, "images_per_second": 9.0,
              "emulated_step_seconds": [7.0], "median_nic_bytes_per_step": 5}]
    rows = {(r["speedup"], r["hosts"]): r for r in scaling_e2e.summarise(cells, {1.0: 3.5})}
    assert rows[20.0, 2]["host_step_seconds"] == pytest.approx(0.31)
    assert rows[20.0, 2]["efficiency"] == pytest.approx(0.75)
    assert rows[1.0, 2]["host_step_seconds"] == 3.5 and rows[1.0, 2]["efficiency"] is None
    # A run given --speedup 20.01 continues one that derived S = 20.0 (3 digits): one row.
    cells.append({**cell, "hosts": 2, "speedup": 20.01, "images_per_second": 170.0,
                  "emulated_step_seconds": [0.36], "median_nic_bytes_per_step": 5})
    rows = {(r["speedup"], r["hosts"]): r for r in scaling_e2e.summarise(cells, {1.0: 3.5})}
    assert sorted(rows) == [(1.0, 2), (20.0, 1), (20.0, 2)]
    assert rows[20.0, 2]["images_per_second"] == 160.0
    assert rows[20.0, 2]["efficiency"] == pytest.approx(0.8)
    with pytest.raises(SystemExit):
        scaling_e2e.parse_args(["--output", "x.json", "--speedup", "2", "--host-step", "1s"])


def test_scaling_e2e_takes_powersgds_compute_from_a_gpus_file_for_the_pair_it_measured(capsys):
    """--compression-seconds-from: data-powersgd and ddp-powersgd run with emulate's
    --compression-seconds at the file's median for the use case's model (hybrid-powersgd
    at its convolutions' where the file has it); the other contenders without; a scheme or
    rank the file did not measure is refused."""
    import scaling_e2e

    gpu = str(REPO / "results" / "powersgd_cost-gpu.json")
    args = scaling_e2e.parse_args(["--output", "x.json", "--speedup", "127", "--contenders",
                                   "data", "data-powersgd", "ddp-powersgd",
                                   "--compression-seconds-from", gpu])
    measured = {m["model"]: m["seconds"] for m in json.loads(Path(gpu).read_text())["models"]}
    ours = measured["alexnet"]["hybriddl powersgd:2"]["median"]
    peer = measured["alexnet"]["ddp powerSGD_hook:2 minus allreduce_hook"]["median"]
    assert args.compression_seconds == {"data-powersgd": ours, "ddp-powersgd": peer}
    assert scaling_e2e.speed_flags(args, "data-powersgd") == [
        "--speedup", "127.0", "--compression-seconds", f"{ours!r}s"]
    assert scaling_e2e.speed_flags(args, "data") == ["--speedup", "127.0"]
    # What was timed there goes into the results file and onto the page: the commit, and the
    # orthogonalisation (a file from before 9cfbb0f timed QR: it does not say, and the
    # page says QR).
    assert args.compression_timed == {"commit": json.loads(Path(gpu).read_text())["commit"],
                                      "orthogonalisation": None}
    given = {"from": gpu, "seconds": args.compression_seconds, "device": "NVIDIA H200",
             **args.compression_timed}
    text = scaling_e2e.gpu_compression({"compression_seconds": given, "cells": []})
    assert "orthogonalised by QR, as before 9cfbb0f" in text
    assert f" at {args.compression_timed['commit'][:7]}," in text
    # The H200's file predates the convolutions' figure: hybrid-powersgd has none there.
    for more, says in ((["--contenders", "hybrid-powersgd"],
                        "no figure for hybrid-powersgd (hybriddl powersgd:2 convolutions)"),
                       (["--powersgd-rank", "4"], "give --powersgd-rank 2"),
                       (["--usecase", "ComplexSmall", "--compression-seconds-from",
                         "/nonexistent.json"], "/nonexistent.json")):
        with pytest.raises(SystemExit):
            scaling_e2e.parse_args(["--output", "x.json", "--compression-seconds-from", gpu,
                                    *more])
        assert says in capsys.readouterr().err


def test_a_host_step_is_measured_at_the_cores_and_workload_asked():
    from hybriddl.tuning.host_step import measure_host_step

    step = measure_host_step("SimpleBig", 1, image_size=64, batch_size=2, warmup=0, steps=2)
    assert (step.model, step.image_size, step.batch_size, step.cores) == ("alexnet", 64, 2, 1)
    assert len(step.step_seconds) == 2 and all(s > 0 for s in step.step_seconds)
    assert "K=1" in step.strategy


@pytest.mark.parametrize(("step", "image_size", "says"), [
    ("1000s", "64", "give a step of at most"),  # slower than this host's
    ("10ms", "16", "--image-size 16"),  # too small an image for the model (torch's traceback)
])
def test_a_host_step_that_cannot_be_emulated_is_one_line_and_exit_2(cli_here, step, image_size,
                                                                     says):
    done = cli_here("emulate", "--hosts", "1", "--host-step", step, "--usecase", "SimpleBig",
                    "--image-size", image_size, "--batch-size", "2", "--", "true")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or cpu_hierarchy() is None,
                    reason="a CPU quota needs root and cgroup v1's cpu hierarchy or v2's cpu")
def test_a_quota_holds_a_busy_host_to_its_share_of_a_core(tmp_path):
    from hybriddl.emulation.hosts import HostCgroup

    group = HostCgroup.create(cpu_hierarchy(), f"{PREFIX}{os.getpid()}-test-quota",
                              kind="cpu")
    try:
        assert group.limit_cpu(0.25) == (2500, 10000)
        # A busy loop in the group, alone on a core of its own: a quarter of it at most.
        busy = ("import time; t, w = time.process_time(), time.time()\n"
                "while time.time() - w < 1: pass\n"
                "print((time.process_time() - t) / (time.time() - w))")
        done = subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs),
                               "taskset", "-c", str(min(os.sched_getaffinity(0))),
                               sys.executable, "-c", busy],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert 0 < float(done.stdout) <= 0.3
    finally:
        group.remove(grace=1)
    assert not group.path.exists()


def test_the_readmes_throughput_row_of_a_workload_is_the_one_with_a_gpus_compute_where_run():
    """Hosts of a GPU's step compress on the GPU: where a workload and link ran with
    PowerSGD's compute timed on a GPU (emulate --compression-seconds), the README shows that
    row, not the one with this CPU's compute / S. A contender whose compute here outlasted
    the GPU's is shown as at least (≥) its efficiency; of two GPU rows, the one measured
    throughout wins over the one with a bound."""
    import scaling_e2e

    def table(bandwidth: str, gpu: bool = False, outlasted: bool = False,
              speedup: float = 100.0) -> dict:
        row = {"hosts": 2, "speedup": speedup, "bandwidth": bandwidth, "efficiency": 0.5,
               "contender": "data-powersgd", "nic_bytes_per_step": 2e5,
               "images_per_second": 100.0}
        peer = {**row, "contender": "ddp-powersgd", "efficiency": 0.6, "images_per_second": 120.0}
        one = {**row, "hosts": 1, "contender": "data", "efficiency": 1.0}
        cell = {"hosts": 2, "time_scale": 1.0, "contender": "ddp-powersgd", "bandwidth": bandwidth,
                "speedup": speedup + 0.004,  # unrounded, as derived from --host-step
                "compression_outlasted": ["hybriddl: warning: ..."] if outlasted else []}
        return {"usecase": "SimpleBig", "image_size": 224, "cpu_model": "a CPU",
                "summary": [one, row, peer], "cells": [cell],
                "compression_seconds": {"device": "NVIDIA H200"} if gpu else None}

    rows = [scaling_e2e.fast_row(data, name) for name, data in (
        ("cpu-10g", table("10gbit")), ("gpu-10g-bound", table("10gbit", True, True, 200.0)),
        ("gpu-10g", table("10gbit", gpu=True)), ("cpu-1g", table("1gbit")),
        ("gpu-1g-bound", table("1gbit", True, True)))]
    assert rows[1]["ddp"] == "ddp-powersgd ≥ 0.60" and rows[1]["ours"] == "data-powersgd 0.50"
    assert rows[2]["ddp"] == "ddp-powersgd 0.60" and not rows[2]["bounded"]
    page = scaling_e2e.FAST_PAGES[0]
    assert "ddp-powersgd ≥ 0.60 (120 img/s)" in scaling_e2e.fast_headline(
        page, {**table("1gbit", True, True), "torch": "2", "commit": "abc", "date": "d"})
    kept = scaling_e2e.readme_rows(rows)
    assert [r["page"] for r in kept] == ["gpu-10g", "gpu-1g-bound"]
    assert "PowerSGD's compute the NVIDIA H200's" in kept[0]["workload"]
    # What the GPU timed: a file that does not say predates Gram-Schmidt (QR).
    assert kept[0]["orthogonalisation"].startswith("QR, as before 9cfbb0f")
    assert rows[0]["orthogonalisation"] is None

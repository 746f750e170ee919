"""Emulated hosts: H network namespaces joined by a switch, each host's NIC counted.

`hybriddl emulate` trains what one sequential process trains, counts on each host's NIC
only what crossed the network, applies the link rate, slows time down by D when the
hosts' cores exceed the machine's (the hosts take turns, each thread at full speed), and leaves nothing behind, even
when interrupted or killed. Needs root and iproute2; skipped (saying so) otherwise.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO, hybriddl_env
from held_run import wait_for
from hybriddl.emulation.hosts import (PREFIX, EmulatedHosts, NicCounters, freezer_hierarchy,
                                      least_time_scale)
from hybriddl.rundir import MODEL

BENCH = REPO / "scripts" / "bench_allreduce.py"
MIB = 2**20
MACHINE_CORES = len(os.sched_getaffinity(0))

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (network namespaces)"),
    pytest.mark.skipif(not all(map(shutil.which, ("ip", "tc", "unshare", "setpriv"))),
                       reason="emulated hosts need ip, tc (iproute2), unshare and setpriv"),
    pytest.mark.root, pytest.mark.emulated, pytest.mark.mpi, pytest.mark.slow,
]


def emulate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybriddl", "emulate", *args],
                          capture_output=True, text=True, timeout=timeout, env=hybriddl_env())


def root_namespace() -> tuple[list[str], str]:
    """The root namespace's interfaces and qdiscs: emulation must never change them."""
    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True,
                                      text=True).stdout)
    qdiscs = subprocess.run(["tc", "qdisc"], capture_output=True, text=True).stdout
    return sorted(link["ifname"] for link in links), qdiscs


def leftovers(owner: int | str, marker: str | None = None) -> list[str]:
    """Namespaces, folders, host cgroups and marked processes an emulation run by
    `owner` (any: "") left."""
    tag = f"{PREFIX}{owner}-" if owner != "" else PREFIX
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in namespaces.splitlines()
             if line.startswith(tag)]
    found += [str(p) for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{tag}*")]
    if freezer_hierarchy():
        found += [str(p) for p in freezer_hierarchy()[0].glob(f"{tag}*")]
    if marker:
        found += [f"process {p.pid}" for p in marked(marker)]
    return found


def marked(marker: str) -> list[psutil.Process]:
    processes = []
    for process in psutil.process_iter(["cmdline"]):
        if marker in " ".join(process.info["cmdline"] or []) and \
                process.status() != psutil.STATUS_ZOMBIE:
            processes.append(process)
    return processes


def bench(tmp_path: Path, *args: str) -> dict:
    output = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(BENCH), *args, "--output", str(output)],
                          capture_output=True, text=True, timeout=300, env=hybriddl_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(output.read_text())["results"][0]


def test_the_rows_exchange_bench_times_both_reduce_scatters_on_the_same_tensor(tmp_path):
    """scripts/bench_rows_exchange.py: libnbc's reduce-scatter and hybriddl's, interleaved,
    float32 and bfloat16, on emulated hosts; its worker fails where the two disagree."""
    output = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_rows_exchange.py"),
                           "--hosts", "2", "--speedup", "1", "--rounds", "2", "--rows-per-host",
                           "3", "--width", "64", "--output", str(output)],
                          capture_output=True, text=True, timeout=300, env=hybriddl_env())
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(output.read_text())
    assert result["cpu_model"] and result["command"].startswith("python scripts/bench_rows")
    assert [(r["hosts"], r["dtype"]) for r in result["rows"]] == [(2, "float32"), (2, "bfloat16")]
    for row in result["rows"]:
        assert row["tensor_bytes"] == 2 * 3 * 64 * (4 if row["dtype"] == "float32" else 2)
        assert 0 < row["libnbc_seconds"]["min"] <= row["libnbc_seconds"]["median"]
        assert 0 < row["hybriddl_seconds"]["min"] <= row["hybriddl_seconds"]["median"]


def test_two_emulated_hosts_train_what_one_sequential_process_trains(tmp_path):
    train = ["train", "--usecase", "SimpleBig", "--image-size", "64", "--max-steps", "3",
             "--strategy", "sequential", "--dropout", "0", "--host-parallel", "data"]
    before = root_namespace()
    report = tmp_path / "report.json"
    done = emulate("--hosts", "2", "--report", str(report), "--", "hybriddl", *train,
                   "--run-dir", str(tmp_path / "emulated"))
    assert done.returncode == 0, done.stderr[-3000:]
    # Into a pipe, the ranks were told it is not a terminal (machine/terminal.py): the
    # epoch table came without colour codes, although Open MPI gave them one.
    assert "Epochs" in done.stdout and "\x1b[" not in done.stdout
    alone = subprocess.run([sys.executable, "-m", "hybriddl", *train, "--run-dir",
                            str(tmp_path / "alone")], capture_output=True, text=True,
                           timeout=300, env=hybriddl_env())
    assert alone.returncode == 0, alone.stderr[-3000:]
    got = torch.load(tmp_path / "emulated" / MODEL, weights_only=True)
    want = torch.load(tmp_path / "alone" / MODEL, weights_only=True)
    assert got.keys() == want.keys()
    for name, value in want.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert float((got[name] - value).abs().max() / scale) <= 1e-5, name
    # Two hosts: each sends S per allreduce (2(H-1)/H*S), 3 steps, and no initial
    # parameters: both built them from the seed and compared a digest. AlexNet's float32
    # gradient is S bytes.
    gradient = 4 * sum(v.numel() for k, v in want.items() if "running" not in k)
    hosts = json.loads(report.read_text())["hosts"]
    assert [h["name"] for h in hosts] == ["h0", "h1"]
    assert hosts[1]["bytes_sent"] == pytest.approx(3 * gradient, rel=0.05)
    assert hosts[0]["bytes_sent"] == pytest.approx(3 * gradient, rel=0.05)
    assert root_namespace() == before
    assert leftovers("") == []


def test_hosts_send_even_bytes_through_the_trainers_averaging(tmp_path):
    # 24 MiB leaves as three allreduce pieces; the bench fails unless every host's average
    # is right.
    result = bench(tmp_path, "--hosts", "4", "--bandwidth", "10gbit", "--mib", "24",
                   "--repeats", "2")
    theory = 2 * 3 / 4 * 24 * MIB
    assert result["host_nic_bytes_theory"] == [theory] * 4
    for sent in result["host_nic_bytes_sent"]:
        assert abs(sent - theory) <= 0.1 * theory, result["host_nic_bytes_sent"]


def test_fp16_averaging_puts_half_the_bytes_evenly_on_the_wire(tmp_path):
    # 3 hosts and 2 Mi float16 elements: slices of unequal length. The bench fails unless
    # every host's average is within 1e-3 (relative) of float32's.
    result = bench(tmp_path, "--hosts", "3", "--bandwidth", "10gbit", "--mib", "4",
                   "--compression", "fp16", "--repeats", "2")
    theory = 2 * 2 / 3 * 2 * MIB  # 2(H-1)/H of the float16 gradient, S/2
    assert result["host_nic_bytes_theory"] == [round(theory)] * 3
    for sent in result["host_nic_bytes_sent"]:
        assert abs(sent - theory) <= 0.1 * theory, result["host_nic_bytes_sent"]


def test_overlapped_averaging_in_parts_is_right_and_even(tmp_path):
    # --overlap: backward's hooks post the buckets; the bench fails unless every host's
    # average is right and a bucket left during backward. --parts 2: two averagings of
    # 3 MiB per repeat, the same 6 MiB in all on every NIC.
    result = bench(tmp_path, "--hosts", "3", "--bandwidth", "10gbit", "--mib", "6",
                   "--overlap", "on", "--parts", "2", "--repeats", "2")
    assert (result["overlap"], result["parts"], result["bytes"]) == (True, 2, 6 * MIB)
    theory = 2 * 2 / 3 * 6 * MIB
    for sent in result["host_nic_bytes_sent"]:
        assert abs(sent - theory) <= 0.1 * theory, result["host_nic_bytes_sent"]


def test_the_bandwidth_limit_is_really_applied(tmp_path):
    result = bench(tmp_path, "--hosts", "2", "--bandwidth", "100mbit", "--mib", "4",
                   "--repeats", "2")
    # Each host sends S = 4 MiB; at 100 Mbit/s that takes 0.34 s at least (less the one
    # burst, 1 ms at the rate, tbf lets through at once).
    sent = min(result["host_nic_bytes_sent"])
    assert sent >= 4 * MIB
    assert result["seconds"] >= (sent - 1e8 / 8 * 1e-3) * 8 / 1e8


def test_traffic_between_ranks_of_one_host_is_not_counted(tmp_path):
    report = tmp_path / "report.json"
    worker = [sys.executable, str(BENCH), "--hosts", "1", "--bandwidth", "1gbit", "--mib", "2",
              "--repeats", "1", "--output", str(tmp_path / "unused.json"), "--worker",
              str(tmp_path / "figures.json")]
    done = emulate("--hosts", "1", "--ranks-per-host", "2", "--report", str(report), "--",
                   *worker)
    assert done.returncode == 0, done.stderr[-3000:]
    # Two ranks averaged 2 MiB twice (warm-up and one repeat): nothing of it left the host.
    host = json.loads(report.read_text())["hosts"][0]
    assert host["bytes_sent"] < 0.02 * 2 * MIB and host["bytes_received"] < 0.02 * 2 * MIB

    done = emulate("--hosts", "2", "--ranks-per-host", "2", "--report", str(report), "--",
                   *worker)
    assert done.returncode == 0, done.stderr[-3000:]
    # 4 ranks, 2 allreduces of S: at most a flat ring's 2(P-1)/P*S per host NIC each, not
    # the 2 x that a count of every rank's traffic would give.
    for host in json.loads(report.read_text())["hosts"]:
        assert host["bytes_sent"] <= 1.1 * 2 * (2 * 3 / 4 * 2 * MIB), host


def test_without_root_emulate_says_so_in_one_line_and_exits_2():
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-m", "hybriddl", "emulate", "--hosts", "2", "--",
                           "true"], capture_output=True, text=True, timeout=60,
                          env=hybriddl_env())
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "need root" in done.stderr, done.stderr
    assert done.stdout == ""


def start_sleeping(marker: str) -> subprocess.Popen:
    """`hybriddl emulate --hosts 2` whose ranks sleep, once both ranks are running; at a
    time scale of 2 where the machine has cgroups that can be frozen, so that the hosts'
    cgroups must be cleaned up too (and what a killed run left frozen, thawed to end)."""
    scaled = ["--time-scale", "2"] if freezer_hierarchy() else []
    process = subprocess.Popen(
        [sys.executable, "-m", "hybriddl", "emulate", "--hosts", "2", *scaled, "--",
         sys.executable, "-c", f"import time; time.sleep(600)  # {marker}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hybriddl_env())
    ranks = [sys.executable, "-c"]
    wait_for(lambda: len([p for p in marked(marker)
                          if (p.info["cmdline"] or [])[:2] == ranks]) == 2,
             "both ranks running", process)
    return process


def test_ctrl_c_to_emulate_leaves_nothing_behind():
    marker = f"marker-{uuid.uuid4().hex}"
    before = root_namespace()
    process = start_sleeping(marker)
    assert leftovers(process.pid)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "emulate interrupted by SIGINT" in err
    assert leftovers(process.pid, marker) == []
    assert root_namespace() == before


def test_a_killed_runs_leftovers_are_removed_by_the_next_run():
    marker = f"marker-{uuid.uuid4().hex}"
    process = start_sleeping(marker)
    process.kill()
    process.wait()  # not communicate: the orphaned ranks still hold its pipes
    process.stdout.close()
    process.stderr.close()
    assert leftovers(process.pid, marker)  # killed: nothing could tear down
    done = emulate("--hosts", "1", "--", "true")
    assert done.returncode == 0, done.stderr
    assert leftovers(process.pid, marker) == []


def test_nic_counters_subtract_to_what_a_span_carried():
    later, earlier = NicCounters("h0", 300, 50), NicCounters("h0", 100, 20)
    assert later - earlier == NicCounters("h0", 200, 30)
    assert (later - earlier).as_dict() == {"name": "h0", "bytes_sent": 200,
                                           "bytes_received": 30}


def test_bad_rates_and_missing_commands_are_one_line_and_exit_2(cli_here):
    for args in (["--hosts", "2", "--bandwidth", "fast", "--", "true"],
                 ["--hosts", "0", "--", "true"], ["--hosts", "2"],
                 ["--hosts", "2", "--cores-per-host", "0", "--", "true"],
                 ["--hosts", "2", "--time-scale", "0.5", "--", "true"],
                 ["--hosts", "2", "--time-scale", "inf", "--", "true"]):
        done = cli_here("emulate", *args)
        assert done.returncode == 2, args
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_rank_count_of_zero_is_refused_before_a_host_is_made(monkeypatch, capsys):
    from hybriddl.cli import main
    from hybriddl.emulation import hosts

    made = []
    monkeypatch.setattr(hosts, "EmulatedHosts", lambda **how: made.append(how))
    assert main(["emulate", "--hosts", "2", "--ranks-per-host", "0", "--", "true"]) == 2
    assert made == [] and "--ranks-per-host 0: give at least 1" in capsys.readouterr().err


def test_a_host_group_that_will_not_go_leaves_the_rest_of_the_teardown_done(tmp_path, monkeypatch):
    """One cgroup that cannot be removed (busy past its tries) is named, after the other
    hosts' groups and the hosts' files are gone: the teardown is not cut short by it."""
    import hybriddl.emulation.hosts as module
    from hybriddl.emulation.hosts import EmulationFailed

    removed = []

    class Group:
        def __init__(self, name, fails):
            self.name, self.fails = name, fails

        def remove(self, grace):
            if self.fails:
                raise EmulationFailed(f"cgroup {self.name} still busy")
            removed.append(self.name)

    monkeypatch.setattr(module, "_namespaces", lambda: [])  # none left to delete
    cluster = EmulatedHosts.__new__(EmulatedHosts)  # what close() reads, nothing made
    cluster._up, cluster._slicer, cluster.namespaces, cluster.switch = True, None, [], "switch"
    cluster.cgroups = [Group("h0", fails=True), Group("h1", fails=False)]
    cluster.folder = tmp_path / "hosts"
    cluster.folder.mkdir()
    with pytest.raises(EmulationFailed, match="cgroup h0 still busy"):
        cluster.close()
    assert removed == ["h1"] and not cluster.folder.exists() and not cluster._up
    assert cluster.cgroups[1] is None


def test_hosts_taking_turns_are_never_left_frozen_when_the_turns_fail():
    """A freezer write refused mid-cycle ends the time slicer: every host is thawed (a
    frozen host would hold its run for ever) and the failure is kept for the run to name."""
    from hybriddl.emulation.hosts import TimeSlicer

    class Group:
        def __init__(self):
            self.calls = []

        def freeze(self, frozen):
            self.calls.append(frozen)
            if frozen and len(self.calls) == 3:  # its second turn's end: refused
                raise OSError(16, "Device or resource busy")

    groups = [Group(), Group()]
    slicer = TimeSlicer([[groups[0]], [groups[1]]], share=0.5)
    slicer.start()
    slicer.join(timeout=10)
    assert not slicer.is_alive() and "Device or resource busy" in slicer.failure
    assert [group.calls[-1] for group in groups] == [False, False]  # both running



def test_stopping_an_mpirun_whose_rank_outlives_it_does_not_wait_for_the_rank():
    """A killed mpirun's rank that lives on holds the pipes: reading them to their end
    waited for the rank (for ever, on a frozen host)."""
    import time

    from hybriddl.emulation.hosts import stop

    # The stand-in for mpirun ignores SIGTERM; its child, the rank, keeps its stdout.
    process = subprocess.Popen(["sh", "-c", "trap '' TERM; echo started; sleep 60 & wait"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        assert process.stdout.readline() == b"started\n"
        started = time.monotonic()
        stop(process, grace=0.5)
        assert time.monotonic() - started < 10
        assert process.returncode == -signal.SIGKILL and process.stdout.closed
    finally:
        with contextlib.suppress(ProcessLookupError):  # the rank, left to the teardown
            os.killpg(process.pid, signal.SIGKILL)

# ---------------------------------------------------------------------- time scale
def test_time_scale_is_hosts_times_cores_over_the_machines_cores():
    assert least_time_scale(2, 1, 2) == 1       # fits: real time
    assert least_time_scale(1, 1, 2) == 1
    assert least_time_scale(2, 2, 2) == 2
    assert least_time_scale(4, 2, 2) == 4
    assert least_time_scale(1, 4, 2) == 2
    assert least_time_scale(1, 3, 2) == 1.5     # one host spans the machine: no rounding
    assert least_time_scale(3, 1, 2) == 2       # core 0 carries hosts 0 and 2
    assert least_time_scale(4, 3, 8) == 2       # 12 cores in turn on 8: some core has 2
    cluster = EmulatedHosts(hosts=2, cores_per_host=MACHINE_CORES, bandwidth="1gbit",
                            latency="1ms", time_scale=None)
    assert cluster.time_scale == 2
    # Each host still sees C cores (so its ranks run C threads), each at 1/D of its speed.
    assert [len(cores) for cores in cluster.cores] == [MACHINE_CORES] * 2
    assert EmulatedHosts(hosts=1, time_scale=None).time_scale == 1
    assert EmulatedHosts(hosts=2, cores_per_host=MACHINE_CORES).time_scale == 1  # default


def scaled_run(tmp_path: Path, *args: str, program: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hybriddl", "emulate", *args, "--report",
         str(tmp_path / "report.json"), "--", sys.executable, "-c", program],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hybriddl_env())


def running(group: Path) -> bool:
    """Whether a host cgroup is let run (thawed) now, as the time slicer last set it."""
    if (group / "freezer.state").exists():
        return (group / "freezer.state").read_text().strip() == "THAWED"
    return (group / "cgroup.freeze").read_text().strip() == "0"


needs_freezer = pytest.mark.skipif(freezer_hierarchy() is None,
                                   reason="time scales above 1 need cgroups that can be frozen")


@needs_freezer
def test_each_host_runs_in_its_cgroup_and_the_hosts_take_turns(tmp_path):
    go = tmp_path / "go"
    # Each rank says who it is and how many cores it may use, then waits.
    program = (
        "import os, time, pathlib\n"
        f"folder = pathlib.Path({str(tmp_path)!r})\n"
        "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
        "text = f'{os.getpid()} {len(os.sched_getaffinity(0))}'\n"
        "(folder / f'rank{rank}.tmp').write_text(text)\n"
        "(folder / f'rank{rank}.tmp').rename(folder / f'rank{rank}')\n"
        "deadline = time.time() + 60\n"
        "while not (folder / 'go').exists() and time.time() < deadline:\n"
        "    time.sleep(0.05)\n")
    process = scaled_run(tmp_path, "--hosts", "2", "--cores-per-host", str(MACHINE_CORES),
                         program=program)
    wait_for(lambda: all((tmp_path / f"rank{r}").exists() for r in range(2)),
             "both ranks running", process)
    root, version = freezer_hierarchy()
    groups = []
    for rank in range(2):
        pid, cores = (tmp_path / f"rank{rank}").read_text().split()
        assert int(cores) == MACHINE_CORES  # C cores: a host runs C threads
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        controllers = "freezer" if version == 1 else ""
        group = [line for line in lines if line.split(":")[1] == controllers][0].split(":")[2]
        host = group.strip("/")
        assert host.startswith(f"{PREFIX}{process.pid}-") and host.endswith(f"-h{rank}")
        groups.append(root / host)
    # The two hosts fill the machine: never both running at once, and each in turn.
    seen = set()
    for _ in range(2000):
        # h0, h1, h0 again: a switch (freeze one, thaw the other) falling between two reads
        # cannot show both running, as turns last 20 ms and the reads take microseconds.
        first, other, again = running(groups[0]), running(groups[1]), running(groups[0])
        assert not (first and other and again)
        if first == again:
            seen.add((first, other))
    assert {(True, False), (False, True)} <= seen, seen
    go.touch()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-3000:]
    assert "time scale 2" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["time_scale"] == 2
    assert report["emulated_seconds"] == pytest.approx(report["seconds"] / 2, abs=0.002)
    assert leftovers(process.pid) == []


@needs_freezer
def test_hosts_that_fill_the_machine_run_d_times_slower_serial_and_parallel(tmp_path):
    """Two hosts of all the machine's cores (D = 2), each timing a Python loop (one
    thread) and a multithreaded torch loop, take D times one such host's time alone: a
    host's serial phases are slowed too (quotas per host left them at full speed), and
    its threads run together (quotas per thread ran each rank at half its share: 4x)."""
    program = ("import os, time, pathlib, torch\n"
               f"torch.set_num_threads({MACHINE_CORES})\n"
               "a = torch.randn(384, 384)\n"
               "for _ in range(5):\n"
               "    a @ a\n"
               "start = time.perf_counter()\n"
               "sum(i * i for i in range(4_500_000))\n"
               "serial = time.perf_counter() - start\n"
               "start = time.perf_counter()\n"
               "for _ in range(1000):\n"
               "    (a @ a).sum().item()\n"
               "parallel = time.perf_counter() - start\n"
               f"folder = pathlib.Path({str(tmp_path)!r})\n"
               "(folder / ('seconds' + os.environ['OMPI_COMM_WORLD_RANK'])).write_text("
               "f'{serial} {parallel}')\n")
    seconds = {}
    for hosts in ("1", "2", "1", "2"):  # interleaved: a busy machine slows both alike
        process = scaled_run(tmp_path, "--hosts", hosts, "--cores-per-host",
                             str(MACHINE_CORES), "--time-scale", hosts, program=program)
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, err[-3000:]
        assert leftovers(process.pid) == []
        ranks = [tuple(map(float, (tmp_path / f"seconds{rank}").read_text().split()))
                 for rank in range(int(hosts))]
        # A step waits for the slowest host.
        seconds.setdefault(hosts, []).append(tuple(max(phase) for phase in zip(*ranks)))
    for phase, name in enumerate(("serial", "parallel")):
        alone = min(r[phase] for r in seconds["1"])
        together = [r[phase] for r in seconds["2"]]
        # D = 2 is 2x; 3.85x still tells it from the 4x and more of quotas per thread (a
        # host's threads frozen mid-matmul at a turn's end wait for each other: the parallel
        # phase measured 2.2-2.9x, past 3x in about one run of six on an Intel Xeon, and
        # 3.6-3.7x in both runs of one suite on an AMD EPYC, 2026-11-26). Hosts at full
        # speed read about 1x in both runs, and quotas per thread 4x in both: one run of the
        # two must be slowed past 1.6x, and one must stay under 3.85x (in one suite a serial
        # phase read 1.30x in one run, 1.87x in the other, AMD EPYC, 2026-11-27).
        assert max(together) > 1.6 * alone and min(together) < 3.85 * alone, \
            (name, [t / alone for t in together], seconds)


def test_emulated_hosts_tell_the_ranks_unless_their_output_reaches_this_terminal(
        monkeypatch, tmp_path):
    """What emulate (and the scripts) and compare's contenders start: `mpirun` follows this
    process's stdout, and a contender's ranks, whose output goes to its log, are told."""
    from hybriddl.machine.terminal import NOT_A_TERMINAL

    told = ["-x", NOT_A_TERMINAL]
    cluster = EmulatedHosts(hosts=2, cores_per_host=1)
    cluster.folder = tmp_path  # where the hostfile goes; nothing is created

    def says(argv: list[str]) -> bool:
        return any(argv[i:i + 2] == told for i in range(len(argv)))

    primary, secondary = os.openpty()
    with open(secondary, "w") as terminal:
        monkeypatch.setattr(sys, "stdout", terminal)
        assert not says(cluster.mpirun(["true"]))
        assert says(cluster.mpirun(["true"], logged=True))
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        assert says(cluster.mpirun(["true"]))
    os.close(primary)


def test_hosts_that_take_turns_send_messages_eagerly_and_hosts_side_by_side_do_not(tmp_path):
    def mca(cluster: EmulatedHosts) -> dict[str, str]:
        cluster.folder = tmp_path  # where the hostfile goes; nothing is created
        argv = cluster.mpirun_options()
        return {argv[i + 1]: argv[i + 2] for i, word in enumerate(argv) if word == "--mca"}

    turns = mca(EmulatedHosts(hosts=2, cores_per_host=MACHINE_CORES, time_scale=None))
    assert turns["btl_tcp_eager_limit"] == str(16 * 2**20)
    assert turns["btl_tcp_rndv_eager_limit"] == str(16 * 2**20)
    side_by_side = mca(EmulatedHosts(hosts=2, cores_per_host=1, time_scale=None))
    assert "btl_tcp_eager_limit" not in side_by_side
    # A user's --mca still wins.
    cluster = EmulatedHosts(hosts=2, cores_per_host=MACHINE_CORES, time_scale=None)
    cluster.folder = tmp_path
    argv = cluster.mpirun_options(mca={"btl_tcp_eager_limit": "65536"})
    assert argv[argv.index("btl_tcp_eager_limit") + 1] == "65536"

"""H emulated hosts on this machine: one network namespace each, joined by a switch.

Each host is a network namespace with one NIC (`eth0`, one end of a veth pair whose
other end sits on a bridge in a switch namespace), an address in the benchmarking range
198.18.0.0/15, its own hostname (a UTS namespace per launch) and its own TMPDIR, and,
its own cores (taskset). Open MPI then sees H machines: ranks of one host talk through
shared memory, ranks of different hosts through TCP over their NICs, so each NIC's
counters are exactly what that host put on the network. `tc` on both ends of each veth
gives every link a rate (full duplex) and a one-way latency.

Time scale. H hosts of C cores that do not fit this machine's cores are emulated with
time slowed down by D = H x C / cores (docs/methodology.md, "Emulated hosts"): each host
gets C/D cores' worth of CPU time, links run at rate/D, latencies are x D, and emulated
time is wall time / D. The hosts take turns (gang scheduling): each host's processes
share a cgroup, and a `TimeSlicer` lets one slot of hosts (as many as fit the cores side
by side) run at a time, every thread of theirs at full speed, while it freezes the
others. A host still sees C cores (or all of the machine's, if fewer), so its ranks run C
threads, and its parallel regions and its serial phases are both slowed D times. (Quotas
per host (cgroup cpu) leave a serial phase at full speed; quotas per thread as well
throttle each thread on its own clock, so threads that meet at barriers wait for one
another: two 2-core VGG16 hosts at D = 2 ran at half their speed.)

Speedup. `speedup` S lets each host stand for one S times faster than its cores here (a
32-core server, a GPU): links run at rate/S, latencies are x S and emulated time is wall
time / S. The hosts then never take turns (an exchange would wait for its partner's turn):
where they do not fit side by side they all run at once, each held to C/D cores of CPU
time by a CPU quota with a short period (`QUOTA_PERIOD`), so time is dilated by S x D
(`Dilation`).

Nothing is created or changed in the root network namespace: the veth pairs are made
directly inside the namespaces. Every namespace is named `hybriddl-emu-<pid>-...` after
the process that made it, so a run that was killed before it could tear down is found
and cleaned by the next one.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hybriddl.errors import UsageError
from hybriddl.failpoints import VARIABLE as FAILPOINTS_VARIABLE
from hybriddl.machine.terminal import rank_output_flags, stop_signals

PREFIX = "hybriddl-emu-"
SUBNET = "198.18.0.0/24"
NIC = "eth0"
# The least token bucket a link's rate limit (tbf) gets: two Ethernet frames of the veths'
# 1500-byte MTU. A bucket fills while a host computes and leaves at once after it: 64 KiB
# at S = 200 (a 5 Mbit/s wall rate) let a 64 KiB allreduce after compute through in 5 ms
# of wall time instead of its 105 ms on the wire.
MIN_BURST_BYTES = 2 * 1514
# A link's queue (tbf's limit) holds 100 ms of the emulated rate, in bytes, whatever S and D:
# the same bytes as a link at full speed. Held as 100 ms of wall time at the scaled rate, it
# shrank with S x D (62.5 KB at S = 200 and 1 Gbit/s), below what TCP queues for one socket
# (net.ipv4.tcp_limit_output_bytes, 4 MiB here), and overflowed where a full-speed link's does
# not: a hybrid AlexNet run at S = 200 dropped 3400-4200 packets a host and TCP resent
# 2-4 % of its segments; with the queue in bytes, none (its steps took as long either way).
QUEUE_SECONDS = 0.1
# Open MPI must use only the emulated NICs between hosts, and its shared memory within one.
MPI_TRANSPORT = {"btl": "tcp,self,sm", "btl_tcp_if_include": SUBNET,
                 "oob_tcp_if_include": SUBNET}
# Hosts that take turns (D > 1): messages up to 16 MiB go eagerly, without Open MPI's
# rendezvous handshake. Each handshake needs both ends running, so between hosts that take
# turns it waits for the other's turn (20 ms a time, more than a real link's round trip by
# a factor of 100s). Measured between 2 emulated hosts at 1 Gbit/s, emulated ms at D = 2
# against D = 1 (side by side): an allreduce of 1.2 MB 60 (12 at D = 1), of 10 MB 200 (91);
# with these 20 and 124 (scripts/emulation_fidelity.py, check (e)).
TURNS_EAGER = {"btl_tcp_eager_limit": 16 * 2**20, "btl_tcp_rndv_eager_limit": 16 * 2**20,
               "btl_tcp_max_send_size": 16 * 2**20}
RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)$", re.IGNORECASE)
DELAY = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
# How long a slot of hosts runs before the next takes the cores (TimeSlicer).
SLICE = 0.02
# The period of the CPU quota of hosts that run at once (speedup): short, so a host held to
# its share waits at most this long to run again (an exchange waits as long for its
# partner), and a step of tens of milliseconds spans several periods.
QUOTA_PERIOD = 0.01
# The kernel's least CPU quota (cgroup v1 cpu.cfs_quota_us, v2 cpu.max): 1 ms.
LEAST_QUOTA = 0.001


class EmulationUnavailable(UsageError):
    """This machine (or this user) cannot make network namespaces."""


class EmulationFailed(RuntimeError):
    """Setting up the emulated hosts failed (the message names the command and why)."""


@dataclass(frozen=True)
class NicCounters:
    """Bytes a host's NIC sent and received (since boot of the NIC, or over a span)."""

    host: str
    bytes_sent: int
    bytes_received: int

    def __sub__(self, earlier: "NicCounters") -> "NicCounters":
        return NicCounters(self.host, self.bytes_sent - earlier.bytes_sent,
                           self.bytes_received - earlier.bytes_received)

    def as_dict(self) -> dict:
        return {"name": self.host, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}


@dataclass(frozen=True)
class EmulatedRun:
    """A finished command and what each host's NIC carried while it ran."""

    returncode: int
    seconds: float  # wall time
    traffic: list[NicCounters]
    stdout: str | None = None
    stderr: str | None = None
    time_scale: float = 1.0
    speedup: float = 1.0

    @property
    def dilation(self) -> float:
        """S x D: wall seconds per emulated second."""
        return Dilation(self.speedup, self.time_scale).factor

    @property
    def emulated_seconds(self) -> float:
        """What the run took on the emulated hosts: wall time / (S x D)."""
        return Dilation(self.speedup, self.time_scale).emulated(self.seconds)


def bits_per_second(rate: str) -> float:
    """'1gbit' -> 1e9, '100mbit' -> 1e8, '125mbps' -> 1e9 (tc's units, decimal prefixes)."""
    match = RATE.match(rate.strip())
    if not match:
        raise UsageError(f"bandwidth {rate!r}: give a rate such as 1gbit, 100mbit or 10gbit")
    value = float(match[1]) * _UNITS[match[2].lower()] * (8 if match[3].lower() == "bps" else 1)
    if value <= 0:
        raise UsageError(f"bandwidth {rate!r}: give a positive rate")
    return value


def seconds_of(delay: str) -> float:
    """'0.1ms' -> 0.0001 (tc's units)."""
    match = DELAY.match(delay.strip())
    if not match:
        raise UsageError(f"latency {delay!r}: give a delay such as 0.1ms, 50us or 1ms")
    return float(match[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match[2].lower()]


def duration_seconds(text: str, flag: str) -> float:
    """'10ms' -> 0.01, '0.01s' -> 0.01, '1.5s' -> 1.5, '500us' -> 0.0005 (a positive one)."""
    match = DELAY.match(text.strip())
    if not match or float(match[1]) <= 0:
        raise UsageError(f"{flag} {text!r}: give a positive duration such as 10ms, 0.01s or "
                         "1.5s")
    return float(match[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match[2].lower()]


def check_speedup(speedup: float) -> float:
    """S as given: 1 or more (a host S times faster than its cores here)."""
    if not speedup >= 1 or math.isinf(speedup):
        raise UsageError(f"--speedup {speedup:g}: give 1 or more (how many times faster than "
                         "its cores here each emulated host computes)")
    return float(speedup)


def speedup_for_step(measured_seconds: float, host_step_seconds: float) -> float:
    """S at which a host whose step takes `measured_seconds` here stands for one whose step
    takes `host_step_seconds`: their ratio, refused (exit 2) below 1."""
    speedup = measured_seconds / host_step_seconds
    if speedup < 1:
        raise UsageError(f"--host-step {host_step_seconds:g} s: this host's step takes "
                         f"{measured_seconds:.3g} s already, so the emulated host would be "
                         f"slower; give a step of at most {measured_seconds:.3g} s")
    return speedup


@dataclass(frozen=True)
class Dilation:
    """How emulated time relates to wall time: S (speedup, each host stands for one S times
    faster) times D (time scale, each host gets C/D cores of CPU time where the hosts do
    not fit side by side). Everything that is not the hosts' compute follows it: links run
    at rate / (S x D), latencies are x (S x D), emulated seconds = wall seconds / (S x D)."""

    speedup: float = 1.0
    time_scale: float = 1.0

    @property
    def factor(self) -> float:
        return self.speedup * self.time_scale

    def link_rate(self, bits_per_second: float) -> float:
        """What tc is set to for an emulated link of `bits_per_second`."""
        return bits_per_second / self.factor

    def link_delay(self, seconds: float) -> float:
        """What netem is set to for an emulated one-way latency of `seconds`."""
        return seconds * self.factor

    def emulated(self, wall_seconds: float) -> float:
        return wall_seconds / self.factor


def quota_of(cores: float, period: float = QUOTA_PERIOD) -> tuple[int, int]:
    """(quota, period) in microseconds that give `cores` cores' worth of CPU time: the
    period stretched where the quota would fall below the kernel's least."""
    period = max(period, LEAST_QUOTA / cores)
    return round(cores * period * 1e6), round(period * 1e6)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise EmulationFailed(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True)
    if done.returncode != 0 and "netem" in args and "unknown" in done.stderr:
        raise EmulationUnavailable("--latency needs the kernel's netem qdisc (module "
                                   "sch_netem), which this machine lacks: leave --latency out")
    if done.returncode != 0:
        raise EmulationFailed(f"tc {' '.join(args)} in {namespace} failed: "
                              f"{done.stderr.strip()}")


def check_available() -> None:
    """Raise EmulationUnavailable (one line saying what is missing) unless hosts can be made."""
    if os.geteuid() != 0:
        raise EmulationUnavailable("emulated hosts need root (network namespaces, tc): run "
                                   "as root, e.g. with sudo")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"emulated hosts need '{tool}' (iproute2, util-linux): "
                                       "install it")


def _namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _owner_alive(name: str) -> bool:
    match = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
    return bool(match) and psutil.pid_exists(int(match[1]))


def _kill_namespace_processes(namespace: str, grace: float) -> None:
    _end_processes([int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()],
                   grace)


def _end_processes(pids: list[int], grace: float) -> None:
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


# ---------------------------------------------------------------------- time slicing
# Set in every rank of emulated hosts slowed down (D > 1) or standing for faster ones (S):
# S·D, read by `time_scale` (the hosts' deadlines and link rates, the run's target clock).
TIME_SCALE_VARIABLE = "HYBRIDDL_TIME_SCALE"
# emulate --compression-seconds G: each host's wire scheme computes G emulated s a step.
COMPRESSION_SECONDS_VARIABLE = "HYBRIDDL_COMPRESSION_SECONDS"


def time_scale() -> float:
    """S·D of emulated hosts (1 on real hosts): wall seconds over it are emulated seconds."""
    try:
        return max(1.0, float(os.environ.get(TIME_SCALE_VARIABLE, "1")))
    except ValueError:
        return 1.0


def default_cores_per_host(hosts: int) -> int:
    """C when not given: this machine's cores shared out between the hosts, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, hosts))


def least_time_scale(hosts: int, cores_per_host: int, machine_cores: int) -> float:
    """The smallest D at which `hosts` hosts of `cores_per_host` cores fit `machine_cores`.

    H x C / cores, at least 1, for hosts as large as the machine or larger. Smaller hosts
    run side by side in slots of cores // C hosts (each on C cores of its own), and the
    slots take turns: D is the number of slots, ceil(H / (cores // C)) (3 hosts of 1 core
    on 2 cores: D = 2, not 1.5)."""
    if cores_per_host >= machine_cores:
        return max(1.0, hosts * cores_per_host / machine_cores)
    return float(math.ceil(hosts / (machine_cores // cores_per_host)))


def _slots(hosts: int, cores_per_host: int, machine_cores: int) -> list[list[int]]:
    """Hosts that run side by side, in turns (see least_time_scale)."""
    side_by_side = max(1, machine_cores // cores_per_host)
    return [list(range(first, min(hosts, first + side_by_side)))
            for first in range(0, hosts, side_by_side)]


def freezer_hierarchy() -> tuple[Path, int] | None:
    """Where cgroups that can be frozen are made, and the cgroup version: v1's freezer
    hierarchy where it is mounted, else a cgroup v2 mount (every v2 cgroup but the root has
    cgroup.freeze); None without either."""
    mounts = psutil.disk_partitions(all=True)
    for mount in mounts:
        if mount.fstype == "cgroup" and "freezer" in mount.opts.split(","):
            return Path(mount.mountpoint), 1
    for mount in mounts:
        if mount.fstype == "cgroup2":
            return Path(mount.mountpoint), 2
    return None


def cpu_hierarchy() -> tuple[Path, int] | None:
    """Where cgroups with a CPU quota are made, and the cgroup version: v1's cpu hierarchy
    where it is mounted, else a cgroup v2 mount whose children may have the cpu
    controller; None without either."""
    mounts = psutil.disk_partitions(all=True)
    for mount in mounts:
        if mount.fstype == "cgroup" and "cpu" in mount.opts.split(","):
            return Path(mount.mountpoint), 1
    for mount in mounts:
        if mount.fstype == "cgroup2":
            root = Path(mount.mountpoint)
            try:
                if "cpu" in (root / "cgroup.controllers").read_text().split():
                    return root, 2
            except OSError:
                pass
    return None


@dataclass(frozen=True)
class HostCgroup:
    """One emulated host's cgroup: every process the host starts joins it, and the
    `TimeSlicer` freezes and thaws them together (`kind` "freezer"), or a CPU quota holds
    them to the host's share of the machine (`kind` "cpu")."""

    path: Path
    version: int
    kind: str = "freezer"

    @classmethod
    def create(cls, hierarchy: tuple[Path, int], name: str,
               kind: str = "freezer") -> "HostCgroup":
        root, version = hierarchy
        if version == 2 and kind == "cpu":
            try:  # v2: a child has the cpu controller only if its parent hands it down
                (root / "cgroup.subtree_control").write_text("+cpu")
            except OSError as exc:
                raise EmulationFailed(f"cannot enable the cpu controller under {root} "
                                      f"({exc.strerror})") from None
        try:
            (root / name).mkdir()
        except OSError as exc:
            raise EmulationFailed(f"cannot make the host cgroup {root / name} "
                                  f"({exc.strerror})") from None
        return cls(root / name, version, kind)

    def limit_cpu(self, cores: float, period: float = QUOTA_PERIOD) -> tuple[int, int]:
        """Hold the host's processes to `cores` cores' worth of CPU time, measured over
        every `period` (stretched to the kernel's least quota); returns (quota, period) in
        microseconds."""
        quota, period_us = quota_of(cores, period)
        try:
            if self.version == 2:
                (self.path / "cpu.max").write_text(f"{quota} {period_us}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as exc:
            raise EmulationFailed(f"cannot set the CPU quota of {self.path} "
                                  f"({exc.strerror})") from None
        return quota, period_us

    @property
    def procs(self) -> Path:
        """Write a PID here to put that process (and what it starts) in the host."""
        return self.path / "cgroup.procs"

    def freeze(self, frozen: bool) -> None:
        """Stop (or let run again) every thread of the host's processes."""
        if self.kind != "freezer":
            return
        try:
            if self.version == 2:
                (self.path / "cgroup.freeze").write_text("1" if frozen else "0")
            else:
                (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        except FileNotFoundError:
            pass  # removed meanwhile (teardown)

    def pids(self) -> list[int]:
        return [int(p) for p in self.procs.read_text().split()]

    def remove(self, grace: float) -> None:
        """Let its processes run, end them, then delete it. Safe to call twice."""
        for attempt in range(50):
            try:
                self.freeze(False)  # a frozen process cannot act on SIGTERM (nor, in v1, die)
                _end_processes(self.pids(), grace)
                self.path.rmdir()
                return
            except FileNotFoundError:
                if not self.path.exists():
                    return
            except OSError as exc:
                # A process just ended may still be counted for a moment.
                if exc.errno != errno.EBUSY or attempt == 49:
                    raise EmulationFailed(f"cannot delete the cgroup {self.path} "
                                          f"({exc.strerror})") from None
            time.sleep(0.1)


class TimeSlicer(threading.Thread):
    """Gang scheduling at time scale D: the hosts run in turns ("slots" of hosts that fit
    the machine side by side, each host on its own cores), every thread of a running host
    at full speed, the others frozen. A host runs SLICE seconds in every SLICE / share, so
    it gets `share` of the wall time on its cores: a parallel region and a serial phase
    are both slowed D times, as the hosts' threads run together, never one at a time."""

    def __init__(self, slots: list[list[HostCgroup]], share: float):
        super().__init__(daemon=True, name="emulation-time-slicer")
        self.slots, self.share = slots, share
        self._stopping = threading.Event()
        self.failure: str | None = None  # why slicing stopped on its own, if it did

    def run(self) -> None:
        try:
            self._slice()
        except Exception as exc:  # a freezer that refused a write: never leave a host frozen
            self.failure = f"{type(exc).__name__}: {exc}"
            self._thaw()

    def _thaw(self) -> None:
        for slot in self.slots:
            for group in slot:
                try:
                    group.freeze(False)
                except Exception:
                    pass

    def _slice(self) -> None:
        for slot in self.slots:
            for group in slot:
                group.freeze(True)
        cycle = SLICE / self.share
        start = time.monotonic()
        while True:
            for index, slot in enumerate(self.slots):
                for group in slot:
                    group.freeze(False)
                ends = start + (index + 1) * SLICE
                stopped = self._stopping.wait(max(0.0, ends - time.monotonic()))
                for group in slot:
                    group.freeze(True)
                if stopped:
                    return
            start += cycle  # absolute deadlines: no drift from the thread's own delays
            if self._stopping.wait(max(0.0, start - time.monotonic())):
                return

    def stop(self) -> None:
        """Stop slicing and let every host run (to end its processes)."""
        self._stopping.set()
        self.join()
        for slot in self.slots:
            for group in slot:
                group.freeze(False)


def _leftover_cgroups() -> list[HostCgroup]:
    found = []
    for hierarchy, kind in ((freezer_hierarchy(), "freezer"), (cpu_hierarchy(), "cpu")):
        if hierarchy is None:
            continue
        root, version = hierarchy
        found += [HostCgroup(path, version, kind) for path in root.glob(f"{PREFIX}*")
                  if path.is_dir() and not _owner_alive(path.name)]
    return found


def remove_leftovers() -> list[str]:
    """Delete the host cgroups, namespaces (and their processes, veths, qdiscs) and files
    of emulations whose process is gone; returns the cgroups and namespaces removed."""
    removed = []
    for group in _leftover_cgroups():  # first: it thaws what a killed run left frozen
        group.remove(grace=0)
        removed.append(str(group.path))
    for name in _namespaces():
        if name.startswith(PREFIX) and not _owner_alive(name):
            _kill_namespace_processes(name, grace=0)
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if not _owner_alive(folder.name + "-"):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


class EmulatedHosts:
    """H hosts with their own network on this machine, for as long as the `with` lasts.

        with EmulatedHosts(hosts=4, bandwidth="1gbit") as cluster:
            run = cluster.run(["python", "-m", "hybriddl", "train", ...])
            run.traffic   # one NicCounters per host: bytes its NIC sent/received

    Host i is named `h<i>` and has address 198.18.0.<i+1>. `rate` and `delay` are the
    emulated link's; `tc` applies them scaled by `dilation` (S x D).

    time_scale D: 1 (the default) runs in real time, each host pinned to its own
    `cores_per_host` cores where hosts x cores_per_host fits the machine, every host
    sharing every core otherwise (said in `notes`). None takes the least D at which the
    hosts fit (`least_time_scale`; 1 when they fit); a number forces D. With D > 1 each
    host gets cores_per_host / D cores of CPU time (TimeSlicer), links run at rate / D
    and latencies are x D: time on the emulated hosts is wall time / D.

    speedup S (None: not asked): each host stands for one S times faster than its cores
    here. The hosts run at once, never in turns: side by side where they fit (D = 1), else
    each held to C/D cores by a CPU quota (`QUOTA_PERIOD`), D the least at which they fit;
    links run at rate / (S x D), latencies are x (S x D), and emulated time is wall time /
    (S x D) (`dilation`). A time scale cannot be forced beside it.
    """

    def __init__(self, hosts: int, cores_per_host: int | None = None,
                 bandwidth: str | None = None, latency: str | None = None,
                 time_scale: float | None = 1.0, speedup: float | None = None,
                 compression_seconds: float | None = None):
        if hosts < 1 or hosts > 250:
            raise UsageError(f"--hosts {hosts}: give between 1 and 250 hosts")
        cores = sorted(os.sched_getaffinity(0))
        if cores_per_host is None:
            cores_per_host = default_cores_per_host(hosts)
        if cores_per_host < 1:
            raise UsageError(f"--cores-per-host {cores_per_host}: give at least 1")
        fits = least_time_scale(hosts, cores_per_host, len(cores))
        if speedup is not None:
            check_speedup(speedup)
            if time_scale not in (None, 1.0, fits):
                raise UsageError(f"--time-scale {time_scale:g} with --speedup: the hosts run "
                                 "at once, each held to its share of the cores; leave "
                                 "--time-scale out")
            time_scale = None
        if time_scale is not None and not 1 <= time_scale < math.inf:
            raise UsageError(f"--time-scale {time_scale:g}: give 1 or more (at least "
                             f"{fits:g} for {hosts} hosts x {cores_per_host} cores here)")
        self.time_scale = fits if time_scale is None else float(time_scale)
        self.speedup = speedup
        self.dilation = Dilation(1.0 if speedup is None else float(speedup), self.time_scale)
        # D > 1 without a speedup: the hosts take turns (TimeSlicer); with one they all run
        # at once under a CPU quota each.
        self.takes_turns = speedup is None and self.time_scale > 1
        self.quota_cores = (cores_per_host / self.time_scale
                            if speedup is not None and self.time_scale > 1 else None)
        self.bandwidth, self.latency = bandwidth, latency
        if compression_seconds is not None and not compression_seconds > 0:
            raise UsageError(f"--compression-seconds {compression_seconds:g}: give the "
                             "seconds a step of the scheme's compute takes on the hosts "
                             "emulated, more than 0 (e.g. 13ms)")
        # Every host's wire scheme computes that long a step, emulated (emulation/pace.py).
        self.compression_seconds = compression_seconds
        self.rate = bits_per_second(bandwidth) if bandwidth else None
        self.delay = seconds_of(latency) if latency else None
        self.names = [f"h{i}" for i in range(hosts)]
        self.addresses = [f"198.18.0.{i + 1}" for i in range(hosts)]
        self.cores_per_host = cores_per_host
        self.notes: list[str] = []
        self.slots = _slots(hosts, cores_per_host, len(cores))
        if self.time_scale >= fits:
            # Disjoint blocks of C cores for the hosts of a slot (all of the machine's for
            # a host as large or larger), so a host's ranks run C threads.
            width = min(cores_per_host, len(cores))
            self.cores = [[cores[(i % (len(cores) // width)) * width + j]
                           for j in range(width)] for i in range(hosts)]
        else:
            self.cores = [None] * hosts
            self.notes.append(f"{hosts} hosts x {cores_per_host} cores do not fit this "
                              f"machine's {len(cores)} cores at time scale "
                              f"{self.time_scale:g}: the hosts share every core (a time "
                              f"scale of {fits:g} would emulate them faithfully)")
        if 1 < self.time_scale < fits:
            raise UsageError(f"--time-scale {self.time_scale:g}: {hosts} hosts x "
                             f"{cores_per_host} cores take turns on this machine's "
                             f"{len(cores)} cores at {fits:g} or more: give at least {fits:g} "
                             "(or 1, to let them share every core unslowed)")
        if speedup is not None:
            factor = self.dilation.factor
            held = (f"; the hosts do not fit side by side, so all run at once, each held to "
                    f"{self.quota_cores:.3g} core(s) of CPU time by a quota over "
                    f"{QUOTA_PERIOD * 1e3:g} ms: time scale D = {self.time_scale:g}, "
                    f"dilation S x D = {factor:g}" if self.quota_cores is not None else "")
            self.notes.append(
                f"speedup {speedup:g}: each host stands for one {speedup:g}x faster than its "
                f"cores here{held}; links run at rate/{factor:g} and latencies "
                f"x{factor:g}; emulated seconds = wall seconds / {factor:g}")
            if self.quota_cores is not None and cores_per_host > 1:
                self.notes.append(
                    f"a quota of {self.quota_cores:.3g} core(s) lets one thread of a "
                    f"{cores_per_host}-core host run faster than 1/{self.time_scale:g} of "
                    "its speed: its serial phases are slowed less than its parallel ones "
                    "(hosts of 1 core are faithful)")
        elif self.time_scale > 1:
            self.notes.append(
                f"time scale {self.time_scale:g}: each host gets "
                f"{cores_per_host / self.time_scale:.3g} core(s) of CPU time (the hosts "
                "take turns on the cores, all of a host's threads at once), links run at "
                f"rate/{self.time_scale:g} and latencies x{self.time_scale:g}; emulated "
                f"seconds = wall seconds / {self.time_scale:g}")
        if cores_per_host > len(cores):
            self.notes.append(f"a host of {cores_per_host} cores runs {len(cores)} threads "
                              f"(this machine's cores) at the speed of {cores_per_host} "
                              f"emulated cores: compute is assumed to scale with cores")
        tag = f"{PREFIX}{os.getpid()}-{id(self) % 100000}"
        self.switch = f"{tag}-switch"
        self.namespaces = [f"{tag}-{name}" for name in self.names]
        self.cgroups: list[HostCgroup | None] = [None] * hosts
        self._owner = os.getpid()
        self._slicer: TimeSlicer | None = None
        self.folder: Path | None = None
        self._up = False

    @property
    def count(self) -> int:
        return len(self.names)

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "EmulatedHosts":
        check_available()
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        self._up = True
        self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        if self.quota_cores is not None:
            hierarchy = cpu_hierarchy()
            if hierarchy is None:
                raise EmulationUnavailable(
                    f"{self.count} hosts x {self.cores_per_host} cores at a speedup need a "
                    "CPU quota per host (cgroup v1's cpu hierarchy, or v2's cpu controller), "
                    "which this machine lacks: mount it, or emulate fewer hosts x cores")
            for index, namespace in enumerate(self.namespaces):
                self.cgroups[index] = HostCgroup.create(hierarchy, namespace, kind="cpu")
                self.cgroups[index].limit_cpu(self.quota_cores)
        elif self.takes_turns:
            hierarchy = freezer_hierarchy()
            if hierarchy is None:
                raise EmulationUnavailable(
                    f"time scale {self.time_scale:g} needs cgroups that can be frozen (v2, "
                    "or v1's freezer), which this machine lacks: mount them, or emulate "
                    "fewer hosts x cores")
            for index, namespace in enumerate(self.namespaces):
                self.cgroups[index] = HostCgroup.create(hierarchy, namespace)
            # A host runs on min(C, cores) cores for `share` of the time: C/D cores' worth.
            width = len(self.cores[0])
            share = self.cores_per_host / self.time_scale / width
            self._slicer = TimeSlicer([[self.cgroups[i] for i in slot] for slot in self.slots],
                                      share)
            self._slicer.start()
        done = _ip("netns", "add", self.switch, check=False)
        if done.returncode != 0:
            raise EmulationUnavailable(f"cannot create a network namespace "
                                       f"({done.stderr.strip()}): emulated hosts need them")
        _ip("-n", self.switch, "link", "add", "switch", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "switch", "up")
        for name, namespace, address in zip(self.names, self.namespaces, self.addresses):
            _ip("netns", "add", namespace)
            # Both ends are born inside their namespaces: the root namespace never sees them.
            _ip("-n", self.switch, "link", "add", name, "type", "veth", "peer", "name", NIC,
                "netns", namespace)
            _ip("-n", self.switch, "link", "set", name, "master", "switch", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", NIC)
            _ip("-n", namespace, "link", "set", NIC, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            if self._slicer is not None:
                self._socket_buffers(namespace)
            self._limit(namespace, NIC, delay=True)
            self._limit(self.switch, name, delay=False)
            (self.folder / name).mkdir()
        self._write_agent()

    def _socket_buffers(self, namespace: str) -> None:
        """Hosts that take turns: TCP buffers (per namespace) that start large enough to
        carry the link while an end is frozen (a turn or more at rate/D). Measured between
        two hosts taking turns at D = 2: at 10 Gbit/s the wire carried 0.9 Gbit/s with
        Linux's defaults, 2.6 with these; at 1 Gbit/s 469 and 489 Mbit/s of 500."""
        rate = (self.rate or 10e9) / self.time_scale
        frozen = SLICE * max(1.0, self.time_scale)  # the longest an end waits to run
        size = max(6 * 2**20, int(2 * rate / 8 * frozen))
        for key in ("tcp_rmem", "tcp_wmem"):  # /proc/sys/net is the writer's namespace's
            done = subprocess.run(["ip", "netns", "exec", namespace, "sh", "-c",
                                   f'echo "4096 {size} {size}" > /proc/sys/net/ipv4/{key}'],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise EmulationFailed(f"setting net.ipv4.{key} in {namespace} failed: "
                                      f"{done.stderr.strip()}")

    def _limit(self, namespace: str, device: str, delay: bool) -> None:
        """Egress of `device`: the link rate (both directions), latency once per direction,
        both in wall time (rate / (S x D), latency x (S x D))."""
        parent = ["root"]
        if delay and self.delay:
            _tc(namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                "delay", f"{self.dilation.link_delay(self.delay) * 1e6:.0f}us", "limit",
                "100000")
            parent = ["parent", "1:1"]
        if self.rate:
            rate = self.dilation.link_rate(self.rate)
            # A burst of 1 ms of wall time at the scaled rate, 1 ms / (S x D) of emulated
            # time: after an idle phase (compute) a host sends that much at once, as a
            # real NIC does not. At least two frames (tbf drops a packet longer than its
            # burst and cuts TCP's segmentation-offload packets into frames).
            burst = max(int(rate / 8 * 1e-3), MIN_BURST_BYTES)
            queue = max(int(self.rate / 8 * QUEUE_SECONDS), burst)  # bytes: see QUEUE_SECONDS
            _tc(namespace, "qdisc", "add", "dev", device, *parent, "handle", "10:", "tbf",
                "rate", f"{rate:.0f}bit", "burst", str(burst), "limit", str(queue))

    def close(self) -> None:
        """Stop every process still on the hosts, delete the namespaces (and with them
        the veths and qdiscs) and the hosts' files. Safe to call twice."""
        if not self._up:
            return
        # A second Ctrl-C (or a SIGTERM) must not leave the teardown half done.
        stoppers = stop_signals() if _main_thread() else ()
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in stoppers}
        try:
            if self._slicer is not None:  # a frozen process cannot end: let them all run
                self._slicer.stop()
                self._slicer = None
            for namespace in [*self.namespaces, self.switch]:
                if namespace in _namespaces():
                    _kill_namespace_processes(namespace, grace=5)
                    _ip("netns", "delete", namespace, check=False)
            failed = None  # one group that would not go: the others and the files still do
            for index, group in enumerate(self.cgroups):
                if group is not None:
                    try:
                        group.remove(grace=5)
                        self.cgroups[index] = None
                    except EmulationFailed as exc:
                        failed = failed or exc
            if self.folder:
                shutil.rmtree(self.folder, ignore_errors=True)
            self._up = False
            if failed is not None:
                raise failed  # named; the next emulate removes what is left (remove_leftovers)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    # ------------------------------------------------------------------ NICs
    def counters(self) -> list[NicCounters]:
        """Each host's NIC counters now (bytes since the host was made)."""
        result = []
        for name, namespace in zip(self.names, self.namespaces):
            stats = json.loads(_ip("-n", namespace, "-s", "-j", "link", "show", "dev",
                                   NIC).stdout)[0]["stats64"]
            result.append(NicCounters(name, stats["tx"]["bytes"], stats["rx"]["bytes"]))
        return result

    def set_link(self, index: int, up: bool) -> None:
        """Take host `index`'s NIC down, as a pulled cable or a dead switch port does, or
        bring it back up."""
        _ip("-n", self.namespaces[index], "link", "set", NIC, "up" if up else "down")

    # ------------------------------------------------------------------ commands
    def on_host(self, index: int, command: list[str]) -> list[str]:
        """argv that runs `command` on host `index` (its namespace, hostname, TMPDIR, cores,
        cgroup)."""
        folder = self.folder / self.names[index]
        pin = f"taskset -c {','.join(map(str, self.cores[index]))} " if self.cores[index] else ""
        setup = (f"hostname {self.names[index]} && export TMPDIR={shlex.quote(str(folder))} "
                 f'&& exec {pin}"$@"')
        argv = ["ip", "netns", "exec", self.namespaces[index], "unshare", "--uts", "sh", "-c",
                setup, "sh", *command]
        group = self.cgroups[index]
        if group is None:
            return argv
        # `ip netns exec` mounts a sysfs of the host's own that hides /sys/fs/cgroup, and
        # mpirun calls the agent from inside host 0: the cgroup is reached through our own
        # mount namespace. Joined before the exec, so all the host starts inherits it.
        procs = f"/proc/{self._owner}/root{group.procs}"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def mpirun(self, command: list[str], ranks_per_host: int = 1,
               mca: dict[str, str] | None = None, mpirun: str | None = None,
               logged: bool = False) -> list[str]:
        """argv that runs `command` under mpirun with `ranks_per_host` ranks on every host
        (started from host 0; `mca` adds or overrides Open MPI parameters; `logged`: its
        output will go to a log file, whatever this process's is)."""
        if ranks_per_host < 1:
            raise UsageError(f"--ranks-per-host {ranks_per_host}: give at least 1")
        return self.mpirun_options(ranks_per_host, mca, mpirun, logged) + [
            "-np", str(ranks_per_host * self.count), *command]

    def mpirun_options(self, ranks_per_host: int = 1, mca: dict[str, str] | None = None,
                       mpirun: str | None = None, logged: bool = False) -> list[str]:
        """mpirun and its options for these hosts, without -np: append `-np N COMMAND`
        (or several `: -np N COMMAND` apps). Each host has `ranks_per_host` slots, filled
        in order (also across apps): rank r runs on host r // ranks_per_host."""
        hostfile = self.folder / "hostfile"
        hostfile.write_text("".join(f"{a} slots={ranks_per_host}\n" for a in self.addresses))
        launcher = mpirun or str(Path(sys.executable).parent / "mpirun")
        if not Path(launcher).exists():
            launcher = shutil.which("mpirun") or launcher
        turns = TURNS_EAGER if self.takes_turns else {}
        parameters = {**MPI_TRANSPORT, **turns, "plm_rsh_agent": str(self.folder / "agent"),
                      **(mca or {})}
        map_by = "slot"
        if self.cores[0] is None or ranks_per_host > len(self.cores[0]):
            map_by += ":oversubscribe"
        argv = [launcher, "--hostfile", str(hostfile), "--map-by", map_by, "--bind-to", "none"]
        if self.dilation.factor > 1:
            # The ranks' own deadlines (heartbeat silence, --host-timeout) and the link rate
            # they measure are in emulated time too: a host's 15 s of silence is 15 x S x D
            # s of wall time here.
            argv += ["-x", f"{TIME_SCALE_VARIABLE}={self.dilation.factor:g}"]
        if self.compression_seconds is not None:
            argv += ["-x", f"{COMPRESSION_SECONDS_VARIABLE}={self.compression_seconds!r}"]
        if os.environ.get(FAILPOINTS_VARIABLE):  # the faults a test injects, on every host
            argv += ["-x", FAILPOINTS_VARIABLE]
        argv += rank_output_flags(logged=logged)
        for key, value in parameters.items():
            argv += ["--mca", key, str(value)]
        return self.on_host(0, argv)

    def _write_agent(self) -> None:
        """The rsh agent mpirun uses to start its daemon on host i: no ssh, just `on_host`
        (which first puts the agent's process, and so the daemon and its ranks, in the
        host's cgroup, which the time slicer freezes and thaws)."""
        table = {address: self.on_host(i, []) for i, address in enumerate(self.addresses)}
        agent = self.folder / "agent"
        agent.write_text(
            f"#!{sys.executable}\n"
            "# mpirun calls: agent [ssh options] HOST COMMAND... (a shell command line)\n"
            "import os, sys\n"
            f"HOSTS = {table!r}\n"
            "args = [a for a in sys.argv[1:] if not a.startswith('-')] or ['']\n"
            "start = sys.argv.index(args[0])\n"
            "host, command = sys.argv[start], ' '.join(sys.argv[start + 1:])\n"
            "if host not in HOSTS:\n"
            "    sys.exit(f'emulated hosts: no host {host!r}')\n"
            # As ssh does, a host whose link is down (set_link) does not answer.
            + _AGENT_LINK_CHECK.format(nics=dict(zip(self.addresses, self.namespaces)), nic=NIC) +
            "argv = HOSTS[host] + ['sh', '-c', command]\n"
            "os.execvp(argv[0], argv)\n")
        agent.chmod(0o755)

    def popen(self, command: list[str], ranks_per_host: int = 1,
              mca: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `command` under mpirun across the hosts (see `mpirun`); kwargs go to Popen."""
        return subprocess.Popen(self.mpirun(command, ranks_per_host, mca), **kwargs)

    def run(self, command: list[str], ranks_per_host: int = 1,
            mca: dict[str, str] | None = None, timeout: float | None = None,
            **kwargs) -> EmulatedRun:
        """Run `command` under mpirun across the hosts to its end; returns its exit code,
        wall time and each NIC's bytes during the run. kwargs go to Popen (e.g.
        capture_output via stdout/stderr=PIPE, text=True, env)."""
        before = self.counters()
        started = time.monotonic()
        process = self.popen(command, ranks_per_host, mca, **kwargs)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:
            stop(process)
            raise
        seconds = time.monotonic() - started
        if self._slicer is not None and self._slicer.failure:
            raise EmulationFailed(f"the hosts' turns on the cores stopped during the run "
                                  f"({self._slicer.failure}): they ran side by side from then "
                                  "on, so its times are not the emulated hosts'; run it again")
        traffic = [after - early for after, early in zip(self.counters(), before)]
        return EmulatedRun(process.returncode, seconds, traffic, stdout, stderr,
                           self.time_scale, self.dilation.speedup)


# Part of the rsh agent (see EmulatedHosts._write_agent): ssh's exit code and message
# for a host that cannot be reached, when the host's NIC is down.
_AGENT_LINK_CHECK = (
    "import subprocess\n"
    "link = subprocess.run(['ip', '-n', {nics!r}[host], '-o', 'link', 'show', {nic!r}],\n"
    "                      capture_output=True, text=True).stdout\n"
    "if 'UP' not in link.partition('<')[2].partition('>')[0].split(','):\n"
    "    sys.stderr.write(f'ssh: connect to host {{host}} port 22: No route to host\\n')\n"
    "    sys.exit(255)\n")


def stop(process: subprocess.Popen, grace: float = 10) -> None:
    """End an mpirun we started: SIGTERM first (mpirun then ends its ranks), then SIGKILL.
    What it printed is read for at most `grace` more seconds: a rank that outlives a killed
    mpirun holds its pipes open (the hosts' teardown ends it)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
    try:
        process.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        process.wait()  # killed: reaped at once
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()

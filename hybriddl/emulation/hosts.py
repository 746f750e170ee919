"""H emulated hosts on this machine: one network namespace each, joined by a switch.

Each host is a network namespace with one NIC (`eth0`, one end of a veth pair whose
other end sits on a bridge in a switch namespace), an address in the benchmarking range
198.18.0.0/15, its own hostname (a UTS namespace per launch) and its own TMPDIR, and,
its own cores (taskset). Open MPI then sees H machines: ranks of one host talk through
shared memory, ranks of different hosts through TCP over their NICs, so each NIC's
counters are exactly what that host put on the network. `tc` on both ends of each veth
gives every link a rate (full duplex) and a one-way latency.

Time scale. H hosts of C cores that do not fit this machine's cores are emulated with
time slowed down by D = H x C / cores (DESIGN.md, "Time scale"): each host's processes
share a cgroup whose CPU quota is C/D cores, each thread of theirs sits in a child cgroup
of 1/D core, links run at rate/D, latencies are x D, and emulated time is wall time / D. A host still sees C cores (or all of the machine's, if
fewer) so its ranks run C threads, each at 1/D of a core's speed.

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

PREFIX = "hybriddl-emu-"
SUBNET = "198.18.0.0/24"
NIC = "eth0"
# Open MPI must use only the emulated NICs between hosts, and its shared memory within one.
MPI_TRANSPORT = {"btl": "tcp,self,sm", "btl_tcp_if_include": SUBNET,
                 "oob_tcp_if_include": SUBNET}
RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)$", re.IGNORECASE)
DELAY = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
# The kernel's CFS period of 100 ms: a 2-thread training step measured 2.00 x (D = 2) and
# 4.90 x (D = 4) its D = 1 step with it, 2.65 x and 4.80 x with 20 ms (the threads meet
# at barriers and each is throttled on its own clock). Quotas below 1 ms are refused,
# so tiny shares lengthen the period.
PERIOD_US, LEAST_QUOTA_US, LONGEST_PERIOD_US = 100_000, 1_000, 1_000_000
# How soon a new thread gets its own 1/D core; until then it shares its creator's.
CONFINE_INTERVAL = 0.05


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

    @property
    def emulated_seconds(self) -> float:
        """What the run took on the emulated hosts: wall time / D."""
        return self.seconds / self.time_scale


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


# ---------------------------------------------------------------------- CPU quotas
# Set in every rank of hosts emulated with D > 1 (read by hybriddl.hosts.mpi).
TIME_SCALE_VARIABLE = "HYBRIDDL_TIME_SCALE"


def least_time_scale(hosts: int, cores_per_host: int, machine_cores: int) -> float:
    """The smallest D at which `hosts` hosts of `cores_per_host` cores fit `machine_cores`.

    H x C / cores, at least 1. A host smaller than the machine is pinned to C cores taken
    in turn (host i: cores i*C.. mod the machine's), so some core carries ceil(H x C /
    cores) hosts: D is rounded up to that, or that core would give its hosts less than
    their 1/D each (3 hosts of 1 core on 2 cores: D = 2, not 1.5)."""
    if cores_per_host >= machine_cores:
        return max(1.0, hosts * cores_per_host / machine_cores)
    return float(max(1, math.ceil(hosts * cores_per_host / machine_cores)))


def cpu_hierarchy() -> tuple[Path, int] | None:
    """Where cgroups with the cpu controller are made, and the cgroup version: v2 where
    its cpu controller is available, else v1's cpu hierarchy; None without either."""
    mounts = psutil.disk_partitions(all=True)
    for mount in mounts:
        if mount.fstype == "cgroup2":
            controllers = Path(mount.mountpoint, "cgroup.controllers")
            try:
                if "cpu" in controllers.read_text().split():
                    return Path(mount.mountpoint), 2
            except OSError:
                pass
    for mount in mounts:
        if mount.fstype == "cgroup" and "cpu" in mount.opts.split(","):
            return Path(mount.mountpoint), 1
    return None


def _write_quota(folder: Path, version: int, cores: float) -> None:
    period = PERIOD_US
    if cores * period < LEAST_QUOTA_US:
        period = min(LONGEST_PERIOD_US, math.ceil(LEAST_QUOTA_US / cores))
    quota = max(LEAST_QUOTA_US, round(cores * period))
    if version == 2:
        (folder / "cpu.max").write_text(f"{quota} {period}")
    else:
        (folder / "cpu.cfs_period_us").write_text(str(period))
        (folder / "cpu.cfs_quota_us").write_text(str(quota))


@dataclass(frozen=True)
class CpuQuota:
    """One emulated host's cgroup: its processes together get at most `cores` cores, and
    each of their threads at most `thread_cores` (1/D: one emulated core).

    The limit per thread is what makes a host's serial phases slow too: with only the
    host's C/D cores, one thread of a host of 2 cores at D = 2 ran at full speed (the
    Python between torch's parallel regions, measured: not slowed at all). `confine_threads`
    gives every thread a child cgroup of its own (v1: any thread may sit in its own; v2:
    a threaded subtree); it is called every CONFINE_INTERVAL seconds while the hosts live.
    """

    path: Path
    version: int
    thread_cores: float | None = None

    @classmethod
    def create(cls, hierarchy: tuple[Path, int], name: str, cores: float,
               thread_cores: float) -> "CpuQuota":
        root, version = hierarchy
        try:
            if version == 2:
                # Children get the cpu controller only if their parent hands it down.
                (root / "cgroup.subtree_control").write_text("+cpu")
            (root / name).mkdir()
            made = cls(root / name, version, thread_cores)
            _write_quota(made.path, version, cores)
        except OSError as exc:
            raise EmulationFailed(f"cannot make the CPU quota cgroup {root / name} "
                                  f"({exc.strerror})") from None
        return made

    @property
    def procs(self) -> Path:
        """Write a PID here to put that process (and what it starts) under the quota."""
        return self.path / "cgroup.procs"

    @property
    def _threads_file(self) -> str:
        return "cgroup.threads" if self.version == 2 else "tasks"

    def _groups(self) -> list[Path]:
        return [self.path, *(p for p in self.path.iterdir() if p.is_dir())]

    def cores(self) -> float:
        """The quota as the kernel holds it, in cores."""
        if self.version == 2:
            quota, period = (self.path / "cpu.max").read_text().split()
        else:
            quota = (self.path / "cpu.cfs_quota_us").read_text()
            period = (self.path / "cpu.cfs_period_us").read_text()
        return int(quota) / int(period)

    def confine_threads(self) -> None:
        """Move every thread not yet alone in a child cgroup (new threads and processes
        start in their creator's) into one of its own; delete the children of ended
        threads."""
        for group in self._groups():
            try:
                threads = (group / self._threads_file).read_text().split()
            except OSError:
                continue  # deleted meanwhile
            for tid in threads:
                if group == self.path or group.name != f"t{tid}":
                    self._confine(tid)
            if group != self.path and not threads:
                try:
                    group.rmdir()
                except OSError:
                    pass  # a thread came in meanwhile

    def _confine(self, tid: str) -> None:
        child = self.path / f"t{tid}"
        try:
            if not child.is_dir():
                child.mkdir()
                if self.version == 2:
                    (child / "cgroup.type").write_text("threaded")
                    (self.path / "cgroup.subtree_control").write_text("+cpu")
                _write_quota(child, self.version, self.thread_cores)
            (child / self._threads_file).write_text(tid)
        except OSError:
            pass  # the thread ended meanwhile; its child goes at the next pass

    def remove(self, grace: float) -> None:
        """End the processes still in it, then delete it. Safe to call twice."""
        for attempt in range(50):
            try:
                pids = {int(p) for group in self._groups()
                        for p in (group / "cgroup.procs").read_text().split()}
                _end_processes(sorted(pids), grace)
                for group in reversed(self._groups()):
                    group.rmdir()
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


def _leftover_quotas() -> list[CpuQuota]:
    hierarchy = cpu_hierarchy()
    if hierarchy is None:
        return []
    root, version = hierarchy
    return [CpuQuota(path, version) for path in root.glob(f"{PREFIX}*")
            if path.is_dir() and not _owner_alive(path.name)]


def remove_leftovers() -> list[str]:
    """Delete the namespaces (and their processes, veths, qdiscs), CPU quota cgroups and
    files of emulations whose process is gone; returns the namespaces and cgroups removed."""
    removed = []
    for name in _namespaces():
        if name.startswith(PREFIX) and not _owner_alive(name):
            _kill_namespace_processes(name, grace=0)
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for quota in _leftover_quotas():
        quota.remove(grace=0)
        removed.append(str(quota.path))
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
    emulated link's; `tc` applies them scaled by `time_scale`.

    time_scale D: 1 (the default) runs in real time, each host pinned to its own
    `cores_per_host` cores where hosts x cores_per_host fits the machine, every host
    sharing every core otherwise (said in `notes`). None takes the least D at which the
    hosts fit (`least_time_scale`; 1 when they fit); a number forces D. With D > 1 each
    host gets a CPU quota of cores_per_host / D cores (a cgroup), links run at rate / D
    and latencies are x D: time on the emulated hosts is wall time / D.
    """

    def __init__(self, hosts: int, cores_per_host: int | None = None,
                 bandwidth: str | None = None, latency: str | None = None,
                 time_scale: float | None = 1.0):
        if hosts < 1 or hosts > 250:
            raise UsageError(f"--hosts {hosts}: give between 1 and 250 hosts")
        cores = sorted(os.sched_getaffinity(0))
        if cores_per_host is None:
            cores_per_host = max(1, len(cores) // hosts)
        if cores_per_host < 1:
            raise UsageError(f"--cores-per-host {cores_per_host}: give at least 1")
        fits = least_time_scale(hosts, cores_per_host, len(cores))
        if time_scale is not None and not time_scale >= 1:
            raise UsageError(f"--time-scale {time_scale:g}: give 1 or more (at least "
                             f"{fits:g} for {hosts} hosts x {cores_per_host} cores here)")
        self.time_scale = fits if time_scale is None else float(time_scale)
        self.bandwidth, self.latency = bandwidth, latency
        self.rate = bits_per_second(bandwidth) if bandwidth else None
        self.delay = seconds_of(latency) if latency else None
        self.names = [f"h{i}" for i in range(hosts)]
        self.addresses = [f"198.18.0.{i + 1}" for i in range(hosts)]
        self.cores_per_host = cores_per_host
        self.notes: list[str] = []
        if self.time_scale >= fits:
            # In turn from host 0: disjoint blocks when the hosts fit, and otherwise C cores
            # each (all of the machine's if fewer), so a host's ranks run C threads.
            self.cores = [[cores[(i * cores_per_host + j) % len(cores)]
                           for j in range(min(cores_per_host, len(cores)))]
                          for i in range(hosts)]
        else:
            self.cores = [None] * hosts
            self.notes.append(f"{hosts} hosts x {cores_per_host} cores do not fit this "
                              f"machine's {len(cores)} cores at time scale "
                              f"{self.time_scale:g}: the hosts share every core (a time "
                              f"scale of {fits:g} would emulate them faithfully)")
        if self.time_scale > 1:
            self.notes.append(
                f"time scale {self.time_scale:g}: each host gets "
                f"{cores_per_host / self.time_scale:.3g} core(s) of CPU time, links run at "
                f"rate/{self.time_scale:g} and latencies x{self.time_scale:g}; emulated "
                f"seconds = wall seconds / {self.time_scale:g}")
        if cores_per_host > len(cores):
            self.notes.append(f"a host of {cores_per_host} cores runs {len(cores)} threads "
                              f"(this machine's cores) at the speed of {cores_per_host} "
                              f"emulated cores: compute is assumed to scale with cores")
        tag = f"{PREFIX}{os.getpid()}-{id(self) % 100000}"
        self.switch = f"{tag}-switch"
        self.namespaces = [f"{tag}-{name}" for name in self.names]
        self.quotas: list[CpuQuota | None] = [None] * hosts
        self._owner = os.getpid()
        self._confiner: threading.Thread | None = None
        self._stop_confining = threading.Event()
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
        if self.time_scale > 1:
            hierarchy = cpu_hierarchy()
            if hierarchy is None:
                raise EmulationUnavailable(
                    f"time scale {self.time_scale:g} needs the cgroup cpu controller "
                    "(v2, or v1 mounted with 'cpu'), which this machine lacks: mount it, or "
                    "emulate fewer hosts x cores")
            for index, namespace in enumerate(self.namespaces):
                self.quotas[index] = CpuQuota.create(
                    hierarchy, namespace, self.cores_per_host / self.time_scale,
                    1 / self.time_scale)
            self._confiner = threading.Thread(target=self._confine_threads, daemon=True,
                                              name="emulation-thread-quotas")
            self._confiner.start()
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
            self._limit(namespace, NIC, delay=True)
            self._limit(self.switch, name, delay=False)
            (self.folder / name).mkdir()
        self._write_agent()

    def _limit(self, namespace: str, device: str, delay: bool) -> None:
        """Egress of `device`: the link rate (both directions), latency once per direction,
        both in wall time (rate / D, latency x D)."""
        parent = ["root"]
        if delay and self.delay:
            _tc(namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                "delay", f"{self.delay * self.time_scale * 1e6:.0f}us", "limit", "100000")
            parent = ["parent", "1:1"]
        if self.rate:
            rate = self.rate / self.time_scale
            # A burst of 1 ms at the link rate (at least a jumbo frame): short enough that
            # a transfer's time is its bytes over the rate.
            burst = max(int(rate / 8 * 1e-3), 65536)
            # tbf's queue holds 100 ms of wall time at the scaled rate, as at D = 1.
            _tc(namespace, "qdisc", "add", "dev", device, *parent, "handle", "10:", "tbf",
                "rate", f"{rate:.0f}bit", "burst", str(burst), "latency", "100ms")

    def close(self) -> None:
        """Stop every process still on the hosts, delete the namespaces (and with them
        the veths and qdiscs) and the hosts' files. Safe to call twice."""
        if not self._up:
            return
        # A second Ctrl-C (or a SIGTERM) must not leave the teardown half done.
        stoppers = (signal.SIGINT, signal.SIGTERM) if _main_thread() else ()
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in stoppers}
        try:
            for namespace in [*self.namespaces, self.switch]:
                if namespace in _namespaces():
                    _kill_namespace_processes(namespace, grace=5)
                    _ip("netns", "delete", namespace, check=False)
            self._stop_confining.set()
            if self._confiner is not None:
                self._confiner.join()
                self._confiner = None
            for index, quota in enumerate(self.quotas):
                if quota is not None:
                    quota.remove(grace=5)
                    self.quotas[index] = None
            if self.folder:
                shutil.rmtree(self.folder, ignore_errors=True)
            self._up = False
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _confine_threads(self) -> None:
        while not self._stop_confining.wait(CONFINE_INTERVAL):
            for quota in self.quotas:
                if quota is not None:
                    quota.confine_threads()

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
        CPU quota)."""
        folder = self.folder / self.names[index]
        pin = f"taskset -c {','.join(map(str, self.cores[index]))} " if self.cores[index] else ""
        setup = (f"hostname {self.names[index]} && export TMPDIR={shlex.quote(str(folder))} "
                 f'&& exec {pin}"$@"')
        argv = ["ip", "netns", "exec", self.namespaces[index], "unshare", "--uts", "sh", "-c",
                setup, "sh", *command]
        quota = self.quotas[index]
        if quota is None:
            return argv
        # `ip netns exec` mounts a sysfs of the host's own that hides /sys/fs/cgroup, and
        # mpirun calls the agent from inside host 0: the cgroup is reached through our own
        # mount namespace. Joined before the exec, so all the host starts inherits it.
        procs = f"/proc/{self._owner}/root{quota.procs}"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def mpirun(self, command: list[str], ranks_per_host: int = 1,
               mca: dict[str, str] | None = None, mpirun: str | None = None) -> list[str]:
        """argv that runs `command` under mpirun with `ranks_per_host` ranks on every host
        (started from host 0; `mca` adds or overrides Open MPI parameters)."""
        if ranks_per_host < 1:
            raise UsageError(f"--ranks-per-host {ranks_per_host}: give at least 1")
        return self.mpirun_options(ranks_per_host, mca, mpirun) + [
            "-np", str(ranks_per_host * self.count), *command]

    def mpirun_options(self, ranks_per_host: int = 1, mca: dict[str, str] | None = None,
                       mpirun: str | None = None) -> list[str]:
        """mpirun and its options for these hosts, without -np: append `-np N COMMAND`
        (or several `: -np N COMMAND` apps). Each host has `ranks_per_host` slots, filled
        in order (also across apps): rank r runs on host r // ranks_per_host."""
        hostfile = self.folder / "hostfile"
        hostfile.write_text("".join(f"{a} slots={ranks_per_host}\n" for a in self.addresses))
        launcher = mpirun or str(Path(sys.executable).parent / "mpirun")
        if not Path(launcher).exists():
            launcher = shutil.which("mpirun") or launcher
        parameters = {**MPI_TRANSPORT, "plm_rsh_agent": str(self.folder / "agent"),
                      **(mca or {})}
        map_by = "slot"
        if self.cores[0] is None or ranks_per_host > len(self.cores[0]):
            map_by += ":oversubscribe"
        argv = [launcher, "--hostfile", str(hostfile), "--map-by", map_by, "--bind-to", "none"]
        if self.time_scale > 1:
            # The ranks' own deadlines (heartbeat silence, --host-timeout) are in emulated
            # time too: a host's 15 s of silence is 15 x D s of wall time here.
            argv += ["-x", f"{TIME_SCALE_VARIABLE}={self.time_scale:g}"]
        for key, value in parameters.items():
            argv += ["--mca", key, str(value)]
        return self.on_host(0, argv)

    def _write_agent(self) -> None:
        """The rsh agent mpirun uses to start its daemon on host i: no ssh, just `on_host`
        (which first puts the agent's process, and so the daemon and its ranks, in the
        host's CPU quota)."""
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
        traffic = [after - early for after, early in zip(self.counters(), before)]
        return EmulatedRun(process.returncode, seconds, traffic, stdout, stderr,
                           self.time_scale)


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
    """End an mpirun we started: SIGTERM first (mpirun then ends its ranks), then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
    process.communicate()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()

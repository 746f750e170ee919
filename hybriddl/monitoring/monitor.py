"""pidstat- and sar-style monitors: what a rank's training costs in CPU, RAM and network.

The paper's evidence (Lerat et al. 2022) comes from `pidstat` (the training process) and
`sar` (the host). Each rank runs one sampler thread that writes, every interval, one row
to `rank<R>-pidstat.csv` (this process and its children: local workers are processes
for some strategies) and one row per network interface to `rank<R>-sar.csv` (the whole
host). Fixed columns with their unit in the name, so `column -t -s, FILE` and pandas read
them as they are. Rows are flushed as they come: a killed run keeps what was sampled.

Percentages follow the tools they imitate: pidstat's CPU % is of one core (a process
with two busy threads shows 200), sar's is of the whole host (100 = every core busy).
"""

from __future__ import annotations

import csv
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MIB = 1024 * 1024

PIDSTAT_COLUMNS = ("timestamp_unix_s", "elapsed_s", "interval_s", "pid", "processes",
                   "cpu_user_pct", "cpu_system_pct", "cpu_total_pct", "rss_mib", "memory_pct",
                   "threads")
SAR_COLUMNS = ("timestamp_unix_s", "elapsed_s", "interval_s", "cpu_user_pct", "cpu_system_pct",
               "cpu_iowait_pct", "cpu_idle_pct", "memory_used_pct", "interface",
               "rx_bytes_per_s", "tx_bytes_per_s", "rx_packets_per_s", "tx_packets_per_s")


def pidstat_file(rank: int) -> str:
    return f"rank{rank}-pidstat.csv"


def sar_file(rank: int) -> str:
    return f"rank{rank}-sar.csv"


@dataclass
class _Peaks:
    """Running aggregates, so a long run keeps constant memory."""

    samples: int = 0
    process_cpu_seconds: float = 0.0
    process_cpu_peak_pct: float = 0.0
    rss_peak_bytes: int = 0
    threads_peak: int = 0
    processes_peak: int = 0
    host_busy_peak_pct: float = 0.0
    host_memory_peak_pct: float = 0.0
    network: dict = field(default_factory=dict)  # interface -> [rx_b, tx_b, rx_p, tx_p]


class Monitor:
    """Samples one rank's process tree and its host every `interval` seconds.

    Use as a context manager (or start()/stop()); `stop()` returns the summary recorded
    in metrics.json under "monitor": process CPU % (average, peak), peak RSS, threads and
    processes; host CPU % and memory; rx/tx bytes and packets per network interface. An
    interval of 0 disables monitoring: no thread, no file, summary None. `pid` is the root
    of the monitored process tree (default: this process).
    """

    def __init__(self, run_dir: Path | str, rank: int = 0, interval: float = 1.0,
                 pid: int | None = None):
        if not interval >= 0 or math.isinf(interval):
            raise ValueError(f"monitor interval {interval}: give seconds >= 0 (0 disables)")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.interval = float(interval)
        self.pidstat_path = self.run_dir / pidstat_file(rank)
        self.sar_path = self.run_dir / sar_file(rank)
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._summary: dict | None = None
        self._error: str | None = None
        self._files = []
        self._sampling_seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def start(self) -> Monitor:
        if not self.enabled or self._thread is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        # Appending lets a resumed run continue its files; the header is written once.
        try:
            self._pidstat = self._open(self.pidstat_path, PIDSTAT_COLUMNS)
            self._sar = self._open(self.sar_path, SAR_COLUMNS)
        except BaseException:  # one could not be opened: none is left open (stop() skips)
            for handle in self._files:
                handle.close()
            self._files = []
            raise
        self._peaks = _Peaks()
        self._started_unix = time.time()
        self._started = self._last = time.perf_counter()
        self._last_proc = self._process_times()
        self._last_host = psutil.cpu_times()
        self._last_net = psutil.net_io_counters(pernic=True)
        self._host_first = self._last_host
        self._thread = threading.Thread(target=self._run, name=f"hybriddl-monitor-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict | None:
        """Stop sampling (idempotent), take a last sample of the tail, close the files."""
        if self._thread is None:
            return self._summary
        self._stop.set()
        self._thread.join()  # before the last sample: the two must never write at once
        try:
            # A tail too short to sample is dropped, unless it is the whole run: a run
            # shorter than a tenth of an interval still reports its totals.
            if time.perf_counter() - self._last >= self.interval / 10 or not self._peaks.samples:
                self._sample_safely()
        finally:
            files, self._files, self._thread = self._files, [], None
            for handle in files:
                try:
                    handle.close()
                except OSError as exc:  # its last rows not written (a full disk): noted, as
                    # a failed sample is; the run's own error, if any, is the one to show
                    self._error = self._error or f"{type(exc).__name__}: {exc}"
            self._summary = self._summarise()
        return self._summary

    def summary(self) -> dict | None:
        return self._summary

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sampling ---------------------------------------------------------------

    def _open(self, path: Path, columns: tuple[str, ...]):
        if path.exists() and path.stat().st_size:
            _drop_cut_row(path)
        new = not path.exists() or path.stat().st_size == 0
        handle = open(path, "a", newline="")
        self._files.append(handle)
        writer = csv.writer(handle)
        if new:
            writer.writerow(columns)
            handle.flush()
        return handle, writer

    def _run(self) -> None:
        next_at = self._started + self.interval
        while not self._stop.wait(max(0.0, next_at - time.perf_counter())):
            if not self._sample_safely():
                return
            next_at += self.interval
            behind = time.perf_counter() - next_at
            if behind > 0:
                # A starved thread skips the ticks it missed instead of sampling in a burst.
                next_at += self.interval * math.ceil(behind / self.interval)

    def _sample_safely(self) -> bool:
        try:
            cpu_started = time.thread_time()
            self._sample()
            self._sampling_seconds += time.thread_time() - cpu_started
            return True
        except Exception as exc:  # noqa: BLE001 - a failed monitor (full disk, ...) must never
            # stop training; the summary says why the samples end early.
            self._error = f"{type(exc).__name__}: {exc}"
            return False

    def _process_times(self) -> dict[int, tuple]:
        """pid -> (Process, user s, system s, rss bytes, threads) for the tree."""
        tree = {}
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            processes = [self._root]
        for process in processes:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    tree[process.pid] = (process, times.user, times.system,
                                         process.memory_info().rss, process.num_threads())
            except psutil.Error:
                continue  # a worker that ended between listing and reading
        return tree

    def _sample(self) -> None:
        now = time.perf_counter()
        stamp = time.time()
        dt = max(now - self._last, 1e-9)
        elapsed = now - self._started
        peaks = self._peaks

        tree = self._process_times()
        user = system = 0.0
        for pid, (process, u, s, _, _) in tree.items():
            before = self._last_proc.get(pid)
            if before is not None and before[0] == process:
                user += u - before[1]
                system += s - before[2]
            else:
                user += u  # started since the last sample: all its CPU is in this interval
                system += s
        rss = sum(entry[3] for entry in tree.values())
        threads = sum(entry[4] for entry in tree.values())
        memory = psutil.virtual_memory()
        cpu_total_pct = 100 * (user + system) / dt
        (_, pidstat), (_, sar) = self._pidstat, self._sar
        pidstat.writerow((f"{stamp:.3f}", f"{elapsed:.3f}", f"{dt:.6f}", self._root.pid, len(tree),
                          f"{100 * user / dt:.1f}", f"{100 * system / dt:.1f}",
                          f"{cpu_total_pct:.1f}", f"{rss / MIB:.2f}",
                          f"{100 * rss / memory.total:.2f}", threads))
        self._pidstat[0].flush()

        host = psutil.cpu_times()
        user_pct, system_pct, iowait_pct, idle_pct = _host_cpu_pct(self._last_host, host)
        net = psutil.net_io_counters(pernic=True)
        for name, counters in net.items():
            before = self._last_net.get(name)
            if before is None:
                continue  # appeared during the run: its rates start next interval
            delta = (counters.bytes_recv - before.bytes_recv, counters.bytes_sent - before.bytes_sent,
                     counters.packets_recv - before.packets_recv,
                     counters.packets_sent - before.packets_sent)
            totals = peaks.network.setdefault(name, [0, 0, 0, 0])
            for i, value in enumerate(delta):
                totals[i] += value
            sar.writerow((f"{stamp:.3f}", f"{elapsed:.3f}", f"{dt:.6f}", f"{user_pct:.1f}",
                          f"{system_pct:.1f}", f"{iowait_pct:.1f}", f"{idle_pct:.1f}",
                          f"{memory.percent:.1f}", name, *(f"{v / dt:.1f}" for v in delta)))
        self._sar[0].flush()

        peaks.samples += 1
        peaks.process_cpu_seconds += user + system
        # The kernel counts CPU in 10 ms ticks: one tick in stop()'s short last interval
        # would read as a spike, so only full-length intervals set the CPU peaks.
        full_interval = dt >= self.interval / 2
        if full_interval:
            peaks.process_cpu_peak_pct = max(peaks.process_cpu_peak_pct, cpu_total_pct)
            peaks.host_busy_peak_pct = max(peaks.host_busy_peak_pct, 100 - idle_pct - iowait_pct)
        peaks.rss_peak_bytes = max(peaks.rss_peak_bytes, rss)
        peaks.threads_peak = max(peaks.threads_peak, threads)
        peaks.processes_peak = max(peaks.processes_peak, len(tree))
        peaks.host_memory_peak_pct = max(peaks.host_memory_peak_pct, memory.percent)
        self._last, self._last_proc, self._last_host, self._last_net = now, tree, host, net

    def _summarise(self) -> dict:
        peaks = self._peaks
        duration = self._last - self._started
        _, _, iowait_pct, idle_pct = _host_cpu_pct(self._host_first, self._last_host)
        summary = {
            "rank": self.rank,
            "interval_s": self.interval,
            "started_at": self._started_unix,
            "duration_s": duration,
            "samples": peaks.samples,
            "host_cpus": psutil.cpu_count(),
            "files": {"pidstat": self.pidstat_path.name, "sar": self.sar_path.name},
            "process": {
                "cpu_avg_pct": 100 * peaks.process_cpu_seconds / duration if duration > 0 else 0.0,
                "cpu_peak_pct": peaks.process_cpu_peak_pct,
                "rss_peak_bytes": peaks.rss_peak_bytes,
                "threads_peak": peaks.threads_peak,
                "processes_peak": peaks.processes_peak,
            },
            "host": {
                "cpu_avg_pct": 100 - idle_pct - iowait_pct if peaks.samples else 0.0,
                "cpu_peak_pct": peaks.host_busy_peak_pct,
                "memory_used_peak_pct": peaks.host_memory_peak_pct,
            },
            "network": {name: dict(zip(("rx_bytes", "tx_bytes", "rx_packets", "tx_packets"), totals))
                        for name, totals in sorted(peaks.network.items())},
            # The sampler's own CPU time: the direct cost of monitoring, beside the benchmark.
            "sampling_cpu_seconds": self._sampling_seconds,
        }
        if self._error:
            summary["error"] = self._error
        return summary


def _host_cpu_pct(before, after) -> tuple[float, float, float, float]:
    """sar's %user (with nice), %system (with irq/softirq), %iowait, %idle between two readings."""
    def delta(name: str) -> float:
        return max(getattr(after, name, 0.0) - getattr(before, name, 0.0), 0.0)

    # guest time is already counted in user time on Linux; adding it would count it twice.
    fields = [f for f in after._fields if f not in ("guest", "guest_nice")]
    total = sum(delta(f) for f in fields)
    if total <= 0:
        return 0.0, 0.0, 0.0, 100.0
    return (100 * (delta("user") + delta("nice")) / total,
            100 * (delta("system") + delta("irq") + delta("softirq")) / total,
            100 * delta("iowait") / total,
            100 * delta("idle") / total)



def _drop_cut_row(path: Path) -> None:
    """A row a full disk or a kill cut short ends the file without its newline: cut it off
    before a resumed run appends, or its first row would merge with it mid-file."""
    with open(path, "rb+") as handle:
        position = handle.seek(0, os.SEEK_END)
        handle.seek(position - 1)
        if handle.read(1) == b"\n":
            return
        while position > 0:
            start = max(0, position - 4096)
            handle.seek(start)
            cut = handle.read(position - start).rfind(b"\n")
            if cut >= 0:
                handle.truncate(start + cut + 1)
                return
            position = start
        handle.truncate(0)  # not one whole line: the header is written again

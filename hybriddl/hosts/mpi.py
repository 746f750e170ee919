"""Everything MPI: one rank per host, gradients averaged with allreduce. No other module
imports mpi4py.

MPI is initialised only when `MPIHosts` is created (hybriddl.hosts.cluster.connect does so
under mpirun), never at import: `hybriddl info` and the worker processes that
strategies spawn must not start an MPI runtime.

Every wait on another host goes through `MPIHosts.wait`, which polls non-blocking
requests while a heartbeat (hybriddl.hosts.heartbeat, on connections of its own) listens
to every other host, so a host that dies, hangs or loses its link turns into an error
naming it within seconds instead of a hang, however long a transfer takes; a host whose
heartbeat is heard but which does not come to an exchange meets the deadline
(--host-timeout).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import math
import os
import pickle
import stat
import sys
import termios
import threading
import time

import numpy as np
import torch
from torch import nn

from hybriddl.hosts.base import (DEFAULT_PROGRESS_SECONDS, DEFAULT_TIMEOUT_SECONDS, Exchange,
                                 Hosts)
from hybriddl.hosts.compression import Compression
from hybriddl.errors import TrainingError, UsageError
from hybriddl.hosts.averaging import Averager, averager_for, back_to, host_empty, to_host
from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES
from hybriddl.hosts.scheme import WHOLE_GRADIENT
from hybriddl.data.sharding import split_bounds
from hybriddl.hosts.beater import BeatSender
from hybriddl.hosts.heartbeat import INTERVAL_SECONDS, SILENCE_SECONDS, Heartbeat
from hybriddl import failpoints
from hybriddl.emulation.hosts import time_scale
from hybriddl.machine.affinity import take_cores
from hybriddl.machine.naming import host_name
from hybriddl.hosts.traffic import TrafficMeter
from hybriddl.hosts.wire import HALF_DTYPES, as_bits

PRODUCTION_HINT = "production runs use one rank per host (mpirun -npernode 1)"
# Each fusion bucket leaves as allreduces of about this size (see MPIHosts._post).
PIECE_BYTES = 8 * 2**20
# An exchange's parts in flight at once a slow link must carry before the progress deadline
# (`MPIHosts.progress_deadline`): at 1 Mbit/s, 4 x 8 MiB take 268 s. A part is a piece of
# at most about 8 MiB, or a larger request sent whole (`wait`'s `largest`).
PROGRESS_PARTS = 4
# The link measurement at start: large enough that latency is a small part of it.
LINK_PROBE_BYTES = 8 * 2**20
LINK_PROBE_TAG = 7301
# The latency measurement at start: small round trips, few enough to take milliseconds.
LATENCY_PROBE_ROUNDS = 10
LATENCY_PROBE_TAG = 7302
ROLL_CALL_TAG = 7303
# The least the first exchange waits for every host to have started: interpreters and
# torch's import start at different speeds (3-4 s each here, more on a loaded machine), and
# a --host-timeout of a few seconds is for steps, not starts.
ROLL_CALL_SECONDS = 20.0
# What a failed reduce-scatter of the split's rows was doing, in its one line.
ROWS_SUM = "returning classifier input gradients"
# How long an aborting rank waits for mpirun to read what it last wrote (see
# `let_mpirun_read_output`).
OUTPUT_READ_SECONDS = 2.0


def library_versions() -> dict:
    """mpi4py's and the MPI library's versions, without initialising MPI."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError as exc:
        return {"mpi4py": None, "mpi_library": f"unavailable ({exc})"}
    return {"mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip("\x00 \n").splitlines()[0]}


def _initialise():
    # With Open MPI's fault tolerance (ULFM) on, a rank that dies makes the survivors'
    # pending operations fail with MPI_ERR_PROC_FAILED and Comm.Get_failed() names it;
    # without it, the first survivor to notice aborts and mpirun blames that survivor.
    os.environ.setdefault("OMPI_MCA_mpi_ft_enable", "1")
    # Gradient buckets go through Iallreduce, and Open MPI's libnbc picks a binomial tree
    # for it below 4 ranks: root receives, then sends, one after the other. Measured on 2
    # emulated hosts at 1 Gbit/s, 64 MiB: 1.16 s with its choice, 0.60 s with its ring
    # (bound 0.54 s); on 4 hosts, 32 MiB: 0.67 s against 0.56 s (bound 0.40 s).
    os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "ring")
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    if not MPI.Is_initialized():
        # Overlap hooks may run on autograd's device threads, not just the main thread.
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def _beat_sender(interval: float) -> BeatSender | None:
    """The beats' own process (hosts/beater.py), started where MPI has not started yet;
    None where it has (the heartbeat's thread then beats)."""
    started = sys.modules.get("mpi4py.MPI")
    if started is not None and started.Is_initialized():
        return None
    return BeatSender.start(interval)


class HostFailure(TrainingError):
    """Another host died, hung or could not be reached; `lost` maps each rank named lost
    to its host's name (empty when MPI could not say who), for a launcher to drop it."""

    def __init__(self, message: str, lost: dict[int, str] | None = None):
        super().__init__(message)
        self.lost = dict(lost or {})


class ProgressThread:
    """Keeps calling MPI while backward runs and bucket allreduces are in flight.

    Open MPI moves the data of non-blocking collectives only inside MPI calls (this
    build has no asynchronous progress), and backward makes none between two hooks, so
    without this thread an early bucket would wait for the end of backward anyway
    (Horovod keeps a background thread for the same reason). Every MPI call made while
    overlapping holds `lock`, so only one thread is inside MPI for these requests.
    """

    INTERVAL_SECONDS = 0.0002

    def __init__(self, MPI):
        self.MPI = MPI
        self.lock = threading.Lock()
        self._requests: list | None = None
        self._driven: list[list] = []  # exchanges left running (MPIHosts.start_*)
        self._wake = threading.Event()
        self._stopping = False
        # An MPI error met here: the requests it failed may be freed, so that the waiting
        # thread sees them done; `MPIHosts.wait` raises it instead.
        self.failure: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="hybriddl-mpi-progress",
                                        daemon=True)
        self._thread.start()

    def track(self, requests: list) -> None:
        """Drive `requests` (a list that grows as buckets leave) until `release`."""
        with self.lock:
            self._requests = requests

    def wake(self) -> None:
        """A request was added (caller holds `lock`)."""
        self._wake.set()

    def release(self) -> None:
        """The caller takes over the requests (it will wait for them itself)."""
        with self.lock:
            self._requests = None
            if not self._driven:
                self._wake.clear()

    def drive(self, requests: list) -> None:
        """Also drive `requests`, an exchange left running while this host computes,
        until `drop(requests)`."""
        with self.lock:
            self._driven.append(requests)
            self._wake.set()

    def drop(self, requests: list) -> None:
        """The caller waits for `requests` itself from now on."""
        with self.lock:
            self._driven = [driven for driven in self._driven if driven is not requests]

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self.lock:
                if self._stopping:
                    return
                pending = [*(self._requests or ()), *(r for d in self._driven for r in d)]
                try:
                    idle = not pending or self.MPI.Request.Testall(pending)
                except self.MPI.Exception as exc:
                    self.failure, idle = exc, True
                if idle:
                    self._wake.clear()
            time.sleep(self.INTERVAL_SECONDS)

    def close(self) -> None:
        with self.lock:
            self._stopping = True
            self._wake.set()
        self._thread.join(timeout=5)


class RunningExchange(Exchange):
    """Requests started by MPIHosts.start_*, driven by its progress thread until
    `result()` takes them back, waits for them as every exchange is waited for (heartbeat,
    deadline) and returns `finish()`. `keep` holds what MPI reads until then."""

    def __init__(self, hosts: MPIHosts, requests: list, what: str, finish, *keep):
        self._hosts, self._requests, self._what, self._finish = hosts, requests, what, finish
        self._keep = keep
        hosts._driver().drive(requests)

    def result(self) -> torch.Tensor:
        self._hosts._driver().drop(self._requests)
        largest = max((tensor.nbytes for tensor in self._keep), default=PIECE_BYTES)
        self._hosts.wait(self._requests, self._what, largest=largest)
        return self._finish()


class LogicalSum:
    """A sum of every logical rank's wire (hosts/base.py `logical_ranks`) in logical-rank
    order, whatever host runs which: the same bits on any host count that runs them.

    Two exchanges, as a ring allreduce's bytes (2(H-1)/H of the wire out of each host):
    each host sends every other host that host's slice of each of its wires (one
    alltoallv, `requests`); once it is done, `gather` adds the slices this host then holds
    in logical-rank order and gathers the summed slices on every host (allgatherv) into
    `total`. MPI's allreduce would sum in an order set by the host count, and
    PowerSGD's error feedback carries that rounding into every later step."""

    def __init__(self, hosts: MPIHosts, wire: torch.Tensor):
        self._hosts = hosts
        parts = len(hosts.logical_ranks)
        n = wire.numel() // parts
        blocks = hosts.logical_blocks or [(r, r + 1) for r in range(hosts.size)]
        self._bounds = split_bounds(n, [1.0] * hosts.size)
        first, stop = self._bounds[hosts.rank]
        mine = stop - first
        rows = wire.view(parts, n)
        # To each host, this host's wires' slices of that host's, one wire after another
        # (with one wire, the wire itself: its slices in host order).
        self._send = wire if parts == 1 else torch.cat(
            [rows[:, a:b].reshape(-1) for a, b in self._bounds])
        self._copies = torch.empty((hosts.logical_count, mine), dtype=wire.dtype)
        self._copies[blocks[hosts.rank][0]:blocks[hosts.rank][1]] = rows[:, first:stop]
        others = [j != hosts.rank for j in range(hosts.size)]
        outgoing = ([parts * (b - a) if other else 0 for (a, b), other in zip(self._bounds, others)],
                    [parts * a for a, _ in self._bounds])
        incoming = ([(b - a) * mine if other else 0 for (a, b), other in zip(blocks, others)],
                    [a * mine for a, _ in blocks])
        self.requests = [hosts.comm.Ialltoallv([_as_mpi(self._send), outgoing],
                                               [_as_mpi(self._copies), incoming])]
        self.total = torch.empty(n, dtype=wire.dtype)
        self._slice: torch.Tensor | None = None

    def gather(self) -> list:
        """Once `requests` are done: this host's slice summed in logical-rank order, and
        the requests that gather every host's into `total`."""
        self._slice = _in_rank_order(self._copies)
        sizes = [b - a for a, b in self._bounds]
        try:
            return [self._hosts.comm.Iallgatherv(
                _as_mpi(self._slice), [_as_mpi(self.total), (sizes, [a for a, _ in self._bounds])])]
        except self._hosts.MPI.Exception as exc:
            raise self._hosts._failure(exc, "averaging gradients") from None


def _naming(what: str | None = None):
    """A decorator of an exchange's method: an MPI error raised as the exchange starts
    (Open MPI refuses to start a collective with a process it knows failed) is the one-line
    HostFailure `wait` raises for one it meets later, naming the failed host where it can;
    `what`: what the exchange is (None: the method's own `what` argument)."""
    def decorate(method):
        @functools.wraps(method)
        def named(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except self.MPI.Exception as exc:
                said = what or inspect.signature(method).bind(self, *args, **kwargs) \
                    .arguments.get("what") or "exchanging with the other hosts"
                raise self._failure(exc, said) from None
        return named
    return decorate


class MPIHosts(Hosts):
    """The hosts of a run launched by mpirun: one rank each."""

    def __init__(self, *, overlap: bool = False, compression=Compression.none,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float = DEFAULT_TIMEOUT_SECONDS,
                 progress_timeout: float = DEFAULT_PROGRESS_SECONDS):
        if bucket_bytes < 1:
            raise UsageError(f"--fusion-mib gives {bucket_bytes} bytes: give a positive size")
        if not timeout > 0:
            raise UsageError(f"--host-timeout {timeout}: give a positive number of seconds")
        if not progress_timeout > 0:
            raise UsageError(f"--progress-timeout {progress_timeout}: give a positive number "
                             "of seconds")
        # On emulated hosts slowed down by D (hybriddl emulate), every wait on another host
        # lasts D times longer in wall time: deadlines follow, or a broadcast that takes 15
        # emulated seconds would read as a lost host.
        self.time_scale = time_scale()
        timeout *= self.time_scale
        # The deadline of an exchange every host is inside and in which nothing completes.
        self.progress_timeout = progress_timeout * self.time_scale
        # Before MPI starts (no fork after it): the process that sends this rank's beats.
        sender = _beat_sender(INTERVAL_SECONDS * self.time_scale)
        self.MPI = MPI = _initialise()
        self.comm = MPI.COMM_WORLD
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        super().__init__(TrafficMeter(counts_buckets=True), compression)
        self.timeout = timeout
        self.overlap = overlap
        self._wire_type, self._sum = compression.mpi_sum(MPI)
        self.bucket_bytes = bucket_bytes
        self.thread_level = MPI.Query_thread()
        self.machine = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.machine.Set_errhandler(MPI.ERRORS_RETURN)
        self.names = ["(not yet known)"] * self.size  # until they are exchanged
        self.names[self.rank] = host_name()
        self.heartbeat: Heartbeat | None = None
        self._deadline_armed = False
        # Exchanges entered since attach(): the heartbeat tells the others (see wait).
        self._exchanges = 0
        self._progress: ProgressThread | None = None  # drives exchanges beside compute
        self.initial_parameters: str | None = None  # how broadcast_parameters made them equal
        if failpoints.fires("stall-start", self.rank):
            failpoints.stall_for_ever()
        # No heartbeat exists before its own set-up: every host answers within the deadline
        # or is named, rather than the others waiting for ever.
        self._roll_call("starting the heartbeat between hosts")
        if failpoints.fires("stall-heartbeat", self.rank):
            failpoints.stall_for_ever()
        self.heartbeat = self._start_heartbeat(sender)
        # Before training, hosts may spend minutes on a data cache or on tuning: while the
        # heartbeat hears them, set-up waits need no deadline (attach() arms it).
        self._deadline_armed = self.heartbeat is None
        self.names = self.allgather(self.names[self.rank])
        self.cores = self._divide_cores()
        everyone = self.allgather((self.machine.Get_size(), self.cores, self.notes))
        self.ranks_per_machine = max(sharing for sharing, _, _ in everyone)
        self.cores_by_rank = [cores for _, cores, _ in everyone]
        self.notes = _unique(note for _, _, notes in everyone for note in notes)
        self.overlap_by_rank: list[bool] = [False] * self.size
        self.averager: Averager | None = None  # attach() lays it out
        self._alone = False  # attached on one rank with an exact scheme: nothing to average
        self.overlapping = False  # hooks attached: gradients leave during backward
        self._hooks: list = []
        self._closed = False

    def _set_up_seconds(self) -> float:
        """The deadline of the waits before the heartbeat hears the others: --host-timeout,
        ROLL_CALL_SECONDS at least, in wall seconds."""
        return max(self.timeout, ROLL_CALL_SECONDS * self.time_scale)

    def _roll_call(self, what: str) -> None:
        """Every other rank answers within --host-timeout (ROLL_CALL_SECONDS at least), or
        HostFailure names those that did not (an allgather would only say that someone is
        missing)."""
        if self.size == 1:
            return
        deadline = self._set_up_seconds()
        others = [r for r in range(self.size) if r != self.rank]
        token = np.ones(1, dtype=np.uint8)
        answers = {r: np.zeros(1, dtype=np.uint8) for r in others}
        received = {r: self.comm.Irecv(answers[r], source=r, tag=ROLL_CALL_TAG) for r in others}
        sent = [self.comm.Isend(token, dest=r, tag=ROLL_CALL_TAG) for r in others]
        started = time.monotonic()
        pending = dict(received)
        while pending:
            for r in [r for r, request in pending.items() if request.Test()]:
                del pending[r]
            if pending and time.monotonic() - started > deadline:
                who = ", ".join(f"rank {r}" for r in sorted(pending))
                failure = HostFailure(f"no answer from {who} for {deadline:.0f} s while "
                                      f"{what}: it did not start, hung before it, or cannot "
                                      "reach this host (see --host-timeout)",
                                      {r: f"rank {r}" for r in pending})
                # MPI is up but not every host: what the caller takes down (abort), or
                # this rank would wait for the silent one in MPI's finalize, for ever.
                failure.hosts = self
                raise failure
            time.sleep(0.001)
        self.MPI.Request.Waitall(sent)

    def _start_heartbeat(self, sender: BeatSender | None) -> Heartbeat | None:
        if self.size == 1:
            if sender:
                sender.close()
            return None
        # A shorter --host-timeout names a silent host sooner too, but a few beats it takes.
        interval = INTERVAL_SECONDS * self.time_scale
        silence = min(SILENCE_SECONDS * self.time_scale, max(self.timeout, 3 * interval))
        # No heartbeat hears the others yet: its own exchanges of addresses wait within the
        # roll call's deadline, as the roll call does, or a host that hangs in between
        # would hold the others for ever.
        timeout, self.timeout = self.timeout, self._set_up_seconds()
        self._deadline_armed = True
        try:
            return Heartbeat(self.allgather, self.rank, self.size, interval=interval,
                             silence=silence, sender=sender)
        except OSError as exc:
            failure = HostFailure(f"rank {self.rank} cannot listen for the other hosts' "
                                  f"heartbeat ({exc.strerror or exc})")
            failure.hosts = self  # MPI is up: the caller takes every rank down
            raise failure from None
        except HostFailure as failure:
            failure.hosts = self
            raise
        finally:
            self.timeout = timeout

    # ------------------------------------------------------------------ machines
    def _divide_cores(self) -> list[int]:
        """This rank's part of its machine's cores (machine/affinity.py), its notes kept."""
        cores, notes = take_cores(self.machine.Get_size(), self.machine.Get_rank(),
                                  self._machine_allgather, self.names[self.rank], self.rank)
        self.notes.extend(notes)
        return cores

    def _machine_allgather(self, value) -> list:
        return self._allgather_on(self.machine, value)

    def describe(self) -> dict:
        return {
            "count": self.size, "names": self.names, "mpi": True,
            "ranks_per_machine": self.ranks_per_machine, "cores": self.cores_by_rank,
            "balance": self.balance, "weights": self.weights,
            "compression": self.compression.name, "overlap": self.overlap_by_rank,
            "fusion_buckets": len(self.averager.buckets.buckets) if self.averager else None,
            "fusion_bucket_bytes": self.bucket_bytes,
            "gradient_bytes_per_step": self.averager.wire_bytes() if self.averager else None,
            "thread_level": self.thread_level,
            "initial_parameters": self.initial_parameters,
            "heartbeat": {"interval_seconds": self.heartbeat.interval,
                          "silence_seconds": self.heartbeat.silence,
                          "payload_bytes_per_second": self.heartbeat.bytes_per_second}
            if self.heartbeat else None,
            "mpi_library": library_versions()["mpi_library"],
            "notes": self.notes,
        }

    # ------------------------------------------------------------------ waiting
    def wait(self, requests: list, what: str, continues: bool = False,
             largest: int = PIECE_BYTES) -> None:
        """Complete `requests`, or raise HostFailure naming who failed, or the deadline.
        `continues`: they are the second part of the exchange waited for last (a
        `LogicalSum`'s gather), counted as that exchange, so a host still inside its first
        part is inside the same exchange, not behind. `largest`: the bytes of the largest
        request through this host, where one is larger than a piece (`progress_deadline`).

        Liveness comes from the heartbeat, not from how long a transfer takes: at 50 Mbit/s
        AlexNet's gradient (228 MB) takes 36 s, VGG16's 86 s, and nothing bounds that. The
        deadline (--host-timeout, from the first step on) names a host whose heartbeat is
        heard but that has not come to this exchange: its beats say it entered fewer
        exchanges and waits in none. Without a heartbeat the deadline bounds every wait.
        """
        Request = self.MPI.Request
        heartbeat = self.heartbeat if self.heartbeat and self.heartbeat.running else None
        started = progressed = time.monotonic()
        self._exchanges += 0 if continues else 1
        if heartbeat:
            heartbeat.report(self._exchanges, inside=True)
        if failpoints.armed("stall-ahead") and heartbeat:
            heartbeat.report(self._exchanges + 1, inside=True)  # one exchange ahead
        if failpoints.armed("stall-inside") or failpoints.armed("stall-ahead"):
            failpoints.stall_for_ever()  # inside, its beats say so; it never drives MPI
        listen = 0.0  # when to ask the heartbeat next: not at every poll, which drives MPI
        waiting_said = self._deadline_armed  # before the first step: a wait is said once
        try:
            # Testsome: each request that completes (a piece of at most 8 MiB) is progress.
            while (done := Request.Testsome(requests)) is not None:
                now = time.monotonic()
                if done:
                    progressed = now
                late = self._deadline_armed and now - started > self.timeout
                if heartbeat and now >= listen:
                    if lost := heartbeat.lost():
                        raise self._lost(lost, what)
                    if late and (behind := heartbeat.behind(self._exchanges)):
                        raise self._not_coming(behind, what)
                    if (not waiting_said and now - started > self.timeout
                            and (behind := heartbeat.behind(self._exchanges))):
                        waiting_said = True
                        self.on_notice(self._still_preparing(behind, what, now - started))
                    if (self._deadline_armed and now - progressed > self.progress_deadline(largest)
                            and heartbeat.inside_from(self._exchanges)):
                        raise self._stuck(heartbeat, what, now - progressed)
                    listen = now + 0.1
                if late and not heartbeat:
                    raise HostFailure(
                        f"no answer from the other hosts for {self.timeout:.0f} s while {what}; "
                        "a host hung or the network is down (see --host-timeout)"
                        + self._heartbeat_fault())
                # Release the GIL so the prefetch thread keeps assembling batches.
                time.sleep(0)
            if self._progress is not None and self._progress.failure is not None:
                raise self._progress.failure  # met by the progress thread first
        except self.MPI.Exception as exc:
            raise self._failure(exc, what) from None
        finally:
            if heartbeat:
                heartbeat.report(self._exchanges, inside=False)

    def _heartbeat_fault(self) -> str:
        """Why this rank's heartbeat stopped, where a fault of its own stopped it: the
        deadline is all that named a lost host from then on."""
        fault = self.heartbeat.fault if self.heartbeat else None
        return f"; this rank's heartbeat had stopped earlier: {fault}" if fault else ""

    def progress_deadline(self, largest: int = PIECE_BYTES) -> float:
        """Seconds an exchange every host is inside may go without a part completing:
        --progress-timeout, or where the link measured at start is slower, the time
        PROGRESS_PARTS parts (8 MiB each, or `largest` bytes where a request is larger)
        take on it: a slow link is not a stall. In wall seconds, as the flag's: on emulated
        hosts the rate measured is in emulated time."""
        rate = self.link_bytes_per_second
        part = max(PIECE_BYTES, largest)
        parts = PROGRESS_PARTS * part / rate * self.time_scale if rate else 0.0
        return max(self.progress_timeout, parts)

    def _stuck(self, heartbeat, what: str, seconds: float) -> HostFailure:
        """Nothing of this exchange completed for `seconds` while every other host is alive
        and inside it, or inside a later one: it has sent all it had for this one."""
        states = "; ".join(f"rank {r} on host {self.names[r]}: {state}"
                           for r, state in heartbeat.states().items())
        dropping = ("a data path that drops packets while the heartbeat's passes (check "
                    "btl_tcp_if_include)")
        # A host one exchange on finished its part of this one: either the hosts entered
        # different collectives, or its last message for this one was lost on the way.
        where, cause = (("inside it", f"a collective the hosts entered differently, or "
                         f"{dropping}")
                        if heartbeat.inside_with(self._exchanges) else
                        ("inside it or a later one", "hosts that entered different "
                         "collectives (a host skipped one, or ran one the others did not), "
                         f"or {dropping}"))
        return HostFailure(
            f"nothing of exchange {self._exchanges} ({what}) completed for {seconds:.0f} s "
            f"while every host is alive and {where} (rank {self.rank} on host "
            f"{self.names[self.rank]}: inside exchange {self._exchanges}; {states}): likely "
            f"{cause}; the last checkpoint resumes the run (see --progress-timeout)")

    def _still_preparing(self, behind: list[int], what: str, seconds: float) -> str:
        who = ", ".join(f"rank {r} on host {self.names[r]}" for r in behind)
        return (f"waiting {seconds:.0f} s for {who} while {what}: alive (its heartbeat is "
                "heard), still preparing (its data cache, a tune); no deadline before the first "
                "step, a host that dies is named")

    def _not_coming(self, behind: list[int], what: str) -> HostFailure:
        who = ", ".join(f"rank {r} on host {self.names[r]}" for r in behind)
        return HostFailure(f"no answer from the other hosts for {self.timeout:.0f} s while "
                           f"{what}: {who} runs (its heartbeat is heard) but has not come to "
                           "this exchange (see --host-timeout)")

    def _lost(self, lost: dict[int, str], what: str) -> HostFailure:
        if set(lost) <= self.heartbeat.ended:  # their processes ended: say so as MPI would
            who = ", ".join(f"rank {r} on host {self.names[r]}" for r in sorted(lost))
            why = "; ".join(sorted(set(lost.values())))
            return HostFailure(f"{who} failed while {what} ({why}); the run stops on every "
                               "host", {r: self.names[r] for r in lost})
        who = ", ".join(f"rank {r} on host {self.names[r]} ({why})"
                        for r, why in sorted(lost.items()))
        return HostFailure(f"lost {who} while {what}: it died, hung or lost its network "
                           "link; the run stops on every host",
                           {r: self.names[r] for r in lost})

    def _failure(self, exc, what: str) -> HostFailure:
        failed = []
        try:
            group = self.comm.Get_failed()
            failed = self.MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                   self.comm.Get_group())
        except (AttributeError, NotImplementedError, self.MPI.Exception):
            pass  # no ULFM in this MPI (Open MPI 5 without --with-ft): the heartbeat names them
        if not failed and self.heartbeat:
            failed = list(self.heartbeat.lost())
        reason = exc.Get_error_string().strip()
        if failed:
            who = ", ".join(f"rank {r} on host {self.names[r]}" for r in sorted(failed))
            return HostFailure(f"{who} failed while {what} ({reason}); the run stops on "
                               "every host", {r: self.names[r] for r in failed})
        return HostFailure(f"communication between hosts failed while {what} ({reason})")

    # ------------------------------------------------------------------ small values
    @_naming("exchanging settings")
    def _allgather_on(self, comm, value) -> list:
        payload = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
        sizes = np.zeros(comm.Get_size(), dtype=np.int64)
        self.wait([comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes)],
                   "exchanging settings")
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.wait([comm.Iallgatherv(payload, [gathered, sizes])], "exchanging settings")
        self.traffic.sent(8 + payload.size)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(gathered[offsets[i]:offsets[i + 1]].tobytes())
                for i in range(comm.Get_size())]

    def allgather(self, value) -> list:
        return self._allgather_on(self.comm, value)

    @_naming("receiving rank 0's settings")
    def broadcast_object(self, value):
        payload = pickle.dumps(value) if self.rank == 0 else b""
        size = np.array([len(payload)], dtype=np.int64)
        self.wait([self.comm.Ibcast(size, root=0)], "receiving rank 0's settings")
        buffer = np.frombuffer(payload, dtype=np.uint8).copy() if self.rank == 0 else \
            np.empty(int(size[0]), dtype=np.uint8)
        self.wait([self.comm.Ibcast(buffer, root=0)], "receiving rank 0's settings")
        if self.rank == 0:
            self.traffic.sent(8 + buffer.size)
        return pickle.loads(buffer.tobytes())

    @_naming("waiting for every host")
    def barrier(self) -> None:
        self.wait([self.comm.Ibarrier()], "waiting for every host")

    @_naming("agreeing whether to stop")
    def any_true(self, flag: bool) -> bool:
        value = np.array([1 if flag else 0], dtype=np.int32)
        self.wait([self.comm.Iallreduce(self.MPI.IN_PLACE, value, self.MPI.MAX)],
                   "agreeing whether to stop")
        self.traffic.sent(value.nbytes)
        return bool(value[0])

    @_naming("averaging the loss")
    def mean_over_hosts(self, total: float, samples: int) -> float:
        sums = np.array([total, samples], dtype=np.float64)
        self.wait([self.comm.Iallreduce(self.MPI.IN_PLACE, sums, self.MPI.SUM)],
                   "averaging the loss")
        self.traffic.sent(sums.nbytes)
        return float(sums[0] / max(sums[1], 1))

    # ------------------------------------------------------------------ parameters
    def broadcast_parameters(self, model: nn.Module, built_from_seed: bool = False) -> None:
        # Every host has prepared (and checked its run directory) before rank 0 writes.
        self.barrier()
        if built_from_seed:
            # Every host built the model from the run's seed: a digest of 64 bytes crosses
            # the wire instead of the model (AlexNet: 244 MB, 31 s at 62.5 Mbit/s, issue 38).
            # sha256 of AlexNet's 228 MB takes 0.35 s on one AMD EPYC core.
            digests = self.allgather(parameters_digest(model))
            others = [r for r, digest in enumerate(digests) if digest != digests[0]]
            if not others:
                self.initial_parameters = "built from the seed on every host (digests equal)"
                return
            self.notes.append(
                f"{', '.join(f'rank {r} on host {self.names[r]}' for r in others)} built other "
                "initial parameters than rank 0 from the same seed (another torch or "
                "torchvision?): rank 0's were sent to every host")
        self.initial_parameters = "rank 0's, sent to every host"
        self.broadcast_tensors([*model.parameters(), *model.buffers()],
                               "receiving rank 0's initial parameters")

    @_naming()
    def broadcast_tensors(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's values of `tensors` written into every host's, in place."""
        staged = []
        for tensor in tensors:
            data = tensor.detach()
            staged.append((data, to_host(data)))
        requests = [self.comm.Ibcast(host.numpy(), root=0) for _, host in staged]
        self.wait(requests, what, largest=max((host.nbytes for _, host in staged), default=0))
        for data, host in staged:
            if host is not data:
                data.copy_(host)
        if self.rank == 0:
            self.traffic.sent(sum(host.nbytes for _, host in staged))

    def link_rate(self, nbytes: int = LINK_PROBE_BYTES) -> float:
        """Bytes per second a host's link carries, the slowest host's: every host sends
        `nbytes` to the next in a ring and receives as many from the previous one, so each
        link carries one message at once, as in a ring allreduce. Measured once at start
        (tens of milliseconds at 1 Gbit/s) for --host-parallel auto. On emulated hosts
        slowed down by D, in emulated time (wall rate x D), as the profile's compute is."""
        send = np.ones(nbytes, dtype=np.uint8)
        receive = np.empty_like(send)
        self.barrier()
        started = time.perf_counter()
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.wait([self.comm.Isend(send, dest=right, tag=LINK_PROBE_TAG),
                    self.comm.Irecv(receive, source=left, tag=LINK_PROBE_TAG)],
                   "measuring the link to the next host")
        mine = nbytes / max(time.perf_counter() - started, 1e-9) * self.time_scale
        self.traffic.sent(nbytes)
        self.link_bytes_per_second = min(self.allgather(mine))
        return self.link_bytes_per_second

    def link_latency(self, rounds: int = LATENCY_PROBE_ROUNDS) -> float:
        """Seconds one small message takes to the next host, the slowest host's: `rounds`
        ring exchanges of 8 bytes (each host sends to the next and receives from the
        previous, through `wait` as every exchange of a step), the median after one
        unmeasured round. What the planner charges each round of a ring collective
        (hybrid/planner.py). On emulated hosts slowed down by D, in emulated time."""
        send, receive = np.ones(1, dtype=np.int64), np.empty(1, dtype=np.int64)
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.barrier()
        seconds = []
        for _ in range(rounds + 1):
            started = time.perf_counter()
            self.wait([self.comm.Isend(send, dest=right, tag=LATENCY_PROBE_TAG),
                        self.comm.Irecv(receive, source=left, tag=LATENCY_PROBE_TAG)],
                       "measuring the latency to the next host")
            seconds.append(time.perf_counter() - started)
        self.traffic.sent(send.nbytes * (rounds + 1))
        mine = sorted(seconds[1:])[rounds // 2] / self.time_scale
        return max(self.allgather(mine))

    # ------------------------------------------------------------------ tensors
    @_naming("exchanging classifier inputs")
    def allgather_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        given, tensor = tensor, to_host(tensor.detach())
        row = _row_elements(tensor)
        out = host_empty((sum(counts), *tensor.shape[1:]), tensor.dtype, given.device)
        sizes = [c * row for c in counts]
        self.wait([self.comm.Iallgatherv(_as_mpi(tensor), [_as_mpi(out), sizes])],
                   "exchanging classifier inputs", largest=out.nbytes)
        self.traffic.sent(tensor.nbytes)
        return back_to(out, given)

    def reduce_scatter_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        requests, summed, keep = self._post_rows_sum(tensor, counts)
        self.wait(requests, ROWS_SUM, largest=max(kept.nbytes for kept in keep))
        return summed()

    def reduce_scatter_half_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """reduce_scatter_rows of a float16 or bfloat16 tensor, summed in its own dtype:
        the split's features' gradients with --feature-dtype."""
        return self.reduce_scatter_rows(tensor, counts)

    @_naming()
    def allreduce_sum(self, tensor: torch.Tensor,
                      what: str = "summing a classifier layer's partial outputs") -> torch.Tensor:
        given, tensor = tensor, to_host(tensor.detach())
        out = host_empty(tensor.shape, tensor.dtype, given.device)
        # Out of place, through libnbc's ring (set in _initialise): every host ends with
        # the same bits, so the classifier's replicated layers stay identical.
        self.wait([self.comm.Iallreduce(_as_mpi(tensor), _as_mpi(out), self.MPI.SUM)], what,
                  largest=out.nbytes)
        self.traffic.sent(tensor.nbytes)
        return back_to(out, given)

    def start_reduce_scatter_rows(self, tensor: torch.Tensor, counts: list[int]) -> Exchange:
        """reduce_scatter_rows started now; the progress thread moves it while this host
        computes, and `result()` sums."""
        requests, summed, keep = self._post_rows_sum(tensor, counts)
        return RunningExchange(self, requests, ROWS_SUM, summed, *keep)

    def _post_rows_sum(self, tensor: torch.Tensor, counts: list[int]):
        """(requests, summed, what MPI reads or writes) of a reduce-scatter of rows.

        Not MPI's reduce-scatter: Open MPI's libnbc reduces to one host along a tree and
        scatters from there, so one host receives every other's whole tensor and the parts
        go back after it. Here each host sends every other host that host's rows (one
        alltoallv, every link busy at once, (H-1)/H of the tensor out of each host), and
        `summed()` adds the H copies of its own rows it then holds, in rank order, in the
        tensor's dtype (2-byte floats in theirs, hosts/wire.py). Measured on emulated hosts
        at 1 Gbit/s and S = 74, AlexNet's features' gradient (emulated ms): 2 hosts, 2.4 MB,
        29.6 with libnbc's and 10.5 with this (bound 9.4); 4 hosts, 4.7 MB, 108.9 against
        41.3 (results/bench_rows_exchange.json)."""
        given, tensor = tensor, to_host(tensor.detach())
        row, mine = _row_elements(tensor), counts[self.rank]
        starts = [sum(counts[:j]) for j in range(self.size)]
        copies = host_empty((self.size, mine, *tensor.shape[1:]), tensor.dtype, given.device)
        send, receive = ((as_bits(tensor), as_bits(copies)) if tensor.dtype in HALF_DTYPES
                         else (_as_mpi(tensor), _as_mpi(copies)))
        others = [j != self.rank for j in range(self.size)]
        # (counts, displacements) in elements; MPI's datatype is the arrays' own.
        outgoing = ([c * row if other else 0 for c, other in zip(counts, others)],
                    [start * row for start in starts])
        incoming = ([mine * row if other else 0 for other in others],
                    [j * mine * row for j in range(self.size)])
        try:
            requests = [self.comm.Ialltoallv([send, outgoing], [receive, incoming])]
        except self.MPI.Exception as exc:
            raise self._failure(exc, ROWS_SUM) from None
        self.traffic.sent(tensor.nbytes)

        def summed() -> torch.Tensor:
            copies[self.rank].copy_(tensor[starts[self.rank]:starts[self.rank] + mine])
            return back_to(_in_rank_order(copies), given)

        return requests, summed, (tensor, copies)

    def _driver(self) -> ProgressThread:
        """The thread that calls MPI while exchanges run beside compute."""
        if self._progress is None:
            self._progress = ProgressThread(self.MPI)
        return self._progress

    @_naming("gathering the classifier's slices")
    def gather_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        given, tensor = tensor, to_host(tensor.detach())
        row = _row_elements(tensor)
        out = host_empty((sum(counts), *tensor.shape[1:]), tensor.dtype, given.device) \
            if self.rank == 0 else None
        target = [_as_mpi(out), [c * row for c in counts]] if out is not None else None
        self.wait([self.comm.Igatherv(_as_mpi(tensor), target, root=0)],
                   "gathering the classifier's slices",
                   largest=sum(counts) * row * tensor.element_size())
        if self.rank != 0:
            self.traffic.sent(tensor.nbytes)
        return None if out is None else back_to(out, given)

    # ------------------------------------------------------------------ gradients
    def use_compression(self, compression) -> None:
        if self.averager is not None:
            raise RuntimeError("use_compression before attach(model)")
        super().use_compression(compression)
        self._wire_type, self._sum = compression.mpi_sum(self.MPI)

    def attach(self, model: nn.Module, gradient_hooks: bool = False,
               overlap: bool | None = None, bucket_bytes: int | None = None) -> None:
        """Lay out the averaging of `model`'s gradients (hosts/averaging.py, of the kind the
        scheme declares): fusion buckets of at most `bucket_bytes` where it is below
        --fusion-mib; with --overlap (or `overlap`) and a strategy whose backward writes
        each gradient once, what can leave during backward leaves as soon as it is
        written. A compression of the whole gradient (PowerSGD) reads the buckets once
        backward is done and sends its factors."""
        self._deadline_armed = True  # training starts: every wait now has --host-timeout
        self._exchanges = 0  # every host counts its exchanges from here (the deadline's)
        if self.size == 1 and self.compression.exact:
            # One rank (`emulate --hosts 1`, a benchmark's one-host reference): its mean
            # gradient is the global one, as for a host without MPI. Copying it through
            # buckets and a one-rank allreduce cost 7.5 % of an AlexNet step here.
            self._alone = True
            return super().attach(model, gradient_hooks, overlap, bucket_bytes)
        asked = self.overlap if overlap is None else overlap
        cap = min(self.bucket_bytes, bucket_bytes or self.bucket_bytes)
        averager = averager_for(self, self.compression, model, cap, asked, self.notes)
        signatures = self.allgather((self.compression.name, averager.buckets.signature(),
                                     averager.buckets.layouts()))
        if any(s[:2] != signatures[0][:2] for s in signatures):
            raise UsageError("hosts lay out gradients differently (different models, library "
                             "versions or --compression): give every host the same options")
        if any(s[2] != signatures[0][2] for s in signatures):
            # Hosts hold their weights in other memory formats (their local strategies
            # differ): the buckets are summed in the parameters' logical order.
            averager = averager_for(self, self.compression, model, cap, asked, [],
                                    follow_layout=False)
        averager.buckets.install_views()
        self.averager = averager
        self._compressed = averager.parameters  # for checkpoints (Hosts.compression_state)
        early = averager.early_hooks()
        self.overlapping = asked and gradient_hooks and bool(early)
        if asked and not early:
            self.notes.append(f"--overlap: --compression {self.compression.name} sends the "
                              "step's factors once backward is done, so nothing leaves "
                              "during backward")
        elif self.overlap and not gradient_hooks:
            self.notes.append(f"--overlap: rank {self.rank}'s strategy computes gradients "
                              "outside one backward pass, so it sends them after the step")
        phases = averager.phase_positions
        everyone = self.allgather((self.overlapping, self.notes, phases))
        if any(theirs != phases for _, _, theirs in everyone):
            raise UsageError("hosts split the compressed exchange differently (--overlap on "
                             "some hosts only?): give every host the same options")
        self.overlap_by_rank = [overlapping for overlapping, _, _ in everyone]
        self.notes = _unique(note for _, notes, _ in everyone for note in notes)
        if self.overlapping:
            self._progress = ProgressThread(self.MPI)
            for parameter, ready in early:
                self._hooks.append(parameter.register_post_accumulate_grad_hook(ready))

    @property
    def progress(self) -> ProgressThread | None:
        """The thread that drives requests while this host computes, where one runs."""
        return self._progress

    # ------------------------------------------------------------------ logical ranks
    def use_logical(self, count: int) -> bool:
        if (self._alone or count <= self.size or len(set(self.weights)) > 1
                or self.averager is None or self.compression.kind != WHOLE_GRADIENT):
            return False
        self.logical_blocks = split_bounds(count, [1.0] * self.size)
        self.compression.use_parts(len(self.logical_ranks))
        return True

    def part_done(self, part: int, samples: int, global_samples: int) -> None:
        self.averager.take_part(part, samples / global_samples if global_samples else 0.0)

    def start_logical_sum(self, wire: torch.Tensor) -> LogicalSum:
        """The sum of every logical rank's wire, in logical-rank order, started: `wire` is
        this host's logical ranks' wires in turn (a CPU tensor)."""
        try:
            return LogicalSum(self, wire)
        except self.MPI.Exception as exc:
            raise self._failure(exc, "averaging gradients") from None

    def _arm(self, share) -> None:
        if self._alone:
            return
        if self.averager is None:
            raise RuntimeError("attach(model) before averaging its gradients")
        # Each host sends n_h/N * g_h, so the sum is the mean over the global batch.
        self.averager.arm(share.samples / share.global_samples)

    def _average(self, share) -> None:
        if self._alone:
            return super()._average(share)
        self.averager.average()

    def _disarm(self) -> None:
        if self.averager is not None:
            self.averager.armed = False

    def iallreduce(self, wire: torch.Tensor, received: torch.Tensor) -> list:
        """Requests that sum `wire` over hosts into `received` (CPU tensors), in pieces.

        Several pieces in flight: libnbc's ring waits for every step of one allreduce
        before the next, and another piece's transfer fills that gap. Measured on 4
        emulated hosts at 1 Gbit/s, 64 MiB: one call 0.965 s, 8 MiB pieces 0.932 s
        (bound 0.805 s); with another job on the machine 1.04 s against 1.73 s."""
        wire_array, out = _as_mpi(wire), _as_mpi(received)
        n = wire_array.size
        pieces = max(1, round(wire.nbytes / PIECE_BYTES))
        cuts = [i * n // pieces for i in range(pieces + 1)]
        try:
            return [self.comm.Iallreduce(self._typed(wire_array[a:b]), self._typed(out[a:b]),
                                         self._sum)
                    for a, b in zip(cuts, cuts[1:])]
        except self.MPI.Exception as exc:
            raise self._failure(exc, "averaging gradients") from None

    def _typed(self, array: np.ndarray):
        return array if self._wire_type is None else [array, self._wire_type]

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._progress:
            self._progress.close()
        self._deadline_armed = self.heartbeat is None  # rank 0 may still be writing model.pt
        self.barrier()
        if self.heartbeat:
            self.heartbeat.close()
        self.MPI.Finalize()

    def abort(self, exit_code: int) -> None:
        let_mpirun_read_output((1, 2), OUTPUT_READ_SECONDS)
        self.comm.Abort(exit_code)


def let_mpirun_read_output(fds: tuple[int, ...], seconds: float) -> None:
    """Flush Python's streams, then wait (at most `seconds`) until whoever reads the pipes
    among `fds` has read every byte written to them.

    MPI_Abort has mpirun kill every rank and exit at once, and a rank's output reaches the
    terminal only once the daemon of its host has read it from the rank's pipe: the line
    that says which rank failed, written just before the abort, was lost now and then
    (issue 34). Once the daemon has read it, mpirun writes it out before it exits. A pty
    (Open MPI's stdout) or a file has no such wait.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    deadline = time.monotonic() + seconds
    for fd in fds:
        while _unread_bytes(fd) and time.monotonic() < deadline:
            time.sleep(0.005)


def _unread_bytes(fd: int) -> int:
    """Bytes still in the pipe `fd` (0 when `fd` is no pipe, or closed)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        count = bytearray(4)
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return int.from_bytes(count, sys.byteorder)


def _in_rank_order(copies: torch.Tensor) -> torch.Tensor:
    """The sum of `copies` (one per rank, along the first dimension) added in rank order,
    in their dtype: the same bits on every host that holds them."""
    total = copies[0].clone()
    for copy in copies[1:]:
        total.add_(copy)
    return total


def _as_mpi(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the array MPI reads or writes in place."""
    if tensor.device.type != "cpu":  # the Open MPI wheel is not CUDA-aware
        raise RuntimeError(f"MPI reads host memory only: a tensor on {tensor.device} goes "
                           "through to_host first")
    return tensor.numpy()


def parameters_digest(model: nn.Module) -> str:
    """sha256 of a model's parameters and buffers (their dtypes, shapes and bytes), the
    same on every host that holds the same values, on whatever device."""
    digest = hashlib.sha256()
    for tensor in [*model.parameters(), *model.buffers()]:
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{data.dtype}{tuple(tensor.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy())
    return digest.hexdigest()


def _row_elements(tensor: torch.Tensor) -> int:
    """Elements in one row; a host whose share is empty sends 0 rows of the same shape."""
    return math.prod(tensor.shape[1:])


def _unique(items) -> list:
    return list(dict.fromkeys(items))

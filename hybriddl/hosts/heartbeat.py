"""A heartbeat between hosts, so that a host that died, hung or lost its link is named fast.

A host stopped by SIGSTOP, or one whose network link went down, sends nothing and closes
nothing: the others' collectives simply never complete, and only a deadline would end
them. So every rank sends every other rank an 8-byte message every `interval` seconds
from a thread of its own, on a communicator of its own (a duplicate of the run's, so
these messages never match the training's), and notes when it last heard from each
peer. A peer silent for `silence` seconds is lost, whatever the training is doing.

The thread needs MPI_THREAD_MULTIPLE (hybriddl.hosts.mpi asks for it). Its cost is
(H - 1) messages of 8 bytes per rank per interval, plus TCP/IP headers.
"""

from __future__ import annotations

import threading
import time

import numpy as np

INTERVAL_SECONDS = 2.0
# Long enough that a rank busy in a long step, a checkpoint write or a swap storm still
# gets its thread scheduled once in a while; short enough to name a lost host in 15-17 s.
SILENCE_SECONDS = 15.0
POLL_SECONDS = 0.25
TAG = 7


class Heartbeat:
    """Beats to and from every other rank of `comm` (a communicator the heartbeat owns)."""

    def __init__(self, MPI, comm, interval: float = INTERVAL_SECONDS,
                 silence: float = SILENCE_SECONDS):
        self.MPI, self.comm = MPI, comm
        self.interval, self.silence = interval, silence
        rank, size = comm.Get_rank(), comm.Get_size()
        self.peers = [r for r in range(size) if r != rank]
        now = time.monotonic()
        self._heard = {peer: now for peer in self.peers}
        # Silence counts only while this thread listened: a thread kept from running (a
        # long call holding the GIL, this process stopped and resumed) must not take the
        # beats still waiting in MPI's queues for silence.
        self._listened_until = now
        self._failed: dict[int, str] = {}  # rank -> MPI's error, from a failed request
        self._inbox = {peer: np.zeros(1, dtype=np.int64) for peer in self.peers}
        self._outbox = {peer: np.zeros(1, dtype=np.int64) for peer in self.peers}
        self._receives = {peer: self._receive(peer) for peer in self.peers}
        self._sends: dict[int, object] = {}
        self._stopping = threading.Event()
        self.beats_sent = 0
        self.cpu_seconds = 0.0  # this thread's own CPU time: what it takes from training
        self._thread = threading.Thread(target=self._run, name="hybriddl-heartbeat", daemon=True)
        self._thread.start()

    @property
    def bytes_per_second(self) -> float:
        """The payload this rank sends (headers not counted)."""
        return len(self.peers) * np.dtype(np.int64).itemsize / self.interval

    def _receive(self, peer: int):
        return self.comm.Irecv(self._inbox[peer], source=peer, tag=TAG)

    def _run(self) -> None:
        next_beat = 0.0
        started = time.thread_time()
        try:
            while not self._stopping.wait(POLL_SECONDS):
                self.cpu_seconds = time.thread_time() - started
                now = time.monotonic()
                for peer in self.peers:
                    if peer not in self._failed:
                        self._exchange(peer, now, now >= next_beat)
                self._listened_until = now
                if now >= next_beat:
                    self.beats_sent += 1
                    next_beat = now + self.interval
        except Exception as exc:  # never a traceback from this thread; the deadline remains
            self._failed.setdefault(-1, f"the heartbeat stopped ({exc})")

    def _exchange(self, peer: int, now: float, beat: bool) -> None:
        try:
            while self._receives[peer].Test():
                self._heard[peer] = now
                self._receives[peer] = self._receive(peer)
            previous = self._sends.get(peer)
            # One beat in flight per peer: a peer that reads nothing gets no pile of them.
            if beat and (previous is None or previous.Test()):
                self._outbox[peer][0] = self.beats_sent
                self._sends[peer] = self.comm.Isend(self._outbox[peer], dest=peer, tag=TAG)
        except self.MPI.Exception as exc:
            self._failed[peer] = exc.Get_error_string().strip()

    def lost(self) -> dict[int, str]:
        """The peers lost so far (rank -> why), empty while every peer is heard."""
        listened = self._listened_until
        lost = {peer: why for peer, why in self._failed.items() if peer >= 0}
        for peer, heard in list(self._heard.items()):
            if peer not in lost and listened - heard > self.silence:
                lost[peer] = f"silent for {listened - heard:.0f} s"
        return lost

    def close(self) -> None:
        """Stop beating and settle this rank's requests (every host stops at its own pace)."""
        self._stopping.set()
        self._thread.join(timeout=5)
        for request in self._receives.values():
            try:
                request.Cancel()
            except self.MPI.Exception:
                pass
        pending = [*self._receives.values(), *self._sends.values()]
        deadline = time.monotonic() + 2
        try:
            while not self.MPI.Request.Testall(pending) and time.monotonic() < deadline:
                time.sleep(0.01)
        except self.MPI.Exception:
            pass

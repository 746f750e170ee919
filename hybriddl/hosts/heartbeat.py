"""A heartbeat between hosts, so that a host that died, hung or lost its link is named fast,
however long a transfer between them takes.

A host stopped by SIGSTOP, or one whose network link went down, sends nothing and closes
nothing: the others' collectives simply never complete. So every rank sends every other
rank an 8-byte beat every `interval` seconds, from a small process of its own where it
could start one before MPI (hosts/beater.py: a rank holding the GIL still beats, a stopped
one does not), else from a thread, and notes when it last heard from each peer. A peer silent for `silence` seconds is lost, whatever the
training is doing; a peer whose process ended closes its connection and is lost at once.

The beats travel on TCP connections of their own, one per pair of ranks, not through MPI.
Open MPI's TCP transport sends all of a pair's messages on one connection, one after the
other, so beats sent through MPI (even on a communicator of their own) waited behind the
bulk data: on two emulated hosts at 62.5 Mbit/s, the 31 s broadcast of AlexNet's
parameters read as 15 s of silence (issue 38). On a connection of its own a beat waits
only in the link's queue (100 ms of data on an emulated link), whatever MPI is sending.

Each beat carries how many exchanges with the other hosts the rank has entered and whether
it is inside one (`report`), so that a host alive but not coming to an exchange can be
told from one busy in a long transfer (`behind`; see MPIHosts._wait).

Connections: every rank listens on one socket of its own; the addresses are exchanged once
through `allgather`, and each rank connects to every lower rank, trying the addresses
that rank gave in order (`beat_addresses`); a hello and its answer, with a token of
the run and both ranks, make sure the connection reached the right process. The thread
does no MPI. Its cost: (H - 1) beats of 8 bytes per rank per interval plus TCP/IP headers,
and a few non-blocking system calls every 0.25 s.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import psutil

from hybriddl.hosts.beater import BeatSender

INTERVAL_SECONDS = 2.0
# Long enough that a rank busy in a long step, a checkpoint write or a swap storm still
# gets its thread scheduled once in a while; short enough to name a lost host in 15-17 s.
SILENCE_SECONDS = 15.0
POLL_SECONDS = 0.25
# A peer's last beat tells where it is only while it is this fresh (in beat intervals):
# `behind` leaves older ones to `lost`.
RECENT_BEATS = 2
# Per address tried: long enough for a loaded host to answer, short enough that a few
# unreachable addresses (a docker bridge, a second NIC) delay the start by seconds only.
CONNECT_SECONDS = 5.0
BEAT = struct.Struct("!q")  # 2 x exchanges entered + 1 while inside one; BYE when leaving
BYE = -1
HELLO = struct.Struct("!8sqq")  # the run's token, the sender's rank, the rank it wants
# Open MPI's parameter naming the interfaces (names or subnets) its TCP transport uses
# between hosts: mpirun passes `--mca btl_tcp_if_include X` to the ranks in this variable.
TCP_INCLUDE = "OMPI_MCA_btl_tcp_if_include"


def beat_addresses(include: str | None = None,
                   interfaces: dict[str, list[str]] | None = None) -> list[str]:
    """This host's IPv4 addresses for the others' beats, the likeliest first: those on the
    interfaces Open MPI's TCP transport is told to use (btl_tcp_if_include: names or
    subnets), else every address but loopback's, then loopback's (ranks on one machine)."""
    include = os.environ.get(TCP_INCLUDE) if include is None else include
    if interfaces is None:
        interfaces = {name: [a.address for a in addresses if a.family == socket.AF_INET]
                      for name, addresses in psutil.net_if_addrs().items()}
    every = [(name, address) for name, addresses in interfaces.items() for address in addresses]
    if include:
        chosen = [address for name, address in every
                  if any(_matches(item.strip(), name, address) for item in include.split(","))]
        if chosen:
            return _unique(chosen)
    loopback = [address for _, address in every if ipaddress.ip_address(address).is_loopback]
    others = [address for _, address in every if address not in loopback]
    return _unique([*others, *(loopback or ["127.0.0.1"])])


def _matches(item: str, interface: str, address: str) -> bool:
    if "/" not in item:
        return item == interface
    try:
        return ipaddress.ip_address(address) in ipaddress.ip_network(item, strict=False)
    except ValueError:
        return False


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


class Heartbeat:
    """Beats to and from every other rank, on TCP connections of its own.

    `allgather(value) -> list` is a collective every rank calls once here, to exchange
    the addresses the ranks listen on.
    """

    def __init__(self, allgather: Callable[[object], list], rank: int, size: int,
                 interval: float = INTERVAL_SECONDS, silence: float = SILENCE_SECONDS,
                 addresses: list[str] | None = None, sender: BeatSender | None = None):
        self.rank, self.interval, self.silence = rank, interval, silence
        # Where beats leave from a process of the rank's own (hosts/beater.py), so that a
        # rank holding the GIL still beats; None: from this thread.
        self.sender = sender
        self.peers = [r for r in range(size) if r != rank]
        self._token = os.urandom(8)
        self._listener = socket.create_server(("0.0.0.0", 0), backlog=max(size, 8))
        self._listener.setblocking(False)
        self.addresses = addresses or beat_addresses()
        self._lock = threading.Lock()  # _connections: the connecting and the beating thread
        self._connections: dict[int, socket.socket] = {}
        self._hellos: dict[socket.socket, bytes] = {}  # accepted, hello not read yet
        self._inbox: dict[int, bytes] = {}
        self._outbox: dict[int, bytes] = {}
        self._state = 0  # what this rank's beats say (see `report`)
        self._progress: dict[int, int] = {}  # peer -> the state its last beat said
        self._left: set[int] = set()  # peers that said BYE: they finished, they are not lost
        self._failed: dict[int, str] = {}  # peer -> why, from its connection
        self.ended: set[int] = set()  # peers whose connection closed: their process ended
        self.beats_sent = 0
        self.cpu_seconds = 0.0  # this thread's own CPU time: what it takes from training
        self._stopping = threading.Event()
        # peer -> when last heard, from the moment its connection was made: a peer still
        # connecting is not silent (see `_connect_by`).
        self._heard: dict[int, float] = {}
        # Silence counts only while this thread listened: a thread kept from running (a
        # long call holding the GIL, this process stopped and resumed) must not take the
        # beats still waiting in the kernel's buffers for silence.
        self._listened_until = time.monotonic()
        table = allgather((self._token, self.addresses, self._listener.getsockname()[1]))
        self._run_token = table[0][0]
        # A higher rank connects to the lower ranks one after another, trying each one's
        # addresses in order, up to CONNECT_SECONDS to connect and as long for the answer
        # per address: it is lost only when it has not connected once all of that has
        # passed, and the silence after it.
        trying = 2 * CONNECT_SECONDS * sum(len(addresses) for _, addresses, _ in table[:rank + 1])
        self._connecting_since = time.monotonic()
        self._connect_by = self._connecting_since + trying + silence
        self._thread = threading.Thread(target=self._run, name="hybriddl-heartbeat", daemon=True)
        self._thread.start()  # it answers the hellos of higher ranks
        for peer in self.peers:
            if peer < rank:
                self._connect(peer, *table[peer][1:])

    @property
    def bytes_per_second(self) -> float:
        """The payload this rank sends (headers not counted)."""
        return len(self.peers) * BEAT.size / self.interval

    @property
    def running(self) -> bool:
        """The beating thread is alive (it stops only on close or on a fault of its own)."""
        return self._thread.is_alive()

    @property
    def fault(self) -> str | None:
        """Why the beating thread stopped on a fault of its own (None: it did not)."""
        return self._failed.get(-1)

    # ------------------------------------------------------------------ connecting
    def _connect(self, peer: int, addresses: list[str], port: int) -> None:
        errors = []
        for address in addresses:
            try:
                connection = socket.create_connection((address, port), timeout=CONNECT_SECONDS)
            except OSError as exc:
                errors.append(f"{address}: {exc.strerror or exc}")
                continue
            try:
                connection.sendall(HELLO.pack(self._run_token, self.rank, peer))
                answer = _read_exactly(connection, HELLO.size)
            except OSError as exc:
                answer = None
                errors.append(f"{address}: {exc.strerror or exc}")
            if answer != HELLO.pack(self._run_token, peer, self.rank):
                connection.close()  # another process listens there (another rank, a reused port)
                if answer is not None:
                    errors.append(f"{address}: not rank {peer}")
                continue
            connection.setblocking(False)
            _no_delay(connection)
            with self._lock:
                self._connections[peer] = connection
            self._heard.setdefault(peer, time.monotonic())
            if self.sender:
                self.sender.add(peer, connection)
            return
        self._failed[peer] = (f"no heartbeat connection to its port {port} at "
                              f"{'; '.join(errors)}: the hosts must reach each other over TCP "
                              "(set btl_tcp_if_include to the interface between them)")

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            connection.setblocking(False)
            self._hellos[connection] = b""
        for connection, received in list(self._hellos.items()):
            try:
                received += connection.recv(HELLO.size - len(received))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                received = b""
            if len(received) < HELLO.size and received:
                self._hellos[connection] = received
                continue
            del self._hellos[connection]
            if len(received) < HELLO.size:
                connection.close()
                continue
            token, peer, wanted = HELLO.unpack(received)
            if token != self._run_token or wanted != self.rank or peer not in self.peers \
                    or peer < self.rank:
                connection.close()  # not one of this run's ranks
                continue
            _no_delay(connection)
            with self._lock:
                # A peer that gave up waiting for an answer tries its next address: the
                # newest connection is the one it keeps.
                previous = self._connections.get(peer)
                self._connections[peer] = connection
                self._failed.pop(peer, None)
                self.ended.discard(peer)
            self._heard.setdefault(peer, time.monotonic())
            if previous is not None:
                previous.close()
            try:  # answered once registered: the peer counts on the connection from then on
                connection.sendall(HELLO.pack(token, self.rank, peer))
            except OSError:
                continue  # the peer tries its next address, or is named silent
            if self.sender:
                self.sender.add(peer, connection)

    # ------------------------------------------------------------------ beating
    def _run(self) -> None:
        next_beat = 0.0
        started = time.thread_time()
        try:
            while not self._stopping.wait(POLL_SECONDS):
                self.cpu_seconds = time.thread_time() - started
                # Taken before reading: whatever arrived before `now` is read below.
                now = time.monotonic()
                if self.sender and not self.sender.running:
                    self.sender = None  # the beats' process ended: this thread beats again
                self._accept()
                beat = now >= next_beat
                with self._lock:
                    connections = list(self._connections.items())
                for peer, connection in connections:
                    if peer not in self._failed:
                        self._exchange(peer, connection, now, beat)
                self._listened_until = now
                if beat:
                    self.beats_sent += 1
                    next_beat = now + self.interval
        except Exception as exc:  # never a traceback from this thread; MPIHosts falls back
            self._failed.setdefault(-1, f"the heartbeat stopped ({exc})")

    def _exchange(self, peer: int, connection: socket.socket, now: float, beat: bool) -> None:
        try:
            while True:
                try:
                    data = connection.recv(4096)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    raise ConnectionAbortedError("closed")
                self._heard[peer] = now
                self._read_beats(peer, self._inbox.get(peer, b"") + data)
            if beat and not self._outbox.get(peer) and not self.sender:
                # One beat in flight per peer: a peer that reads nothing gets no pile of them.
                self._outbox[peer] = BEAT.pack(self._state)
            if self._outbox.get(peer):
                try:
                    sent = connection.send(self._outbox[peer])
                    self._outbox[peer] = self._outbox[peer][sent:]
                except (BlockingIOError, InterruptedError):
                    pass
        except OSError as exc:
            with self._lock:
                if self._connections.get(peer) is not connection:
                    return  # replaced by a newer connection from the same peer
            if peer in self._left:
                return
            if isinstance(exc, (ConnectionAbortedError, ConnectionResetError, BrokenPipeError)):
                # Closed (FIN) or reset (RST, when beats were still unread): by the kernel,
                # as the peer's process ended, since a living one says BYE first.
                self.ended.add(peer)
                how = "closed" if isinstance(exc, ConnectionAbortedError) else "reset"
                self._failed[peer] = f"its heartbeat connection {how}: its process ended"
            else:
                self._failed[peer] = f"its heartbeat connection failed: {exc.strerror or exc}"

    def _read_beats(self, peer: int, data: bytes) -> None:
        whole = len(data) - len(data) % BEAT.size
        for (value,) in BEAT.iter_unpack(data[:whole]):
            if value == BYE:
                self._left.add(peer)
            else:
                self._progress[peer] = value
        self._inbox[peer] = data[whole:]

    def report(self, exchanges: int, inside: bool) -> None:
        """What this rank's next beats say: `exchanges` entered so far, and whether it
        waits inside one now."""
        self._state = 2 * exchanges + int(inside)
        if self.sender:
            self.sender.report(self._state)

    # ------------------------------------------------------------------ asking
    def lost(self) -> dict[int, str]:
        """The peers lost so far (rank -> why), empty while every peer is heard."""
        listened = self._listened_until
        # Copies: the listening thread adds peers to these while this one reads them.
        lost = {peer: why for peer, why in list(self._failed.items())
                if peer >= 0 and peer not in self._left}
        for peer in self.peers:
            if peer in lost or peer in self._left:
                continue
            heard = self._heard.get(peer)
            if heard is None and listened > self._connect_by:
                lost[peer] = ("its heartbeat did not connect in "
                              f"{listened - self._connecting_since:.0f} s")
            elif heard is not None and listened - heard > self.silence:
                lost[peer] = f"silent for {listened - heard:.0f} s"
        return lost

    def behind(self, exchanges: int) -> list[int]:
        """The peers whose last beat said they had entered fewer than `exchanges` exchanges
        and were inside none: alive, but not coming to this one (a peer inside an earlier
        exchange is in a transfer with someone, however long it takes). Only peers heard
        within the last RECENT_BEATS intervals: what an older beat said may be stale (a
        host cut off between two exchanges), and such a peer is named by `lost` after the
        silence instead."""
        listened, recent = self._listened_until, RECENT_BEATS * self.interval
        return sorted(peer for peer, state in list(self._progress.items())
                      if state // 2 < exchanges and not state % 2 and peer not in self._left
                      and listened - self._heard.get(peer, listened) <= recent)

    def inside_with(self, exchanges: int) -> bool:
        """Whether every peer is heard and inside exchange number `exchanges` too (its last
        beat, within RECENT_BEATS intervals, says so): all hosts alive and in the same one."""
        return self._every_peer_heard(lambda state: state == 2 * exchanges + 1)

    def inside_from(self, exchanges: int) -> bool:
        """Whether every peer is heard and inside exchange number `exchanges` or a later one:
        all hosts alive, none of them behind this exchange (a peer inside a later one has
        sent all it had for this one)."""
        return self._every_peer_heard(lambda state: state % 2 == 1 and state // 2 >= exchanges)

    def _every_peer_heard(self, saying) -> bool:
        """Whether every peer still in the run was heard within RECENT_BEATS intervals and its
        last beat's state is one `saying` accepts."""
        listened, recent = self._listened_until, RECENT_BEATS * self.interval
        return all((state := self._progress.get(peer)) is not None and saying(state)
                   and peer not in self._left
                   and listened - self._heard.get(peer, -recent) <= recent
                   for peer in self.peers)

    def states(self) -> dict[int, str]:
        """Each peer's state as its last beat said: where it is, for a line about a stall."""
        listened = self._listened_until
        said = {}
        for peer in self.peers:
            state = self._progress.get(peer)
            heard = listened - self._heard.get(peer, listened)
            if state is None:
                said[peer] = "beats only (no exchange reported yet)"
            else:
                where = "inside" if state % 2 else "after"
                said[peer] = f"{where} exchange {state // 2} ({heard:.0f} s ago)"
        return said

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Say BYE to every peer (so that none takes this rank's end for a failure) and stop."""
        if self.sender:
            self.sender.close()  # its last beat whole before the BYE
        self._stopping.set()
        self._thread.join(timeout=5)
        with self._lock:
            connections = list(self._connections.items())
            self._connections.clear()
        for peer, connection in connections:
            try:
                connection.settimeout(1.0)
                connection.sendall(self._outbox.get(peer, b"") + BEAT.pack(BYE))
                connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            connection.close()
        for connection in self._hellos:
            connection.close()
        self._listener.close()


def _read_exactly(connection: socket.socket, size: int) -> bytes | None:
    received = b""
    while len(received) < size:
        data = connection.recv(size - len(received))
        if not data:
            return None
        received += data
    return received


def _no_delay(connection: socket.socket) -> None:
    # An 8-byte beat must leave at once, not wait for Nagle's algorithm to fill a segment.
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

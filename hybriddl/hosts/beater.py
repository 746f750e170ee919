"""The beats' sender: a small process of each rank's own, so that a rank busy in one long
call holding Python's GIL, or starved of CPU, still beats, while a stopped one does not.

The heartbeat (hosts/heartbeat.py) keeps its connections, reads the peers' beats and
judges them from a thread of the rank; a thread needs the GIL for every beat it sends,
and a rank in a C call that keeps the GIL (or a pure-Python section the interpreter does
not switch out of) sent nothing for as long: its peers named it lost after 15 s. Here a
child process, started before MPI starts (no fork after MPI's initialisation: it is
spawned with its own interpreter, stdlib only, a few MB), is handed each connection once
the hello was answered (SCM_RIGHTS on a Unix socket pair) and sends every beat on it.
The rank tells it what its beats say (`report`) on the same pair.

A rank's liveness is what the kernel says of it: the child beats while its parent runs
or sleeps (a GIL held in `sleep`, a wait in a C library, a CPU given to others), and
stops while its parent is stopped (SIGSTOP, a debugger: state T in /proc), so that a
stopped rank is still named lost by its peers. It ends when its parent ends (its parent
id changes) or says so (`close`).

    python -m hybriddl.hosts.beater FD INTERVAL    (started by `BeatSender.start`)
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

BEAT = struct.Struct("!q")  # hosts/heartbeat.py's: the state a beat says
# Messages from the rank: a state ("S" + BEAT), a connection ("C" + the peer's rank,
# the socket passed alongside), the end ("E").
STATE, CONNECTION, END = b"S", b"C", b"E"
PEER = struct.Struct("!q")
POLL_SECONDS = 0.05
HAND_SECONDS = 2.0  # the most a connection waits to be handed over (`BeatSender.add`)
STOPPED_STATES = ("T", "t")  # stopped by a signal, stopped by a tracer
LAUNCHER_VARIABLES = ("OMPI_", "PMIX_", "PRTE_", "SLURM_")


class BeatSender:
    """The rank's side: the child process and the Unix socket pair to it."""

    def __init__(self, process: subprocess.Popen, control: socket.socket):
        self._process = process
        self._control = control

    @classmethod
    def start(cls, interval: float) -> BeatSender | None:
        """The child, beating every `interval` seconds once given connections; None where
        it cannot start (the heartbeat then beats from its thread, as before)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Not an MPI process: without the launcher's variables, nothing takes it for a rank.
        environment = {key: value for key, value in os.environ.items()
                       if not key.startswith(LAUNCHER_VARIABLES)}
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "hybriddl.hosts.beater", str(theirs.fileno()),
                 repr(interval)], env=environment,
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(process, ours)

    def add(self, peer: int, connection: socket.socket) -> None:
        """Beat to `peer` on `connection` (the child holds its own descriptor of it). A child
        that does not take it within HAND_SECONDS is ended: the heartbeat's thread then
        beats itself (Heartbeat._run)."""
        self._control.settimeout(HAND_SECONDS)
        try:
            socket.send_fds(self._control, [CONNECTION + PEER.pack(peer)],
                            [connection.fileno()])
        except OSError:
            self._process.kill()
        finally:
            self._control.settimeout(None)

    def report(self, state: int) -> None:
        try:
            self._control.send(STATE + BEAT.pack(state), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError, OSError):
            pass  # the child reads its messages every 50 ms: the next report is sent

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def close(self, seconds: float = 2.0) -> None:
        """Stop the child (its last beat sent whole) before the rank says goodbye itself."""
        try:
            self._control.send(END)
        except OSError:
            pass
        try:
            self._process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._control.close()


def parent_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a tracer), from /proc (False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0].decode() in STOPPED_STATES


def run(control: socket.socket, interval: float) -> None:
    """The child's loop: read the rank's messages, beat every `interval` seconds to every
    connection it was given, unless the rank is stopped; end with the rank."""
    parent = os.getppid()
    connections: dict[int, socket.socket] = {}
    unsent: dict[int, bytes] = {}
    state, next_beat = 0, 0.0
    control.setblocking(False)
    while os.getppid() == parent:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(control, 64, 1)
            except (BlockingIOError, InterruptedError):
                break
            if not message or message[:1] == END:
                return
            if message[:1] == STATE:
                state = BEAT.unpack(message[1:])[0]
            elif message[:1] == CONNECTION and fds:
                peer = PEER.unpack(message[1:])[0]
                connections[peer] = socket.socket(fileno=fds[0])
                connections[peer].setblocking(False)
        now = time.monotonic()
        if now >= next_beat and not parent_stopped(parent):
            next_beat = now + interval
            for peer, connection in list(connections.items()):
                # One beat in flight per peer: a peer that reads nothing gets no pile of them.
                pending = unsent.get(peer) or BEAT.pack(state)
                try:
                    sent = connection.send(pending)
                    unsent[peer] = pending[sent:]
                except (BlockingIOError, InterruptedError):
                    unsent[peer] = pending
                except OSError:
                    connection.close()  # the rank's own thread reads why, on its descriptor
                    del connections[peer]
        time.sleep(POLL_SECONDS)


def main(argv: list[str]) -> None:
    # Ctrl-C, and a scheduler's SIGTERM or SIGUSR1 (scancel, a time limit), go to the whole
    # process group: the rank handles them, stops with the other hosts, and ends this. Its
    # beats go on meanwhile, or the others would name it lost while it stops.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    control = socket.socket(fileno=int(argv[0]))
    run(control, float(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])

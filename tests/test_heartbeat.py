"""The heartbeat between hosts (hybriddl.hosts.heartbeat), on its own TCP connections, in
one process (ranks as threads): beats flow without MPI, a peer whose process ended is named
at once, a silent one after the silence, one that said goodbye never, and a peer alive but
outside the exchange the others wait in is told apart from one in a transfer.

A host lost on emulated hosts: tests/test_heartbeat_hosts.py.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

import hybriddl.hosts.heartbeat as heartbeat_module
from hybriddl.hosts.beater import BeatSender, parent_stopped
from hybriddl.hosts.heartbeat import Heartbeat, beat_addresses

# ---------------------------------------------------------------------- in one process
# Beats every 0.1 s and silences of a second, read against the clock: with no other test
# beside them (tests/two_at_once.py).
timed = pytest.mark.alone

class Ranks:
    """`count` Heartbeats in one process, each built on a thread of its own (as ranks
    build theirs at once), exchanging their addresses through a plain allgather."""

    def __init__(self, count: int, interval: float = 0.1, silence: float = 1.0,
                 senders: bool = False, join: bool = True):
        self.values: list = [None] * count
        # With `senders`, each rank's beats leave from a process of its own (hosts/beater.py).
        self.senders = [BeatSender.start(interval) if senders else None for _ in range(count)]
        self._barrier = threading.Barrier(count)
        self.beats: list[Heartbeat | None] = [None] * count
        self._threads = [threading.Thread(target=self._start, args=(r, count, interval, silence))
                         for r in range(count)]
        for thread in self._threads:
            thread.start()
        if join:
            self.join()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=30)
        assert all(self.beats), "a heartbeat did not start"

    def _start(self, rank, count, interval, silence) -> None:
        def allgather(value):
            self.values[rank] = value
            self._barrier.wait()
            gathered = list(self.values)
            self._barrier.wait()
            return gathered
        self.beats[rank] = Heartbeat(allgather, rank, count, interval=interval,
                                     silence=silence, addresses=["127.0.0.1"],
                                     sender=self.senders[rank])

    def close(self) -> None:
        for beat in self.beats:
            beat.close()


def wait_until(condition, seconds: float):
    """Poll `condition` (its value when true); fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value


def freeze(beat: Heartbeat) -> None:
    """Stop a heartbeat's thread with its connections open: a process stopped or cut off."""
    beat._stopping.set()
    beat._thread.join(timeout=5)


@timed
def test_the_heartbeat_needs_no_mpi_so_its_beats_never_wait_behind_bulk_data():
    """Open MPI sends a pair's messages on one TCP connection, one after another: beats
    sent through MPI waited behind a 31 s broadcast (issue 38). These have their own."""
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(
        Path(heartbeat_module.__file__).read_text())) if isinstance(node, (ast.Import,
        ast.ImportFrom)) for alias in (node.names if isinstance(node, ast.Import) else
        [ast.alias(node.module or "")])}
    assert "mpi4py" not in imported
    ranks = Ranks(3)
    try:
        assert [sorted(beat._connections) for beat in ranks.beats] == [[1, 2], [0, 2], [0, 1]]
        wait_until(lambda: all(len(beat._progress) == 2 for beat in ranks.beats), 5)
        assert [beat.lost() for beat in ranks.beats] == [{}, {}, {}]
    finally:
        ranks.close()


@timed
def test_a_peer_whose_process_ended_is_named_at_once():
    ranks = Ranks(2, silence=30.0)
    try:
        freeze(ranks.beats[1])
        for connection in ranks.beats[1]._connections.values():
            connection.close()  # what the kernel does for a killed process: no goodbye
        started = time.monotonic()
        lost = wait_until(ranks.beats[0].lost, 5)
        assert time.monotonic() - started < 2
        assert list(lost) == [1] and "its process ended" in lost[1] and ranks.beats[0].ended == {1}
    finally:
        ranks.close()


@timed
def test_a_silent_peer_is_named_after_the_silence_and_not_before():
    ranks = Ranks(2, silence=1.0)
    try:
        wait_until(lambda: ranks.beats[0]._progress, 5)
        freeze(ranks.beats[1])
        frozen = time.monotonic()
        lost = wait_until(ranks.beats[0].lost, 5)
        assert time.monotonic() - frozen > 1.0 - 0.3  # the last beat may predate the freeze
        assert re.fullmatch(r"silent for \d s", lost[1]) and not ranks.beats[0].ended
    finally:
        ranks.close()


@timed
def test_a_peer_still_connecting_to_the_lower_ranks_is_not_silent_until_it_could_have(monkeypatch):
    """A rank connects to the lower ranks one after another, up to CONNECT_SECONDS per
    address that does not answer (a firewalled NIC, a docker bridge): its silence counts
    from its connection, and one that never connects is named once it could have."""
    monkeypatch.setattr(heartbeat_module, "CONNECT_SECONDS", 0.5)
    go = threading.Event()
    connect = Heartbeat._connect

    def slow_to_rank_1(self, peer, addresses, port):
        if self.rank == 2 and peer == 1:
            go.wait(timeout=30)  # still trying the addresses before rank 1's
        connect(self, peer, addresses, port)

    monkeypatch.setattr(Heartbeat, "_connect", slow_to_rank_1)
    ranks = Ranks(3, silence=1.0, join=False)
    try:
        first = wait_until(lambda: ranks.beats[1], 10)
        started = time.monotonic()
        # Past the silence, within the time rank 2 may take: 2 x 0.5 s per address of
        # ranks 0 and 1, and the silence.
        wait_until(lambda: first._listened_until > started + 1.2, 5)
        assert 2 not in first._connections and first.lost() == {}
        go.set()
        ranks.join()
        wait_until(lambda: all(len(beat._progress) == 2 for beat in ranks.beats), 5)
        assert [beat.lost() for beat in ranks.beats] == [{}, {}, {}]
    finally:
        go.set()
        ranks.close()
    go.clear()
    never = Ranks(3, silence=1.0, join=False)
    try:
        first = wait_until(lambda: never.beats[1], 10)
        lost = wait_until(first.lost, 10)
        assert list(lost) == [2] and re.fullmatch(r"its heartbeat did not connect in \d s",
                                                  lost[2]), lost
    finally:
        go.set()
        never.join()
        never.close()


@timed
def test_a_peer_that_said_goodbye_is_not_lost():
    """Hosts leave the final barrier at their own pace: one that finished first and
    closed its heartbeat must not read as lost to one still waiting."""
    ranks = Ranks(2, silence=0.5)
    ranks.beats[1].close()
    try:
        wait_until(lambda: 1 in ranks.beats[0]._left, 5)
        time.sleep(1.0)  # the span under test: twice the silence, no beat
        assert ranks.beats[0].lost() == {}
    finally:
        ranks.beats[0].close()


@timed
def test_a_peer_outside_the_exchange_is_behind_and_one_inside_an_earlier_one_is_not():
    ranks = Ranks(3)
    try:
        ranks.beats[1].report(4, inside=False)  # alive, not come to exchange 5
        ranks.beats[2].report(4, inside=True)   # in exchange 4: a transfer with someone
        ranks.beats[0].report(5, inside=True)
        wait_until(lambda: ranks.beats[0]._progress.get(1) == 8 and
                   ranks.beats[0]._progress.get(2) == 9, 5)
        # A peer counts as behind only while its beats are fresh (two intervals): on a
        # loaded machine a beat can come late, so the answer is awaited, not read once.
        # Read together, so that exchange 4's answer comes from the same fresh beats.
        wait_until(lambda: (ranks.beats[0].behind(5), ranks.beats[0].behind(4)) == ([1], []), 5)
    finally:
        ranks.close()


@timed
def test_a_peer_whose_last_beat_is_old_is_not_behind_but_left_to_the_silence():
    """A host cut off between two exchanges: its last beat said "outside, fewer exchanges",
    but that is stale once no beat follows; it is named lost after the silence, not as a
    host that runs and does not come (which --host-timeout shorter than the silence did)."""
    ranks = Ranks(2, interval=0.1, silence=5.0)
    try:
        ranks.beats[1].report(4, inside=False)
        wait_until(lambda: ranks.beats[0]._progress.get(1) == 8, 5)
        wait_until(lambda: ranks.beats[0].behind(5) == [1], 5)  # fresh beats, as above
        freeze(ranks.beats[1])
        wait_until(lambda: ranks.beats[0].behind(5) == [], 2)
        assert ranks.beats[0].lost() == {}  # not yet: 5 s of silence
    finally:
        ranks.close()


@timed
def test_a_rank_whose_thread_was_held_names_no_peer_when_it_runs_again():
    """A rank stopped (SIGSTOP) or holding the GIL for longer than the silence hears nothing
    meanwhile: its peers' beats wait in its sockets. Silence counts only while it listened,
    so neither during the hold nor once its thread runs again does it name a healthy peer."""
    ranks = Ranks(2, silence=1.0)
    try:
        wait_until(lambda: ranks.beats[0]._progress, 5)
        with ranks.beats[0]._lock:  # its thread waits here at its next poll, as held
            time.sleep(2.0)  # twice the silence
            assert ranks.beats[0].lost() == {}
        time.sleep(0.5)  # polls that read the waiting beats
        assert ranks.beats[0].lost() == {}
    finally:
        ranks.close()


@timed
def test_beats_from_a_process_of_the_ranks_own_go_on_while_its_thread_is_held():
    """hosts/beater.py: a rank whose threads cannot run (the GIL held in one long call)
    still beats, and is not named lost by its peers; its own thread keeps reading them."""
    ranks = Ranks(2, silence=1.0, senders=True)
    try:
        ranks.beats[1].report(3, inside=False)
        wait_until(lambda: ranks.beats[0]._progress.get(1) == 6, 5)  # the state it reported
        with ranks.beats[1]._lock:  # rank 1's thread held for three silences
            time.sleep(3.0)
            assert ranks.beats[0].lost() == {}
        assert all(sender.running for sender in ranks.senders)
    finally:
        ranks.close()
    assert not any(sender.running for sender in ranks.senders)  # ended with the heartbeat
    assert not parent_stopped(os.getpid())


@timed
def test_where_the_beats_process_ends_the_heartbeats_thread_beats_again():
    ranks = Ranks(2, silence=1.0, senders=True)
    try:
        ranks.senders[1]._process.kill()
        ranks.senders[1]._process.wait()
        time.sleep(2.0)  # twice the silence
        assert ranks.beats[0].lost() == {} and ranks.beats[1].sender is None
    finally:
        ranks.close()


def test_the_beats_process_outlasts_a_schedulers_sigterm_to_the_process_group():
    """scancel signals every process of the job: the rank stops with its hosts, beating."""
    import signal

    def ignored() -> int:
        status = Path(f"/proc/{sender._process.pid}/status").read_text()
        return int(status.split("SigIgn:")[1].split()[0], 16)

    sender = BeatSender.start(0.1)
    try:
        wait_until(lambda: ignored() & 1 << (signal.SIGINT - 1), 10)  # its handlers are set
        sender._process.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            sender._process.wait(timeout=1)  # a process that does not ignore it ends at once
        assert sender.running
    finally:
        sender.close()
    assert not sender.running


def test_the_beats_process_tells_a_stopped_rank_from_a_running_one():
    """hosts/beater.py beats only while its rank is not stopped (SIGSTOP: state T)."""
    import signal
    import subprocess

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert not parent_stopped(sleeper.pid)
        sleeper.send_signal(signal.SIGSTOP)
        wait_until(lambda: parent_stopped(sleeper.pid), 5)
        sleeper.send_signal(signal.SIGCONT)
        wait_until(lambda: not parent_stopped(sleeper.pid), 5)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not parent_stopped(sleeper.pid)  # gone: not stopped


def test_beats_use_the_interfaces_mpi_is_told_to_use_else_every_address_loopback_last():
    interfaces = {"lo": ["127.0.0.1"], "eth0": ["198.18.0.2"], "docker0": ["172.17.0.1"]}
    assert beat_addresses("198.18.0.0/24", interfaces) == ["198.18.0.2"]
    assert beat_addresses("lo", interfaces) == ["127.0.0.1"]
    assert beat_addresses("eth0,docker0", interfaces) == ["198.18.0.2", "172.17.0.1"]
    assert beat_addresses("", interfaces) == ["198.18.0.2", "172.17.0.1", "127.0.0.1"]
    assert beat_addresses("10.0.0.0/8", interfaces)[-1] == "127.0.0.1"  # none matches
    assert beat_addresses("", {"eth0": []}) == ["127.0.0.1"]

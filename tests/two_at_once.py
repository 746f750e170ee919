"""Two tests at once where that cannot change what they measure (a pytest plugin, loaded by
conftest.py).

`python -m pytest -q -n 2 --dist loadfile tests` runs the suite on pytest-xdist's workers: a
module's tests go to one worker, in order. A test marked for what it starts (`root`, `mpi`,
`emulated`, `slurm`, `gpu`) or marked `alone` (what it asserts depends on timings, as the
tuner's picks do, or it holds a gloo group in the worker's process) runs alone: its
timings, its emulated hosts' cores and its checks of what a run left on the machine
(processes, namespaces, shared memory) see no other test. Unless it is also marked
`beside`: it starts hosts, ranks, mounts or a SLURM job but mostly waits (for a silence, a
slow link, a requeue), what it asserts holds on a loaded machine (bounds of seconds with
room) and it checks only what it started; alone, its waits left both cores idle. Other
tests, `slow` ones too (a training run in a child process, its files and its numbers), run
beside each other. A module marked `holds_hosts` keeps emulated hosts in a module fixture,
made for its first test marked alone and kept to its last test: it runs alone from that
first test to its last (its tests before, on one machine, run beside others).
Modules with no test alone come first: both workers are busy with them at once, before the
tests alone, which leave one worker waiting, begin. Among them those with a `slow` test come
first and the quick ones last: a worker still in its last such module when the other has
begun the tests alone runs it one test at a time between theirs, so that module should be
short; and of the modules with tests alone, those that begin with tests beside others come
first, to meet those last modules. (pytest-xdist would order the modules by their number of tests instead: the
controller turns that off, `--no-loadscope-reorder`. Without it, modules alone came first
as often as not, and about 110 s of a 1250 s suite ran one test beside an idle worker.)
A test that a `skip` mark, or a `skipif` whose condition is true, skips is not alone: it
runs nothing.

Two file locks shared by the workers: `alone` (shared by tests beside each other, exclusive
for a test alone) and a turnstile in front of it, so that a test waiting to run alone is not
overtaken by a stream of others (a fair readers-writer lock). README's and CI's test
command runs on two workers; without `-n` (the GPU check's pytest, which has no xdist) the
tests run one after another, in the order written, without any lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ALONE_MARKS = ("root", "mpi", "emulated", "slurm", "gpu", "alone")
BESIDE = "beside"  # starts what ALONE_MARKS name, yet may run beside other tests
HOLDS_HOSTS = "holds_hosts"
LOCKS_VARIABLE = "HYBRIDDL_TEST_LOCKS"  # the folder of the two locks, set by the controller


def marked_alone(item: pytest.Item) -> bool:
    return (any(item.get_closest_marker(mark) for mark in ALONE_MARKS)
            and item.get_closest_marker(BESIDE) is None and not skipped_by_marks(item))


def skipped_by_marks(item: pytest.Item) -> bool:
    """Whether a `skip` mark, or a `skipif` whose condition is already true (not a string to
    evaluate), skips the test: it runs nothing, so it needs no turn alone. Such a test
    waited for the other worker's test under way to end (up to half a minute) only to
    skip: 18 GPU tests on a host without one did, about 100 s a suite."""
    iter_markers = getattr(item, "iter_markers", None)
    if iter_markers is None:
        return False
    if next(iter(iter_markers("skip")), None) is not None:
        return True
    for mark in iter_markers("skipif"):
        conditions = mark.args if mark.args else (
            (mark.kwargs["condition"],) if "condition" in mark.kwargs else (True,))
        if any(not isinstance(condition, str) and condition for condition in conditions):
            return True
    return False


def alone_from_the_start(items: list[pytest.Item]) -> set[str]:
    """The node ids of the tests that run alone: those marked so and, in a module that
    holds hosts, every test from its first one marked so (whose fixture makes the hosts) to
    the module's last (after which they are taken down). `items` in run order."""
    alone, holding = set(), set()
    for item in items:
        marked = marked_alone(item)
        if marked and item.get_closest_marker(HOLDS_HOSTS):
            holding.add(item.path)
        if marked or item.path in holding:
            alone.add(item.nodeid)
    return alone


class Turns:
    """This worker's hold on the two locks."""

    def __init__(self, folder: Path):
        self._turnstile = open(folder / "turnstile", "a")
        self._alone = open(folder / "alone", "a")
        self.holding: bool | None = None  # None: nothing held; else whether exclusively

    def take(self, alone: bool) -> None:
        if self.holding == alone:
            return
        self.give_back()
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._alone, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.holding = alone

    def give_back(self) -> None:
        if self.holding is not None:
            fcntl.flock(self._alone, fcntl.LOCK_UN)
            self.holding = None


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller made the folder
        folder = os.environ.get(LOCKS_VARIABLE)
        if folder:
            config._hybriddl_turns = Turns(Path(folder))
    elif getattr(config.option, "numprocesses", None):  # the controller of workers
        # The modules in the workers' order (pytest_collection_modifyitems), not xdist's.
        config.option.loadscopereorder = False
        folder = tempfile.mkdtemp(prefix="hybriddl-test-locks-")
        os.environ[LOCKS_VARIABLE] = folder
        config._hybriddl_locks = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_hybriddl_locks", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(LOCKS_VARIABLE, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config, "_hybriddl_turns", None) is None:
        return  # one after another: the order as written
    with_alone = {item.path for item in items
                  if marked_alone(item) or item.get_closest_marker(HOLDS_HOSTS)}
    with_slow = {item.path for item in items if item.get_closest_marker("slow")}
    first = {}
    for item in items:
        first.setdefault(item.path, item)
    starts_alone = {path for path, item in first.items() if marked_alone(item)}
    # Stable: each module's tests in their order. Of the modules with tests alone, those
    # whose first tests run beside others come first: they meet the other worker's last
    # modules beside each other.
    items.sort(key=lambda item: (item.path in with_alone, item.path not in with_slow,
                                 item.path in starts_alone))
    config._hybriddl_alone = alone_from_the_start(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    turns: Turns | None = getattr(item.config, "_hybriddl_turns", None)
    if turns is None:
        yield
        return
    turns.take(item.nodeid in item.config._hybriddl_alone)
    try:
        yield
    finally:
        # A module that holds hosts keeps its turn until its last test's teardown.
        keep = (item.get_closest_marker(HOLDS_HOSTS) is not None and nextitem is not None
                and nextitem.path == item.path)
        if not keep:
            turns.give_back()

"""tests/two_at_once.py, the plugin that runs tests two at once: on two workers, tests
beside each other do run at the same time, and a test marked `alone` runs with no other.

A small suite in a temporary folder, run by pytest-xdist as the real one is: module a's first
test and module b's first test wait for each other (they fail if they cannot run at once);
then, once b's first short test has ended, a's `alone` test runs while b goes on with short
tests, none of which may overlap it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
pytest_plugins = ["two_at_once"]
"""
INI = """[pytest]
markers =
    alone: runs alone
"""
COMMON = """
import time
from pathlib import Path
import pytest

HERE = Path(__file__).parent


def record(name, start, end):
    with open(HERE / "log", "a") as log:
        log.write(f"{name} {start} {end}\\n")


def meet(mine, theirs):
    (HERE / mine).touch()
    deadline = time.monotonic() + 30
    while not (HERE / theirs).exists():
        assert time.monotonic() < deadline, f"{theirs} never ran beside {mine}"
        time.sleep(0.01)
"""
MODULE_A = COMMON + """

def test_a_meets_b():
    start = time.monotonic()
    meet("a", "b")
    record("a_meets_b", start, time.monotonic())


def test_a_waits_for_bs_first_short_test():
    start = time.monotonic()
    meet("a_waits", "short0")
    record("a_waits", start, time.monotonic())


@pytest.mark.alone
def test_alone():
    start = time.monotonic()
    time.sleep(0.3)
    record("alone", start, time.monotonic())
"""
SHORTS = 40
MODULE_B = COMMON + f"\nSHORTS = {SHORTS}\n" + """

def test_b_meets_a():
    start = time.monotonic()
    meet("b", "a")
    record("b_meets_a", start, time.monotonic())


@pytest.mark.parametrize("i", range(SHORTS))
def test_short(i):
    start = time.monotonic()
    time.sleep(0.1)
    record(f"short{i}", start, time.monotonic())
    (HERE / f"short{i}").touch()
"""


def test_tests_run_beside_each_other_and_one_marked_alone_runs_alone(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_a.py").write_text(MODULE_A)
    (tmp_path / "test_b.py").write_text(MODULE_B)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{SHORTS + 4} passed" in done.stdout, done.stdout[-3000:]
    spans = {name: (float(start), float(end)) for name, start, end in
             (line.split() for line in (tmp_path / "log").read_text().splitlines())}
    alone_start, alone_end = spans.pop("alone")
    overlapping = [name for name, (start, end) in spans.items()
                   if start < alone_end and end > alone_start]
    assert overlapping == []
    # b's short tests ran before and after it (a asked to run alone once b's first had
    # ended): the test alone waited for the one under way, not for all of them.
    shorts = [spans[f"short{i}"] for i in range(SHORTS)]
    assert any(end <= alone_start for _, end in shorts), spans
    assert any(start >= alone_end for start, _ in shorts), spans


def test_on_two_workers_the_modules_with_no_test_alone_come_first(tmp_path):
    """A module's tests keep their order; a module with any test alone goes after those with
    none, and one after another (no worker's locks) nothing moves."""
    from types import SimpleNamespace

    import two_at_once

    def item(module, *marks):
        return SimpleNamespace(path=tmp_path / module, name=f"{module}{len(marks)}",
                               nodeid=f"{module}::{len(marks)}", get_closest_marker=lambda mark: mark if mark in marks else None)

    items = [item("a", "mpi"), item("a"), item("b"), item("c", "alone"), item("d"),
             item("d", "slow"), item("e"), item("f"), item("f", "emulated")]
    names = [(i.path.name, i.name) for i in items]
    worker = SimpleNamespace(_hybriddl_turns=object())
    sorted_items = list(items)
    two_at_once.pytest_collection_modifyitems(worker, sorted_items)
    # Beside each other, those with a slow test first; then those with a test alone, the
    # one that begins with a test beside others first.
    assert [i.path.name for i in sorted_items] == ["d", "d", "b", "e", "f", "f", "a", "a", "c"]
    assert [i.name for i in sorted_items if i.path.name == "a"] == ["a1", "a0"]
    same = list(items)
    two_at_once.pytest_collection_modifyitems(SimpleNamespace(), same)
    assert [(i.path.name, i.name) for i in same] == names


def test_a_module_that_holds_hosts_runs_alone_from_its_first_test_alone_to_its_last(tmp_path):
    """Its fixture makes the hosts for the first test marked alone and keeps them to the
    module's end: the tests before run beside others, every one after alone."""
    from types import SimpleNamespace

    import two_at_once

    def item(module, name, *marks):
        return SimpleNamespace(path=tmp_path / module, nodeid=f"{module}::{name}",
                               get_closest_marker=lambda mark: mark if mark in marks else None)

    items = [item("h", "one_host", "holds_hosts"), item("h", "across", "holds_hosts", "mpi"),
             item("h", "after", "holds_hosts"), item("m", "first"), item("m", "mpi", "mpi"),
             item("m", "last")]
    assert two_at_once.alone_from_the_start(items) == {"h::across", "h::after", "m::mpi"}


def test_the_controller_keeps_the_workers_order_of_the_modules(monkeypatch):
    """pytest-xdist's loadfile would hand out the modules by their number of tests."""
    from types import SimpleNamespace

    import two_at_once

    monkeypatch.delenv(two_at_once.LOCKS_VARIABLE, raising=False)
    controller = SimpleNamespace(option=SimpleNamespace(numprocesses=2, loadscopereorder=True))
    two_at_once.pytest_configure(controller)
    try:
        assert controller.option.loadscopereorder is False
    finally:
        two_at_once.pytest_unconfigure(controller)


def test_a_test_marked_beside_runs_beside_others_whatever_it_starts(tmp_path):
    """`beside` takes a test that starts ranks or hosts out of the tests alone, and its
    module, with no other test alone, runs among those beside each other, before them."""
    from types import SimpleNamespace

    import two_at_once

    def item(module, name, *marks):
        return SimpleNamespace(path=tmp_path / module, name=name, nodeid=f"{module}::{name}",
                               get_closest_marker=lambda mark: mark if mark in marks else None)

    waits = item("w", "waits", "root", "emulated", "mpi", "slow", "beside")
    timed = item("t", "timed", "root", "emulated", "mpi")
    assert not two_at_once.marked_alone(waits) and two_at_once.marked_alone(timed)
    items = [timed, waits, item("q", "quick")]
    worker = SimpleNamespace(_hybriddl_turns=object())
    two_at_once.pytest_collection_modifyitems(worker, items)
    assert [i.name for i in items] == ["waits", "quick", "timed"]
    assert worker._hybriddl_alone == {"t::timed"}


def test_a_test_its_marks_skip_is_not_alone(tmp_path):
    """A test marked to run alone that a `skip` mark or a true `skipif` skips runs nothing:
    it takes no turn alone (it waited for the other worker's test only to skip), and its
    module counts as one with no test alone. A `skipif` still false, or a condition string
    not evaluated here, leaves it alone."""
    from types import SimpleNamespace

    import two_at_once

    def item(module, name, *marks, skip=(), skipif=()):
        found = {"skip": [SimpleNamespace(args=(), kwargs={}) for _ in skip],
                 "skipif": [SimpleNamespace(args=args, kwargs=kwargs) for args, kwargs in skipif]}
        return SimpleNamespace(path=tmp_path / module, name=name, nodeid=f"{module}::{name}",
                               get_closest_marker=lambda mark: mark if mark in marks else None,
                               iter_markers=lambda name: iter(found[name]))

    skipped = item("g", "cuda", "gpu", skipif=[((True,), {"reason": "no CUDA"})])
    assert not two_at_once.marked_alone(skipped)
    assert not two_at_once.marked_alone(item("g", "s", "alone", skip=[1]))
    assert not two_at_once.marked_alone(item("g", "kw", "mpi",
                                             skipif=[((), {"condition": True})]))
    assert not two_at_once.marked_alone(item("g", "bare", "mpi", skipif=[((), {})]))
    assert two_at_once.marked_alone(item("g", "false", "gpu", skipif=[((False,), {})]))
    assert two_at_once.marked_alone(item("g", "str", "gpu", skipif=[(("sys.platform",), {})]))
    items = [skipped, item("q", "quick")]
    worker = SimpleNamespace(_hybriddl_turns=object())
    two_at_once.pytest_collection_modifyitems(worker, items)
    assert worker._hybriddl_alone == set()

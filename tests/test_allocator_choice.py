"""Which allocator hybriddl runs on (machine/allocator.py, cli/allocator.py,
tuning/allocators.py): the console script starts again once on the chosen library, every
process it starts inherits it, `auto` is measured once per host, an absent library falls
back with one line, a bad value is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import hybriddl_env
from hybriddl.machine import allocator
from hybriddl.tuning.profiles import Profile, fingerprint, fingerprint_changes

needs = {name: pytest.mark.skipif(allocator.library_path(name) is None,
                                  reason=f"{allocator.LIBRARIES[name]} is not installed "
                                         f"(Debian: apt-get install {allocator.PACKAGES[name]})")
         for name in allocator.LIBRARIES}

# The console script (main() with no argv, so it may start again on its allocator), whose
# `info` command here sets up the processes strategy and reports what is mapped into this
# process and into each spawned worker, read from /proc/<pid>/maps.
WORKERS_MAPS = """
import json, sys, torch
import hybriddl.cli.info
from hybriddl.machine import allocator

def workers_maps(args):
    from hybriddl.strategies import StrategyOptions, make_strategy
    with make_strategy("processes", StrategyOptions(workers=2, oversubscribe=True)) as s:
        s.setup(torch.nn.Linear(4, 2))
        pids = [p.pid for p in s.processes]
        maps = {pid: allocator.loaded_allocator(f"/proc/{pid}/maps") for pid in pids}
    print(json.dumps({"main": allocator.loaded_allocator(), "workers": list(maps.values())}))
    return 0

hybriddl.cli.info.cmd_info = workers_maps
sys.argv = ["hybriddl", *json.loads(sys.argv[1])]
from hybriddl.cli import main
raise SystemExit(main())
"""


def console_script(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = hybriddl_env(**env)
    environ.pop("HYBRIDDL_ALLOCATOR", None)  # conftest's glibc: here the flag decides
    return subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                          text=True, timeout=300, env=environ)


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs[n]) for n in allocator.LIBRARIES])
def test_the_console_script_and_its_spawned_workers_run_on_the_asked_allocator(name):
    done = console_script(WORKERS_MAPS, "--allocator", name, "info")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"main": name, "workers": [name]}
    assert done.stderr == ""  # started again once, silently


@needs["tcmalloc"]
def test_glibc_takes_an_inherited_preload_out():
    preloaded = allocator.preload_environment("tcmalloc", {})
    done = console_script(WORKERS_MAPS, "--allocator", "glibc", "info", **preloaded)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"main": "glibc", "workers": ["glibc"]}


@needs["tcmalloc"]
def test_a_process_started_on_the_choice_keeps_it_without_starting_again():
    # What a rank or a compare contender sees: the parent's environment, auto.
    preloaded = allocator.preload_environment("tcmalloc", {})
    done = console_script(WORKERS_MAPS, "info", **preloaded)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"main": "tcmalloc", "workers": ["tcmalloc"]}


ABSENT_JEMALLOC = WORKERS_MAPS.replace(
    "from hybriddl.machine import allocator\n",
    "from hybriddl.machine import allocator\n"
    "allocator.LIBRARIES['jemalloc'] = 'libjemalloc-absent.so.99'\n")


def test_an_absent_library_falls_back_to_glibc_with_one_line():
    done = console_script(ABSENT_JEMALLOC, "--allocator", "jemalloc", "info")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"main": "glibc", "workers": ["glibc"]}
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "jemalloc is not installed" in lines[0]
    assert "apt-get install libjemalloc2" in lines[0] and "glibc" in lines[0]


def test_a_bad_allocator_flag_is_one_line_and_exit_2(cli_here):
    done = cli_here("--allocator", "mimalloc", "info")
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and "choose from" in done.stderr


def test_a_bad_allocator_variable_is_one_line_and_exit_2(cli):
    done = cli("info", HYBRIDDL_ALLOCATOR="mimalloc")
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "HYBRIDDL_ALLOCATOR=mimalloc" in lines[0]
    assert "Traceback" not in done.stderr


# --- auto: measured once per host --------------------------------------------------------

@pytest.fixture
def two_installed(monkeypatch):
    """A host with tcmalloc and glibc, whose choice nobody made yet."""
    monkeypatch.setattr(allocator, "installed_allocators", lambda: ["tcmalloc", "glibc"])
    monkeypatch.delenv(allocator.PRELOADED_ENV, raising=False)


class Timer:
    """A measurement that says glibc is faster here, and counts how often it was asked."""

    def __init__(self):
        self.calls = []

    def __call__(self, names):
        self.calls.append(names)
        return {"tcmalloc": [1.0, 1.2, 1.1], "glibc": [0.9, 0.95, 1.3]}


@needs["tcmalloc"]
def test_the_console_script_starts_again_before_it_imports_torch(tmp_path):
    """Settled without a measurement, the choice is made before the command's module (and
    torch, seconds) is imported: a process that starts again imports torch once."""
    environ = hybriddl_env()
    environ.pop("HYBRIDDL_ALLOCATOR", None)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hybriddl", "--allocator",
                           "tcmalloc", "train", "--image-size", "8", "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          env=environ)
    assert done.returncode == 2 and "--image-size 8" in done.stderr, done.stderr[-2000:]
    torch_imports = [line for line in done.stderr.splitlines()
                     if line.startswith("import time:") and line.split("|")[-1].strip() == "torch"]
    assert len(torch_imports) == 1, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_what_is_settled_without_measuring(tmp_path, two_installed, monkeypatch):
    cache = tmp_path / "allocator-h.json"
    monkeypatch.setattr(allocator, "choice_cache_path", lambda: cache)
    assert allocator.settled_without_measuring("auto") is None  # measured after parsing
    assert allocator.settled_without_measuring("mimalloc") is None  # the parser says why
    asked = allocator.settled_without_measuring("glibc")
    assert (asked.name, asked.how) == ("glibc", "asked")
    allocator.settle("auto", Timer(), cache=cache)
    kept = allocator.settled_without_measuring("auto")
    assert (kept.name, kept.how) == ("glibc", "cached")
    monkeypatch.setenv(allocator.PRELOADED_ENV, "tcmalloc")
    assert allocator.settled_without_measuring("auto").how == "inherited"


def test_auto_measures_once_and_then_reads_the_hosts_choice(tmp_path, two_installed):
    timer, cache = Timer(), tmp_path / "allocator-h.json"
    first = allocator.settle("auto", timer, cache=cache)
    assert (first.name, first.how) == ("glibc", "measured")
    assert len(first.notes) == 1 and "glibc 0.950, tcmalloc 1.100" in first.notes[0]
    again = allocator.settle("auto", timer, cache=cache)
    assert (again.name, again.how, again.notes) == ("glibc", "cached", [])
    assert timer.calls == [["tcmalloc", "glibc"]]
    assert json.loads(cache.read_text())["median_seconds"] == {"tcmalloc": 1.1, "glibc": 0.95}


def test_auto_measures_again_when_the_host_changed(tmp_path, two_installed, monkeypatch):
    timer, cache = Timer(), tmp_path / "allocator-h.json"
    allocator.settle("auto", timer, cache=cache)
    monkeypatch.setattr(allocator, "usable_cores", lambda: 64)
    assert allocator.settle("auto", timer, cache=cache).how == "measured"
    assert len(timer.calls) == 2


def test_auto_takes_the_choice_a_parent_process_settled(tmp_path, two_installed, monkeypatch):
    monkeypatch.setenv(allocator.PRELOADED_ENV, "tcmalloc")
    timer = Timer()
    choice = allocator.settle("auto", timer, cache=tmp_path / "allocator-h.json")
    assert (choice.name, choice.how, timer.calls) == ("tcmalloc", "inherited", [])


def test_an_allocator_that_fails_to_run_is_left_out(tmp_path, two_installed):
    choice = allocator.settle("auto", lambda names: {"glibc": [1.0]},
                              cache=tmp_path / "allocator-h.json")
    assert choice.name == "glibc" and "tcmalloc failed to run" in choice.notes[0]


@needs["tcmalloc"]
@pytest.mark.slow
def test_the_probe_runs_each_allocator_in_a_child_that_really_uses_it():
    from hybriddl.tuning.allocators import time_allocators

    seconds = time_allocators(["tcmalloc", "glibc"], rounds=1, image_size=64, batch_size=4,
                              steps=1)
    # A child that ran on another allocator than it was started with would be left out.
    assert set(seconds) == {"tcmalloc", "glibc"}
    assert all(len(s) == 1 and s[0] > 0 for s in seconds.values())


# --- profiles record it -----------------------------------------------------------------

def test_a_profile_records_the_allocator_its_tune_ran_on():
    assert fingerprint()["allocator"] == allocator.loaded_allocator()


def test_a_profile_from_before_allocators_reads_as_measured_on_glibc():
    old = {"schema_version": 2, "host": "h", "fingerprint": {"cpu_model": "x", "torch": "2"},
           "settings": {"usecase": "SimpleBig", "model": "alexnet", "image_size": 224,
                        "batch_size": 32},
           "candidates": [{"strategy": {"name": "sequential"}, "status": "measured",
                           "seconds_per_step": 1.0}],
           "pick": {"name": "sequential"}}
    profile = Profile.from_dict(old)
    assert profile.fingerprint["allocator"] == "glibc"
    assert fingerprint_changes(profile.fingerprint, {**profile.fingerprint,
                                                     "allocator": "tcmalloc"}) \
        == ["allocator 'glibc' -> 'tcmalloc'"]


def test_freed_memory_is_given_back_on_every_allocator():
    code = ("from hybriddl.machine.allocator import give_back_freed_memory, keep_freed_memory,"
            " loaded_allocator; import torch; kept = keep_freed_memory(); torch.ones(2**24); "
            "print(loaded_allocator(), kept, give_back_freed_memory())")
    for name in allocator.installed_allocators():
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=allocator.preload_environment(name, hybriddl_env()))
        assert done.returncode == 0, done.stderr
        # glibc keeps freed memory by mallopt; the others do by design and are left alone.
        assert done.stdout.split() == [name, str(name == "glibc"), "True"]


def test_auto_measures_without_keeping_where_the_cache_folder_cannot_be_written(
        tmp_path, two_installed, monkeypatch):
    # XDG_CACHE_HOME under a file (or a read-only home): every command failed before.
    (tmp_path / "a-file").write_text("")
    timer, cache = Timer(), tmp_path / "a-file" / "hybriddl" / "allocator-h.json"
    choice = allocator.settle("auto", timer, cache=cache)
    assert (choice.name, choice.how, timer.calls) == ("glibc", "measured", [["tcmalloc", "glibc"]])
    assert "kept in" not in choice.notes[0]
    assert "not kept" in choice.notes[1] and "XDG_CACHE_HOME" in choice.notes[1]
    # A cache file that cannot be written (a full disk) is said, and the run goes on.
    from hybriddl import files

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files.os, "fsync", full)
    choice = allocator.settle("auto", timer, cache=tmp_path / "allocator-h.json")
    assert choice.how == "measured" and "not kept (writing" in choice.notes[0]
    assert "No space left on device" in choice.notes[0]
    assert list(tmp_path.glob("*allocator-h.json*")) == [tmp_path / "allocator-h.json.lock"]


def test_a_lock_another_process_keeps_is_waited_for_a_bounded_time(tmp_path, two_installed,
                                                                   monkeypatch):
    """Another process holds the measurement's lock and never lets go (stopped with
    Ctrl-Z, say): this start waited for ever; it measures alone after the bound, keeps
    nothing (the holder may still write), and says why."""
    import fcntl

    monkeypatch.setattr(allocator, "LOCK_WAIT_SECONDS", 0.5)
    cache = tmp_path / "allocator-h.json"
    with open(tmp_path / "allocator-h.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: flock treats it as another holder
        started = time.monotonic()
        choice = allocator.settle("auto", Timer(), cache=cache)
    assert time.monotonic() - started < 30
    assert (choice.name, choice.how) == ("glibc", "measured")
    assert "not kept" in choice.notes[-1] and "held by another process" in choice.notes[-1]
    assert not cache.exists()
    assert allocator.settle("auto", Timer(), cache=cache).how == "measured"  # and now kept
    assert cache.exists()

"""The one owner of this process's C allocator: which one it runs on, and how glibc's hands
freed memory back.

**Which allocator.** hybriddl runs on tcmalloc (Debian's libtcmalloc-minimal4), jemalloc
(libjemalloc2) or glibc's malloc, the one `auto` found fastest on this host. An allocator
can only be chosen before the process starts (LD_PRELOAD), so the console script settles
the choice (`settle`) and re-executes itself once with the library preloaded
(`preload_environment`; PRELOADED_ENV, set then, says it happened, so it happens once),
before it imports torch wherever no measurement is due (`settled_without_measuring`).
Every process hybriddl starts inherits that environment: ranks, spawned worker processes,
compare's contenders. `auto` is measured, not assumed: a few timed steps with each
library found, in child processes, interleaved rounds (tuning/allocators.py), kept per
host in the user's cache directory (`choice_cache_path`) with the facts they depend on
(CPU, cores, torch, the libraries), measured again when those change. `--allocator` or
HYBRIDDL_ALLOCATOR names one instead; a library that is not installed falls back to glibc
with one line. `loaded_allocator` reads what this process really runs on from
/proc/self/maps: what profiles record.

**Freed memory kept (glibc).**

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
mmap and unmaps it on free. A training step allocates the same large tensors every time
(AlexNet's classifier gradients alone are 218 MB), so each step touches hundreds of MB of
new pages: 65,000-77,000 page faults and 0.10-0.13 s of kernel time per AlexNet step at
224 px (README, "Memory kept between steps"). Keeping freed memory in the heap (no mmap
for large blocks, no trimming) lets the next step reuse the same pages.

`keep_freed_memory()` does that with glibc's own `mallopt`, at run time, in this process
only; worker processes call it themselves. The price is memory: the heap keeps the
largest step's blocks, and holes between them (README gives the high-water marks). glibc
was seen not to reuse a freed block for the next 64-byte-aligned request of the same size
(strace: the heap grew by the block each time), so the heap grows during the first steps,
until it holds what a step needs (tests/test_allocator.py checks that it then stops). Set HYBRIDDL_MALLOC=system to
leave glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import json
import os
import sysconfig
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from hybriddl.errors import StorageError, UsageError
from hybriddl.files import atomic_write_json, user_cache_dir
from hybriddl.machine.hostinfo import cpu_model, usable_cores
from hybriddl.machine.naming import host_name

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The largest trim threshold mallopt takes (an int): freed memory is never given back.
NEVER_TRIM = 2**31 - 1

_kept = False


def keep_freed_memory() -> bool:
    """From now on, keep freed memory for reuse instead of returning it to the kernel.

    Returns True when this process now keeps it (glibc, and HYBRIDDL_MALLOC is not
    'system'); False elsewhere (another C library, or the user opted out). Idempotent.
    tcmalloc and jemalloc keep freed memory for reuse by design; glibc's settings would
    change an allocator nobody calls, so they are left alone there (False).
    """
    global _kept
    if _kept:
        return True
    if os.environ.get("HYBRIDDL_MALLOC", "keep") == "system" or loaded_allocator() != GLIBC:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to tell
        return False
    # mallopt returns 1 on success; both, or neither (the first alone changes nothing).
    _kept = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _kept


def give_back_freed_memory() -> bool:
    """Return the heap's free pages to the kernel now (glibc's malloc_trim).

    For measurements taken one after another in one process (the tuner's candidates):
    with freed memory kept, the process would otherwise still hold the pages of every
    earlier candidate, and each one's peak would read as the largest so far. True when
    glibc gave something back, or tcmalloc or jemalloc were asked to.
    """
    loaded = loaded_allocator()
    try:
        if loaded == "tcmalloc":
            ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
            return True
        if loaded == "jemalloc":  # every arena (MALLCTL_ARENAS_ALL = 4096) purged
            return ctypes.CDLL(None).mallctl(b"arena.4096.purge", None, None, None, 0) == 0
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
    except (OSError, AttributeError, TypeError):  # not glibc
        return False


def reset_high_water_mark() -> bool:
    """Set this process's VmHWM to its current RSS (Linux >= 4.0: /proc/self/clear_refs),
    so that a peak read later is the peak since now. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


# --- Which allocator this process runs on -----------------------------------------------

GLIBC = "glibc"
# The shared object each allocator is preloaded from (Debian's names): tcmalloc's minimal
# build has no heap profiler, which a training step has no use for.
LIBRARIES = {"tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
ALLOCATORS = (*LIBRARIES, GLIBC)
CHOICES = ("auto", *ALLOCATORS)
ENV = "HYBRIDDL_ALLOCATOR"  # what --allocator says when it is left out
PRELOADED_ENV = "HYBRIDDL_ALLOCATOR_PRELOADED"  # set by the re-execution: the settled choice
CACHE_VERSION = 1
# How long a start waits for another process's measurement (a few seconds of steps on each
# allocator, longer on a loaded host) before it measures alone, keeping nothing.
LOCK_WAIT_SECONDS = 300.0
LOCK_POLL_SECONDS = 0.2


def library_path(name: str) -> str | None:
    """Where allocator `name`'s shared object is installed; None when it is not (or glibc)."""
    soname = LIBRARIES.get(name)
    if soname is None:
        return None
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    folders = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    for folder in (*folders, "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        path = Path(folder, soname)
        if path.exists():
            return str(path)
    return None


def installed_allocators() -> list[str]:
    """The allocators this host can run on: glibc's, and each library that is installed."""
    return [name for name in ALLOCATORS if name == GLIBC or library_path(name)]


def loaded_allocator(maps: str = "/proc/self/maps") -> str:
    """The allocator this process runs on, from the libraries mapped into it."""
    try:
        mapped = Path(maps).read_text()
    except OSError:  # not Linux: no preloading either
        return GLIBC
    for name, soname in LIBRARIES.items():
        if f"/{soname}" in mapped:
            return name
    return GLIBC


def preload_environment(name: str, environ: dict | None = None) -> dict:
    """`environ` (default: this process's) with allocator `name` preloaded and every other
    allocator library taken out of LD_PRELOAD; PRELOADED_ENV names the choice."""
    env = dict(os.environ if environ is None else environ)
    kept = [entry for entry in env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
            if entry and not any(entry.endswith(soname) for soname in LIBRARIES.values())]
    path = library_path(name)
    preload = ([path] if path else []) + kept
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    env[PRELOADED_ENV] = name
    return env


@dataclass
class AllocatorChoice:
    """What a process settled: the allocator to run on, why, and what the user should read."""

    name: str
    how: str  # "asked", "measured", "cached", "inherited" or "fallback"
    notes: list[str] = field(default_factory=list)  # one line each

    def needs_reexecution(self) -> bool:
        """True when this process must start again to run on `name` (only once: after the
        re-execution PRELOADED_ENV names it, and a preload that did not take is a note)."""
        if loaded_allocator() == self.name:
            return False
        if os.environ.get(PRELOADED_ENV) == self.name:
            self.notes.append(f"{self.name} was preloaded but is not mapped into this "
                              f"process (LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}); "
                              f"running on {loaded_allocator()}")
            return False
        return True


# seconds per step by allocator, each allocator's round medians; called with the names
Measure = Callable[[list[str]], dict[str, list[float]]]


def requested_allocator(flag: str | None, environ: dict | None = None) -> str:
    """--allocator if given, else HYBRIDDL_ALLOCATOR, else auto; a bad value is a UsageError."""
    environ = os.environ if environ is None else environ
    if flag:
        return flag
    value = environ.get(ENV, "").strip() or "auto"
    if value not in CHOICES:
        raise UsageError(f"{ENV}={value}: choose one of {', '.join(CHOICES)} "
                         f"(or unset it: auto)")
    return value


def settle(requested: str, measure: Measure, *, cache: Path | None = None,
           on_measuring: Callable[[list[str], Path], None] = lambda names, path: None
           ) -> AllocatorChoice:
    """The allocator to run on for `requested` (a value of CHOICES, see
    `requested_allocator`). `auto`: the one an ancestor process settled, else the host's
    measured choice from `cache` (default `choice_cache_path()`), else measured now with
    `measure` (announced through `on_measuring`) and kept there."""
    if requested not in CHOICES:
        raise UsageError(f"--allocator {requested}: choose one of {', '.join(CHOICES)}")
    if requested != "auto":
        if requested == GLIBC or library_path(requested):
            return AllocatorChoice(requested, "asked")
        return AllocatorChoice(GLIBC, "fallback", [
            f"{requested} is not installed ({LIBRARIES[requested]}; Debian: apt-get install "
            f"{PACKAGES[requested]}): running on glibc's allocator"])
    inherited = os.environ.get(PRELOADED_ENV)
    if inherited in ALLOCATORS:
        return AllocatorChoice(inherited, "inherited")
    names = installed_allocators()
    if names == [GLIBC]:
        return AllocatorChoice(GLIBC, "measured", [])  # nothing to compare with
    return measured_choice(names, measure, cache or choice_cache_path(), on_measuring)


def settled_without_measuring(requested: str) -> AllocatorChoice | None:
    """What `settle` answers where that needs no measurement (a named allocator, one an
    ancestor settled, glibc alone installed, or a choice kept for this host under the same
    facts); None where `auto` must measure first or `requested` is not a choice. Nothing is
    written: the console script asks it before it imports torch."""
    if requested not in CHOICES:
        return None
    names = installed_allocators()
    if requested != "auto" or os.environ.get(PRELOADED_ENV) in ALLOCATORS or names == [GLIBC]:
        return settle(requested, _no_measurement)
    cached = _read_choice(choice_cache_path(), choice_facts(names))
    return AllocatorChoice(cached, "cached") if cached else None


def _no_measurement(names: list[str]) -> dict:
    raise AssertionError("settle measured where settled_without_measuring needs none")


def choice_cache_path() -> Path:
    """$XDG_CACHE_HOME/hybriddl/allocator-<host>.json (else ~/.cache/hybriddl/...)."""
    return user_cache_dir() / f"allocator-{host_name().replace(os.sep, '_')}.json"


def choice_facts(names: Iterable[str]) -> dict:
    """What a measured choice depends on: a change in any of these measures again."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu_model": cpu_model(), "cores_usable": usable_cores(), "torch": torch_version,
            "libraries": {name: library_path(name) for name in names if name != GLIBC}}


def measured_choice(names: list[str], measure: Measure, path: Path,
                    on_measuring: Callable[[list[str], Path], None]) -> AllocatorChoice:
    """The cached choice when its facts still hold, else one measured now and kept. One
    process of the machine measures at a time (a lock beside the cache file); the others
    wait for it and read its choice. Where the cache's folder cannot be written, the
    choice is measured now and not kept (a note says why and what to do)."""
    facts = choice_facts(names)
    cached = _read_choice(path, facts)
    if cached:
        return AllocatorChoice(cached, "cached")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "w")
    except OSError as exc:
        choice = _measured_now(names, measure, path, on_measuring)
        choice.notes.append(f"allocator: the choice is not kept ({path.parent}: "
                            f"{exc.strerror or exc}); it is measured again at every start: "
                            "set XDG_CACHE_HOME to a folder you can write")
        return choice
    with lock:
        if not _locked(lock, LOCK_WAIT_SECONDS):
            choice = _measured_now(names, measure, path, on_measuring)
            choice.notes.append(
                f"allocator: the choice is not kept ({lock.name} was held by another process "
                f"for {LOCK_WAIT_SECONDS:g} s: one stopped, or measuring on a loaded host); "
                "it is measured again at the next start")
            return choice
        cached = _read_choice(path, facts)
        if cached:
            return AllocatorChoice(cached, "cached")
        return _measured_now(names, measure, path, on_measuring, facts)


def _locked(handle, seconds: float) -> bool:
    """`handle` locked exclusively within `seconds`: False where another process (stopped,
    or measuring for longer than that) kept it; a blocking lock waited for it for ever."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_SECONDS)


def _measured_now(names: list[str], measure: Measure, path: Path,
                  on_measuring: Callable[[list[str], Path], None],
                  facts: dict | None = None) -> AllocatorChoice:
    """The fastest of `names` measured now; kept at `path` with `facts` when facts are given."""
    on_measuring(names, path)
    seconds = measure(names)
    medians = {name: sorted(s)[(len(s) - 1) // 2] for name, s in seconds.items() if s}
    if not medians:
        return AllocatorChoice(GLIBC, "fallback", [
            "no allocator could be measured on this host: running on glibc's"])
    choice = min(medians, key=medians.get)
    missing = [name for name in names if name not in medians]
    kept = ""
    if facts is not None:
        try:
            atomic_write_json(path, {"version": CACHE_VERSION, "host": host_name(),
                                     "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "facts": facts, "round_seconds": seconds,
                                     "median_seconds": medians, "choice": choice})
            kept = f"; kept in {path}"
        except StorageError as exc:  # a full disk: the run goes on, the next start measures again
            kept = f"; not kept ({exc})"
    summary = ", ".join(f"{name} {medians[name]:.3f}" for name in sorted(medians, key=medians.get))
    left_out = f"; {', '.join(missing)} failed to run, left out" if missing else ""
    return AllocatorChoice(choice, "measured", [
        f"allocator: {choice}, the fastest here (s/step: {summary}{left_out}){kept}"])


def _read_choice(path: Path, facts: dict) -> str | None:
    """The choice kept at `path` if it was measured under `facts`; else None (absent,
    unreadable, or measured on another CPU, torch or set of libraries)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != CACHE_VERSION \
            or record.get("facts") != facts or record.get("choice") not in ALLOCATORS:
        return None
    return record["choice"]

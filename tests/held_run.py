"""A training run the tests can stop at an exact point: the real CLI, held still.

As a script (`python held_run.py PAUSED GO N WHERE hybriddl-args...`) it runs
`hybriddl.cli.main`, and at the N-th call of one function writes its pid to PAUSED
(with `.rank<R>` appended under mpirun) and waits until GO exists. WHERE says which call:
  after-write   just after a checkpoint was written (the training thread, once the
                background write is on disk);
  inside-write  inside a checkpoint write, its bytes in the temporary file, not renamed
                (the background writer is held; training goes on until it must wait);
  step          at the start of an optimizer step (the sequential strategy's), once the
                checkpoints begun before it are on disk;
  any-step      the same, at the trainer's optimizer step, whatever the strategy;
  prepare       before the run is prepared (data loaded, strategy picked), as a host
                building a data cache or tuning is.
  tune          before a visit of `--strategy auto`'s tune (the N-th candidate measured).
So a test signals or kills a run at a known step without sleeping or timing anything.
The parent side is `Held`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).resolve()
DEADLINE_SECONDS = 300


def wait_for(condition, what: str, process: subprocess.Popen | None = None) -> None:
    """Poll `condition` until it holds; fail at the deadline or if `process` ends first."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not condition():
        if process is not None and process.poll() is not None:
            _, err = process.communicate()
            pytest.fail(f"run exited ({process.returncode}) before {what}:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {DEADLINE_SECONDS} s")
        time.sleep(0.02)


_started: list[subprocess.Popen] = []


def kill_leftovers() -> None:
    """Kill what a failed test left held (the run and its ranks/workers), then reap it."""
    while _started:
        process = _started.pop()
        if process.poll() is None:
            tree = [psutil.Process(process.pid)]
            try:
                tree += tree[0].children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            for member in tree:
                try:
                    member.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(tree, timeout=30)
        process.communicate()


class Held:
    """A held training run in a child process (under `launcher`, e.g. mpirun, if given)."""

    def __init__(self, tmp: Path, args: list[str], pause_at: int = 1, where: str = "after-write",
                 launcher: list[str] = (), ranks: int | None = None, env: dict | None = None):
        from conftest import hybriddl_env

        self.paused, self.go = tmp / "paused", tmp / "go"
        self.process = subprocess.Popen(
            [*launcher, sys.executable, str(SCRIPT), str(self.paused), str(self.go),
             str(pause_at), where, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env or hybriddl_env())
        _started.append(self.process)
        self.markers = ([self.paused] if ranks is None else
                        [self.paused.with_name(f"paused.rank{r}") for r in range(ranks)])
        wait_for(lambda: all(m.exists() and m.read_text() for m in self.markers),
                 f"pause ({where} #{pause_at})", self.process)

    def pid(self, rank: int = 0) -> int:
        """The held training process (of that rank, under mpirun)."""
        return int(self.markers[rank].read_text())

    def release(self) -> None:
        self.go.touch()

    def finish(self) -> tuple[int, str]:
        _, err = self.process.communicate(timeout=DEADLINE_SECONDS)
        return self.process.returncode, err


def _hold_at_call(owner, name: str, pause_at: int, hold, counts=lambda *a: True,
                  after: bool = False) -> None:
    real = getattr(owner, name)
    calls = 0

    def held(*args, **kwargs):
        nonlocal calls
        counted = counts(*args)
        calls += counted
        if counted and not after and calls == pause_at:
            hold(*args)
        result = real(*args, **kwargs)
        if counted and after and calls == pause_at:
            hold(*args)
        return result

    setattr(owner, name, held)


def _main(argv: list[str]) -> int:
    import hybriddl.run.checkpointer
    import hybriddl.strategies.sequential
    from hybriddl.cli import main

    paused, go, pause_at, where = Path(argv[0]), Path(argv[1]), int(argv[2]), argv[3]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if rank is not None:
        paused = paused.with_name(f"{paused.name}.rank{rank}")

    keepers = []
    _hold_at_call(hybriddl.run.checkpointer.Checkpointer, "__init__", 0,
                  lambda *args: None,
                  counts=lambda keeper, *rest: keepers.append(keeper) or False)

    def hold(*args) -> None:
        for keeper in keepers:  # checkpoints are written in the background
            keeper.wait_for_write()
        paused.write_text(str(os.getpid()))
        while not go.exists():
            time.sleep(0.01)

    def hold_writer(*args) -> None:
        paused.write_text(str(os.getpid()))
        while not go.exists():
            time.sleep(0.01)

    if where == "after-write":
        _hold_at_call(hybriddl.run.checkpointer.Checkpointer, "save", pause_at, hold, after=True)
    elif where == "inside-write":
        _hold_at_call(os, "fsync", pause_at, hold_writer,
                      lambda fd: ".checkpoint.pt.tmp-" in os.readlink(f"/proc/self/fd/{fd}"))
    elif where == "prepare":
        import hybriddl.run.trainer
        _hold_at_call(hybriddl.run.trainer, "prepare", pause_at, hold)
    elif where == "tune":
        import hybriddl.tuning.tuner
        _hold_at_call(hybriddl.tuning.tuner, "_visit_one", pause_at, hold)
    elif where == "step":
        _hold_at_call(hybriddl.strategies.sequential.Sequential, "compute_gradients", pause_at,
                      hold)
    elif where == "any-step":
        import hybriddl.run.trainer
        _hold_at_call(hybriddl.run.trainer, "optimizer_step", pause_at, hold)
    else:
        raise SystemExit(f"held_run.py: unknown WHERE {where!r}")
    return main(argv[4:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

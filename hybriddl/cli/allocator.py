"""`--allocator`: the console script settles the allocator, then starts again on it, once
(hybriddl/machine/allocator.py says why and how)."""

from __future__ import annotations

import argparse
import os
import sys

from hybriddl.display import console
from hybriddl.errors import UsageError
from hybriddl.machine import allocator


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allocator", choices=allocator.CHOICES,
        help=f"the C allocator every process of this command runs on (default: "
             f"${allocator.ENV}, else auto: the one measured fastest on this host, once, "
             f"kept in $XDG_CACHE_HOME/hybriddl or ~/.cache/hybriddl); a library that is "
             f"not installed falls back to glibc")


def start_on_settled_allocator(argv: list[str]) -> None:
    """Before the command's module (and torch) is imported: where the allocator is settled
    without a measurement, replace this process with the same command line on it now, so
    that a process that starts again imports torch once, not twice (seconds a process: every
    rank mpirun starts). Where `auto` must measure first, or the flag is bad,
    `run_on_chosen_allocator` settles it once the command line is parsed."""
    try:
        choice = allocator.settled_without_measuring(
            allocator.requested_allocator(allocator_flag(argv)))
    except UsageError:
        return  # the parser or run_on_chosen_allocator says it in one line
    if choice is not None and choice.needs_reexecution():
        _start_again(choice.name)


def allocator_flag(argv: list[str]) -> str | None:
    """--allocator's value in `argv`, read up to the command's name (where the flag goes)."""
    words = iter(argv)
    for word in words:
        if word == "--allocator":
            return next(words, None)
        if word.startswith("--allocator="):
            return word.split("=", 1)[1]
        if not word.startswith("-"):
            return None
    return None


def run_on_chosen_allocator(args: argparse.Namespace) -> None:
    """Settle the allocator; when this process does not run on it, replace this process
    with the same command line on it (os.execve: this call does not return then)."""
    choice = allocator.settle(allocator.requested_allocator(args.allocator), _time_allocators,
                              on_measuring=_announce)
    again = choice.needs_reexecution()
    for note in choice.notes:
        console.print(f"hybriddl: {note}", markup=False, highlight=False, soft_wrap=True)
    if again:
        _start_again(choice.name)


def _start_again(name: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              allocator.preload_environment(name))


def _time_allocators(*args, **kwargs):
    # Imported when a measurement is due: the probe's strategy loads torch, which a command
    # that only starts processes (emulate, launch) never needs.
    from hybriddl.tuning.allocators import time_allocators

    return time_allocators(*args, **kwargs)


def _announce(names: list[str], path) -> None:
    from hybriddl.tuning.allocators import describe_probe

    console.print(f"hybriddl: allocator auto: timing {', '.join(names)} on this host, once "
                  f"({describe_probe()}, about a minute); kept in {path}",
                  markup=False, highlight=False, soft_wrap=True)

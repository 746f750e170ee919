"""`--allocator`: the console script settles the allocator, then starts again on it, once
(hybriddl/machine/allocator.py says why and how)."""

from __future__ import annotations

import argparse
import os
import sys

from hybriddl.display import console
from hybriddl.machine import allocator


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allocator", choices=allocator.CHOICES,
        help=f"the C allocator every process of this command runs on (default: "
             f"${allocator.ENV}, else auto: the one measured fastest on this host, once, "
             f"kept in $XDG_CACHE_HOME/hybriddl or ~/.cache/hybriddl); a library that is "
             f"not installed falls back to glibc")


def run_on_chosen_allocator(args: argparse.Namespace) -> None:
    """Settle the allocator; when this process does not run on it, replace this process
    with the same command line on it (os.execve: this call does not return then)."""
    choice = allocator.settle(allocator.requested_allocator(args.allocator), _time_allocators,
                              on_measuring=_announce)
    again = choice.needs_reexecution()
    for note in choice.notes:
        console.print(f"hybriddl: {note}", markup=False, highlight=False, soft_wrap=True)
    if again:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                  allocator.preload_environment(choice.name))


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

"""`hybriddl launch`: parse, print each launch and event as one line, leave the rest to
`launcher.Launcher`."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
from pathlib import Path

from hybriddl.cli.commands import COMMANDS
from hybriddl.cli.workload_flags import add_mca_flag
from hybriddl.errors import UsageError
from hybriddl.machine.terminal import stop_signals

# The training's flags that name its run directory: the launcher owns that choice, since
# every relaunch continues the same run.
RUN_DIR_FLAGS = ("--run-dir", "--resume", "--resume-if-exists")


def add_parser(commands) -> argparse.ArgumentParser:
    """Register `launch` on the CLI's subparsers."""
    launch = commands.add_parser("launch", help=COMMANDS["launch"])
    launch.add_argument("--hostfile", required=True,
                        help="Open MPI hostfile: one host per line (slots are ignored: one "
                             "rank per host)")
    launch.add_argument("--min-hosts", type=int, default=1,
                        help="stop when fewer hosts than this answer (default: 1)")
    launch.add_argument("--restarts", type=int, default=3,
                        help="relaunch at most N times (default: 3)")
    launch.add_argument("--rsh-agent",
                        help="how mpirun and the launcher reach a host (default: "
                             "$OMPI_MCA_plm_rsh_agent, else ssh)")
    add_mca_flag(launch)
    launch.add_argument("--probe-seconds", type=float, default=10.0,
                        help="a host that does not run 'true' within this is not answering "
                             "(default: 10)")
    launch.add_argument("--retry-delay", type=float, default=2.0,
                        help="seconds between a failure and the relaunch (default: 2)")
    launch.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- train FLAGS...: the training, with --run-dir DIR")
    launch.set_defaults(handler=cmd_launch)
    return launch


def split_training(command: list[str]) -> tuple[list[str], Path]:
    """`train` and its flags without the run directory flags, and the run directory."""
    command = command[1:] if command[:1] == ["--"] else list(command)
    if command[:1] == ["hybriddl"]:
        command = command[1:]
    if command[:1] != ["train"]:
        raise UsageError("give the training after '--', e.g. hybriddl launch --hostfile hosts "
                         "-- train --run-dir runs/a --max-steps 100")
    kept, run_dirs = [], []
    words = iter(command)
    for word in words:
        flag, equals, value = word.partition("=")
        if flag in RUN_DIR_FLAGS:
            value = value if equals else next(words, None)
            if not value:  # none, or empty: the current directory, whose files a relaunch clears
                raise UsageError(f"{flag} needs a directory")
            run_dirs.append(value)
        else:
            kept.append(word)
    if len(set(run_dirs)) != 1:
        raise UsageError("give the training exactly one run directory (--run-dir DIR): every "
                         "relaunch continues the run there")
    return kept, Path(run_dirs[0]).resolve()


def cmd_launch(args: argparse.Namespace) -> int:
    from hybriddl.display import terminal_console

    from hybriddl.launch.launcher import (LaunchConfig, Launcher, LaunchObserver,
                                          read_hostfile)

    train_args, run_dir = split_training(args.command)
    rsh_agent = args.rsh_agent or os.environ.get("OMPI_MCA_plm_rsh_agent") or "ssh"
    if not 0 < args.probe_seconds < float("inf"):  # 0: no host could ever answer
        raise UsageError(f"--probe-seconds {args.probe_seconds}: give a positive number of "
                         "seconds")
    if not 0 <= args.retry_delay < math.inf:
        raise UsageError(f"--retry-delay {args.retry_delay}: give 0 or more seconds")
    config = LaunchConfig(hosts=read_hostfile(args.hostfile), train_args=train_args,
                          run_dir=run_dir, min_hosts=args.min_hosts, restarts=args.restarts,
                          rsh_agent=rsh_agent, mca=dict(args.mca or []),
                          probe_seconds=args.probe_seconds, retry_delay=args.retry_delay)
    console = terminal_console(stderr=True)

    class Lines(LaunchObserver):
        def on_launch(self, attempt, hosts, argv) -> None:
            console.print(f"hybriddl launch: launch {attempt} on {len(hosts)} hosts "
                          f"({', '.join(hosts)}): {shlex.join(argv)}",
                          markup=False, highlight=False, soft_wrap=True)

        def on_event(self, event) -> None:
            console.print(f"hybriddl launch: {event.line()}", markup=False, highlight=False,
                          soft_wrap=True)

    launcher = Launcher(config, Lines())
    # Ctrl-C, SIGTERM and a closed terminal: every rank checkpoints the same step and
    # leaves; a second one ends them at once.
    previous = {signum: signal.signal(signum, lambda s, f: launcher.request_stop(s))
                for signum in stop_signals()}
    try:
        code = launcher.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code == 0:
        console.print(f"hybriddl launch: finished after {len(launcher.events)} fault(s); "
                      f"run directory: {run_dir}", markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()
    return code

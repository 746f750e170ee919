"""`hybriddl emulate`: run a command under mpirun across H emulated hosts, report each NIC."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from hybriddl.emulation.hosts import EmulationFailed
from hybriddl.errors import UsageError


def add_emulate_parser(commands) -> argparse.ArgumentParser:
    """Register `emulate` on the CLI's subparsers."""
    emulate = commands.add_parser(
        "emulate", help="run a command under mpirun across H emulated hosts (network "
        "namespaces, needs root) and report the bytes each host's NIC sent and received")
    emulate.add_argument("--hosts", type=int, required=True, help="H emulated hosts")
    emulate.add_argument("--cores-per-host", type=int,
                         help="cores pinned to each host when H x C fits the machine "
                              "(default: the machine's cores / H, at least 1)")
    emulate.add_argument("--ranks-per-host", type=int, default=1,
                         help="MPI ranks per host, mpirun -npernode K (default: 1)")
    emulate.add_argument("--bandwidth", help="every link's rate in both directions, tc units "
                         "(e.g. 1gbit, 100mbit; default: unlimited)")
    emulate.add_argument("--latency", help="one-way delay per link, tc units (e.g. 0.1ms)")
    emulate.add_argument("--mca", nargs=2, action="append", metavar=("KEY", "VALUE"),
                         help="extra Open MPI parameter for mpirun (repeatable)")
    emulate.add_argument("--report", help="JSON file: per host its name and NIC bytes")
    emulate.add_argument("command", nargs=argparse.REMAINDER,
                         help="-- COMMAND...: what mpirun starts on every rank ('hybriddl ...' "
                              "runs this installation's hybriddl)")
    emulate.set_defaults(handler=cmd_emulate)
    return emulate


def cmd_emulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("give the command to run after '--', e.g. hybriddl emulate --hosts 2 "
                         "-- hybriddl train --max-steps 3")
    if command[0] == "hybriddl":
        command = [sys.executable, "-m", "hybriddl", *command[1:]]
    report = Path(args.report) if args.report else None
    if report and not report.parent.is_dir():
        raise UsageError(f"--report {report}: folder {report.parent} does not exist")
    env = dict(os.environ)
    # Emulating hosts needs root, so the ranks run as root too.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    console = Console(stderr=True)
    # Ctrl-C and SIGTERM (a job scheduler, kill) must tear the hosts down, also when the
    # shell that started us ignores SIGINT (a background job of a script does).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        return _run(args, command, report, env, console)
    except EmulationFailed as exc:
        console.print(f"hybriddl: emulated hosts failed: {exc}", markup=False, highlight=False,
                      soft_wrap=True)
        return 1
    except Interrupted as stop:
        console.print(f"hybriddl: emulate interrupted by {signal.Signals(stop.signum).name}; "
                      "the emulated hosts are torn down", markup=False, highlight=False)
        return 128 + stop.signum


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(signum)


def _run(args, command, report, env, console) -> int:
    from rich.table import Table

    from hybriddl.emulation.hosts import EmulatedHosts
    from hybriddl.run.rundir import atomic_write_json

    with EmulatedHosts(hosts=args.hosts, cores_per_host=args.cores_per_host,
                       bandwidth=args.bandwidth, latency=args.latency) as cluster:
        for note in cluster.notes:
            console.print(f"hybriddl: note: {note}", markup=False, highlight=False,
                          soft_wrap=True)
        run = cluster.run(command, ranks_per_host=args.ranks_per_host,
                          mca=dict(args.mca or []), env=env)
    table = Table(title=f"NIC bytes during the run ({run.seconds:.1f} s, exit {run.returncode})")
    for column in ("host", "sent", "received"):
        table.add_column(column, justify="left" if column == "host" else "right")
    for host in run.traffic:
        table.add_row(host.host, f"{host.bytes_sent:,}", f"{host.bytes_received:,}")
    console.print(table)
    if report:
        atomic_write_json(report, {
            "emulated_hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
            "bandwidth": args.bandwidth, "latency": args.latency,
            "command": command, "returncode": run.returncode,
            "seconds": round(run.seconds, 3),
            "hosts": [host.as_dict() for host in run.traffic]})
    return run.returncode

"""`hybriddl emulate`: run a command under mpirun across H emulated hosts, report each NIC
(and the time scale, when the hosts are emulated slower than real time)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from hybriddl.cli.flags import add_link_flags, add_mca_flag
from hybriddl.emulation.hosts import EmulationFailed
from hybriddl.errors import UsageError


EPILOG = """\
time scale: H hosts of C cores that do not fit this machine's cores run with time slowed
down by D = H x C / cores (when C is fewer than the machine's cores, D is the number of
turns: hosts that fit side by side run together, each on C cores of its own, and take
turns with the others): each host gets C/D cores of CPU time, in slices of 20 ms in which
all of its threads run at full speed while the hosts of other turns are frozen (a cgroup
per host), links run at rate/D and latencies are x D. The report and the console give D and the emulated seconds (wall / D). What the command
itself measures stays in wall time: a run's metrics.json reports wall seconds and
images_per_second, so on the emulated hosts img/s = images_per_second x D and step
seconds = step seconds / D. NIC bytes do not depend on D.

limits: compute is assumed to scale with cores (a host of C cores is C/D cores' worth of
CPU time; a host of more cores than the machine has runs the machine's cores' threads);
the kernel's networking (veth, tc) and the MPI daemons' polling share the machine and
are not scaled; an exchange between hosts that take turns waits for the other's turn
(Open MPI then sends messages up to 16 MiB eagerly, without its rendezvous handshake).
"""


def add_parser(commands) -> argparse.ArgumentParser:
    """Register `emulate` on the CLI's subparsers."""
    emulate = commands.add_parser(
        "emulate", help="run a command under mpirun across H emulated hosts (network "
        "namespaces, needs root) and report the bytes each host's NIC sent and received",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    emulate.add_argument("--hosts", type=int, required=True, help="H emulated hosts")
    emulate.add_argument("--cores-per-host", type=int,
                         help="C cores per host; when H x C exceeds the machine's cores, time "
                              "is slowed down (see below) (default: the machine's cores / H, "
                              "at least 1)")
    emulate.add_argument("--time-scale", type=float, metavar="D",
                         help="slow time down by D (default: the least D at which the hosts "
                              "fit, 1 when they do); 1 where they do not fit shares every "
                              "core between the hosts, unfaithfully")
    emulate.add_argument("--ranks-per-host", type=int, default=1,
                         help="MPI ranks per host, mpirun -npernode K (default: 1)")
    add_link_flags(emulate)
    add_mca_flag(emulate)
    emulate.add_argument("--report", help="JSON file: time scale, wall and emulated "
                         "seconds, per host its name and NIC bytes")
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
    from hybriddl.files import atomic_write_json

    with EmulatedHosts(hosts=args.hosts, cores_per_host=args.cores_per_host,
                       bandwidth=args.bandwidth, latency=args.latency,
                       time_scale=args.time_scale) as cluster:
        for note in cluster.notes:
            console.print(f"hybriddl: note: {note}", markup=False, highlight=False,
                          soft_wrap=True)
        run = cluster.run(command, ranks_per_host=args.ranks_per_host,
                          mca=dict(args.mca or []), env=env)
    wall = " wall" if run.time_scale != 1 else ""
    table = Table(title=f"NIC bytes during the run ({run.seconds:.1f} s{wall}, "
                        f"exit {run.returncode})")
    for column in ("host", "sent", "received"):
        table.add_column(column, justify="left" if column == "host" else "right")
    for host in run.traffic:
        table.add_row(host.host, f"{host.bytes_sent:,}", f"{host.bytes_received:,}")
    console.print(table)
    if run.time_scale != 1:
        console.print(f"hybriddl: time scale {run.time_scale:g}: {run.seconds:.1f} s wall = "
                      f"{run.emulated_seconds:.1f} s on the emulated hosts", markup=False,
                      highlight=False, soft_wrap=True)
    if report:
        atomic_write_json(report, {
            "emulated_hosts": args.hosts, "cores_per_host": cluster.cores_per_host,
            "ranks_per_host": args.ranks_per_host,
            "bandwidth": args.bandwidth, "latency": args.latency,
            "time_scale": run.time_scale, "command": command, "returncode": run.returncode,
            "seconds": round(run.seconds, 3),
            "emulated_seconds": round(run.emulated_seconds, 3),
            "hosts": [host.as_dict() for host in run.traffic]})
    return run.returncode

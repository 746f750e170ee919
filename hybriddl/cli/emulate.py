"""`hybriddl emulate`: run a command under mpirun across H emulated hosts, report each NIC
(and the time scale and speedup, when emulated time is not wall time)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from hybriddl.cli.commands import COMMANDS
from hybriddl.cli.workload_flags import add_link_flags, add_mca_flag, add_workload_flags
from hybriddl.emulation.hosts import (EmulationFailed, check_speedup, default_cores_per_host,
                                      duration_seconds, quota_of)
from hybriddl.errors import UsageError
from hybriddl.files import check_writable
from hybriddl.machine.terminal import stop_signals
from hybriddl.usecases import USECASES


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

speedup: --speedup S lets each host stand for one S times faster than its cores here (a
server, a GPU): the hosts run at once, never in turns, links run at rate/S, latencies are
x S and emulated seconds = wall seconds / S. Where H x C exceeds the machine's cores, every
host still runs at once, held to C/D cores of CPU time by a CPU quota over 10 ms periods
(D as above): the dilation is then S x D (rates / (S x D), emulated = wall / (S x D)).
--host-step 10ms --usecase NAME measures one host's step here (C threads, the use case's
per-host batch and image size, or --batch-size and --image-size) and takes S = that step
/ 10 ms. The report gives speedup, time_scale, dilation and emulated_seconds; the ranks'
deadlines and the link rate they measure are in emulated time (HYBRIDDL_TIME_SCALE =
S x D), what the command writes stays in wall time. --compression-seconds G puts a compute
measured elsewhere in place of this CPU's divided by S x D: each step that compresses with
PowerSGD (hybriddl's, or DDP's powerSGD_hook), its compute here is timed and padded to G x
S x D wall seconds, G emulated (where it already takes longer, a warning says so).

limits: compute is assumed to scale with cores (a host of C cores is C/D cores' worth of
CPU time; a host of more cores than the machine has runs the machine's cores' threads);
the kernel's networking (veth, tc) and the MPI daemons' polling share the machine and
are not scaled; an exchange between hosts that take turns waits for the other's turn
(Open MPI then sends messages up to 16 MiB eagerly, without its rendezvous handshake).
"""


def add_parser(commands) -> argparse.ArgumentParser:
    """Register `emulate` on the CLI's subparsers."""
    emulate = commands.add_parser(
        "emulate", help=COMMANDS["emulate"], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    emulate.add_argument("--hosts", type=int, required=True, help="H emulated hosts")
    emulate.add_argument("--cores-per-host", type=int,
                         help="C cores per host; when H x C exceeds the machine's cores, time "
                              "is slowed down (see below) (default: the machine's cores / H, "
                              "at least 1)")
    emulate.add_argument("--time-scale", type=float, metavar="D",
                         help="slow time down by D (default: the least D at which the hosts "
                              "fit, 1 when they do); 1 where they do not fit shares every "
                              "core between the hosts, unfaithfully")
    emulate.add_argument("--speedup", type=float, metavar="S",
                         help="each host stands for one S times faster than its cores here: "
                              "hosts run at once, links at rate/S, latencies x S, emulated "
                              "seconds = wall / S (see below)")
    emulate.add_argument("--host-step", metavar="DURATION",
                         help="derive S from a step: S = one host's step measured here for "
                              "--usecase (on C cores) / DURATION, e.g. 10ms, 0.01s, 1.5s")
    emulate.add_argument("--compression-seconds", metavar="DURATION",
                         help="the hosts' PowerSGD compute per step, as measured where they "
                              "stand for (a GPU's: scripts/powersgd_cost.py), e.g. 13ms: each "
                              "compressed step's compute here is padded to it (emulated), "
                              "in hybriddl's scheme and DDP's powerSGD_hook alike, rather "
                              "than this CPU's divided by S")
    add_workload_flags(emulate, batch="the per-host batch --host-step measures at",
                       typed_only=True)
    # Here a use case has no default: it is what --host-step measures, and asked with it.
    usecase = next(action for action in emulate._actions if action.dest == "usecase")
    usecase.help = f"the use case --host-step measures, one of {', '.join(USECASES)}"
    emulate.add_argument("--channels-last", action="store_true",
                         help="--host-step measures with channels_last (as a command that "
                              "trains with --channels-last)")
    emulate.add_argument("--ranks-per-host", type=int, default=1,
                         help="MPI ranks per host, mpirun -npernode K (default: 1)")
    add_link_flags(emulate)
    add_mca_flag(emulate)
    emulate.add_argument("--report", help="JSON file: speedup, time scale, dilation, wall "
                         "and emulated seconds, the measured host step, per host its name "
                         "and NIC bytes")
    emulate.add_argument("command", nargs=argparse.REMAINDER,
                         help="-- COMMAND...: what mpirun starts on every rank ('hybriddl ...' "
                              "runs this installation's hybriddl)")
    emulate.set_defaults(handler=cmd_emulate)
    return emulate


def cmd_emulate(args: argparse.Namespace) -> int:
    from hybriddl.display import terminal_console

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("give the command to run after '--', e.g. hybriddl emulate --hosts 2 "
                         "-- hybriddl train --max-steps 3")
    if command[0] == "hybriddl":
        command = [sys.executable, "-m", "hybriddl", *command[1:]]
    elif shutil.which(command[0]) is None:  # not mpirun's banner on every host
        raise UsageError(f"{command[0]}: no such command; give a program on PATH or its path "
                         "after '--'")
    if args.ranks_per_host < 1:  # before a host step is measured or a host is made
        raise UsageError(f"--ranks-per-host {args.ranks_per_host}: give at least 1")
    speed = _speed_flags(args)
    report = Path(args.report) if args.report else None
    if report and not report.parent.is_dir():
        raise UsageError(f"--report {report}: folder {report.parent} does not exist")
    if report:  # before the hosts run: what they measured must have somewhere to go
        check_writable(report, "--report", folder=False)
    env = dict(os.environ)
    # Emulating hosts needs root, so the ranks run as root too.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    console = terminal_console(stderr=True)
    # Ctrl-C, SIGTERM (a job scheduler, kill) and a closed terminal must tear the hosts
    # down, also when the shell that started us ignores SIGINT (a background job of a
    # script does).
    for signum in stop_signals():
        signal.signal(signum, _interrupt)
    try:
        return _run(args, command, report, env, console, speed)
    except EmulationFailed as exc:
        console.print(f"hybriddl: emulated hosts failed: {exc}", markup=False, highlight=False,
                      soft_wrap=True)
        return 1
    except Interrupted as stop:
        console.print(f"hybriddl: emulate interrupted by {signal.Signals(stop.signum).name}; "
                      "the emulated hosts are torn down", markup=False, highlight=False)
        return 128 + stop.signum


def _speed_flags(args: argparse.Namespace) -> dict:
    """--speedup, --host-step and what it measures, --compression-seconds, checked before
    anything is made: {"speedup": S or None, "host_step": seconds or None,
    "compression_seconds": seconds or None}."""
    workload = [flag for flag, value in (("--usecase", args.usecase), ("--model", args.model),
                                         ("--image-size", args.image_size),
                                         ("--batch-size", args.batch_size),
                                         ("--channels-last", args.channels_last)) if value]
    if args.speedup is not None and args.host_step is not None:
        raise UsageError("give --speedup S or --host-step DURATION (which derives S), not both")
    if args.time_scale is not None and (args.speedup is not None or args.host_step is not None):
        raise UsageError("--time-scale with --speedup/--host-step: at a speedup the hosts run at "
                         "once and the time scale follows from the cores; leave --time-scale out")
    if args.host_step is not None and args.usecase is None:
        raise UsageError(f"--host-step {args.host_step}: give --usecase NAME, the use case whose "
                         "step is measured here to derive the speedup")
    if args.host_step is None and workload:
        raise UsageError(f"{', '.join(workload)}: these say what --host-step measures; give "
                         "--host-step DURATION too, or leave them out")
    return {"speedup": None if args.speedup is None else check_speedup(args.speedup),
            "host_step": None if args.host_step is None
            else duration_seconds(args.host_step, "--host-step"),
            "compression_seconds": None if args.compression_seconds is None
            else duration_seconds(args.compression_seconds, "--compression-seconds")}


def _measure_speedup(args: argparse.Namespace, host_step: float, console) -> tuple[float, dict]:
    """S from one host's step measured here; says it in one line. (S, the report's record)."""
    from hybriddl.emulation.hosts import speedup_for_step
    from hybriddl.tuning.host_step import measure_host_step

    cores = args.cores_per_host or default_cores_per_host(args.hosts)
    if cores < 1:
        raise UsageError(f"--cores-per-host {cores}: give at least 1")
    measured = measure_host_step(args.usecase, cores, model=args.model,
                                 image_size=args.image_size, batch_size=args.batch_size,
                                 channels_last=args.channels_last)
    speedup = speedup_for_step(measured.seconds, host_step)
    low, high = measured.spread
    console.print(f"hybriddl: host step {host_step * 1e3:g} ms: {measured.usecase} "
                  f"({measured.model}, batch {measured.batch_size}, {measured.image_size} px, "
                  f"{measured.strategy}) takes {measured.seconds:.4g} s here on {cores} "
                  f"core(s) (median of {len(measured.step_seconds)}, {low:.4g}-{high:.4g} s): "
                  f"speedup S = {speedup:.4g}", markup=False, highlight=False, soft_wrap=True)
    return speedup, {"asked_seconds": host_step, "measured": measured.as_dict(),
                     "speedup": speedup}


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(signum)


def _run(args, command, report, env, console, speed) -> int:
    from rich.table import Table

    from hybriddl.emulation.hosts import EmulatedHosts
    from hybriddl.files import atomic_write_json

    speedup, host_step = speed["speedup"], None
    if speed["host_step"] is not None:
        speedup, host_step = _measure_speedup(args, speed["host_step"], console)
    with EmulatedHosts(hosts=args.hosts, cores_per_host=args.cores_per_host,
                       bandwidth=args.bandwidth, latency=args.latency,
                       time_scale=args.time_scale, speedup=speedup,
                       compression_seconds=speed["compression_seconds"]) as cluster:
        for note in cluster.notes:
            console.print(f"hybriddl: note: {note}", markup=False, highlight=False,
                          soft_wrap=True)
        run = cluster.run(command, ranks_per_host=args.ranks_per_host,
                          mca=dict(args.mca or []), env=env)
    wall = " wall" if run.dilation != 1 else ""
    table = Table(title=f"NIC bytes during the run ({run.seconds:.1f} s{wall}, "
                        f"exit {run.returncode})")
    for column in ("host", "sent", "received"):
        table.add_column(column, justify="left" if column == "host" else "right")
    for host in run.traffic:
        table.add_row(host.host, f"{host.bytes_sent:,}", f"{host.bytes_received:,}")
    console.print(table)
    if speedup is not None:
        console.print(f"hybriddl: speedup {run.speedup:.4g} x time scale {run.time_scale:g} = "
                      f"dilation {run.dilation:.4g}: {run.seconds:.1f} s wall = "
                      f"{run.emulated_seconds:.4g} s on the emulated hosts", markup=False,
                      highlight=False, soft_wrap=True)
    elif run.time_scale != 1:
        console.print(f"hybriddl: time scale {run.time_scale:g}: {run.seconds:.1f} s wall = "
                      f"{run.emulated_seconds:.1f} s on the emulated hosts", markup=False,
                      highlight=False, soft_wrap=True)
    if report:
        atomic_write_json(report, {
            "emulated_hosts": args.hosts, "cores_per_host": cluster.cores_per_host,
            "ranks_per_host": args.ranks_per_host,
            "bandwidth": args.bandwidth, "latency": args.latency,
            # emulated = wall / dilation; dilation = speedup x time_scale.
            "speedup": run.speedup, "time_scale": run.time_scale, "dilation": run.dilation,
            "turns": cluster.takes_turns,
            "cpu_quota": None if cluster.quota_cores is None else {
                "cores_per_host": cluster.quota_cores,
                "period_seconds": quota_of(cluster.quota_cores)[1] / 1e6},
            "host_step": host_step,
            "compression_seconds": speed["compression_seconds"],
            "command": command, "returncode": run.returncode,
            "seconds": round(run.seconds, 3),
            "emulated_seconds": round(run.emulated_seconds, 6),
            "hosts": [host.as_dict() for host in run.traffic]})
    return run.returncode

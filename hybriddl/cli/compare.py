"""`hybriddl compare`: the hybrid, Horovod's model and PyTorch DDP on the same emulated hosts."""

from __future__ import annotations

import argparse

from hybriddl.compare.compare import CONTENDERS, MeasureSettings
from hybriddl.display import TrainDisplay, comparison_table, console, out
from hybriddl.strategies import Processes


def add_parser(commands) -> argparse.ArgumentParser:
    compare = commands.add_parser(
        "compare", help="hybrid vs Horovod's model vs PyTorch DDP on emulated hosts: speed, "
                        "bytes per host NIC, memory")
    add_compare_arguments(compare)
    compare.set_defaults(handler=cmd_compare)
    return compare


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    MeasureSettings.add_arguments(parser)
    parser.add_argument("--hosts", type=int, default=2,
                        help="H emulated hosts (network namespaces; needs root)")
    parser.add_argument("--workers-per-host", type=int, default=2,
                        help="K local workers per host; flat-mpi, flat-ring and DDP run H x K "
                             "ranks, K on each host")
    parser.add_argument("--local-strategy", default=Processes.name,
                        help=f"the hybrid hosts' local strategy (default: {Processes.name})")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"which to run, comma-separated (default: {','.join(CONTENDERS)})")
    parser.add_argument("--bandwidth", help="every host's link rate, e.g. 1gbit or 10gbit "
                        "(default: unlimited)")
    parser.add_argument("--latency", help="every link's one-way delay, e.g. 0.1ms (needs the "
                        "kernel's netem)")
    parser.add_argument("--output", help="output folder (default: a new folder under runs/)")


def cmd_compare(args: argparse.Namespace) -> int:
    from hybriddl.compare import compare

    config = compare.CompareConfig(
        settings=MeasureSettings.from_args(args), hosts=args.hosts,
        workers_per_host=args.workers_per_host, local_strategy=args.local_strategy,
        contenders=tuple(name.strip() for name in args.contenders.split(",") if name.strip()),
        output=args.output, bandwidth=args.bandwidth, latency=args.latency)
    display = TrainDisplay()
    try:
        config, output = compare.prepare(config, display)
    finally:
        display.stop()
    with console.status("starting") as status:
        def announce(contender) -> None:
            console.print(f"[bold]{contender.name}[/]: {contender.describe_launch()}",
                          markup=True, highlight=False, soft_wrap=True)
            status.update(f"running {contender.name} ({contender.ranks} ranks)")

        comparison = compare.run_comparison(config, output, announce)
    out.print(comparison_table(comparison, compare.COLUMNS, compare.table_cells(comparison)))
    for line in compare.notes(comparison):
        out.print(f"- {line}", highlight=False)
    out.print(f"written: {output / compare.RESULT}, {output / compare.REPORT}, charts in {output}")
    return 0

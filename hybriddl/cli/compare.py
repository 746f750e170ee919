"""`hybriddl compare`: the hybrid, Horovod's model and PyTorch DDP on the same emulated hosts."""

from __future__ import annotations

import argparse

from hybriddl.cli.commands import COMMANDS
from hybriddl.cli.flags import add_data_flags, add_fp16_flag, add_measure_flags, default_of
from hybriddl.cli.settings import compare_config
from hybriddl.cli.workload_flags import add_link_flags, add_workload_flags
from hybriddl.compare.settings import (CONTENDERS, KNOWN, CompareConfig, MeasureSettings,
                                       idle_powersgd_rank)
from hybriddl.display import TrainDisplay, comparison_table, console, out
from hybriddl.strategies import STRATEGIES, Flat


def add_parser(commands) -> argparse.ArgumentParser:
    compare = commands.add_parser("compare", help=COMMANDS["compare"])
    add_compare_arguments(compare)
    compare.set_defaults(handler=cmd_compare)
    return compare


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_flags(parser, batch="global batch over all hosts and workers")
    add_data_flags(parser, cache=False)
    add_measure_flags(parser, MeasureSettings)
    add_fp16_flag(parser)
    parser.add_argument("--hosts", type=int, help="H emulated hosts (network namespaces; needs "
                        f"root) (default: {default_of(CompareConfig, 'hosts')})")
    parser.add_argument("--workers-per-host", type=int,
                        help="K local workers per host; flat-mpi, flat-ring and DDP run H x K "
                             f"ranks, K on each host (default: {default_of(CompareConfig, 'workers_per_host')})")
    local = ", ".join(name for name in STRATEGIES if name != Flat.name)
    parser.add_argument("--local-strategy",
                        help=f"the hybrid hosts' local strategy: one of {local} "
                             f"(default: {default_of(CompareConfig, 'local_strategy')})")
    parser.add_argument("--contenders",
                        help="which to run, comma-separated, among "
                             f"{', '.join(KNOWN)}: the exact ones by default "
                             f"({','.join(CONTENDERS)}); ddp-fp16 and ddp-powersgd are DDP with "
                             "torch's fp16_compress_hook and powerSGD_hook, flat-fp16 Horovod's "
                             "model with fp16 compression, hybrid-powersgd and data-powersgd "
                             "hybriddl's own PowerSGD (--compression powersgd:R)")
    parser.add_argument("--powersgd-rank", type=int, metavar="R",
                        help="the rank R of every PowerSGD contender, DDP's and hybriddl's "
                             f"(default: {default_of(CompareConfig, 'powersgd_rank')})")
    add_link_flags(parser)
    parser.add_argument("--output", help="output folder (default: a new folder under runs/)")


def cmd_compare(args: argparse.Namespace) -> int:
    from hybriddl.compare import compare, outputs

    from hybriddl.files import check_writable

    config = compare_config(args)
    if args.output:  # before any host starts
        check_writable(args.output, "--output")
    display = TrainDisplay()
    try:
        config, output = compare.prepare(config, display)
        if line := idle_powersgd_rank(args.powersgd_rank, config.contenders):
            display.warn(line)
    finally:
        display.stop()
    with console.status("starting") as status:
        def announce(contender) -> None:
            console.print(f"[bold]{contender.name}[/]: {contender.describe_launch()}",
                          markup=True, highlight=False, soft_wrap=True)
            status.update(f"running {contender.name} ({contender.ranks} ranks)")

        comparison = compare.run_comparison(config, output, announce)
    out.print(comparison_table(comparison, outputs.COLUMNS, outputs.table_cells(comparison)))
    for line in outputs.notes(comparison):
        out.print(f"- {line}", highlight=False)
    out.print(f"written: {output / outputs.RESULT}, {output / outputs.REPORT}, charts in {output}")
    return 0

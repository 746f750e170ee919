"""The command line of the PyTorch DDP contender of `hybriddl compare`, started once per
host as compare.compare.plan starts it; the processes' work is hybriddl.compare.ddp's.

    python -m hybriddl.cli.compare_ddp --processes P [--hosts H --host-index I --master-addr A] ... --result-dir D
"""

from __future__ import annotations

import argparse
import sys

from hybriddl.cli.flags import add_data_flags, add_fp16_flag, add_measure_flags
from hybriddl.cli.settings import measure_settings
from hybriddl.cli.workload_flags import add_workload_flags
from hybriddl.compare.settings import POWERSGD, MeasureSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybriddl.cli.compare_ddp",
                                     description=__doc__.splitlines()[0])
    add_workload_flags(parser, batch="global batch over all hosts and workers")
    add_data_flags(parser, cache=False)
    add_measure_flags(parser, MeasureSettings)
    hooks = parser.add_mutually_exclusive_group()
    add_fp16_flag(hooks)
    hooks.add_argument("--powersgd-rank", type=int, metavar="R",
                       help="average with torch's powerSGD_hook at rank R, in one bucket "
                            "(default: DDP's own allreduce)")
    parser.add_argument("--powersgd-min-rate", type=float, metavar="M",
                        help="with --powersgd-rank: compress only the matrices whose factors are "
                             "more than M times smaller (the hook's min_compression_rate; "
                             "default: torch's, 2)")
    parser.add_argument("--processes", type=int, required=True, help="DDP processes P in all")
    parser.add_argument("--hosts", type=int, default=1, help="hosts H the processes span")
    parser.add_argument("--host-index", type=int, default=0, help="which host this is")
    parser.add_argument("--master-addr", default="127.0.0.1", help="host 0's address")
    parser.add_argument("--interface", default="lo", help="the NIC gloo uses and the meter reads")
    parser.add_argument("--result-dir", required=True, help="where rank<R>.json goes")
    goal = parser.add_argument_group("train to a target accuracy instead of timing steps "
                                     "(scripts/time_to_accuracy.py's DDP peer)")
    goal.add_argument("--epochs", type=int, help="train N epochs at most, validating")
    goal.add_argument("--lr", type=float, help="SGD learning rate (default: the use case's)")
    goal.add_argument("--eval-every", type=int, metavar="N",
                      help="validate every N steps as well as at every epoch's end")
    goal.add_argument("--target-accuracy", type=float, metavar="A")
    goal.add_argument("--stop-at-target", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    from hybriddl.compare.ddp import run_host
    from hybriddl.compare.ddp_peer import MIN_COMPRESSION_RATE, CommHook

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.powersgd_rank is not None and args.powersgd_rank < 1:
        parser.error(f"--powersgd-rank {args.powersgd_rank}: give a rank of 1 or more")
    if args.powersgd_min_rate is not None and (args.powersgd_rank is None
                                               or args.powersgd_min_rate < 1):
        parser.error(f"--powersgd-min-rate {args.powersgd_min_rate}: give a rate of 1 or more, "
                     "with --powersgd-rank R")
    hook = (CommHook(POWERSGD, args.powersgd_rank, args.powersgd_min_rate or MIN_COMPRESSION_RATE)
            if args.powersgd_rank else CommHook())
    goal = None
    if args.epochs is not None:
        from hybriddl.compare.ddp import TrainingGoal

        if args.epochs < 1 or (args.eval_every is not None and args.eval_every < 1):
            parser.error("--epochs and --eval-every: give at least 1")
        if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
            parser.error(f"--target-accuracy {args.target_accuracy}: give a value in (0, 1]")
        goal = TrainingGoal(args.epochs, args.lr, args.eval_every, args.target_accuracy,
                            args.stop_at_target)
    elif any(v not in (None, False) for v in (args.lr, args.eval_every, args.target_accuracy,
                                               args.stop_at_target)):
        parser.error("--lr, --eval-every, --target-accuracy and --stop-at-target go with "
                     "--epochs N")
    run_host(measure_settings(args), args.processes, args.hosts, args.host_index,
             args.master_addr, args.interface, args.result_dir, hook, goal)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The command line's settings: `train`'s flags into a TrainConfig (hybriddl.run.settings),
with --resume, the checkpoint's settings under the flags given; the across-hosts flags into
`connect`'s keywords; and a line for each flag that does nothing in this run.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from hybriddl.errors import UsageError
from hybriddl.hosts.base import DEFAULT_TIMEOUT_SECONDS
from hybriddl.hosts.compression import Compression
from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES
from hybriddl.run import checkpoint
from hybriddl.run.settings import TrainConfig
from hybriddl.strategies import PRECISIONS, STRATEGIES, StrategyOptions
from hybriddl.strategies.base import CoreWorkersStrategy
from hybriddl.tuning.tuner import AUTO

# The command line's training flags are TrainConfig's fields, under the same names.
TRAINING_FLAGS = tuple(f.name for f in fields(TrainConfig) if f.name != "strategy_options")


def given_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the user typed; strategy_options holds the typed options."""
    given = {name: getattr(args, name) for name in TRAINING_FLAGS
             if getattr(args, name) is not None}
    devices = tuple(d.strip() for d in args.devices.split(",")) if args.devices else None
    options = {"workers": args.workers, "micro_batches": args.micro_batches, "devices": devices,
               "oversubscribe": args.oversubscribe or None, "precision": args.precision,
               "channels_last": args.channels_last or None,
               "accumulate": getattr(args, "accumulate", None)}
    given["strategy_options"] = {k: v for k, v in options.items() if v is not None}
    return given


def add_numerics_args(parser: argparse.ArgumentParser, *, channels_last: bool) -> None:
    """--precision (train and tune) and --channels-last (train): the strategy's numerics."""
    parser.add_argument("--precision", choices=(*PRECISIONS, AUTO),
                        help="fp32 (default); bf16: autocast forward, float32 weights and "
                             "optimizer; auto: the tuner tries both (with --strategy auto)")
    if channels_last:
        parser.add_argument("--channels-last", action="store_true",
                            help="images and convolution weights in channels_last memory "
                                 "format (with a named --strategy; auto decides itself)")


def add_accumulate_arg(parser: argparse.ArgumentParser, where: str) -> None:
    """--accumulate (train and tune): gradient accumulation, a strategy option."""
    parser.add_argument("--accumulate", type=int, metavar="N",
                        help="compute each host batch in N sequential chunks and add their "
                             "gradients: the same step with activations for one chunk at a "
                             f"time (less memory; default: 1); {where}")


def resume_if_exists(args: argparse.Namespace) -> bool:
    """Turn --resume-if-exists into --resume or --run-dir; False if its run already finished."""
    run_dir = args.resume_if_exists
    if run_dir is None:
        return True
    if args.resume is not None or args.run_dir not in (None, run_dir):
        raise UsageError(f"--resume-if-exists {run_dir} names the run directory already: leave "
                         "--resume and --run-dir out")
    state = checkpoint.run_state(run_dir)
    if state == checkpoint.FINISHED:
        return False
    if state == checkpoint.RESUMABLE:
        args.resume, args.run_dir = run_dir, None
    else:
        args.run_dir = run_dir
    return True


def training_config(args: argparse.Namespace):
    """The run's TrainConfig, and with --resume the checkpoint it continues from."""
    settings, resume = given_settings(args), None
    if args.resume is not None:
        if args.run_dir is not None and args.run_dir != args.resume:
            raise UsageError(f"--run-dir {args.run_dir} and --resume {args.resume}: a resumed "
                             "run continues in its own directory; leave --run-dir out")
        resume = checkpoint.load(args.resume)
        settings = checkpoint.resumed_settings(resume, settings, args.resume)
    else:
        settings.setdefault("strategy", AUTO)
    options = StrategyOptions(**settings.pop("strategy_options"))
    known = {f.name for f in fields(TrainConfig)}
    settings = {name: value for name, value in settings.items() if name in known}
    return TrainConfig(**settings, strategy_options=options), resume


# The across-hosts flags, which do something only when there are other hosts.
HOSTS_FLAGS = {"overlap": "--overlap", "fp16_allreduce": "--fp16-allreduce",
               "fusion_mib": "--fusion-mib", "host_timeout": "--host-timeout",
               "balance": "--balance", "throughput": "--throughput"}


def hosts_options(args: argparse.Namespace) -> dict:
    """`hosts.cluster.connect`'s keywords from the across-hosts flags."""
    return {"overlap": args.overlap,
            "compression": Compression.fp16 if args.fp16_allreduce else Compression.none,
            "bucket_bytes": (DEFAULT_BUCKET_BYTES if args.fusion_mib is None
                             else int(args.fusion_mib * 2**20)),
            "timeout": DEFAULT_TIMEOUT_SECONDS if args.host_timeout is None else args.host_timeout}


def ignored_flags(args: argparse.Namespace, config: TrainConfig, hosts_count: int) -> list[str]:
    """One line for each flag given that does nothing in this run, so none is ignored silently."""
    lines = []
    strategy = STRATEGIES.get(config.strategy)
    if args.workers is not None and strategy and not issubclass(strategy, CoreWorkersStrategy):
        with_workers = ", ".join(name for name, cls in STRATEGIES.items()
                                 if issubclass(cls, CoreWorkersStrategy))
        lines.append(f"--workers {args.workers} does nothing with --strategy {config.strategy}, "
                     f"which has no local workers (these have: {with_workers})")
    if hosts_count == 1:
        lines += [f"{flag} does nothing on a single host: it acts when mpirun starts one rank "
                  "on each of several hosts"
                  for name, flag in HOSTS_FLAGS.items() if getattr(args, name) not in (None, False)]
    return lines

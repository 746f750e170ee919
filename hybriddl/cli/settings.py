"""The flags become settings, once: `train`'s into a TrainConfig (hybriddl.run.settings), with
--resume the checkpoint's settings under the flags given; the across-hosts flags into
`connect`'s keywords; compare's into a CompareConfig and its contenders' into
MeasureSettings; and a line for each flag that does nothing in this run. Flags left out
(None) take the settings' own defaults.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from hybriddl.cli.flags import with_workers
from hybriddl.compare.settings import CompareConfig, MeasureSettings
from hybriddl.errors import UsageError
from hybriddl.hosts.compression import AUTO as AUTO_COMPRESSION, EXACT, Compression, parse_compression
from hybriddl.hosts.scheme import BUCKETED
from hybriddl.run import resumption
from hybriddl.run.settings import TrainConfig
from hybriddl.strategies import STRATEGIES, StrategyOptions
from hybriddl.strategies.base import CoreWorkersStrategy
from hybriddl.tuning.tuner import AUTO

def typed(args: argparse.Namespace, settings: type) -> dict:
    """The fields of a settings dataclass that were typed: the flags of the same names
    (--batch-size is batch_size) that are not None."""
    return {f.name: getattr(args, f.name) for f in fields(settings)
            if getattr(args, f.name, None) is not None}


def typed_strategy_options(args: argparse.Namespace) -> dict:
    """The StrategyOptions fields typed (cli/flags.py: the strategy and numerics flags)."""
    devices = tuple(d.strip() for d in args.devices.split(",")) if args.devices else None
    options = {"workers": args.workers, "micro_batches": args.micro_batches, "devices": devices,
               "oversubscribe": args.oversubscribe or None,
               "precision": getattr(args, "precision", None),
               "channels_last": getattr(args, "channels_last", None) or None,
               "accumulate": getattr(args, "accumulate", None)}
    return {k: v for k, v in options.items() if v is not None}


def given_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the user typed (train's flags are its fields, under the same
    names); strategy_options holds the typed options."""
    given = {**typed(args, TrainConfig), "strategy_options": typed_strategy_options(args)}
    compression = typed_compression(args)
    if compression is not None:
        given["compression"] = compression
    return given


def typed_compression(args: argparse.Namespace) -> str | None:
    """--compression as typed (checked), --fp16-allreduce being --compression fp16; None
    when neither was typed."""
    text = getattr(args, "compression", None)
    if text is not None:
        text = text.strip()
        parse_compression(text)  # an unknown scheme or rank: one line, exit 2
    if getattr(args, "fp16_allreduce", False):
        fp16 = Compression.fp16.name
        if text not in (None, fp16):
            raise UsageError(f"--fp16-allreduce and --compression {text}: --fp16-allreduce is "
                             f"--compression {fp16}; give one of them")
        text = fp16
    return text


def measure_settings(args: argparse.Namespace) -> MeasureSettings:
    """compare's, and its contenders' ranks', workload and timed steps."""
    return MeasureSettings(**typed(args, MeasureSettings))


def compare_config(args: argparse.Namespace) -> CompareConfig:
    given = typed(args, CompareConfig)
    if "contenders" in given:
        given["contenders"] = tuple(name.strip() for name in given["contenders"].split(",")
                                    if name.strip())
    return CompareConfig(**{**given, "settings": measure_settings(args)})


def resume_if_exists(args: argparse.Namespace) -> bool:
    """Turn --resume-if-exists into --resume or --run-dir; False if its run already finished."""
    run_dir = args.resume_if_exists
    if run_dir is None:
        return True
    if args.resume is not None or args.run_dir not in (None, run_dir):
        raise UsageError(f"--resume-if-exists {run_dir} names the run directory already: leave "
                         "--resume and --run-dir out")
    state = resumption.run_state(run_dir)
    if state == resumption.FINISHED:
        return False
    if state == resumption.RESUMABLE:
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
        resume = resumption.load(args.resume)
        settings = resumption.resumed_settings(resume, settings, args.resume)
    else:
        settings.setdefault("strategy", AUTO)
    options = StrategyOptions(**settings.pop("strategy_options"))
    known = {f.name for f in fields(TrainConfig)}
    settings = {name: value for name, value in settings.items() if name in known}
    return TrainConfig(**settings, strategy_options=options), resume


# The across-hosts flags, which do something only when there are other hosts.
HOSTS_FLAGS = {"overlap": "--overlap", "fp16_allreduce": "--fp16-allreduce",
               "fusion_mib": "--fusion-mib", "host_timeout": "--host-timeout",
               "progress_timeout": "--progress-timeout",
               "balance": "--balance", "throughput": "--throughput",
               "check_every": "--check-every", "strict_equal": "--strict-equal"}


def hosts_options(args: argparse.Namespace) -> dict:
    """`hosts.cluster.connect`'s keywords from the across-hosts flags; those left out are
    connect's defaults."""
    compression = parse_compression(typed_compression(args) or EXACT)
    options = {"overlap": args.overlap,
               # auto is settled by the trainer (use_compression), from the planner.
               "compression": Compression.none if compression == AUTO_COMPRESSION else compression}
    if args.fusion_mib is not None:
        options["bucket_bytes"] = int(args.fusion_mib * 2**20)
    if args.host_timeout is not None:
        options["timeout"] = args.host_timeout
    if args.progress_timeout is not None:
        if not args.progress_timeout > 0:
            raise UsageError(f"--progress-timeout {args.progress_timeout:g}: give a positive "
                             "number of seconds")
        options["progress_timeout"] = args.progress_timeout
    return options


def ignored_flags(args: argparse.Namespace, config: TrainConfig, hosts_count: int) -> list[str]:
    """One line for each flag given that does nothing in this run, so none is ignored silently."""
    lines = []
    strategy = STRATEGIES.get(config.strategy)
    if args.workers is not None and strategy and not issubclass(strategy, CoreWorkersStrategy):
        lines.append(f"--workers {args.workers} does nothing with --strategy {config.strategy}, "
                     f"which has no local workers (these have: {with_workers()})")
    if hosts_count == 1:
        lines += [f"{flag} does nothing on a single host: it acts when mpirun starts one rank "
                  "on each of several hosts"
                  for name, flag in HOSTS_FLAGS.items() if getattr(args, name) not in (None, False)]
        compression = parse_compression(config.compression) \
            if getattr(args, "compression", None) else None
        # A whole-gradient scheme applies alone too (the same steps as on H hosts); an
        # inexact bucketed one has nothing to send.
        if getattr(compression, "kind", None) == BUCKETED and not compression.exact:
            lines.append(f"--compression {compression.name} does nothing on a single host: it "
                         "acts when mpirun starts one rank on each of several hosts")
    return lines

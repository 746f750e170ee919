"""The flags become settings, once: `train`'s into TrainFlags (the fields typed, the run to
resume, `connect`'s keywords; hybriddl.run.settings.settled_config makes them the run's
TrainConfig, under a resumed checkpoint's settings); compare's into a CompareConfig and its
contenders' into MeasureSettings. Flags left out (None) take the settings' own defaults.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from hybriddl.compare.settings import CompareConfig, MeasureSettings
from hybriddl.errors import UsageError
from hybriddl.hosts.compression import AUTO as AUTO_COMPRESSION, EXACT, Compression, parse_compression
from hybriddl.hosts.scheme import BUCKETED
from hybriddl.run import resumption
from hybriddl.run.settings import TrainConfig

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
    """--compression as typed (its parse checks it), --fp16-allreduce being --compression
    fp16; None when neither was typed."""
    text = getattr(args, "compression", None)
    if text is not None:
        text = text.strip()
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


@dataclass(frozen=True)
class TrainFlags:
    """`train`'s command line, read once: what cmd_train needs before the hosts connect
    (`finished`, `connect`) and after (`given` and `resume` become the run's TrainConfig
    in hybriddl.run.settings.settled_config; the rest says which flags do nothing here)."""

    finished: bool  # --resume-if-exists names a run that has finished: nothing to do
    given: dict  # the TrainConfig fields typed; strategy_options: the options typed
    resume: str | None  # the run directory the run continues (--resume, --resume-if-exists)
    run_dir: str | None  # where the run writes, where known before it starts
    connect: dict  # hosts.cluster.connect's keywords
    alone: tuple[str, ...]  # a line for each flag typed that does nothing on a single host
    idle: tuple[str, ...]  # a line for each flag typed that another flag typed makes idle


def train_flags(args: argparse.Namespace) -> TrainFlags:
    """Every `train` flag checked and turned into settings, once (a bad one: UsageError)."""
    if args.measure_only and args.resume_if_exists:
        raise UsageError("--measure-only writes no checkpoint, so --resume-if-exists would have "
                         "nothing to resume: leave one of them out")
    if args.measure_only and args.resume:
        raise UsageError(f"--measure-only writes no checkpoint, validation or model.pt, so it "
                         f"cannot continue the run in {args.resume}: leave one of them out")
    if args.measure_only and (args.target_accuracy is not None or args.eval_every is not None
                              or args.stop_at_target):
        raise UsageError("--measure-only runs no validation, so --target-accuracy, "
                         "--eval-every and --stop-at-target would time nothing: leave one "
                         "side out")
    # The flags' own reading first, then what reads files or parses (the scheme).
    given = given_settings(args)
    connect = connect_options(args)
    host_flags = tuple(flag for name, flag in HOSTS_FLAGS.items()
                       if getattr(args, name) not in (None, False))
    for flag, value in (("--run-dir", args.run_dir), ("--resume", args.resume),
                        ("--resume-if-exists", args.resume_if_exists)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag} '{value}': give a directory")
    if args.weights is not None and not args.weights.strip():  # would train from scratch
        raise UsageError(f"--weights '{args.weights}': give a state_dict file or a weights name")
    run_dir, resume, finished = args.run_dir, args.resume, False
    if args.resume_if_exists is not None:
        # For job schedulers: --resume RUN_DIR with a checkpoint there, a new run in RUN_DIR
        # without, nothing where its run finished.
        if resume is not None or run_dir not in (None, args.resume_if_exists):
            raise UsageError(f"--resume-if-exists {args.resume_if_exists} names the run "
                             "directory already: leave --resume and --run-dir out")
        state = resumption.run_state(args.resume_if_exists)
        finished = state == resumption.FINISHED
        if state == resumption.RESUMABLE:
            resume, run_dir = args.resume_if_exists, None
        else:
            run_dir = args.resume_if_exists
    if resume is not None and run_dir is not None and run_dir != resume:
        raise UsageError(f"--run-dir {run_dir} and --resume {resume}: a resumed run "
                         "continues in its own directory; leave --run-dir out")
    given.pop("run_dir", None)
    if run_dir is not None:
        given["run_dir"] = run_dir
    typed = given.get("compression")
    scheme = parse_compression(typed or EXACT)  # an unknown scheme or rank: one line, exit 2
    # auto is settled by the trainer (use_compression), from the planner.
    connect["compression"] = Compression.none if scheme == AUTO_COMPRESSION else scheme
    # A whole-gradient scheme applies alone too (the same steps as on H hosts); an inexact
    # bucketed one has nothing to send (--fp16-allreduce, its other name, is said above).
    if (args.compression is not None and getattr(scheme, "kind", None) == BUCKETED
            and not scheme.exact):
        host_flags += (f"--compression {scheme.name}",)
    alone = tuple(f"{flag} does nothing on a single host: it acts when mpirun starts one "
                  "rank on each of several hosts" for flag in host_flags)
    idle = (f"--checkpoint-every {args.checkpoint_every} does nothing with --measure-only, "
            "which writes no checkpoint",) if args.measure_only and \
        args.checkpoint_every is not None else ()
    return TrainFlags(finished, given, resume, run_dir or resume, connect, alone, idle)


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
    # auto is settled by the trainer (use_compression), from the planner.
    return {**connect_options(args),
            "compression": Compression.none if compression == AUTO_COMPRESSION else compression}


def connect_options(args: argparse.Namespace) -> dict:
    """`hosts_options` but the compression (which train settles with its other flags)."""
    options = {"overlap": args.overlap}
    if args.fusion_mib is not None:
        if not 0 < args.fusion_mib < math.inf:
            raise UsageError(f"--fusion-mib {args.fusion_mib:g}: give a positive number of MiB")
        options["bucket_bytes"] = int(args.fusion_mib * 2**20)
    if args.host_timeout is not None:
        options["timeout"] = args.host_timeout
    if args.progress_timeout is not None:
        if not args.progress_timeout > 0:
            raise UsageError(f"--progress-timeout {args.progress_timeout:g}: give a positive "
                             "number of seconds")
        options["progress_timeout"] = args.progress_timeout
    return options

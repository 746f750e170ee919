"""The flags several commands share, each group defined once: the data, the local strategy
and its numerics, the hosts, the timed steps, tuning (the workload, the emulated links and
Open MPI's parameters: workload_flags.py).

A flag's default lives with what it configures (the use case, the tuner, the fusion
buffers, a settings dataclass); the help text quotes it from there. Flags whose default is
None are filled in when the flags become settings (cli/settings.py), so that the same
default holds for every command and --resume can tell a typed flag from one left out.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from hybriddl.hosts.base import BALANCE_POLICIES, DEFAULT_PROGRESS_SECONDS, DEFAULT_TIMEOUT_SECONDS
from hybriddl.hosts.compression import compression_help
from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES
from hybriddl.hosts.heartbeat import SILENCE_SECONDS
from hybriddl.hybrid.parallel import HOST_PARALLEL
from hybriddl.hybrid.planner import FEATURE_DTYPES
from hybriddl.strategies import PRECISIONS, STRATEGIES, Pipeline, StrategyOptions, with_workers
from hybriddl.tuning import tuner


def default_of(settings: type, name: str):
    """A settings dataclass's default for one of its fields, for a help text."""
    field = next(f for f in fields(settings) if f.name == name)
    return field.default if field.default is not MISSING else field.default_factory()


def add_data_flags(parser: argparse.ArgumentParser, *, cache: bool = True) -> None:
    """--data and --data-cache: train's, tune's and compare's images."""
    parser.add_argument("--data",
                        help="'synthetic' (embedded, default), synthetic:N (N generated images), "
                             "an ImageFolder DIR, or cifar10:DIR; all but 'synthetic' are "
                             "streamed from a cache file built once")
    if cache:
        parser.add_argument("--data-cache", metavar="DIR",
                            help="where decoded data are cached for every later run and tune "
                                 "(default: $XDG_CACHE_HOME/hybriddl or ~/.cache/hybriddl)")


def add_strategy_flags(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """--strategy and its options: --workers, --micro-batches, --devices, --oversubscribe."""
    named = ", ".join(STRATEGIES)
    parser.add_argument("--strategy", required=required,
                        help=f"local strategy: {named}" if required else
                        f"local strategy: {tuner.AUTO} (this host's profiled pick; tunes first "
                        f"when no profile fits), {named} (default: {tuner.AUTO})")
    parser.add_argument("--workers", type=int, help=f"local workers K for {with_workers()}")
    parser.add_argument("--micro-batches", type=int,
                        help=f"{Pipeline.name} micro-batches M "
                             f"(default: {StrategyOptions().micro_batches})")
    parser.add_argument("--devices", help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu,cpu")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more local workers than usable cores")


def add_numerics_flags(parser: argparse.ArgumentParser, *, channels_last: bool) -> None:
    """--precision (train and tune) and --channels-last (train): the strategy's numerics."""
    parser.add_argument("--precision", choices=(*PRECISIONS, tuner.AUTO),
                        help=f"{StrategyOptions().precision} (default); bf16: autocast forward, "
                             "float32 weights and optimizer; auto: the tuner tries both (with "
                             "--strategy auto)")
    if channels_last:
        parser.add_argument("--channels-last", action="store_true",
                            help="images and convolution weights in channels_last memory "
                                 "format (with a named --strategy; auto decides itself)")


def add_accumulate_flag(parser: argparse.ArgumentParser, where: str) -> None:
    """--accumulate (train and tune): gradient accumulation, a strategy option."""
    parser.add_argument("--accumulate", type=int, metavar="N",
                        help="compute each host batch in N sequential chunks and add their "
                             "gradients: the same step with activations for one chunk at a "
                             "time (less memory; a BatchNorm model's batch statistics are each "
                             f"chunk's; default: {StrategyOptions().accumulate}); {where}")


def add_fp16_flag(parser) -> None:
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="half-precision gradients on the wire (half the bytes); in train, "
                             "the same as --compression fp16")


def add_compression_flag(parser) -> None:
    parser.add_argument("--compression", metavar="SCHEME", help=compression_help())


def add_hosts_flags(parser: argparse.ArgumentParser) -> None:
    """The across-hosts flags: `connect`'s keywords (cli/settings.py:hosts_options), the
    batch shares and the host-parallel scheme."""
    group = parser.add_argument_group("across hosts (when started by mpirun, one rank per host)")
    group.add_argument("--overlap", action="store_true",
                       help="send gradient buckets while backward still runs, where the strategy allows it")
    add_compression_flag(group)
    group.add_argument("--feature-dtype", choices=tuple(FEATURE_DTYPES),
                       help="with --host-parallel hybrid, the split's features and their "
                            "gradients on the wire: float32 is exact (default), bfloat16 half "
                            "the bytes (inexact, opt-in); with --compression auto, left out, "
                            "the planner's")
    add_fp16_flag(group)
    group.add_argument("--balance", choices=BALANCE_POLICIES,
                       help="hosts' shares of the global batch: proportional to their images/s, or "
                            "even (default: throughput when the hosts' figures differ)")
    group.add_argument("--throughput", type=float, metavar="IMAGES_PER_S",
                       help="this host's images/s for --balance (default: its profile's, if any)")
    group.add_argument("--host-parallel", choices=HOST_PARALLEL,
                       help="data: average the whole gradient; hybrid: convolutions data-parallel, "
                            "the classifier's linear layers split across hosts (exact; far fewer "
                            "bytes for AlexNet and VGG); auto (default): the faster, predicted "
                            "from the profile and the link the hosts measure at start")
    group.add_argument("--fusion-mib", type=float,
                       help="size of the gradient fusion buffers in MiB "
                            f"(default: {DEFAULT_BUCKET_BYTES / 2**20:g})")
    group.add_argument("--host-timeout", type=float,
                       help="stop when another host, alive, has not come to an exchange for this "
                            f"many seconds (default: {DEFAULT_TIMEOUT_SECONDS:.0f}); a transfer "
                            "in progress is never cut short, however slow the link: a host that "
                            f"died, hung or lost its link is named after {SILENCE_SECONDS:.0f} s "
                            "of heartbeat silence")
    group.add_argument("--progress-timeout", type=float,
                       help="stop when every host is alive and inside the same exchange and no "
                            "part of it completed for this many seconds (default: "
                            f"{DEFAULT_PROGRESS_SECONDS:.0f}, or on a slow link the time of 4 "
                            "parts of 8 MiB, or of one request sent whole where larger): a "
                            "collective the hosts entered differently, or a data path that "
                            "drops packets while the heartbeat's passes")


def add_seed_flag(parser: argparse.ArgumentParser, settings: type) -> None:
    """--seed, a run's one seed (initialisation, shuffling, augmentation, dropout masks); its
    default is `settings`' (run.settings.TrainConfig, compare.settings.MeasureSettings)."""
    parser.add_argument("--seed", type=int, help="initialisation, shuffling and augmentation seed "
                        f"(default: {default_of(settings, 'seed')})")


def add_timed_steps_flags(parser: argparse.ArgumentParser, steps: int, warmup: int,
                          each: str = "") -> None:
    """--steps and --warmup: the optimizer steps a measurement times, and the untimed ones
    before them (`each`: what one measurement is, e.g. " per visit"). Left out, they are
    None and the measurement's own defaults, `steps` and `warmup`, apply."""
    parser.add_argument("--steps", type=int, help=f"timed steps{each} (default: {steps})")
    parser.add_argument("--warmup", type=int,
                        help=f"untimed steps{each} before them (default: {warmup})")


def add_measure_flags(parser: argparse.ArgumentParser, settings: type) -> None:
    """--steps, --warmup, --seed: the timed steps of compare and its contenders' ranks;
    their defaults are `settings`' (compare.settings.MeasureSettings)."""
    add_timed_steps_flags(parser, default_of(settings, "steps"), default_of(settings, "warmup"))
    add_seed_flag(parser, settings)


def add_tuning_flags(parser: argparse.ArgumentParser) -> None:
    """tune's budget, interleaved rounds and timed steps per visit, defaults the tuner's."""
    parser.add_argument("--budget", type=float, default=tuner.TUNE_BUDGET_SECONDS,
                        help="seconds for all candidates together; a candidate that cannot "
                             "finish within its share is dropped "
                             f"(default: {tuner.TUNE_BUDGET_SECONDS:.0f})")
    parser.add_argument("--rounds", type=int, default=tuner.TUNE_ROUNDS,
                        help=f"interleaved rounds (default: {tuner.TUNE_ROUNDS})")
    parser.add_argument("--second-look", type=int, default=tuner.SECOND_LOOK_ROUNDS,
                        help="extra rounds for the two fastest and any other whose fastest "
                             f"round is within {tuner.SECOND_LOOK_SPAN:.0%}% of the fastest, at "
                             f"most {tuner.SECOND_LOOK_MOST} (default: {tuner.SECOND_LOOK_ROUNDS})")
    add_timed_steps_flags(parser, tuner.TUNE_TIMED_STEPS, tuner.TUNE_WARMUP_STEPS, " per visit")


def add_profile_dir_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--profile-dir", help=f"{what} (default: $HYBRIDDL_PROFILES or ./profiles)")

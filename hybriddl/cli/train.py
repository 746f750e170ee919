"""`hybriddl train`: a use case on this host, or on every host under mpirun."""

from __future__ import annotations

import argparse

from hybriddl.config import (add_accumulate_arg, add_numerics_args, hosts_options, ignored_flags,
                             resume_if_exists, training_config)
from hybriddl.display import TrainDisplay, console, epoch_table, out, show_host_failure
from hybriddl.errors import TrainingInterrupted
from hybriddl.strategies import STRATEGIES
from hybriddl.tuning.tuner import AUTO_BUDGET_SECONDS
from hybriddl.usecases import DEFAULT_USECASE, USECASES


def add_parser(commands) -> argparse.ArgumentParser:
    train = commands.add_parser("train", help="train a use case on this host (or under mpirun)")
    add_training_args(train)
    add_hosts_args(train)
    train.set_defaults(handler=cmd_train)
    return train

def add_training_args(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(USECASES)
    # Defaults are None here and filled in by TrainConfig, so that --resume can tell the
    # flags a user typed from those left out (which then come from the checkpoint).
    parser.add_argument("--usecase", help=f"one of {names} (default: {DEFAULT_USECASE})")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--data",
                        help="'synthetic' (embedded, default), synthetic:N (N generated images), "
                             "an ImageFolder DIR, or cifar10:DIR; all but 'synthetic' are "
                             "streamed from a cache file built once")
    parser.add_argument("--data-cache", metavar="DIR",
                        help="where decoded data are cached for every later run and tune "
                             "(default: $XDG_CACHE_HOME/hybriddl or ~/.cache/hybriddl)")
    # default None, not False: --resume tells a typed flag from one left out by None.
    parser.add_argument("--strict-data", action="store_true", default=None,
                        help="stop (exit 2) if any file of --data is no usable image, instead "
                             "of leaving it out and listing it beside the cache")
    parser.add_argument("--classes", type=int, help="cifar10: keep only the first N classes")
    parser.add_argument("--val-fraction", type=float,
                        help="share of each class held out for validation (default: 0.2)")
    parser.add_argument("--image-size", type=int, help="pixels per side (default: 224)")
    parser.add_argument("--batch-size", type=int, help="global batch: samples per optimizer step over all hosts")
    parser.add_argument("--epochs", type=int, help="default: the use case's (3)")
    parser.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    parser.add_argument("--lr", type=float, help="SGD learning rate (default: 0.001)")
    parser.add_argument("--momentum", type=float, help="SGD momentum (default: 0.9)")
    parser.add_argument("--dropout", type=float,
                        help="dropout of the torchvision model; 0 makes runs comparable step for step")
    parser.add_argument("--weights", metavar="FILE", help="start from a state_dict, e.g. a run's model.pt")
    parser.add_argument("--seed", type=int,
                        help="initialisation, shuffling and augmentation seed (default: 0)")
    parser.add_argument("--run-dir", help="output folder (default: a new folder under runs/)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its checkpoint; flags left out "
                             "are the checkpoint's")
    parser.add_argument("--resume-if-exists", metavar="RUN_DIR",
                        help="for job schedulers that restart the same command: --resume RUN_DIR "
                             "if it has a checkpoint, nothing (exit 0) if its run finished, "
                             "else a new run in RUN_DIR")
    parser.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="also write a checkpoint every N steps (always: every epoch)")
    parser.add_argument("--strategy",
                        help=f"local strategy: auto (this host's profiled pick; tunes first when no "
                             f"profile fits), {', '.join(STRATEGIES)} (default: auto)")
    parser.add_argument("--profile-dir", help="where auto finds and keeps profiles "
                        "(default: $HYBRIDDL_PROFILES or ./profiles)")
    parser.add_argument("--tune-budget", type=float,
                        help="seconds auto may spend tuning when no profile fits "
                             f"(default: {AUTO_BUDGET_SECONDS:.0f})")
    parser.add_argument("--workers", type=int, help="local workers K for threads/processes/intraop")
    parser.add_argument("--micro-batches", type=int, help="pipeline micro-batches M (default: 4)")
    parser.add_argument("--devices", help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu,cpu")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more local workers than usable cores")
    add_numerics_args(parser, channels_last=True)
    add_accumulate_arg(parser, "with auto, the profile tuned with the same N")
    parser.add_argument("--monitor-interval", type=float,
                        help="seconds between pidstat/sar-style samples (default: 1; 0 disables)")


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--usecase", default=DEFAULT_USECASE, help=f"one of {', '.join(USECASES)}")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--image-size", type=int, help="pixels per side (default: the use case's, 224)")
    parser.add_argument("--batch-size", type=int, help="this host's batch (default: the use case's)")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="seconds for all candidates together; a candidate that cannot "
                             "finish within its share is dropped (default: 600)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--second-look", type=int, default=2,
                        help="extra rounds for the two fastest and any other whose fastest "
                             "round is within 10%% of the fastest, at most 4 (default: 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per visit (default: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per visit (default: 1)")
    parser.add_argument("--output", help="profile file (default: one per setting in PROFILE_DIR)")
    parser.add_argument("--data", help="measure on batches of this data, as train's --data "
                        "(default: the use case's embedded set)")
    parser.add_argument("--data-cache", metavar="DIR", help="as train's --data-cache")
    parser.add_argument("--profile-dir", help="default: $HYBRIDDL_PROFILES or ./profiles")
    add_numerics_args(parser, channels_last=False)
    add_accumulate_arg(parser, "every candidate computes the batch in N chunks; train "
                               "--accumulate N with --strategy auto uses this profile")


def add_hosts_args(parser: argparse.ArgumentParser) -> None:
    from hybriddl.hosts.base import BALANCE_POLICIES, DEFAULT_TIMEOUT_SECONDS

    group = parser.add_argument_group("across hosts (when started by mpirun, one rank per host)")
    group.add_argument("--overlap", action="store_true",
                       help="send gradient buckets while backward still runs, where the strategy allows it")
    group.add_argument("--fp16-allreduce", action="store_true",
                       help="half-precision gradients on the wire (half the bytes)")
    group.add_argument("--balance", choices=BALANCE_POLICIES,
                       help="hosts' shares of the global batch: proportional to their images/s, or "
                            "even (default: throughput when the hosts' figures differ)")
    group.add_argument("--throughput", type=float, metavar="IMAGES_PER_S",
                       help="this host's images/s for --balance (default: its profile's, if any)")
    group.add_argument("--host-parallel", choices=("auto", "data", "hybrid"),
                       help="data: average the whole gradient; hybrid: convolutions data-parallel, "
                            "the classifier's linear layers split across hosts (exact; far fewer "
                            "bytes for AlexNet and VGG); auto (default): the faster, predicted "
                            "from the profile and the link the hosts measure at start")
    group.add_argument("--fusion-mib", type=float,
                       help="size of the gradient fusion buffers in MiB (default: 64)")
    group.add_argument("--host-timeout", type=float,
                       help="stop when another host has not come to a step's exchange for this "
                            f"many seconds (default: {DEFAULT_TIMEOUT_SECONDS:.0f}); a host that "
                            "died, hung or lost its link is named after 15 s of silence regardless")


def cmd_train(args: argparse.Namespace) -> int:
    from hybriddl.data.loading import data_notes, data_repairs
    from hybriddl.hosts.cluster import connect
    from hybriddl.run import trainer
    from hybriddl.run.failure_record import StepsSeen, record_failure, record_stop
    from hybriddl.rundir import default_run_dir
    from hybriddl.run.shutdown import StopRequest, stop_every_host

    if not resume_if_exists(args):
        console.print(f"hybriddl: the run in {args.resume_if_exists} has finished; nothing to do",
                      markup=False, highlight=False, soft_wrap=True)
        return 0
    hosts = connect(**hosts_options(args))
    display = TrainDisplay(enabled=hosts.rank == 0)  # one progress bar, not one per host
    stop = StopRequest()
    steps = StepsSeen(display)  # how far this attempt came, should it fail
    try:
        with stop.handling_signals():
            config, resume = training_config(args)
            for line in ignored_flags(args, config, hosts.size):
                display.warn(line)
            if hosts.size > 1 and config.run_dir is None:
                # Every rank names rank 0's run directory (its monitors write there too).
                config.run_dir = hosts.broadcast_object(
                    str(default_run_dir(config.usecase)) if hosts.rank == 0 else None)
            prepared = trainer.prepare(config, display, resume, hosts_count=hosts.size, stop=stop)
            for line in data_notes(prepared.split):
                display.warn(line)
            metrics = trainer.run(prepared, steps, hosts, stop=stop)
            for line in data_repairs(prepared.split):
                display.warn(line)
    except TrainingInterrupted:
        # Every host stopped after the same step: they leave together, nothing to abort.
        display.stop()
        record_stop(args.run_dir or args.resume, hosts.rank, steps)
        hosts.close()
        raise
    except (Exception, KeyboardInterrupt) as exc:
        display.stop()
        record_failure(args.run_dir or args.resume, hosts.rank, exc, steps)
        stop_every_host(hosts, exc, show_host_failure)
        raise
    finally:
        display.stop()
    hosts.close()
    if hosts.rank == 0:
        out.print(epoch_table(metrics["epochs"]))
        out.print(f"run directory: {prepared.run_dir}")
    return 0


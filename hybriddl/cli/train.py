"""`hybriddl train`: a use case on this host, or on every host under mpirun."""

from __future__ import annotations

import argparse

from hybriddl.cli.commands import COMMANDS
from hybriddl.cli.flags import (add_accumulate_flag, add_data_flags, add_hosts_flags,
                                add_numerics_flags, add_profile_dir_flag, add_seed_flag,
                                add_strategy_flags, default_of)
from hybriddl.cli.settings import train_flags
from hybriddl.cli.workload_flags import add_workload_flags
from hybriddl.display import (TrainDisplay, console, epoch_table, out, show_host_failure,
                              target_line)
from hybriddl.errors import TrainingError, TrainingInterrupted
from hybriddl.run.settings import TrainConfig, settled_config
from hybriddl.tuning.tuner import AUTO_BUDGET_SECONDS
from hybriddl.usecases import DEFAULT_USECASE, get_usecase


def add_parser(commands) -> argparse.ArgumentParser:
    train = commands.add_parser("train", help=COMMANDS["train"])
    add_training_args(train)
    train.set_defaults(handler=cmd_train)
    return train


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """train's flags. Their defaults are None and filled in by TrainConfig, so that --resume
    can tell the flags a user typed from those left out (which then come from the checkpoint)."""
    case = get_usecase(DEFAULT_USECASE)
    add_workload_flags(parser, batch="global batch: samples per optimizer step over all hosts",
                       typed_only=True)
    add_data_flags(parser)
    # default None, not False: --resume tells a typed flag from one left out by None.
    parser.add_argument("--strict-data", action="store_true", default=None,
                        help="stop (exit 2) if any file of --data is no usable image, instead "
                             "of leaving it out and listing it beside the cache")
    parser.add_argument("--classes", type=int, help="cifar10: keep only the first N classes")
    parser.add_argument("--val-fraction", type=float,
                        help="share of each class held out for validation "
                             f"(default: {default_of(TrainConfig, 'val_fraction')})")
    parser.add_argument("--epochs", type=int, help=f"default: the use case's ({case.epochs})")
    parser.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    parser.add_argument("--lr", type=float,
                        help=f"SGD learning rate (default: the use case's, {case.lr})")
    parser.add_argument("--momentum", type=float,
                        help=f"SGD momentum (default: the use case's, {case.momentum})")
    parser.add_argument("--dropout", type=float,
                        help="dropout of the torchvision model; 0 makes runs comparable step for step")
    parser.add_argument("--weights", metavar="FILE|NAME",
                        help="start from a state_dict (e.g. a run's model.pt), or from weights "
                             "torchvision lists for the model (DEFAULT, IMAGENET1K_V1, "
                             "AlexNet_Weights.IMAGENET1K_V1), read from torch's cache "
                             "($TORCH_HOME/hub/checkpoints) or downloaded there")
    add_seed_flag(parser, TrainConfig)
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
    parser.add_argument("--measure-only", action="store_true",
                        help="time the steps only: no checkpoint, validation pass or model.pt "
                             "(what benchmarks run: scripts/scaling_e2e.py); metrics.json "
                             "says so, and the run cannot be resumed")
    timed = parser.add_argument_group("time to accuracy (as MLPerf Training times a run)")
    timed.add_argument("--target-accuracy", type=float, metavar="A",
                       help="record the step, epoch, wall and emulated seconds at which "
                            "validation accuracy first reaches A, in (0, 1] (metrics.json's "
                            "target; the clock runs through evaluations)")
    timed.add_argument("--eval-every", type=int, metavar="N",
                       help="validate every N optimizer steps as well (default: at every "
                            "epoch's end only)")
    timed.add_argument("--stop-at-target", action="store_true", default=None,
                       help="end the run, checkpointed and with its model.pt, once "
                            "--target-accuracy is reached")
    same = parser.add_argument_group("the same model on every host")
    same.add_argument("--check-every", type=int, metavar="N",
                      help="compare the hosts' parameters every N steps and at every "
                           "epoch's end; a host that differs is named and given rank 0's "
                           "(default: as often as costs 1%% of a step)")
    same.add_argument("--strict-equal", action="store_true", default=None,
                      help="stop the run where hosts hold different parameters, instead of "
                           "giving them rank 0's")
    add_strategy_flags(parser)
    add_profile_dir_flag(parser, "where auto finds and keeps profiles")
    parser.add_argument("--tune-budget", type=float,
                        help="seconds auto may spend tuning when no profile fits "
                             f"(default: {AUTO_BUDGET_SECONDS:.0f})")
    add_numerics_flags(parser, channels_last=True)
    add_accumulate_flag(parser, "with auto, the profile tuned with the same N")
    parser.add_argument("--monitor-interval", type=float,
                        help="seconds between pidstat/sar-style samples "
                             f"(default: {default_of(TrainConfig, 'monitor_interval'):g}; 0 disables)")
    add_hosts_flags(parser)


def cmd_train(args: argparse.Namespace) -> int:
    from hybriddl import failpoints
    from hybriddl.data.loading import data_repairs
    from hybriddl.hosts.cluster import connect
    from hybriddl.run import trainer
    from hybriddl.run.failure_record import StepsSeen, record_failure, record_stop
    from hybriddl.run.shutdown import StopRequest, stop_every_host

    failpoints.active()  # HYBRIDDL_FAILPOINTS: a name it does not know is one line, exit 2
    flags = train_flags(args)  # every flag checked and settled, here only
    if flags.finished:
        console.print(f"hybriddl: the run in {args.resume_if_exists} has finished; nothing to do",
                      markup=False, highlight=False, soft_wrap=True)
        return 0
    try:
        hosts = connect(**flags.connect)
    except TrainingError as exc:
        if getattr(exc, "hosts", None) is not None:  # started, but not every host answered
            stop_every_host(exc.hosts, exc, show_host_failure)
        raise
    display = TrainDisplay(enabled=hosts.rank == 0)  # one progress bar, not one per host
    hosts.on_notice = display.warn  # a long wait for a host still preparing, said once
    stop = StopRequest()
    steps = StepsSeen(display)  # how far this attempt came, should it fail
    try:
        with stop.handling_signals():
            # A resumed run's checkpoint is read once every host is there: one that cannot
            # read it is named to the others.
            config, resume, idle = settled_config(flags.given, flags.resume)
            for line in [*idle, *flags.idle, *(flags.alone if hosts.size == 1 else ())]:
                display.warn(line)  # a flag that does nothing here is not ignored silently
            prepared = trainer.prepare(config, display, resume, hosts=hosts, stop=stop)
            metrics = trainer.run(prepared, steps, hosts, stop=stop,
                                  figures_only=args.measure_only)
            for line in data_repairs(prepared.split):
                display.warn(line)
    except TrainingInterrupted:
        # Every host stopped after the same step: they leave together, nothing to abort.
        display.stop()
        record_stop(flags.run_dir, hosts.rank, steps)
        hosts.close()
        raise
    except (Exception, KeyboardInterrupt) as exc:
        display.stop()
        record_failure(flags.run_dir, hosts.rank, exc, steps)
        stop_every_host(hosts, exc, show_host_failure)
        raise
    finally:
        display.stop()
    hosts.close()
    if hosts.rank == 0:
        out.print(epoch_table(metrics["epochs"]))
        if (metrics.get("target") or {}).get("accuracy") is not None:
            out.print(target_line(metrics["target"]), markup=False, highlight=False,
                      soft_wrap=True)
        out.print(f"run directory: {prepared.run_dir}")
    return 0


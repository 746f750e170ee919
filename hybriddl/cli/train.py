"""`hybriddl train`: a use case on this host, or on every host under mpirun."""

from __future__ import annotations

import argparse

from hybriddl.cli.flags import add_training_flags
from hybriddl.cli.settings import hosts_options, ignored_flags, resume_if_exists, training_config
from hybriddl.display import TrainDisplay, console, epoch_table, out, show_host_failure
from hybriddl.errors import TrainingInterrupted


def add_parser(commands) -> argparse.ArgumentParser:
    train = commands.add_parser("train", help="train a use case on this host (or under mpirun)")
    add_training_flags(train)
    train.set_defaults(handler=cmd_train)
    return train

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


"""The command line: parses, reports with rich, and leaves the computing to the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybriddl import __version__
from hybriddl.compare.compare import MeasureSettings, add_compare_arguments
from hybriddl.usecases import DEFAULT_USECASE, USECASES
from hybriddl.config import (add_accumulate_arg, add_numerics_args, hosts_options, ignored_flags,
                             resume_if_exists, training_config)
from hybriddl.tuning.tuner import AUTO_BUDGET_SECONDS, tune_settings
from hybriddl.display import (TrainDisplay, TuneDisplay, comparison_table, console, epoch_table,
                              files_table, host_table, out, show_error, show_host_failure,
                              show_pick)
from hybriddl.emulation.command import add_emulate_parser
from hybriddl.errors import StorageError, TrainingError, TrainingInterrupted, UsageError
from hybriddl.inference.command import add_inference_parsers
from hybriddl.launch.command import add_launch_parser
from hybriddl.strategies import STRATEGIES


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit code 2, like every other bad input."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="hybriddl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hybriddl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)

    train = commands.add_parser("train", help="train a use case on this host (or under mpirun)")
    add_training_args(train)
    add_hosts_args(train)
    train.set_defaults(handler=cmd_train)

    compare = commands.add_parser(
        "compare", help="hybrid vs Horovod's model vs PyTorch DDP on emulated hosts: speed, "
                        "bytes per host NIC, memory")
    add_compare_arguments(compare)
    compare.set_defaults(handler=cmd_compare)

    tune = commands.add_parser("tune", help="measure every feasible local strategy here, keep the "
                               "fastest as this host's profile")
    add_tune_args(tune)
    tune.set_defaults(handler=cmd_tune)
    report = commands.add_parser("report", help="PNG charts and a Markdown table from run directories")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories made by 'train'")
    report.add_argument("--output", default="report", help="folder for the charts and report.md "
                        "(default: ./report)")
    report.set_defaults(handler=cmd_report)

    info = commands.add_parser("info", help="this host: cores, RAM, GPUs, library versions")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(handler=cmd_info)
    add_emulate_parser(commands)
    add_inference_parsers(commands)
    add_launch_parser(commands)
    return parser


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


def cmd_tune(args: argparse.Namespace) -> int:
    from hybriddl.data.loading import image_notes
    from hybriddl.tuning import profiles, tuner

    settings = tune_settings(args.usecase, args.model, args.image_size, args.batch_size,
                             args.precision, args.accumulate)
    output = Path(args.output or profiles.profile_path(profiles.profile_dir(args.profile_dir), settings))
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory: give a file path such as "
                         f"{profiles.profile_path(output, settings)}")
    loading = TrainDisplay()
    try:
        images = tuner.tune_images(settings, args.data, args.data_cache, loading.on_data_progress)
        for line in image_notes(images):
            loading.warn(line)
    finally:
        loading.stop()
    display = TuneDisplay()
    try:
        rounds = {key: getattr(args, key) for key in ("warmup", "steps", "rounds", "second_look")}
        profile = tuner.tune_host(settings, images, budget=args.budget, observer=display, **rounds)
    finally:
        display.stop()
    profiles.save_profile(profile, output)
    show_pick(profile, output)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hybriddl.monitoring.report import write_report

    written = write_report(args.run_dirs, args.output)
    out.print(files_table(f"Report of {len(args.run_dirs)} run(s)", written))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from hybriddl.hosts.mpi import library_versions
    from hybriddl.machine.hostinfo import host_info

    info = host_info() | library_versions()
    if args.json:
        out.print_json(json.dumps(info))
        return 0
    out.print(host_table(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as exc:
        show_error("error: ", exc)
        return 2
    except TrainingError as exc:  # a StorageError may come from tune or compare too
        show_error("error: " if isinstance(exc, StorageError) else "training stopped: ", exc)
        return 1
    except TrainingInterrupted as exc:
        show_error("", exc)
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("hybriddl: interrupted", markup=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())

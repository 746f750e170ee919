"""The command line: parses, reports with rich, and leaves the computing to the library."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
import traceback

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from hybriddl import __version__
from hybriddl.compare import CONTENDERS, MeasureSettings
from hybriddl.errors import StorageError, TrainingError, TrainingInterrupted, UsageError
from hybriddl.strategies import STRATEGIES, StrategyOptions
from hybriddl.tuner import AUTO, AUTO_BUDGET_SECONDS, TuneObserver
from hybriddl.usecases import USECASES

console = Console(stderr=True)
out = Console()


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
        "compare", help="hybrid vs Horovod's model vs PyTorch DDP: speed and bytes on the network")
    add_compare_args(compare)
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
    return parser


def add_training_args(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(USECASES)
    # Defaults are None here and filled in by TrainConfig, so that --resume can tell the
    # flags a user typed from those left out (which then come from the checkpoint).
    parser.add_argument("--usecase", help=f"one of {names} (default: ComplexSmall)")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--data",
                        help="'synthetic' (embedded, default), an ImageFolder DIR, or cifar10:DIR")
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
    parser.add_argument("--seed", type=int,
                        help="initialisation, shuffling and augmentation seed (default: 0)")
    parser.add_argument("--run-dir", help="output folder (default: a new folder under runs/)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its checkpoint; flags left out "
                             "are the checkpoint's")
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
    parser.add_argument("--monitor-interval", type=float,
                        help="seconds between pidstat/sar-style samples (default: 1; 0 disables)")


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    MeasureSettings.add_arguments(parser)
    parser.add_argument("--hosts", type=int, default=2, help="H hosts (MPI ranks) of the hybrid")
    parser.add_argument("--workers-per-host", type=int, default=2,
                        help="K local workers per host; flat and DDP run H x K ranks")
    parser.add_argument("--local-strategy", default="processes",
                        help="the hybrid hosts' local strategy (default: processes)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"which to run, comma-separated (default: {','.join(CONTENDERS)})")
    parser.add_argument("--output", help="output folder (default: a new folder under runs/)")


TRAINING_FLAGS = ("usecase", "model", "data", "classes", "val_fraction", "image_size",
                  "batch_size", "epochs", "lr", "momentum", "dropout", "seed", "max_steps",
                  "run_dir", "checkpoint_every", "strategy", "profile_dir", "tune_budget",
                  "monitor_interval", "balance", "throughput")


def given_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the user typed; strategy_options holds the typed options."""
    given = {name: getattr(args, name) for name in TRAINING_FLAGS
             if getattr(args, name) is not None}
    devices = tuple(d.strip() for d in args.devices.split(",")) if args.devices else None
    options = {"workers": args.workers, "micro_batches": args.micro_batches, "devices": devices,
               "oversubscribe": args.oversubscribe or None}
    given["strategy_options"] = {k: v for k, v in options.items() if v is not None}
    return given


def training_config(args: argparse.Namespace):
    """The run's TrainConfig, and with --resume the checkpoint it continues from."""
    from hybriddl import checkpoint
    from hybriddl.trainer import TrainConfig

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
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    settings = {name: value for name, value in settings.items() if name in known}
    return TrainConfig(**settings, strategy_options=options), resume


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--usecase", default="ComplexSmall", help=f"one of {', '.join(USECASES)}")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--image-size", type=int, help="pixels per side (default: the use case's, 224)")
    parser.add_argument("--batch-size", type=int, help="this host's batch (default: the use case's)")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="seconds for all candidates together; a candidate that cannot "
                             "finish within its share is dropped (default: 600)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per candidate (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per candidate (default: 1)")
    parser.add_argument("--output", help="profile file (default: PROFILE_DIR/<host>-<usecase>.json)")
    parser.add_argument("--profile-dir", help="default: $HYBRIDDL_PROFILES or ./profiles")


class TuneDisplay(TuneObserver):
    """rich progress over the candidates: which one runs, its steps, what came of it."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.progress = Progress(TextColumn("[bold]Tuning"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("candidates"), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=console,
                                 disable=not enabled)
        self.task = None
        self.candidates = []

    def on_tune_start(self, candidates, reason) -> None:
        self.candidates = candidates
        if not self.enabled:
            return
        if reason:
            console.print(f"hybriddl: {reason}", markup=False, highlight=False)
        self.progress.start()
        self.task = self.progress.add_task("", total=len(candidates))

    def on_candidate_start(self, index, choice, share_seconds) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=f"{choice.label} "
                                 f"(share {share_seconds:.0f} s)")

    def on_candidate_step(self, index, step, seconds) -> None:
        if self.task is not None:
            choice = self.candidates[index]
            self.progress.update(self.task, description=f"{choice.label}: step {step + 1}, "
                                 f"{seconds:.2f} s")

    def on_candidate_end(self, index, result) -> None:
        if self.task is None:
            return
        self.progress.update(self.task, advance=1,
                             description=f"{result.choice.label}: {result.status}")
        if index + 1 == len(self.candidates):
            self.progress.stop()

    def stop(self) -> None:
        self.progress.stop()


def tune_table(profile) -> Table:
    """The profile's candidates, fastest first, dropped ones last with their note."""
    s = profile.settings
    table = Table(title=f"{profile.host}: {s.usecase} ({s.model}), {s.image_size} px, "
                        f"batch {s.batch_size}")
    with_gpu = any(c.speedup_over_gpu is not None for c in profile.candidates)
    columns = ["", "strategy", "s/step", "images/s", "speedup"]
    columns += ["vs 1 GPU"] if with_gpu else []
    columns += ["peak RSS MiB", "note"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("strategy", "note") else "right",
                         no_wrap=column != "note")
    order = sorted(profile.candidates, key=lambda c: (not c.measured, c.seconds_per_step or 0.0))
    for c in order:
        picked = c.measured and c.choice == profile.pick
        figures = [f"{c.seconds_per_step:.3f}", f"{c.images_per_second:.1f}",
                   f"{c.speedup:.2f}x" if c.speedup is not None else "-"] if c.measured else ["-"] * 3
        if with_gpu:
            figures.append(f"{c.speedup_over_gpu:.2f}x" if c.speedup_over_gpu is not None else "-")
        rss = f"{c.peak_rss_bytes / 2**20:.0f}" if c.peak_rss_bytes else "-"
        table.add_row("[bold green]pick[/]" if picked else ("dropped" if not c.measured else ""),
                      c.choice.label, *figures, rss, c.note,
                      style="bold" if picked else ("dim" if not c.measured else None))
    return table

def add_hosts_args(parser: argparse.ArgumentParser) -> None:
    from hybriddl.cluster import BALANCE_POLICIES, DEFAULT_TIMEOUT_SECONDS

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
    group.add_argument("--fusion-mib", type=float, default=64,
                       help="size of the gradient fusion buffers in MiB (default: 64)")
    group.add_argument("--host-timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                       help="stop when another host has not answered for this many seconds "
                            f"(default: {DEFAULT_TIMEOUT_SECONDS:.0f})")



class TrainDisplay:
    """rich progress bar per epoch (batch, ETA, img/s, loss) and the epoch table."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.tuning = TuneDisplay(enabled)  # shown when --strategy auto has to tune first
        self.progress = self._new_progress()
        self.task = None
        self.epochs = 0
        self.records: list[dict] = []
        self._samples = 0
        self._seconds = 0.0

    def _new_progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("batches"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            TextColumn("{task.fields[rate]:>7.1f} img/s  loss {task.fields[loss]:.4f}"),
            console=console, disable=not self.enabled, transient=False)

    def on_data_progress(self, done: int, total: int) -> None:
        if self.task is None and self.enabled:
            # Transient: once the data are ready the bar goes, and if they are bad the
            # error stays the only line on stderr (no bar is left behind in a log).
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("images"),
                                     TimeElapsedColumn(), console=console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("Preparing data", total=total)
        if self.task is not None:
            self.progress.update(self.task, completed=done)

    def on_tune_start(self, candidates, reason) -> None:
        self.progress.stop()
        self.task = None
        self.tuning.on_tune_start(candidates, reason)

    def on_candidate_start(self, index, choice, share_seconds) -> None:
        self.tuning.on_candidate_start(index, choice, share_seconds)

    def on_candidate_step(self, index, step, seconds) -> None:
        self.tuning.on_candidate_step(index, step, seconds)

    def on_candidate_end(self, index, result) -> None:
        self.tuning.on_candidate_end(index, result)

    def on_start(self, info: dict) -> None:
        self.epochs = info["epochs"]
        self.progress.stop()
        self.tuning.stop()
        self.task = None
        if self.enabled and info.get("strategy_choice"):
            console.print(info["strategy_choice"]["message"], markup=False, highlight=False)
        if self.enabled:
            strategy = ", ".join(f"{k}={v}" for k, v in info["strategy"].items() if k != "name")
            console.print(f"[bold]{info['usecase']}[/]: {info['model']} on {info['data']['source']} "
                          f"({info['data']['train_images']} train / {info['data']['val_images']} val "
                          f"images, {len(info['data']['classes'])} classes), {info['image_size']} px, "
                          f"global batch {info['global_batch']}, strategy "
                          f"[bold]{info['strategy']['name']}[/] {strategy}".rstrip())
            hosts = info["hosts"]
            if hosts["count"] > 1:
                console.print(f"{hosts['count']} hosts ({', '.join(hosts['names'])}), shares by "
                              f"{hosts['balance']}, gradients {hosts.get('compression', 'none')} "
                              "on the wire")
            for note in hosts.get("notes", []):
                console.print(f"[yellow]note:[/] {note}", highlight=False)

    def on_epoch_start(self, epoch: int, steps: int) -> None:
        if not self.enabled:
            return
        self.progress = self._new_progress()
        self.progress.start()
        self._samples, self._seconds = 0, 0.0
        self.task = self.progress.add_task(f"Epoch {epoch + 1}/{self.epochs}", total=steps,
                                           rate=0.0, loss=0.0)

    def on_step(self, epoch: int, step: int, samples: int, seconds: float, loss: float) -> None:
        if not self.enabled:
            return
        self._samples += samples
        self._seconds += seconds
        self.progress.update(self.task, advance=1, rate=self._samples / max(self._seconds, 1e-9),
                             loss=loss)

    def on_epoch_end(self, record: dict) -> None:
        self.records.append(record)
        if self.enabled:
            self.progress.stop()
            console.print(f"  epoch {record['epoch']}: {record['seconds']:.1f} s, "
                          f"{record['images_per_second']:.1f} img/s, loss {record['train_loss']:.4f}, "
                          f"val accuracy {record['val_accuracy']:.3f}")

    def stop(self) -> None:
        self.progress.stop()
        self.tuning.stop()


def epoch_table(records: list[dict]) -> Table:
    table = Table(title="Epochs")
    for column in ("epoch", "seconds", "images/s", "train loss", "val accuracy", "data wait %"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(str(r["epoch"]), f"{r['seconds']:.1f}", f"{r['images_per_second']:.1f}",
                      f"{r['train_loss']:.4f}", f"{r['val_accuracy']:.3f}",
                      f"{100 * r['data_wait_seconds'] / r['seconds']:.1f}")
    return table


def cmd_train(args: argparse.Namespace) -> int:
    from hybriddl import trainer
    from hybriddl.cluster import connect
    from hybriddl.rundir import default_run_dir
    from hybriddl.shutdown import StopRequest

    hosts = connect(overlap=args.overlap, fp16_allreduce=args.fp16_allreduce,
                    bucket_bytes=int(args.fusion_mib * 2**20), timeout=args.host_timeout)
    display = TrainDisplay(enabled=hosts.rank == 0)  # one progress bar, not one per host
    stop = StopRequest()
    try:
        with stop.handling_signals():
            config, resume = training_config(args)
            if hosts.size > 1 and config.run_dir is None:
                # Every rank names rank 0's run directory (its monitors write there too).
                config.run_dir = hosts.broadcast_object(
                    str(default_run_dir(config.usecase)) if hosts.rank == 0 else None)
            prepared = trainer.prepare(config, display, resume, hosts_count=hosts.size)
            metrics = trainer.run(prepared, display, hosts, stop=stop)
    except TrainingInterrupted:
        # Every host stopped after the same step: they leave together, nothing to abort.
        display.stop()
        hosts.close()
        raise
    except (Exception, KeyboardInterrupt) as exc:
        display.stop()
        stop_every_host(hosts, exc)
        raise
    finally:
        display.stop()
    hosts.close()
    if hosts.rank == 0:
        out.print(epoch_table(metrics["epochs"]))
        out.print(f"run directory: {prepared.run_dir}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from hybriddl import compare

    config = compare.CompareConfig(
        settings=MeasureSettings.from_args(args), hosts=args.hosts,
        workers_per_host=args.workers_per_host, local_strategy=args.local_strategy,
        contenders=tuple(name.strip() for name in args.contenders.split(",") if name.strip()),
        output=args.output)
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
    table = Table(title="Hybrid vs Horovod's model vs PyTorch DDP")
    for key, header, _ in compare.COLUMNS:
        table.add_column(header, justify="left" if key == "name" else "right")
    for cells in compare.table_cells(comparison):
        table.add_row(*cells)
    out.print(table)
    for line in compare.notes(comparison):
        out.print(f"- {line}", highlight=False)
    out.print(f"written: {output / compare.RESULT}, {output / compare.REPORT}, charts in {output}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from hybriddl import profiles, tuner

    settings = tuner.tune_settings(args.usecase, args.model, args.image_size, args.batch_size)
    output = (Path(args.output) if args.output
              else profiles.profile_path(profiles.profile_dir(args.profile_dir), settings.usecase))
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory: give a file path such as "
                         f"{profiles.profile_path(output, settings.usecase)}")
    display = TuneDisplay()
    try:
        profile = tuner.tune_host(settings, tuner.embedded_images(settings), budget=args.budget,
                                  warmup=args.warmup, steps=args.steps, observer=display)
    finally:
        display.stop()
    profiles.save_profile(profile, output)
    out.print(tune_table(profile))
    pick = profile.pick_result
    speedup = f", {pick.speedup:.2f}x sequential on one core" if pick.speedup is not None else ""
    out.print(f"pick: [bold]{pick.choice.label}[/]{speedup}; profile written to {output}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hybriddl.report import write_report

    written = write_report(args.run_dirs, args.output)
    table = Table(title=f"Report of {len(args.run_dirs)} run(s)")
    table.add_column("file")
    for path in written:
        table.add_row(str(path))
    out.print(table)
    return 0


def stop_every_host(hosts, exc: BaseException) -> None:
    """Under mpirun, say which rank failed and why, then take every other rank down.

    Returns only for a single host, where main() reports the error as usual.
    """
    from hybriddl.cluster import SingleHost

    if isinstance(hosts, SingleHost):
        return
    import socket

    where = f"rank {hosts.rank} on {socket.gethostname()}"
    if isinstance(exc, (UsageError, TrainingError)):
        console.print(f"hybriddl: {where}: {exc}", markup=False, highlight=False, soft_wrap=True)
    elif isinstance(exc, KeyboardInterrupt):
        console.print(f"hybriddl: {where}: interrupted", markup=False)
    else:
        console.print(f"hybriddl: {where} failed:\n"
                      + "".join(traceback.format_exception(exc)).rstrip(),
                      markup=False, highlight=False, soft_wrap=True)
    code = 2 if isinstance(exc, UsageError) else 130 if isinstance(exc, KeyboardInterrupt) else 1
    hosts.abort(code)


def cmd_info(args: argparse.Namespace) -> int:
    from hybriddl.hostinfo import host_info

    info = host_info()
    if args.json:
        out.print_json(json.dumps(info))
        return 0
    table = Table(title="This host", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in info.items():
        if key == "gpus":
            value = "; ".join(f"{g['index']}: {g['name']} ({g['memory_gib']} GiB)" for g in value) or "none"
        table.add_row(key.replace("_", " "), str(value))
    out.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as exc:
        console.print(f"hybriddl: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except StorageError as exc:  # also from tune and compare, which train nothing
        console.print(f"hybriddl: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1
    except TrainingError as exc:
        console.print(f"hybriddl: training stopped: {exc}", markup=False, highlight=False,
                      soft_wrap=True)
        return 1
    except TrainingInterrupted as exc:
        console.print(f"hybriddl: {exc}", markup=False, highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("hybriddl: interrupted", markup=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())

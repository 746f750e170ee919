"""The command line: parses, reports with rich, and leaves the computing to the library."""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from hybriddl import __version__
from hybriddl.errors import TrainingError, UsageError
from hybriddl.strategies import STRATEGIES, StrategyOptions
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
    train.set_defaults(handler=cmd_train)

    info = commands.add_parser("info", help="this host: cores, RAM, GPUs, library versions")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(handler=cmd_info)
    return parser


def add_training_args(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(USECASES)
    parser.add_argument("--usecase", default="ComplexSmall", help=f"one of {names} (default: ComplexSmall)")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--data", default="synthetic",
                        help="'synthetic' (embedded, default), an ImageFolder DIR, or cifar10:DIR")
    parser.add_argument("--classes", type=int, help="cifar10: keep only the first N classes")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="share of each class held out for validation (default: 0.2)")
    parser.add_argument("--image-size", type=int, help="pixels per side (default: 224)")
    parser.add_argument("--batch-size", type=int, help="global batch: samples per optimizer step over all hosts")
    parser.add_argument("--epochs", type=int, help="default: the use case's (3)")
    parser.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    parser.add_argument("--lr", type=float, help="SGD learning rate (default: 0.001)")
    parser.add_argument("--momentum", type=float, help="SGD momentum (default: 0.9)")
    parser.add_argument("--dropout", type=float,
                        help="dropout of the torchvision model; 0 makes runs comparable step for step")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, shuffling and augmentation seed")
    parser.add_argument("--run-dir", help="output folder (default: a new folder under runs/)")
    parser.add_argument("--strategy", default="sequential",
                        help=f"local strategy: {', '.join(STRATEGIES)} (default: sequential)")
    parser.add_argument("--workers", type=int, help="local workers K for threads/processes/intraop")
    parser.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches M")
    parser.add_argument("--devices", help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu,cpu")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more local workers than usable cores")


def config_from_args(args: argparse.Namespace):
    from hybriddl.trainer import TrainConfig

    devices = tuple(d.strip() for d in args.devices.split(",")) if args.devices else ()
    options = StrategyOptions(workers=args.workers, micro_batches=args.micro_batches,
                              devices=devices, oversubscribe=args.oversubscribe)
    return TrainConfig(usecase=args.usecase, model=args.model, data=args.data, classes=args.classes,
                       val_fraction=args.val_fraction, image_size=args.image_size,
                       batch_size=args.batch_size, epochs=args.epochs, lr=args.lr,
                       momentum=args.momentum, dropout=args.dropout, seed=args.seed,
                       max_steps=args.max_steps, run_dir=args.run_dir, strategy=args.strategy,
                       strategy_options=options)


class TrainDisplay:
    """rich progress bar per epoch (batch, ETA, img/s, loss) and the epoch table."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
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

    def on_start(self, info: dict) -> None:
        self.epochs = info["epochs"]
        self.progress.stop()
        self.task = None
        if self.enabled:
            strategy = ", ".join(f"{k}={v}" for k, v in info["strategy"].items() if k != "name")
            console.print(f"[bold]{info['usecase']}[/]: {info['model']} on {info['data']['source']} "
                          f"({info['data']['train_images']} train / {info['data']['val_images']} val "
                          f"images, {len(info['data']['classes'])} classes), {info['image_size']} px, "
                          f"global batch {info['global_batch']}, strategy "
                          f"[bold]{info['strategy']['name']}[/] {strategy}".rstrip())

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

    display = TrainDisplay()
    try:
        prepared = trainer.prepare(config_from_args(args), display)
        metrics = trainer.run(prepared, display)
    finally:
        display.stop()
    out.print(epoch_table(metrics["epochs"]))
    out.print(f"run directory: {prepared.run_dir}")
    return 0


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
    except TrainingError as exc:
        console.print(f"hybriddl: training stopped: {exc}", markup=False, highlight=False,
                      soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("hybriddl: interrupted", markup=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())

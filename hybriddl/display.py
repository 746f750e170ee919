"""Everything the command line draws with rich: progress, tables, failure lines."""

from __future__ import annotations

import os
import traceback

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from hybriddl.hosts.scheme import EXACT
from hybriddl.tuning.observer import TuneObserver

# Where output goes to a file or a pipe (a SLURM job's log, mpirun's forwarded output) and
# COLUMNS is unset, rich draws at 80 columns: compare's table came out with its cells cut to
# a letter or two ("co…") and longer lines broken. A log has no width; there it gets this.
LOG_WIDTH = 200


def terminal_console(stderr: bool = False) -> Console:
    """A console for stdout or stderr: the terminal's width on a terminal, COLUMNS where
    set, else LOG_WIDTH. No emoji: user input like "powersgd:two" is not an emoji code."""
    console = Console(stderr=stderr, emoji=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = LOG_WIDTH
    return console


console = terminal_console(stderr=True)
out = terminal_console()


def stop_progress(progress: Progress) -> None:
    """Stop a bar that was started: rich's `stop` also prints an empty line where stderr is
    not a terminal, even for a bar that never started (a bad flag's error then came after
    four empty lines)."""
    if progress.live.is_started:
        if progress.live.transient:  # gone without a trace: not even that line
            progress.live.stop()
        else:
            progress.stop()


class TuneDisplay(TuneObserver):
    """rich progress over the candidates: which one runs, its steps, what came of it."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.progress = Progress(TextColumn("[bold]Tuning {task.fields[round]}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("candidates"), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=console,
                                 disable=not enabled)
        self.task = None
        self.candidates = []

    def on_tune_start(self, candidates, reason) -> None:
        self.candidates = candidates
        if not self.enabled:
            return
        if reason:
            console.print(f"hybriddl: {reason}", markup=False, highlight=False, soft_wrap=True)
        self.progress.start()
        self.task = self.progress.add_task("", total=len(candidates), round="")

    def on_round_start(self, number, visits, second_look) -> None:
        if self.task is not None:
            what = "second look" if second_look else "round"
            self.progress.update(self.task, completed=0, total=visits, round=f"{what} {number}")

    def on_candidate_start(self, index, choice, share_seconds) -> None:
        if self.task is not None:
            self.progress.advance(self.task)
            self.progress.update(self.task, description=f"{choice.label} "
                                 f"(share {share_seconds:.0f} s)")

    def on_candidate_step(self, index, step, seconds) -> None:
        if self.task is not None:
            choice = self.candidates[index]
            self.progress.update(self.task, description=f"{choice.label}: step {step + 1}, "
                                 f"{seconds:.2f} s")

    def on_candidate_end(self, index, result) -> None:
        # Called for every candidate once all rounds are over.
        if self.task is None:
            return
        if index + 1 == len(self.candidates):
            stop_progress(self.progress)

    def stop(self) -> None:
        stop_progress(self.progress)


def tune_table(profile) -> Table:
    """The profile's candidates, fastest first, dropped ones last with their note."""
    s = profile.settings
    table = Table(title=f"{profile.host}: {s.usecase} ({s.model}), {s.image_size} px, "
                        f"batch {s.batch_size}")
    with_gpu = any(c.speedup_over_gpu is not None for c in profile.candidates)
    columns = ["", "strategy", "median s/step", "spread", "rounds", "images/s", "speedup"]
    columns += ["vs 1 GPU"] if with_gpu else []
    columns += ["peak RSS MiB", "note"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("strategy", "note") else "right",
                         no_wrap=column != "note")
    order = sorted(profile.candidates, key=lambda c: (not c.measured, c.seconds_per_step or 0.0))
    for c in order:
        picked = c.measured and c.choice == profile.pick
        figures = [f"{c.seconds_per_step:.3f}", _spread(c), str(len(c.round_seconds) or "-"),
                   f"{c.images_per_second:.1f}",
                   f"{c.speedup:.2f}x" if c.speedup is not None else "-"] if c.measured else ["-"] * 5
        if with_gpu:
            figures.append(f"{c.speedup_over_gpu:.2f}x" if c.speedup_over_gpu is not None else "-")
        rss = f"{c.peak_rss_bytes / 2**20:.0f}" if c.peak_rss_bytes else "-"
        table.add_row("[bold green]pick[/]" if picked else ("dropped" if not c.measured else ""),
                      c.choice.label, *figures, rss, c.note,
                      style="bold" if picked else ("dim" if not c.measured else None))
    return table


def _spread(candidate) -> str:
    """The lowest and highest round figures, '-' for a profile without them."""
    if not candidate.spread_seconds:
        return "-"
    low, high = candidate.spread_seconds
    return f"{low:.3f}-{high:.3f}"


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

    def warn(self, line: str) -> None:
        if self.enabled:
            console.print(f"hybriddl: warning: {line}", markup=False, highlight=False,
                          soft_wrap=True)

    def on_data_progress(self, done: int, total: int) -> None:
        if self.task is None and self.enabled:
            # Transient: once the data are ready the bar goes, and if they are bad the
            # error stays the only line on stderr (no bar is left behind in a log).
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("images"),
                                     TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("Preparing data", total=total)
        if self.task is not None:
            self.progress.update(self.task, completed=done)

    def on_tune_start(self, candidates, reason) -> None:
        stop_progress(self.progress)
        self.task = None
        self.tuning.on_tune_start(candidates, reason)

    def on_round_start(self, number, visits, second_look) -> None:
        self.tuning.on_round_start(number, visits, second_look)

    def on_candidate_start(self, index, choice, share_seconds) -> None:
        self.tuning.on_candidate_start(index, choice, share_seconds)

    def on_candidate_step(self, index, step, seconds) -> None:
        self.tuning.on_candidate_step(index, step, seconds)

    def on_candidate_end(self, index, result) -> None:
        self.tuning.on_candidate_end(index, result)

    def on_start(self, info: dict) -> None:
        self.epochs = info["epochs"]
        stop_progress(self.progress)
        self.tuning.stop()
        self.task = None
        if self.enabled and info.get("strategy_choice"):
            console.print(info["strategy_choice"]["message"], markup=False, highlight=False)
        if self.enabled and info.get("weights"):
            show_start_weights(info["weights"])
        if self.enabled:
            from hybriddl.strategies import StrategySpec  # here: every command imports display

            strategy = StrategySpec.from_dict(info["strategy"]).label
            console.print(f"[bold]{info['usecase']}[/]: {info['model']} on {info['data']['source']} "
                          f"({info['data']['train_images']} train / {info['data']['val_images']} val "
                          f"images, {len(info['data']['classes'])} classes), {info['image_size']} px, "
                          f"global batch {info['global_batch']}, strategy [bold]{strategy}[/]")
            hosts = info["hosts"]
            if hosts["count"] > 1:
                console.print(f"{hosts['count']} hosts ({', '.join(hosts['names'])}), shares by "
                              f"{hosts['balance']}, gradients {hosts.get('compression', EXACT)} "
                              "on the wire")
            scheme = info.get("host_parallel")
            if scheme and (hosts["count"] > 1 or scheme["scheme"] != "data"):
                console.print(f"across hosts: [bold]{scheme['scheme']}[/] ({scheme['reason']})",
                              highlight=False)
            show_plan(info.get("plan"))
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
        # loss: the mean since it was last read back (None until then: keep the shown one).
        fields = {} if loss is None else {"loss": loss}
        self.progress.update(self.task, advance=1, rate=self._samples / max(self._seconds, 1e-9),
                             **fields)

    def on_epoch_end(self, record: dict) -> None:
        self.records.append(record)
        if self.enabled:
            stop_progress(self.progress)
            console.print(f"  epoch {record['epoch']}: {record['seconds']:.1f} s, "
                          f"{record['images_per_second']:.1f} img/s, loss {record['train_loss']:.4f}, "
                          f"val accuracy {accuracy(record['val_accuracy'])}")

    def on_warning(self, line: str) -> None:
        if self.enabled:  # above the epoch's bar, which goes on
            self.progress.console.print(f"hybriddl: warning: {line}", markup=False,
                                        highlight=False, soft_wrap=True)

    def on_evaluation(self, entry: dict) -> None:
        if self.enabled:  # above the epoch's bar, which goes on
            self.progress.console.print(f"  step {entry['step']} (epoch {entry['epochs']:g}): "
                                        f"val accuracy {accuracy(entry['accuracy'])}",
                                        markup=False, highlight=False)

    def on_target(self, record: dict) -> None:
        if self.enabled:  # above the epoch's bar, which goes on
            self.progress.console.print(f"  {target_line(record)}", markup=False,
                                        highlight=False)

    def stop(self) -> None:
        stop_progress(self.progress)
        self.tuning.stop()


def plan_table(plan: dict) -> Table:
    """The exchange planner's predictions (hybrid/planner.py), fastest first, the settled
    scheme in bold."""
    inputs = plan["inputs"]
    table = Table(title=f"Exchange plan: {plan['hosts']} hosts, compute "
                        f"{inputs['compute_seconds']:.3f} s, link "
                        f"{inputs['link_bytes_per_second'] * 8 / 1e9:.2f} Gbit/s, latency "
                        f"{inputs['latency_seconds'] * 1e3:.2f} ms")
    for column in ("scheme", "exact", "MB/step", "step s", "images/s"):
        table.add_column(column, justify="left" if column == "scheme" else "right",
                         no_wrap=True)
    chosen = plan["chosen"]["scheme"]
    estimated = False
    for row in plan["rows"]:
        mark = "*" if row["compression_cost"] == "estimated" else ""
        estimated = estimated or bool(mark)
        table.add_row(row["scheme"], "yes" if row["exact"] else "no",
                      f"{row['nic_bytes_per_step'] / 1e6:.2f}", f"{row['step_seconds']:.3f}{mark}",
                      f"{row['images_per_second']:.1f}",
                      style="bold" if row["scheme"] == chosen else None)
    if estimated:
        table.caption = "predicted; * PowerSGD's own compute estimated, not measured"
    return table


def show_plan(plan: dict | None) -> None:
    """The plan's table and, where an inexact scheme is predicted much faster than the
    exact one the run takes, the one line that names it, and where one host alone is
    predicted faster, the line that says so; alone, nothing (no exchange)."""
    if not plan or not plan.get("rows"):
        return
    console.print(plan_table(plan))
    console.print(f"exchange: [bold]{plan['chosen']['scheme']}[/] "
                  f"({'exact' if plan['chosen']['exact'] else 'not exact'})", highlight=False)
    for line in (plan.get("advice"), plan.get("alone")):
        if line:
            console.print(f"[yellow]hint:[/] {line}", highlight=False, soft_wrap=True)


def accuracy(value: float | None) -> str:
    """A validation accuracy, or "-" where none was measured (`train --measure-only`)."""
    return "-" if value is None else f"{value:.3f}"


def target_line(record: dict) -> str:
    """Where a run stands against its `--target-accuracy` (metrics.json's `target` record):
    where it first reached it, or its best validation so far and the clock."""
    def clock(wall: float, emulated: float) -> str:
        return f"{wall:.1f} s" + (f" ({emulated:.1f} s emulated)" if emulated != wall else "")

    if record["reached"]:
        return (f"target: val accuracy {record['accuracy']:g} reached at step {record['step']} "
                f"(epoch {record['epochs']:g}), after "
                f"{clock(record['wall_seconds'], record['emulated_seconds'])}")
    evaluations = record["evaluations"]
    if not evaluations:
        return f"target: val accuracy {record['accuracy']:g} not reached: nothing validated yet"
    best = max(evaluations, key=lambda e: e["accuracy"])  # the first of equals
    return (f"target: val accuracy {record['accuracy']:g} not reached in {len(evaluations)} "
            f"validations (best {best['accuracy']:.3f} at step {best['step']}), after "
            f"{clock(record['clock']['wall_seconds'], record['clock']['emulated_seconds'])}")


def epoch_table(records: list[dict]) -> Table:
    table = Table(title="Epochs")
    for column in ("epoch", "seconds", "images/s", "train loss", "val accuracy", "data wait %"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(str(r["epoch"]), f"{r['seconds']:.1f}", f"{r['images_per_second']:.1f}",
                      f"{r['train_loss']:.4f}", accuracy(r["val_accuracy"]),
                      f"{100 * r['data_wait_seconds'] / r['seconds']:.1f}")
    return table


def comparison_table(comparison: dict, columns, cells) -> Table:
    table = Table(title="Hybrid vs Horovod's model vs PyTorch DDP")
    for key, header, _ in columns:
        table.add_column(header, justify="left" if key == "name" else "right")
    for row in cells:
        table.add_row(*row)
    return table


def files_table(title: str, paths) -> Table:
    table = Table(title=title)
    table.add_column("file")
    for path in paths:
        table.add_row(str(path))
    return table


def host_table(info: dict) -> Table:
    table = Table(title="This host", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in info.items():
        if key == "gpus":
            value = "; ".join(f"{g['index']}: {g['name']} ({g['memory_gib']} GiB)" for g in value) or "none"
        table.add_row(key.replace("_", " "), str(value))
    return table


def show_pick(profile, output) -> None:
    from hybriddl.tuning.tuner import bf16_gain  # here: every command imports display

    out.print(tune_table(profile))
    pick = profile.pick_result
    speedup = f", {pick.speedup:.2f}x sequential on one core" if pick.speedup is not None else ""
    out.print(f"pick: [bold]{pick.choice.label}[/]{speedup}; profile written to {output}")
    gain = bf16_gain(profile)
    if gain:
        out.print(gain, markup=False, highlight=False, soft_wrap=True)


def show_host_failure(where: str, exc: BaseException) -> None:
    """The one line (or, for a bug, the traceback) that says which rank failed and why."""
    from hybriddl.errors import TrainingError, UsageError

    if isinstance(exc, (UsageError, TrainingError)):
        console.print(f"hybriddl: {where}: {exc}", markup=False, highlight=False, soft_wrap=True)
    elif isinstance(exc, KeyboardInterrupt):
        console.print(f"hybriddl: {where}: interrupted", markup=False)
    else:
        console.print(f"hybriddl: {where} failed:\n"
                      + "".join(traceback.format_exception(exc)).rstrip(),
                      markup=False, highlight=False, soft_wrap=True)


def show_error(prefix: str, exc: BaseException | str) -> None:
    console.print(f"hybriddl: {prefix}{exc}", markup=False, highlight=False, soft_wrap=True)


def evaluation_table(evaluation) -> Table:
    """Per class: precision, recall, F1 and support; '-' where a figure is undefined."""
    table = Table(title="Per class")
    table.add_column("class")
    for column in ("precision", "recall", "F1", "support"):
        table.add_column(column, justify="right")
    for scores in evaluation.per_class:
        table.add_row(scores.name, *(f"{value:.3f}" if value is not None else "-"
                                     for value in (scores.precision, scores.recall, scores.f1)),
                      str(scores.support))
    return table


def show_start_weights(record: dict) -> None:
    """The one line that says which weights a run starts from, and the head it replaced."""
    head = record.get("replaced_head")
    replaced = (f"; its {head['file_classes']}-class head {head['layer']} replaced by a "
                f"re-initialised {head['classes']}-class one" if head else "")
    named = f"torchvision's {record['name']}, " if record.get("name") else ""
    console.print(f"starting from weights {named}{record['file']} (sha256 {record['sha256'][:12]}){replaced}",
                  markup=False, highlight=False, soft_wrap=True)

"""Time to a target accuracy on real images, over seeds, scored as MLPerf Training scores
its runs: each cell (a contender on H emulated hosts) is trained once per seed to the target
(`train --target-accuracy A --stop-at-target`), its emulated seconds to the target taken
from metrics.json's `target`; the cell's score drops the fastest and the slowest run and
averages the rest, a run that misses the target within the epoch cap counting as the
slowest (more than one miss: no score).

The target is fixed before any other cell runs: the highest validation accuracy, rounded
down to the percent, that one host training exactly reaches in all but at most one of its
seeds within the epoch cap (those reference runs go to the cap, validated every
--eval-every steps). It goes in the results file, and a later call reads it from there.

Contenders: `exact` (hybriddl, the exact scheme the planner picks: `--host-parallel auto
--compression none`), `auto` (whatever the planner picks, inexact too: `--compression
auto`, each run's pick recorded), `powersgd:R[:start=N]` (hybriddl's PowerSGD, the planner's
scheme), `ddp` and `ddp-powersgd:R[:min_rate=M]` (PyTorch DDP with its own allreduce, or
torch's powerSGD_hook at rank R, its min_compression_rate M, one process per core, trained
to the same target: hybriddl.cli.compare_ddp --epochs). Every run has the same global
batch, learning rate, seed list and data; hosts stand for faster ones at one speedup S for
the whole file (`--host-step` measures S once, at the first run, from one host's step here;
later runs use `--speedup S`). Runs are kept as they finish: a call with --output naming an
existing file runs only the (contender, hosts, seed) not in it.

    python scripts/digits_imagefolder.py /tmp/mnist
    python scripts/time_to_accuracy.py --usecase SimpleBig --data /tmp/mnist \\
        --image-size 64 --lr 0.01 --epochs 6 --eval-every 25 --seeds 1 2 3 4 5 \\
        --host-step 10ms --bandwidth 1gbit --cells 1:exact 2:powersgd:2 2:ddp-powersgd:2 \\
        --output results/time_to_accuracy-mnist-SimpleBig-1gbit.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import REPO, ddp_command, emulated_cell, host_options, results_header
from pages import Page, model_name, ratio_text
from hybriddl.files import atomic_write_json
from hybriddl.usecases import get_usecase

RESULTS = REPO / "results"
EXACT, AUTO, DDP, DDP_PREFIX = "exact", "auto", "ddp", "ddp-powersgd:"
# hybriddl's local strategy on every host: PyTorch's intra-op threads on the host's cores
# (the fastest local strategy at small sizes; every strategy trains the same steps).
LOCAL = ["--strategy", "intraop", "--channels-last"]
# MLPerf Training runs an image-classification submission this many times.
MLPERF_RUNS = 5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--model", help="train's --model (default: the use case's)")
    parser.add_argument("--data", required=True, help="a real image set (ImageFolder): "
                        "scripts/digits_imagefolder.py writes one")
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int,
                        help="the global batch, the same at every host count (default: the "
                             "use case's)")
    parser.add_argument("--lr", type=float, required=True,
                        help="one learning rate, at which one host exact converges, for every cell")
    parser.add_argument("--epochs", type=int, required=True, help="the epoch cap")
    parser.add_argument("--eval-every", type=int, help="validate every N steps as well as "
                        "at every epoch's end")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--cells", nargs="+", required=True, metavar="H:CONTENDER",
                        help="e.g. 1:exact 2:exact 2:powersgd:2 4:ddp-powersgd:2")
    parser.add_argument("--cores-per-host", type=int, default=1)
    parser.add_argument("--bandwidth", default="1gbit")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--speedup", type=float, help="emulate's --speedup S (every run)")
    speed.add_argument("--host-step", help="S from one host's step measured here (e.g. "
                                           "10ms), once, at the first run")
    parser.add_argument("--target", type=float, help="the target accuracy, where it is not "
                        "fixed yet by the reference (1:exact) in --output")
    parser.add_argument("--interleave", action="store_true",
                        help="where the target is fixed already (in --output, or --target): "
                        "every cell, the one-host reference too, seed by seed (1:exact s1, "
                        "2:... s1, 1:exact s2, ...), each stopped at the target, so that a "
                        "drift in this machine's speed falls on every cell alike")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="runs at once, each pinned to its own cores (a cell's hosts x "
                             "cores per host of them), where the cells fit N times in this "
                             "machine's cores (default: 1, one run at a time, unpinned)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    try:
        args.cells = [parse_cell(text) for text in args.cells]
        args.lanes = lanes(args.jobs, max(h for h, _ in args.cells) * args.cores_per_host)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def lanes(jobs: int, need: int, cores: list[int] | None = None) -> list[list[int] | None]:
    """The cores each of `jobs` runs at once is pinned to (`need` each, from this process's
    `cores`); [None] for one run at a time, which emulate shares out all of them to."""
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: give 1 or more runs at once")
    if jobs == 1:
        return [None]
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if jobs * need > len(cores):
        raise ValueError(f"--jobs {jobs}: {jobs} runs of up to {need} core(s) each (the "
                         f"largest cell's hosts x --cores-per-host) need {jobs * need} cores, "
                         f"this machine gives {len(cores)}: give --jobs "
                         f"{max(1, len(cores) // need)} or fewer")
    return [cores[i * need:(i + 1) * need] for i in range(jobs)]


def parse_cell(text: str) -> tuple[int, str]:
    """'2:powersgd:2' -> (2, 'powersgd:2')."""
    hosts, _, contender = text.partition(":")
    if not hosts.isdigit() or int(hosts) < 1 or not contender:
        raise ValueError(f"--cells {text}: give HOSTS:CONTENDER, e.g. 2:powersgd:2")
    if not (contender in (EXACT, AUTO) or contender.startswith("powersgd:")
            or (is_ddp(contender) and ddp_flags(contender) is not None)):
        raise ValueError(f"--cells {text}: the contender is exact, auto, powersgd:R[:start=N], "
                         "ddp or ddp-powersgd:R[:min_rate=M]")
    return int(hosts), contender


def is_ddp(contender: str) -> bool:
    return contender == DDP or contender.startswith(DDP_PREFIX)


def ddp_flags(contender: str) -> list[str] | None:
    """compare_ddp's hook flags for 'ddp-powersgd:R[:min_rate=M]' (torch's powerSGD_hook at
    rank R, min_compression_rate M), none for 'ddp' (DDP's own allreduce); None where it is
    neither."""
    if contender == DDP:
        return []
    rank, _, rest = contender[len(DDP_PREFIX):].partition(":")
    rate = rest.removeprefix("min_rate=") if rest else "2"
    if not (rank.isdigit() and int(rank) >= 1 and rate.isdigit() and int(rate) >= 1):
        return None
    return ["--powersgd-rank", rank] + (["--powersgd-min-rate", rate] if rest else [])


# ------------------------------------------------------------------------ scoring

def mlperf_score(seconds: list[float | None]) -> dict:
    """MLPerf Training's score of one cell's runs (None: a run that missed the target):
    the fastest and slowest dropped, the rest averaged; a miss is the slowest, and more
    than one miss (or fewer than 3 runs) gives no score."""
    runs, missed = len(seconds), sum(s is None for s in seconds)
    ordered = sorted(seconds, key=lambda s: math.inf if s is None else s)
    kept = ordered[1:-1]
    if missed > 1:  # settled whatever further runs do
        return {"score_seconds": None, "why": f"{missed} of {runs} runs missed the target"}
    if runs < 3:
        return {"score_seconds": None,
                "why": f"{runs} run{'s' if runs != 1 else ''}: MLPerf's score needs at least 3"}
    return {"score_seconds": statistics.fmean(kept),
            "dropped": [ordered[0], ordered[-1]], "kept": kept}


def target_from_reference(best: list[float]) -> float:
    """The highest accuracy, rounded down to the percent, that all but at most one of the
    reference's runs reach (each run's best validation accuracy within the cap)."""
    ordered = sorted(best)
    reached_by_all_but_one = ordered[1] if len(ordered) > 1 else ordered[0]
    return math.floor(round(100 * reached_by_all_but_one, 6)) / 100


def first_reaching(evaluations: list[dict], target: float) -> dict | None:
    return next((e for e in evaluations if e["accuracy"] >= target), None)


def summarise(runs: list[dict], target: float, bandwidth: str,
              host_step_seconds: float | None) -> list[dict]:
    """One row per (contender, hosts): seeds, runs reaching the target, the MLPerf-style
    score in emulated seconds, its ratio to one host exact's, median epochs to target,
    and the final accuracy's mean and spread over seeds."""
    done = [r for r in runs if "failed" not in r]
    cells = sorted({(r["hosts"], r["contender"]) for r in done})
    rows = []
    for hosts, contender in cells:
        mine = [r for r in done if (r["hosts"], r["contender"]) == (hosts, contender)]
        reaching = [first_reaching(r["evaluations"], target) for r in mine]
        score = mlperf_score([e["emulated_seconds"] if e else None for e in reaching])
        finals = [r["evaluations"][-1]["accuracy"] for r in mine if r["evaluations"]]
        epochs = [e["epochs"] for e in reaching if e]
        # Emulated seconds per epoch, validation included, each run's over all it ran.
        per_epoch = [r["evaluations"][-1]["emulated_seconds"] / r["evaluations"][-1]["epochs"]
                     for r in mine if r["evaluations"]]
        rows.append({
            "model": mine[0]["model"], "hosts": hosts, "bandwidth": bandwidth,
            "host_step_seconds": host_step_seconds, "contender": contender,
            "exact": contender in (EXACT, DDP) or (contender == AUTO and all(
                r.get("plan_chosen", {}).get("exact") for r in mine)),
            **({"picked": sorted({r["plan_chosen"]["scheme"] for r in mine
                                  if r.get("plan_chosen")})} if contender == AUTO else {}),
            "seeds": len(mine),
            "reached": sum(e is not None for e in reaching),
            **score, "median_epochs_to_target": statistics.median(epochs) if epochs else None,
            "seconds_by_seed": {str(r["seed"]): (e["emulated_seconds"] if e else None)
                                for r, e in zip(mine, reaching)},
            "final_accuracy_mean": statistics.fmean(finals) if finals else None,
            "final_accuracy_spread": [min(finals), max(finals)] if finals else None,
            "final_epochs": [r["evaluations"][-1]["epochs"] for r in mine if r["evaluations"]],
            "epoch_seconds": statistics.median(per_epoch) if per_epoch else None,
            # Validation and checkpoint between epochs (runs recorded before it: None).
            "between_epochs_seconds": statistics.median(gaps) if (gaps := [
                g for r in mine for g in r.get("between_epochs_seconds", [])]) else None,
        })
    reference = next((r for r in rows if (r["hosts"], r["contender"]) == (1, EXACT)), None)
    for row in rows:
        row["ratio_to_one_host"] = (
            row["score_seconds"] / reference["score_seconds"]
            if reference and reference["score_seconds"] and row["score_seconds"] else None)
        row["epoch_ratio_to_one_host"] = (
            row["epoch_seconds"] / reference["epoch_seconds"]
            if reference and reference["epoch_seconds"] and row["epoch_seconds"] else None)
    return rows


# ------------------------------------------------------------------------ one run

def goal_flags(args, seed: int, stop_at: float | None) -> list[str]:
    """What every contender trains: the data, sizes, batch, learning rate, seed, epoch
    cap, validation and target."""
    flags = ["--usecase", args.usecase, "--data", args.data, "--image-size",
             str(args.image_size), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
             "--seed", str(seed), "--epochs", str(args.epochs)]
    flags += ["--model", args.model] if args.model else []
    flags += ["--eval-every", str(args.eval_every)] if args.eval_every else []
    if stop_at is not None:
        flags += ["--target-accuracy", str(stop_at), "--stop-at-target"]
    return flags


def run_once(args, hosts: int, contender: str, seed: int, speed: list[str],
             stop_at: float | None, scratch: Path, cores: list[int] | None = None) -> dict:
    """One seed of one cell on emulated hosts (on `cores` only, where given); its
    evaluations in emulated seconds."""
    run_dir = scratch / f"h{hosts}-{contender.replace(':', '_')}-s{seed}"
    if is_ddp(contender):
        command = ddp_command(hosts, args.cores_per_host, run_dir, [
            *ddp_flags(contender), *goal_flags(args, seed, stop_at)])
    else:
        compression = "none" if contender == EXACT else contender
        command = ["hybriddl", "train", *goal_flags(args, seed, stop_at), *LOCAL,
                   "--workers", str(args.cores_per_host), "--overlap", "--host-parallel",
                   "auto", "--compression", compression, "--monitor-interval", "0",
                   "--run-dir", str(run_dir)]
    ran, measured = emulated_cell(
        host_options(hosts, args.cores_per_host, bandwidth=args.bandwidth, speed=speed),
        command, run_dir, "rank0.json" if is_ddp(contender) else "metrics.json",
        cores=cores or ())
    record = {"hosts": hosts, "contender": contender, "seed": seed,
              "model": args.model or get_usecase(args.usecase).model,
              "wall_seconds": ran.wall_seconds, "command": ran.shown(),
              **({"cores": cores} if cores else {})}
    if measured is None:
        return {**record, "failed": ran.returncode, "output_tail": ran.tail(8)}
    emulation = ran.report
    target = measured["target"]
    record.update({
        "speedup": emulation.get("speedup", 1.0), "time_scale": emulation.get("time_scale", 1.0),
        "host_step": emulation.get("host_step"),
        "evaluations": [{k: e[k] for k in ("step", "epochs", "accuracy", "emulated_seconds",
                                           "wall_seconds")} for e in target["evaluations"]],
        "stopped_at_target": bool(stop_at is not None and target["reached"]),
        "train_loss": [e["train_loss"] for e in measured["epochs"]],
    })
    epochs = [e for e in measured["epochs"] if "started_at" in e]
    if len(epochs) > 1:
        # Emulated seconds from an epoch's last step to the next one's first: its
        # validation and checkpoint (a compressed scheme's collective, a split
        # classifier's gather), on the run's clock like the steps.
        record["between_epochs_seconds"] = [
            round((after["started_at"] - before["ended_at"]) / ran.dilation, 4)
            for before, after in zip(epochs, epochs[1:])]
    config = measured.get("config", {})
    chosen = (config.get("plan") or {}).get("chosen")
    if chosen:  # what the planner settled (under auto: the scheme it picked)
        record["plan_chosen"] = {"scheme": chosen["scheme"], "exact": chosen["exact"]}
    if config.get("host_parallel"):
        record["host_parallel"] = config["host_parallel"]["scheme"]
        record["compression"] = (config.get("hosts") or {}).get("compression")
    if measured.get("comm_hook"):
        record["comm_hook"] = measured["comm_hook"]
    return record


def accuracy_links() -> str:
    """The time-to-accuracy pages that exist, where compressed schemes are judged."""
    pages = sorted(p.stem for p in RESULTS.glob("time_to_accuracy-*.json"))
    if not pages:
        return "no time-to-accuracy table is measured yet"
    return ", ".join(f"[{name}]({name}.md)" for name in pages)


# ------------------------------------------------------------------------ its pages

def contender_text(row: dict) -> str:
    """A cell's contender as tables show it; `auto` with the scheme(s) the planner picked."""
    if row.get("picked"):
        return f"{row['contender']} (picked: {' / '.join(row['picked'])})"
    return row["contender"]


def seconds_text(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.3g}"


def short_text(row: dict) -> str:
    """" (N runs; MLPerf asks 5)" where a cell has fewer runs than MLPerf's; "" elsewhere."""
    return f" ({row['seeds']} runs; MLPerf asks {MLPERF_RUNS})" if row["seeds"] < MLPERF_RUNS \
        else ""


def score_text(row: dict) -> str:
    if row["score_seconds"] is None:
        return f"none ({row['why']})"
    return f"{row['score_seconds']:.3g}{short_text(row)}"


def mlperf_table(data: dict) -> str:
    """One row per cell: the MLPerf-style score beside the runs reaching the target, the
    ratio to one host exact, median epochs, and the final accuracy over seeds."""
    lines = score_rows(data.get("summary", []))
    lines += not_finished(data, lambda r: f"{r['contender']} at {r['hosts']} hosts, seed "
                                          f"{r['seed']}")
    own = own_target(data) if data.get("target") else None
    if own:
        lines += ["", f"The same runs scored at {own['accuracy']:g}, the target this file's "
                      "own one-host exact seeds fix by the rule above (the file's target, "
                      f"{data['target']['accuracy']:g}: {data['target']['how']}). A run "
                      "stopped at the higher target reached this one no later; its "
                      "evaluations say when:", "", *score_rows(own["summary"])]
    by_epoch = equal_epochs_table(data)
    if by_epoch:
        lines += ["", "Validation accuracy at the end of each epoch, mean over the cell's "
                      "seeds (points against one host exact's mean at the same epoch; "
                      "[k of n]: only k of its n runs ran that epoch, the others had "
                      "stopped at the target):", "", by_epoch]
    for group in set_apart(data):  # runs kept for the record, out of every row above
        named = ", ".join(f"{r['contender']} at {r['hosts']} hosts seed {r['seed']}"
                          for r in group["runs"])
        lines += ["", f"Set apart ({len(group['runs'])} runs: {named}): {group['why']}"]
    return "\n".join(lines)


def score_rows(summary: list[dict]) -> list[str]:
    """The score table's lines, one row per cell of `summary`."""
    lines = ["| hosts | contender | exact? | seeds | reached the target | score, emulated s "
             "| × one host's | median epochs to target | last validation accuracy (at the "
             "target or the cap), mean (range) | emulated s per epoch (median) | × one "
             "host's | of which between epochs (validation, checkpoint) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for row in summary:
        spread = row["final_accuracy_spread"]
        final = ("–" if row["final_accuracy_mean"] is None else
                 f"{row['final_accuracy_mean']:.3f} ({spread[0]:.3f}–{spread[1]:.3f})")
        epochs = row["median_epochs_to_target"]
        lines.append(f"| {row['hosts']} | {contender_text(row)} | "
                     f"{'yes' if row['exact'] else '**no**'} | {row['seeds']} | "
                     f"{row['reached']} of {row['seeds']} | {score_text(row)} | "
                     f"{ratio_text(row['ratio_to_one_host'])} | "
                     f"{'–' if epochs is None else f'{epochs:g}'} | {final} | "
                     f"{seconds_text(row.get('epoch_seconds'))} | "
                     f"{ratio_text(row.get('epoch_ratio_to_one_host'))} | "
                     f"{seconds_text(row.get('between_epochs_seconds'))} |")
    return lines


def set_apart(data: dict) -> list[dict]:
    """The file's groups of runs set apart, each {"why", "runs"} (one group, or a list)."""
    invalid = data.get("invalidated_runs") or []
    return [invalid] if isinstance(invalid, dict) else invalid


def accuracy_by_epoch(runs: list[dict]) -> dict[int, list[float]]:
    """Each whole epoch's validation accuracies, one per run that validated at its end."""
    by_epoch: dict[int, list[float]] = {}
    for run in runs:
        for e in run.get("evaluations") or []:
            if float(e["epochs"]).is_integer():
                by_epoch.setdefault(int(e["epochs"]), []).append(e["accuracy"])
    return by_epoch


def equal_epochs_table(data: dict) -> str:
    """Each cell's validation accuracy at the end of each epoch, mean over the seeds that
    ran it, and the points it differs from one host exact's mean at the same epoch. A run
    stopped at the target runs no later epoch: where fewer seeds than the cell's ran an
    epoch (marked), that mean is of the runs not yet at the target."""
    done = [r for r in data["runs"] if "failed" not in r]
    cells = sorted({(r["hosts"], r["contender"]) for r in done})
    by_cell = {cell: accuracy_by_epoch([r for r in done if (r["hosts"], r["contender"]) == cell])
               for cell in cells}
    seeds = {cell: sum((r["hosts"], r["contender"]) == cell for r in done) for cell in cells}
    reference = by_cell.get((1, EXACT), {})
    epochs = sorted({e for accuracies in by_cell.values() for e in accuracies})
    if not epochs:
        return ""
    lines = ["| hosts | contender | " + " | ".join(f"epoch {e}" for e in epochs) + " |",
             "|---:|---|" + "---|" * len(epochs)]
    for cell in cells:
        texts = []
        for e in epochs:
            accuracies = by_cell[cell].get(e)
            if not accuracies:
                texts.append("–")
                continue
            mean = statistics.fmean(accuracies)
            text = f"{mean:.3f}"
            if cell != (1, EXACT) and reference.get(e):
                text += f" ({100 * (mean - statistics.fmean(reference[e])):+.1f})"
            if len(accuracies) < seeds[cell]:
                text += f" [{len(accuracies)} of {seeds[cell]}]"
            texts.append(text)
        lines.append(f"| {cell[0]} | {cell[1]} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def not_finished(data: dict, run_name) -> list[str]:
    """A line under a table for each run that failed, named by `run_name(run)`."""
    return [f"\nNot finished: {run_name(r)} (exit {r['failed']})." for r in data["runs"]
            if "failed" in r]


def taking_turns(data: dict) -> dict[int, float]:
    """Host count -> time scale D of the file's runs where the hosts took turns on this
    machine's cores (D > 1: every exchange slowed; emulated seconds are wall / D)."""
    return {r["hosts"]: r["time_scale"] for r in data.get("runs", [])
            if r.get("time_scale", 1.0) > 1}


def host_speed(data: dict) -> str:
    """The hosts' speed where no host step was asked: their own (S = 1: emulated seconds
    are wall seconds) or the file's --speedup; and where they took turns on the cores."""
    turns = taking_turns(data)
    if not data.get("speedup"):
        return (f"hosts of {data['cores_per_host']} core(s) here at their own speed (S = 1), "
                + (", ".join(f"{hosts} of them taking turns on this machine's cores (D = "
                             f"{scale:g}, which slows every exchange)"
                             for hosts, scale in sorted(turns.items())) + ", fewer side by side"
                   if turns else "side by side"))
    return f"hosts each S times as fast as a core here (S = {data['speedup']:.3g})"


def mlperf_setting(data: dict) -> str:
    target = data.get("target") or {}
    void = (f"**Its one-host reference is void**: {data['reference_void']} "
            if data.get("reference_void") else
            f"**Its one-host reference ran slowed**: {data['reference_slowed']} "
            if data.get("reference_slowed") else "")
    step = data.get("host_step_seconds")
    speed = (f"each host standing for one whose step takes {step * 1e3:g} ms (S = "
             f"{data['speedup']:.3g}, one host's step measured here / that step), side by "
             "side" if step else host_speed(data))
    return (f"{void}{data['usecase']} on real images (`{data['data']}`: MNIST, "
            "scripts/digits_imagefolder.py), "
            f"{data['image_size']} px, global batch {data['global_batch']} at every host count, "
            f"SGD lr {data['lr']:g} momentum 0.9, at most {data['epoch_cap']} epochs, "
            f"{data['cores_per_host']} core(s) per host, {data['bandwidth']} links, {speed}; "
            f"target: validation accuracy {target.get('accuracy', '–')} "
            f"({target.get('how', 'not fixed yet')})"
            + (f"; {data['jobs']} runs at once, each pinned to its own cores (sharing this "
               "machine's memory bandwidth and caches: an epoch may be slower than alone)"
               if data.get("jobs", 1) > 1 else "")
            + (f". {data['page_note']}" if data.get("page_note") else ""))


MLPERF_NOTES = """\
How to read it: each cell trains one run per seed to the target (`train --target-accuracy
A --stop-at-target`; the clock runs through every validation, as in MLPerf); its score
drops the fastest and the slowest run and averages the rest, in emulated seconds (wall /
(S·D)). A run that misses the target within the epoch cap counts as the slowest; more than one
miss, no score. `exact` is hybriddl's exact scheme as the planner picks it; `powersgd:R`
is hybriddl's PowerSGD at rank R (not exact), one factor a step, `:rounds=2` both factors
in two allreduces as the paper and torch's hook, `:min_rate=M` compressing only the matrices
whose factors are at least M times smaller; `ddp-powersgd:R` is PyTorch DDP with torch's
powerSGD_hook (one bucket, its own start after 2 steps), `:min_rate=M` its
min_compression_rate (torch's default is 2), which picks the same matrices; `ddp` is DDP's
own allreduce (exact averaging; torch's dropout, not hybriddl's keyed masks), the peer's
loop without compression. The one-host exact runs that fix the target go to the cap, and
their final accuracy is the cap's; under `--interleave` (a target given or fixed before)
they stop at the target like every cell."""


def interleaved_ratios(data: dict) -> dict[int, list[float]]:
    """Per host count, each seed's epoch time over one host's in the same seed, from the
    file's `interleaved_check` runs (run seed by seed, so that a drift of the machine's
    speed falls on both)."""
    per = {}
    for run in (data.get("interleaved_check") or {}).get("runs", []):
        last = run["evaluations"][-1]
        per[(run["hosts"], run["seed"])] = last["emulated_seconds"] / last["epochs"]
    ratios: dict[int, list[float]] = {}
    for (hosts, seed), seconds in sorted(per.items()):
        if hosts > 1 and (1, seed) in per:
            ratios.setdefault(hosts, []).append(seconds / per[(1, seed)])
    return ratios


def headline_claim(hosts: list[dict], compressed: list[dict]) -> str | None:
    """The README's one claim sentence: the lowest ratio to one host's time among
    `headline_rows` that has a score, and the compressed row where hybriddl's best scheme
    leads DDP + PowerSGD's by the most seeds reaching the target. None where neither."""
    scored = [f for f in headline_rows(hosts) if f["best"]["ratio_to_one_host"] is not None]
    parts = []
    if scored:
        f = min(scored, key=lambda f: f["best"]["ratio_to_one_host"])
        best = f["best"]
        parts.append(f"{best['hosts']} hosts reach {model_name(f['usecase'])}'s target "
                     f"accuracy on real images in {ratio_text(best['ratio_to_one_host'])}× one "
                     "host's time ("
                     + ("exact" if best["exact"] else f"{contender_text(best)}, **not exact**")
                     + f"; {f['workload']}; {f['hosts']}; {f['cpu']}; MLPerf-scored over "
                     f"{best['seeds']} seeds)")
    if compressed:
        f = max(compressed, key=lambda f: f["ours"]["reached"] / f["ours"]["seeds"]
                - f["peer"]["reached"] / f["peer"]["seeds"])
        ours, peer = f["ours"], f["peer"]
        parts.append(f"compressed, hybriddl's {contender_text(ours)} trains "
                     f"{model_name(f['usecase'])} to {f['target']:g} in {ours['reached']} of "
                     f"{ours['seeds']} seeds, DDP + "
                     f"PowerSGD's {contender_text(peer)} in {peer['reached']} of "
                     f"{peer['seeds']}")
    return "**" + "; ".join(parts) + ".**" if parts else None


def compressed_row(data: dict, page: str) -> dict | None:
    """The README's verdict from a one-host file that measured DDP + PowerSGD beside
    hybriddl's compressed schemes (PowerSGD approximates the mean gradient, so one host
    trains what H hosts train), as one row of `compressed_table`: at the target this file
    scores (its own, lower one where the target was given from another CPU's file and its
    exact seeds fix one), exact, hybriddl's best compressed cell and DDP's (the most seeds
    reaching it, then the highest last accuracy), and the other cells' seeds reaching it.
    None for every other file (a file of more hosts is a row of `hosts_table`)."""
    rows, target = data.get("summary") or [], (data.get("target") or {}).get("accuracy")
    if not rows or target is None or data.get("reference_void") or \
            not all(r["hosts"] == 1 for r in rows):
        return None
    own = own_target(data)
    given = target if own else None
    if own:
        rows, target = own["summary"], own["accuracy"]
    one = next((r for r in rows if r["contender"] == EXACT), None)
    compressed = sorted((r for r in rows if not r["exact"]),
                        key=lambda r: (-r["reached"] / r["seeds"], -r["final_accuracy_mean"]))
    ours = [r for r in compressed if not is_ddp(r["contender"])]
    peers = [r for r in compressed if is_ddp(r["contender"])]
    if one is None or not ours or not peers:
        return None
    return {"page": page, "target": target, "given": given, "one": one, "ours": ours[0],
            "usecase": data["usecase"],
            "peer": peers[0], "others": ours[1:] + peers[1:], "cpu": data["cpu_model"],
            "workload": f"{data['usecase']} ({rows[0]['model']}, {data['image_size']} px), "
                        f"one host of {data['cores_per_host']} core(s)"}


def compressed_table(found: list[dict]) -> list[str]:
    """The README's compressed schemes, judged by accuracy: one sentence, then a row per
    file from `compressed_row` (its runs are not interleaved rounds: scores are indicative;
    the pages have every cell and the epochs' times)."""
    if not found:
        return []

    def cell(row: dict) -> str:
        score = ("none" if row["score_seconds"] is None else
                 f"{row['score_seconds']:.3g} s ({ratio_text(row['ratio_to_one_host'])}× "
                 "exact's)")
        spread = row["final_accuracy_spread"]
        return (f"{row['reached']}/{row['seeds']}, {score}; last accuracy "
                f"{row['final_accuracy_mean']:.3f} ({spread[0]:.3f}–{spread[1]:.3f})")

    lines = ["**Compressed schemes, judged by accuracy** (not exact; PowerSGD approximates "
             "the mean gradient, so one host trains what more hosts train): seeds reaching "
             "the target and the MLPerf score there (runs not in interleaved rounds: times "
             "indicative):", "",
             "| workload (CPU) | target | exact | hybriddl's best compressed | DDP + "
             "PowerSGD's best | the other compressed cells |", "|---|---|---|---|---|---|"]
    for f in found:
        target = f"{f['target']:g}" + (f" (its own; {f['given']:g} given)" if f["given"] else "")
        others = ", ".join(f"{contender_text(r)} {r['reached']}/{r['seeds']}"
                           for r in f["others"]) or "–"
        lines.append(f"| [{f['workload']}](docs/benchmarks/{f['page']}.md) ({f['cpu']}) | "
                     f"{target} | {cell(f['one'])} | {contender_text(f['ours'])}: "
                     f"{cell(f['ours'])} | {contender_text(f['peer'])}: {cell(f['peer'])} | "
                     f"{others} |")
    return lines


def hosts_row(data: dict, page: str) -> dict | None:
    """A file of more hosts as a row of the README's table: the target it is scored at
    (the lower one its own one-host exact seeds fix where one host has no score at a given
    one), one host exact, the best hybriddl cell on more hosts (scored first, then the
    fastest), and DDP's beside it where measured. None for one-host files, a void or
    slowed reference, or no cell on more hosts."""
    rows, target = data.get("summary") or [], (data.get("target") or {}).get("accuracy")
    if not rows or target is None or data.get("reference_void") or \
            data.get("reference_slowed"):
        return None

    def reference(cells):
        return next((r for r in cells if (r["hosts"], r["contender"]) == (1, EXACT)), None)

    one, own, given = reference(rows), own_target(data), None
    if own and not (one and one["score_seconds"]):  # scored at the file's own target instead
        given = {"accuracy": target, "one": one}
        rows, target = own["summary"], own["accuracy"]
        one = reference(rows)
    more = [r for r in rows if r["hosts"] > 1 and not is_ddp(r["contender"])]
    if one is None or not more:
        return None
    best = min(more, key=lambda r: (r["score_seconds"] is None, r["score_seconds"] or 0,
                                    r.get("epoch_ratio_to_one_host") or math.inf))
    peer = next((r for r in rows if r["hosts"] == best["hosts"] and is_ddp(r["contender"])),
                None)
    step = data.get("host_step_seconds")
    turns = taking_turns(data).get(best["hosts"])
    interleaved = all("--interleave" in c for c in data.get("commands")
                      or [data.get("command", "")])
    return {"page": page, "target": target, "given": given, "one": one, "best": best,
            "usecase": data["usecase"],
            # A row per workload in the README, per workload and CPU in the benchmarks
            # index (`headline_rows`); its CPU last, so [:-1] is the workload.
            "workload_key": (best["model"], data["image_size"], data["bandwidth"], step,
                             data.get("cpu_model")),
            "preference": (data["epoch_cap"], interleaved,
                           sum(r["seeds"] for r in rows), data.get("date", "")),
            "peer": peer, "cpu": data.get("cpu_model"),
            "check": interleaved_ratios(data).get(best["hosts"]),
            # Seed by seed, the hosts counts alternating: a drift of the machine falls on both.
            "interleaved": interleaved,
            "workload": f"{data['usecase']} ({best['model']}, {data['image_size']} px), "
                        f"{data['bandwidth']} links, at most {data['epoch_cap']} epochs",
            "hosts": (f"{best['hosts']} of {data['cores_per_host']} core(s), "
                      + (f"{step * 1e3:g} ms host step (S = {data['speedup']:.3g})" if step
                         else f"S = {data.get('speedup') or 1:g}")
                      + (f", D = {turns:g}" if turns else ", side by side"))}


def headline_rows(found: list[dict], every_cpu: bool = False) -> list[dict]:
    """One `hosts_row` per workload (model, image size, link, host step), or per workload
    and CPU with `every_cpu` (a host of S = 1 is its CPU's core: another CPU is another
    host), in the order first found: the file with the largest epoch cap, then
    interleaved, then the most runs, then the newest. The README shows the first, the
    benchmarks index the second; every file keeps its page (docs/benchmarks)."""
    kept: dict[tuple, dict] = {}
    for row in found:
        key = row["workload_key"] if every_cpu else row["workload_key"][:-1]
        have = kept.get(key)
        if have is None or row["preference"] > have["preference"]:
            kept[key] = row
    return list(kept.values())


def hosts_table(found: list[dict], every_cpu: bool = False) -> list[str]:
    """The time to accuracy on more hosts, a row per workload from `headline_rows` (the
    README's, which points to the rest) or per workload and CPU (the benchmarks index's)."""
    found = headline_rows(found, every_cpu)
    if not found:
        return []

    def cell(row: dict) -> str:
        score = "none" if row["score_seconds"] is None else f"{row['score_seconds']:.3g} s"
        return f"{row['reached']}/{row['seeds']}, {score}{short_text(row)}"

    def ratio(row: dict | None, check: list[float] | None = None) -> str:
        if row is None:
            return "not measured"
        if row["ratio_to_one_host"] is not None:
            return f"{ratio_text(row['ratio_to_one_host'])}×"
        return (f"none (an epoch {ratio_text(row.get('epoch_ratio_to_one_host'))}×"
                + (f"; {ratio_text(min(check))}–{ratio_text(max(check))}× in seeds run "
                   "interleaved" if check else "") + ")")

    rows = ("a row per workload and CPU, from its file capped last, interleaved, with the "
            "most runs, newest")
    if not every_cpu:
        rows = (rows.replace(" and CPU", "") + "; each CPU's row: [docs/benchmarks]"
                "(docs/benchmarks/README.md#time-to-accuracy-a-row-per-workload-and-cpu)")
    lines = ["**Time to accuracy on more hosts**: real images (MNIST), the target one host "
             "exact reaches in all but one of its seeds, each cell's runs scored as MLPerf "
             f"scores them (the fastest and slowest dropped, the rest averaged; emulated s; "
             f"{rows}):", "",
             "| workload | hosts (CPU) | target | one host exact: reached, score | more hosts: "
             "scheme, reached, score | × one host | DDP + PowerSGD, × one host |",
             "|---|---|---|---|---|---:|---|"]
    for f in found:
        best, given = f["best"], f["given"]
        target = f"{f['target']:g}" + (
            f" (its own; {given['accuracy']:g} given: one host "
            f"{given['one']['reached']}/{given['one']['seeds']})" if given else "")
        scheme = contender_text(best) + ("" if best["exact"] else " (**not exact**)")
        lines.append(f"| [{f['workload']}](docs/benchmarks/{f['page']}.md) | {f['hosts']} "
                     f"({f['cpu']}) | {target} | {cell(f['one'])} | {scheme}: {cell(best)} | "
                     f"{ratio(best, f['check'])}"
                     + ("" if f["interleaved"] else " (runs not interleaved: indicative)")
                     + f" | {ratio(f['peer'])} |")
    return lines


PAGES = [Page("time_to_accuracy-mnist-*", "Time to a target accuracy over seeds, scored as "
                   "MLPerf", "results/time_to_accuracy-mnist-*.json", mlperf_table,
                   mlperf_setting, MLPERF_NOTES,
                   none_yet="scripts/time_to_accuracy.py --data MNIST ... writes them")]


# ------------------------------------------------------------------------ the file

def main(argv=None) -> int:
    args = parse_args(argv)
    args.batch_size = args.batch_size or get_usecase(args.usecase).batch_size
    output = Path(args.output)
    result = json.loads(output.read_text()) if output.exists() else {
        "what": " ".join(__doc__.split("\n\n")[0].split()), "usecase": args.usecase,
        "data": args.data, "image_size": args.image_size, "global_batch": args.batch_size,
        "lr": args.lr, "epoch_cap": args.epochs, "eval_every": args.eval_every,
        "cores_per_host": args.cores_per_host, "bandwidth": args.bandwidth,
        "target": None, "speedup": args.speedup, "runs": []}
    header = results_header("time_to_accuracy.py", argv)
    if result.get("cpu_model", header["cpu_model"]) != header["cpu_model"]:
        # One file's times (and roundings) are one CPU's: a run here would be another's.
        print(f"time_to_accuracy: {output} was measured on {result['cpu_model']}, this "
              f"machine is {header['cpu_model']}: give another --output", file=sys.stderr)
        return 2
    result.update(header)
    result.setdefault("commands", []).append(result["command"])
    if args.target is not None and result["target"] is None:
        result["target"] = {"accuracy": args.target, "how": "given (--target)"}
    if args.jobs > 1:
        result["jobs"] = args.jobs  # the page says that runs shared the machine
    done = {(r["hosts"], r["contender"], r["seed"]) for r in result["runs"] if "failed" not in r}
    # The reference first: the target is fixed from it before any other cell runs.
    cells = sorted(args.cells, key=lambda cell: cell != (1, EXACT))
    # The reference's seeds first, then the other cells seed by seed, interleaved, so that
    # a change in this machine's speed falls on every cell alike.
    waves = [[(cell, seed) for cell in cells if cell == (1, EXACT) for seed in args.seeds],
             [(cell, seed) for seed in args.seeds for cell in cells if cell != (1, EXACT)]]
    if args.interleave:
        if result["target"] is None:
            raise SystemExit("time_to_accuracy: --interleave needs a fixed target: run the "
                             "reference cell 1:exact first (or give --target)")
        waves = [[(cell, seed) for seed in args.seeds for cell in cells]]
    saving = threading.Lock()
    free = queue.SimpleQueue()
    for lane in args.lanes:
        free.put(lane)

    def run(job, scratch: Path) -> None:
        (hosts, contender), seed = job
        reference = (hosts, contender) == (1, EXACT)
        stop_at = None if reference and not args.interleave else result["target"]["accuracy"]
        speed = (["--speedup", repr(result["speedup"])] if result["speedup"] else
                 ["--host-step", args.host_step, "--usecase", args.usecase,
                  "--image-size", str(args.image_size), "--batch-size",
                  str(args.batch_size), "--channels-last"] if args.host_step else [])
        lane = free.get()
        try:
            record = run_once(args, hosts, contender, seed, speed, stop_at, scratch, lane)
        finally:
            free.put(lane)
        with saving:
            # The code each run measured (a file grows over calls, and sessions).
            record["commit"], record["cpu_model"] = result["commit"], result["cpu_model"]
            if result.get("code_changed_since_commit"):
                record["code_changed_since_commit"] = result["code_changed_since_commit"]
            result["runs"] = [r for r in result["runs"] if (r["hosts"], r["contender"],
                              r["seed"]) != (hosts, contender, seed)] + [record]
            if record.get("host_step") and not result["speedup"]:
                result["speedup"] = record["speedup"]
                result["host_step_seconds"] = record["host_step"].get("asked_seconds")
            print(json.dumps({k: record.get(k) for k in ("hosts", "contender", "seed", "cores",
                              "failed", "wall_seconds", "stopped_at_target")}), flush=True)
            save(output, result)

    with tempfile.TemporaryDirectory(prefix="hybriddl-tta-") as scratch:
        for wave in waves:
            if wave and wave[0][0] != (1, EXACT) and result["target"] is None:
                result["target"] = fixed_target(result)
                save(output, result)
                if result["target"] is None:
                    raise SystemExit("time_to_accuracy: no target yet: run the reference "
                                     "cell 1:exact first (or give --target)")
            todo = [job for job in wave if (*job[0], job[1]) not in done]
            # --host-step measures S at the first run: it runs alone, the rest with its S.
            first = 1 if todo and args.host_step and not result["speedup"] else 0
            for job in todo[:first]:
                run(job, Path(scratch))
            with ThreadPoolExecutor(len(args.lanes)) as pool:
                list(pool.map(lambda job: run(job, Path(scratch)), todo[first:]))
        if result["target"] is None:
            result["target"] = fixed_target(result)
            save(output, result)
    return 0


def fixed_target(result: dict) -> dict | None:
    """The target the reference's runs fix (None before any finished)."""
    best = [max(e["accuracy"] for e in r["evaluations"]) for r in result["runs"]
            if (r["hosts"], r["contender"]) == (1, EXACT) and "failed" not in r
            and r["evaluations"]]
    if not best:
        return None
    return {"accuracy": target_from_reference(best), "reference_best": best,
            "how": "the highest accuracy, rounded down to the percent, that one host exact "
                   "reaches in all but at most one of its seeds within the cap"}


def save(output: Path, result: dict) -> None:
    if result["target"] is not None:
        result["summary"] = summarise(result["runs"], result["target"]["accuracy"],
                                      result["bandwidth"], result.get("host_step_seconds"))
    atomic_write_json(output, result)


def own_target(result: dict) -> dict | None:
    """Where the target was given (from another file, another CPU) and this file's own
    one-host exact seeds fix a lower one, every cell scored at that one too: a run stopped
    at the given target reached the lower one no later, so its record holds the answer (not
    so for a higher one: runs stopped below it)."""
    given = result["target"]
    fixed = fixed_target(result) if given.get("how", "").startswith("given") else None
    if fixed is None or fixed["accuracy"] >= given["accuracy"]:
        return None
    return {"accuracy": fixed["accuracy"],
            "summary": summarise(result["runs"], fixed["accuracy"], result["bandwidth"],
                                 result.get("host_step_seconds"))}


if __name__ == "__main__":
    sys.exit(main())

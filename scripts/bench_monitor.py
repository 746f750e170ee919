"""What monitoring costs: training throughput with and without the pidstat/sar sampler.

Side by side in one process, on one model and one strategy: rounds alternate monitored
and unmonitored segments of timed optimizer steps (the order flips every round, so a
drift of the machine's load hits both alike), and the medians over rounds are compared.
The budget (issue 6) is at most 1% of throughput.

    python scripts/bench_monitor.py --usecase ComplexSmall --image-size 224 --steps 10 --rounds 5
    python scripts/bench_monitor.py --image-size 32 --batch-size 8 --steps 3 --rounds 2 \\
        --monitor-interval 0.1        # a quick check that the script works
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hybriddl.tuning.benchmark import sample_batch
from hybriddl.data.loading import load_data
from hybriddl.errors import UsageError
from hybriddl.monitoring.monitor import Monitor
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.step import optimizer_step
from hybriddl.usecases import build_model, get_usecase, use_case_workload


BUDGET_PCT = 1.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--usecase", default="ComplexSmall")
    parser.add_argument("--model", help="default: the use case's")
    parser.add_argument("--image-size", type=int, help="default: the use case's (224)")
    parser.add_argument("--batch-size", type=int, help="default: the use case's")
    parser.add_argument("--strategy", default="sequential")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per segment")
    parser.add_argument("--rounds", type=int, default=5, help="monitored + unmonitored pairs")
    parser.add_argument("--monitor-interval", type=float, default=1.0)
    parser.add_argument("--output", default="bench_monitor.json")
    return parser.parse_args(argv)


def timed_steps(strategy, optimizer, x, y, steps: int) -> float:
    """Images/s over `steps` full optimizer steps."""
    started = time.perf_counter()
    for _ in range(steps):
        optimizer_step(strategy, optimizer, x, y)
    return steps * len(y) / (time.perf_counter() - started)


def run(args: argparse.Namespace) -> dict:
    case = get_usecase(args.usecase)
    model_name, image_size, batch_size = use_case_workload(args.usecase, args.model,
                                                           args.image_size, args.batch_size)
    if args.steps < 1 or args.rounds < 1 or args.monitor_interval <= 0:
        raise UsageError("--steps and --rounds need at least 1 and --monitor-interval a positive "
                         "number of seconds")
    split = load_data("synthetic", variant=case.dataset, image_size=image_size, val_fraction=0.2)
    x, y = sample_batch(split.train, batch_size, image_size)
    torch.manual_seed(0)
    model = build_model(model_name, len(split.classes))
    rates = {"monitored": [], "unmonitored": []}
    sampling = []
    with make_strategy(args.strategy, StrategyOptions(workers=args.workers)) as strategy, \
            tempfile.TemporaryDirectory() as scratch:
        strategy.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum)
        timed_steps(strategy, optimizer, x, y, 1)  # warm-up: allocator, first-touch pages
        for round_number in range(args.rounds):
            order = ("monitored", "unmonitored") if round_number % 2 == 0 else ("unmonitored", "monitored")
            for mode in order:
                monitor = (Monitor(Path(scratch) / f"round{round_number}", 0, args.monitor_interval)
                           if mode == "monitored" else contextlib.nullcontext())
                with monitor:
                    rates[mode].append(timed_steps(strategy, optimizer, x, y, args.steps))
                if mode == "monitored":
                    summary = monitor.summary()
                    sampling.append(summary["sampling_cpu_seconds"] / summary["duration_s"])
        description = strategy.describe()
    monitored = statistics.median(rates["monitored"])
    unmonitored = statistics.median(rates["unmonitored"])
    return {
        "usecase": args.usecase, "model": model_name, "image_size": image_size,
        "batch_size": batch_size, "strategy": description, "steps_per_segment": args.steps,
        "rounds": args.rounds, "monitor_interval_s": args.monitor_interval,
        "images_per_second": rates,
        "median_images_per_second": {"monitored": monitored, "unmonitored": unmonitored},
        "throughput_cost_pct": 100 * (1 - monitored / unmonitored),
        "sampler_cpu_pct_of_one_core": 100 * statistics.median(sampling),
        "budget_pct": BUDGET_PCT,
    }


def show(result: dict, console: Console) -> None:
    table = Table(title=f"Monitoring cost: {result['model']} {result['image_size']} px, batch "
                        f"{result['batch_size']}, {result['strategy']['name']}, "
                        f"{result['rounds']} rounds × {result['steps_per_segment']} steps, "
                        f"interval {result['monitor_interval_s']} s")
    table.add_column("segments")
    table.add_column("median images/s", justify="right")
    table.add_column("min", justify="right")
    table.add_column("max", justify="right")
    for mode in ("unmonitored", "monitored"):
        rates = result["images_per_second"][mode]
        table.add_row(mode, f"{statistics.median(rates):.2f}", f"{min(rates):.2f}", f"{max(rates):.2f}")
    console.print(table)
    cost = result["throughput_cost_pct"]
    verdict = "[green]within[/]" if cost <= result["budget_pct"] else "[red]over[/]"
    console.print(f"throughput cost of monitoring: [bold]{cost:+.2f}%[/] ({verdict} the "
                  f"{result['budget_pct']:.0f}% budget; negative = noise in favour of monitoring); "
                  f"the sampler itself used {result['sampler_cpu_pct_of_one_core']:.2f}% of one core")


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console()
    try:
        result = run(args)
    except UsageError as exc:
        console.print(f"bench_monitor: error: {exc}", markup=False)
        return 2
    show(result, console)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

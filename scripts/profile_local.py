"""Where a step's time goes, per local strategy: the gradients (of which the reduction of
the local workers' gradients), the optimizer step and the replica resync, against the
ideal of sequential / K.

    PYTHONPATH=. python scripts/profile_local.py --usecase SimpleBig --workers 2

Medians over the timed steps after the warm-up. Run it where the speedup falls short
of K: the phases that do not shrink with K are where the missing speedup went.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from hybriddl.errors import UsageError
from hybriddl.machine.hostinfo import usable_cores
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.usecases import USECASES, build_model, get_usecase

PHASES = ("gradients", "reduction", "optimizer", "after_step", "step")


def profile(name: str, options: StrategyOptions, model_name: str, x, y, warmup: int,
            steps: int, lr: float, momentum: float) -> dict:
    """Median seconds of each phase of `steps` optimizer steps of one strategy."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = build_model(model_name, 3, dropout=0.0)
    samples = {phase: [] for phase in PHASES}
    try:
        with make_strategy(name, options) as strategy:
            strategy.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            for step in range(warmup + steps):
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=False)
                stats = strategy.compute_gradients(x, y)
                t1 = time.perf_counter()
                optimizer.step()
                t2 = time.perf_counter()
                strategy.after_step()
                t3 = time.perf_counter()
                if step >= warmup:
                    reduction = stats.extra.get("reduce_seconds", 0.0)
                    for phase, seconds in zip(PHASES, (t1 - t0, reduction, t2 - t1, t3 - t2,
                                                       t3 - t0)):
                        samples[phase].append(seconds)
            description = strategy.describe()
    finally:
        torch.set_num_threads(threads)
    return {"strategy": description, **{p: statistics.median(s) for p, s in samples.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="ComplexSmall", help=f"one of {', '.join(USECASES)}")
    parser.add_argument("--model", help="torchvision classifier (default: the use case's)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, help="default: the use case's")
    parser.add_argument("--workers", type=int, default=usable_cores())
    parser.add_argument("--strategies", default="sequential,intraop,threads,processes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", help="write the profile as JSON here")
    args = parser.parse_args(argv)
    case = get_usecase(args.usecase)
    model_name = args.model or case.model
    batch_size = args.batch_size or case.batch_size
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, args.image_size, args.image_size, generator=generator)
    y = torch.randint(3, (batch_size,), generator=generator)
    options = StrategyOptions(workers=args.workers)
    try:
        rows = [profile(name, options, model_name, x, y, args.warmup, args.steps, case.lr,
                        case.momentum) for name in args.strategies.split(",")]
    except UsageError as exc:
        Console(stderr=True).print(f"profile_local: error: {exc}", markup=False, soft_wrap=True)
        return 2
    table = Table(title=f"{model_name}, {args.image_size} px, batch {batch_size}: "
                        f"median seconds per phase (ideal = sequential step / {args.workers})")
    table.add_column("strategy", no_wrap=True)
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_column("speedup", justify="right")
    baseline = rows[0]["step"]
    for row in rows:
        name = " ".join([row["strategy"]["name"]] + [f"{k}={v}" for k, v in row["strategy"].items()
                                                      if k != "name"])
        table.add_row(name, *(f"{row[p]:.3f}" for p in PHASES), f"{baseline / row['step']:.2f}x")
    table.add_row("ideal", "", "", "", "", f"{baseline / args.workers:.3f}", f"{args.workers:.2f}x")
    Console(width=max(Console().width, 120)).print(table)  # piped output: no truncation
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"model": model_name, "image_size": args.image_size,
                       "batch_size": batch_size, "workers": args.workers, "rows": rows}, handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

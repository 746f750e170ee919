"""Local strategies against PyTorch's own options, side by side, in one invocation.

    PYTHONPATH=. python scripts/bench_local.py --usecase ComplexSmall --workers 2 \
        --output bench-vgg16.json

Same model, batch and image size for every row: sequential (the baseline), intraop K,
threads K, processes K, plain PyTorch with its default threads, and PyTorch DDP over
gloo with K processes. Each row runs in a fresh spawned process, so its peak memory is
its own. Seconds/step is the median of the timed optimizer steps after the warm-up;
speedup = t_sequential / t_row (the paper's definition).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hybriddl.tuning.benchmark import (StepTiming, measure_ddp, measure_pytorch, measure_strategy,
                                sample_batch)
from hybriddl.data import SYNTHETIC_CLASSES, ImageSet, render_synthetic
from hybriddl.errors import UsageError
from hybriddl.hosts.hostinfo import host_info, usable_cores
from hybriddl.run.rundir import atomic_write_json
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.usecases import USECASES, build_model, check_image_size, get_usecase


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="ComplexSmall", help=f"one of {', '.join(USECASES)}")
    parser.add_argument("--model", help="torchvision classifier (default: the use case's)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="pixels per side (default: 224)")
    parser.add_argument("--batch-size", type=int, help="host batch (default: the use case's)")
    parser.add_argument("--workers", type=int, default=usable_cores(),
                        help="K for intraop/threads/processes/DDP (default: usable cores)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow K above the usable cores")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: 1)")
    parser.add_argument("--output", help="write the table as JSON here")
    return parser.parse_args(argv)


def batch(model: str, batch_size: int, image_size: int, num_classes: int):
    """A batch of the embedded data, preprocessed as in training (rendered, not loaded:
    the benchmark needs batch_size images, not the data set)."""
    images = torch.stack([torch.from_numpy(render_synthetic(i % num_classes, i, 64))
                          for i in range(batch_size)])
    labels = torch.arange(batch_size) % num_classes
    return sample_batch(ImageSet(images, labels, list(SYNTHETIC_CLASSES)), batch_size, image_size)


def in_fresh_process(function, *args, **kwargs) -> StepTiming:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args, **kwargs).result()


def run(args) -> dict:
    case = get_usecase(args.usecase)
    model_name = args.model or case.model
    batch_size = args.batch_size or case.batch_size
    num_classes = len(SYNTHETIC_CLASSES)
    for flag, value in (("--steps", args.steps), ("--batch-size", batch_size)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give at least 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: give 0 or more")
    options = StrategyOptions(workers=args.workers, oversubscribe=args.oversubscribe)
    for name in ("intraop", "threads", "processes"):
        make_strategy(name, options)  # refuses an infeasible K before anything runs
    check_image_size(build_model(model_name, num_classes), args.image_size, num_classes)
    x, y = batch(model_name, batch_size, args.image_size, num_classes)
    common = dict(warmup=args.warmup, steps=args.steps, lr=case.lr, momentum=case.momentum)
    default_threads = torch.get_num_threads()  # PyTorch's own choice, before anyone pins it
    rows = []
    for name in ("sequential", "intraop", "threads", "processes"):
        rows.append(in_fresh_process(measure_strategy, name, options, model_name, num_classes,
                                     x, y, **common))
    rows.append(in_fresh_process(measure_pytorch, default_threads, model_name, num_classes, x, y,
                                 **common))
    rows.append(in_fresh_process(measure_ddp, args.workers, model_name, num_classes, x, y,
                                 **common))
    baseline = rows[0].seconds_per_step
    return {"usecase": args.usecase, "model": model_name, "image_size": args.image_size,
            "batch_size": batch_size, "workers": args.workers, "warmup": args.warmup,
            "steps": args.steps, "host": host_info(),
            "rows": [{**asdict(r), "images_per_second": r.images_per_second,
                      "speedup": baseline / r.seconds_per_step} for r in rows]}


def label(strategy: dict) -> str:
    details = " ".join(f"{k}={v}" for k, v in strategy.items() if k != "name")
    return f"{strategy['name']} {details}".strip()


def table(result: dict) -> Table:
    title = (f"{result['model']}, {result['image_size']} px, batch {result['batch_size']}, "
             f"median of {result['steps']} steps after {result['warmup']} warm-up")
    table = Table(title=title)
    for column in ("strategy", "s/step", "images/s", "speedup", "peak RSS MiB", "peak PSS MiB"):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for row in result["rows"]:
        mib = [f"{row[key] / 2**20:.0f}" for key in ("peak_rss_bytes", "peak_pss_bytes")]
        table.add_row(label(row["strategy"]), f"{row['seconds_per_step']:.3f}",
                      f"{row['images_per_second']:.1f}", f"{row['speedup']:.2f}x", *mib)
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 110))  # piped output: no truncation
    try:
        result = run(args)
    except UsageError as exc:
        Console(stderr=True).print(f"bench_local: error: {exc}", markup=False, soft_wrap=True)
        return 2
    console.print(table(result))
    if args.output:
        atomic_write_json(Path(args.output), result)
        console.print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What keeping freed memory is worth: one strategy with and without it, side by side.

    python scripts/bench_memory_reuse.py --usecase SimpleBig --strategy intraop \
        --rounds 5 --output results/memory_reuse-SimpleBig.json

hybriddl's strategies tell glibc to keep freed memory for reuse (machine/allocator.py);
HYBRIDDL_MALLOC=system leaves glibc's defaults. Each round runs the strategy once in each
mode, each in a fresh spawned process (the setting lasts a process's life), modes
alternating; per timed step it records the seconds, the minor page faults and the kernel
CPU seconds of that process (in-process strategies only: a worker process's faults are not
its parent's). ratio = t(system) / t(kept) within a round; medians over the rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from rich.console import Console

from bench_local import batch
from hybriddl.usecases import get_usecase, use_case_workload
from hybriddl.data import SYNTHETIC_CLASSES
from hybriddl.errors import UsageError
from hybriddl.hosts.mpi import library_versions
from hybriddl.machine.hostinfo import host_info, usable_cores
from hybriddl.files import atomic_write_json
from hybriddl.step import optimizer_step
from hybriddl.strategies import STRATEGIES, StrategyOptions, cpu_strategies, make_strategy
from hybriddl.tuning.benchmark import timing_model

MODES = ("system", "keep")  # values of HYBRIDDL_MALLOC
IN_PROCESS = tuple(name for name in cpu_strategies() if not STRATEGIES[name].worker_processes)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--model", help="torchvision classifier (default: the use case's)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, help="host batch (default: the use case's)")
    parser.add_argument("--strategy", default="intraop", help=f"one of {', '.join(IN_PROCESS)}")
    parser.add_argument("--workers", type=int, default=usable_cores())
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per visit")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", help="write the results as JSON here")
    return parser.parse_args(argv)


def visit(mode: str, strategy_name: str, options: StrategyOptions, model_name: str,
          x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int, lr: float,
          momentum: float) -> dict:
    """In a fresh process: warm-up, then per timed step its seconds, faults, kernel time."""
    os.environ["HYBRIDDL_MALLOC"] = mode  # read when the strategy is set up
    torch.manual_seed(0)
    model = timing_model(model_name, len(SYNTHETIC_CLASSES))
    seconds, faults, kernel = [], [], []
    with make_strategy(strategy_name, options) as strategy:
        strategy.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        for step in range(warmup + steps):
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            optimizer_step(strategy, optimizer, x, y)
            elapsed, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
            if step >= warmup:
                seconds.append(elapsed)
                faults.append(after.ru_minflt - before.ru_minflt)
                kernel.append(after.ru_stime - before.ru_stime)
    return {"mode": mode, "step_seconds": seconds, "seconds_per_step": statistics.median(seconds),
            "faults_per_step": statistics.median(faults),
            "kernel_seconds_per_step": statistics.median(kernel)}


def run(args) -> dict:
    if args.strategy not in IN_PROCESS:
        raise UsageError(f"--strategy {args.strategy}: choose from {', '.join(IN_PROCESS)} "
                         "(a worker process's page faults are not counted in its parent)")
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give at least 1")
    case = get_usecase(args.usecase)
    model_name, _, batch_size = use_case_workload(args.usecase, args.model, args.image_size,
                                                  args.batch_size)
    x, y = batch(model_name, batch_size, args.image_size, len(SYNTHETIC_CLASSES))
    options = StrategyOptions(workers=args.workers, channels_last=args.channels_last)
    described = make_strategy(args.strategy, options).describe()  # refuses an infeasible K first
    rounds = []
    for round_ in range(args.rounds):
        rounds.append({})
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                result = pool.submit(visit, mode, args.strategy, options, model_name, x, y,
                                     args.warmup, args.steps, case.lr, case.momentum).result()
            rounds[-1][mode] = result
            print(f"round {round_ + 1}: HYBRIDDL_MALLOC={mode} {result['seconds_per_step']:.3f} "
                  f"s/step, {result['faults_per_step']:.0f} faults/step", flush=True)
    summary = {mode: {key: statistics.median(r[mode][key] for r in rounds)
                      for key in ("seconds_per_step", "faults_per_step", "kernel_seconds_per_step")}
               for mode in MODES}
    ratios = [r["system"]["seconds_per_step"] / r["keep"]["seconds_per_step"] for r in rounds]
    summary["ratio_system_over_keep"] = {"median": statistics.median(ratios), "min": min(ratios),
                                         "max": max(ratios)}
    return {"usecase": args.usecase, "model": model_name, "image_size": args.image_size,
            "batch_size": batch_size, "strategy": described | {"workers": args.workers},
            "warmup": args.warmup, "steps": args.steps, "rounds": rounds, "summary": summary,
            "host": host_info() | library_versions()}


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console()
    try:
        result = run(args)
    except UsageError as exc:
        console.print(f"bench_memory_reuse: error: {exc}", markup=False)
        return 2
    for mode in MODES:
        s = result["summary"][mode]
        console.print(f"HYBRIDDL_MALLOC={mode}: {s['seconds_per_step']:.3f} s/step, "
                      f"{s['faults_per_step']:.0f} page faults/step, "
                      f"{s['kernel_seconds_per_step']:.3f} s kernel/step", markup=False)
    r = result["summary"]["ratio_system_over_keep"]
    console.print(f"system / keep: {r['median']:.3f}x (rounds {r['min']:.3f}-{r['max']:.3f})",
                  markup=False)
    if args.output:
        atomic_write_json(args.output, result)
        console.print(f"saved {args.output}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

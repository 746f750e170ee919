"""PowerSGD's own compute per step on one core: a CPU's row chunks against whole-matrix
products (hosts/powersgd.py; the batched products are what a GPU runs, and what a CPU ran
before the row chunks), side by side in interleaved rounds.

    python scripts/bench_powersgd.py                       # AlexNet and VGG16, rank 2
    python scripts/bench_powersgd.py --models alexnet --rounds 5

Each step is `aggregate` with an allreduce that returns its input (one host: the compute
alone, no wire), the approximations written into the gradients as hosts write them; the
steps alternate sending Q and P, as training does. Writes results/bench_powersgd.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench_common import REPO, results_header, spread
from pages import Page

VARIANTS = {"row chunks": True, "whole-matrix products": False}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16"])
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=str(REPO / "results" / "bench_powersgd.json"))
    args = parser.parse_args(argv)
    for name in ("rank", "rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: give at least 1")
    return args


def measure(model_name: str, args) -> list[dict]:
    import torch

    from hybriddl.hosts.powersgd import PowerSGD
    from hybriddl.usecases import build_model

    model = build_model(model_name, 3)
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(p.shape, generator=generator) for p in model.parameters()]
    del model
    compressions = {}
    for variant, chunks in VARIANTS.items():
        compression = PowerSGD(args.rank)
        compression.cpu_chunks = chunks
        compression.setup([g.shape for g in gradients])
        compressions[variant] = compression
    out = [g.clone() for g in gradients]
    for compression in compressions.values():  # warm-up: first touches of the buffers
        for _ in range(2):
            compression.aggregate(gradients, lambda wire: wire, out=out)
    seconds = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds):
        for variant, compression in compressions.items():
            for _ in range(args.steps):
                started = time.perf_counter()
                compression.aggregate(gradients, lambda wire: wire, out=out)
                seconds[variant].append(time.perf_counter() - started)
        print(f"{model_name} round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{v} {statistics.median(s[-args.steps:]) * 1e3:.1f} ms" for v, s in seconds.items()),
            flush=True)
    rows = []
    for variant, values in seconds.items():
        rows.append({"model": model_name, "variant": variant,
                     "seconds_per_step": statistics.median(values),
                     "spread": spread(values, 6), "steps_timed": len(values)})
    base = rows[1]["seconds_per_step"]
    for row in rows:
        row["vs_whole_matrix"] = row["seconds_per_step"] / base
    return rows


# ---------------------------------------------------------------- its page in docs/benchmarks

def bench_powersgd_table(data: dict) -> str:
    lines = ["| model | PowerSGD compute | ms/step (median) | spread | × whole-matrix products |",
             "|---|---|---:|---|---:|"]
    for r in data["rows"]:
        low, high = r["spread"]["min"] * 1e3, r["spread"]["max"] * 1e3
        lines.append(f"| {r['model']} | {r['variant']} | {r['seconds_per_step'] * 1e3:.1f} | "
                     f"{low:.1f}–{high:.1f} | {r['vs_whole_matrix']:.2f} |")
    return "\n".join(lines)


def bench_powersgd_setting(data: dict) -> str:
    return (f"PowerSGD rank {data['rank']} on {data['threads']} thread(s), "
            f"{data['rounds']} interleaved rounds of {data['steps']} steps per variant")


BENCH_POWERSGD_NOTES = """How to read it: one step of hybriddl's PowerSGD (hosts/powersgd.py) on a whole model's
gradients, alone (the allreduce returns its input): the wire is not in it. *row chunks* is
what a CPU runs (each matrix worked through in chunks that stay in cache, matrix-vector
products); *whole-matrix products* is the batched path a GPU runs, which a CPU ran before.
On emulated hosts this compute is part of every compressed step (scaling_fast pages)."""


PAGES = [
    Page("bench_powersgd", "PowerSGD's own compute on one core",
         "results/bench_powersgd.json", bench_powersgd_table, bench_powersgd_setting,
         BENCH_POWERSGD_NOTES),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = {**results_header("bench_powersgd.py", argv), "rank": args.rank,
              "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
              "rows": []}
    for model_name in args.models:
        result["rows"] += measure(model_name, args)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

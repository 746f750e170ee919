"""Local strategies against PyTorch's own options, side by side, in one invocation.

    python scripts/bench_local.py --usecase ComplexSmall --workers 2 \
        --rounds 3 --output bench-vgg16.json

Same model, batch and image size for every row: sequential (the baseline), intraop K,
threads K, processes K, layerwise K, and the peers: PyTorch DDP over gloo with K
processes, and plain PyTorch (its default threads) as it comes and tuned: glibc told to
keep freed memory (fp32-kept, as every hybriddl row does: machine/allocator.py) or
tcmalloc preloaded (fp32-tcmalloc, Debian's libtcmalloc-minimal4), each also with
channels_last (-cl), and with --compile-peer torch.compile too (fp32-kept-compile, its
compile inside the warm-up). "Tuned PyTorch" is the fastest of these plain rows. The
hybriddl rows run on the allocator hybriddl runs on here (`--allocator`, default auto: the
one measured fastest on this host, machine/allocator.py), as its console script would.
`--variants` adds the hybriddl rows again in other numerics (channels_last, bf16
autocast, gradient accumulation in 2 or 4 chunks: -acc2, -acc4); a bf16 variant also
adds plain PyTorch with autocast, the bf16 peer. Each row
runs in a fresh spawned process, so its peak memory is its own: peak RSS and PSS are
sampled after each step, peak HWM is the kernel's high-water mark (VmHWM), which also
sees the peak inside a step that glibc gave back before the sample.

This machine's steps vary by 15-20 %, and slowly (other tenants), so rows are
interleaved: R rounds of every row in turn (A B C A B C ...). A row's seconds/step is
the median of its rounds' medians (each over the timed steps after the warm-up); its
spread is the lowest and highest round median. speedup = t_sequential / t_row (the
paper's definition); vs_faster_peer = t_peer / t_row against the fastest float32 peer
(any plain PyTorch row, tuned or not, or DDP), each ratio taken within a round, median
over the rounds; hwm_vs_faster_peer = the row's peak HWM / that of the peer fastest over
the rounds.
"""

from __future__ import annotations

import argparse
import ctypes.util
import multiprocessing
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench_common import results_header
from pages import Page, provenance
from hybriddl.compare.local_peers import measure_ddp, measure_pytorch
from hybriddl.tuning.benchmark import StepTiming, measure_strategy, sample_batch
from hybriddl.data import SYNTHETIC_CLASSES, ImageSet, render_synthetic
from hybriddl.usecases import (USECASES, build_model, check_image_size, get_usecase,
                               use_case_workload)
from hybriddl.errors import UsageError
from hybriddl.hosts.mpi import library_versions
from hybriddl.machine import allocator
from hybriddl.machine.hostinfo import host_info, usable_cores
from hybriddl.files import atomic_write_json
from hybriddl.strategies import STRATEGIES, StrategyOptions, StrategySpec, cpu_strategies, make_strategy
from hybriddl.tuning.allocators import time_allocators

# The baseline, then every CPU strategy of the registry.
STRATEGY_ROWS = tuple(cpu_strategies())
VARIANTS = {"fp32": StrategyOptions(), "fp32-cl": StrategyOptions(channels_last=True),
            "bf16": StrategyOptions(precision="bf16"),
            "bf16-cl": StrategyOptions(precision="bf16", channels_last=True),
            # Gradient accumulation: the same step in 2 or 4 chunks (less activation memory).
            "fp32-cl-acc2": StrategyOptions(channels_last=True, accumulate=2),
            "fp32-cl-acc4": StrategyOptions(channels_last=True, accumulate=4)}
TCMALLOC = "tcmalloc_minimal"
# Plain PyTorch rows that are float32 peers: variant -> (keep freed memory, preload
# tcmalloc, channels_last, torch.compile).
PEER_VARIANTS = {"fp32": (False, False, False, False),
                 "fp32-kept": (True, False, False, False),
                 "fp32-kept-cl": (True, False, True, False),
                 "fp32-tcmalloc": (False, True, False, False),
                 "fp32-tcmalloc-cl": (False, True, True, False),
                 "fp32-kept-compile": (True, False, False, True)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="ComplexSmall", help=f"one of {', '.join(USECASES)}")
    parser.add_argument("--model", help="torchvision classifier (default: the use case's)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="pixels per side (default: 224)")
    parser.add_argument("--batch-size", type=int, help="host batch (default: the use case's)")
    parser.add_argument("--workers", type=int, default=usable_cores(),
                        help="K for intraop/threads/processes/layerwise/DDP (default: usable cores)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow K above the usable cores")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps per row and round (default: 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first, per row and round (default: 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times every row runs, interleaved (default: 1)")
    parser.add_argument("--variants", default="fp32",
                        help=f"numerics of the hybriddl rows, comma-separated, from "
                             f"{', '.join(VARIANTS)} (default: fp32); sequential is always fp32")
    parser.add_argument("--strategies", default=",".join(STRATEGY_ROWS[1:]),
                        help="hybriddl rows besides sequential (default: all)")
    parser.add_argument("--compile-peer", action="store_true",
                        help="add plain PyTorch with torch.compile to the peers (its compile "
                             "runs in the warm-up; slower than eager where measured here)")
    parser.add_argument("--allocator", choices=allocator.CHOICES,
                        help="the hybriddl rows' allocator (default: $HYBRIDDL_ALLOCATOR, else "
                             "auto: the one hybriddl measured fastest on this host)")
    parser.add_argument("--output", help="write the table as JSON here")
    return parser.parse_args(argv)


def tcmalloc_path() -> str | None:
    """Where tcmalloc is, for LD_PRELOAD (None when it is not installed)."""
    found = ctypes.util.find_library(TCMALLOC)
    if found is None:
        return None
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                   "/usr/lib"):
        if Path(folder, found).exists():
            return str(Path(folder, found))
    return found


def batch(model: str, batch_size: int, image_size: int, num_classes: int):
    """A batch of the embedded data, preprocessed as in training (rendered, not loaded:
    the benchmark needs batch_size images, not the data set)."""
    images = torch.stack([torch.from_numpy(render_synthetic(i % num_classes, i, 64))
                          for i in range(batch_size)])
    labels = torch.arange(batch_size) % num_classes
    return sample_batch(ImageSet(images, labels, list(SYNTHETIC_CLASSES)), batch_size, image_size)


def in_fresh_process(function, *args, env: dict | None = None, **kwargs) -> StepTiming:
    """Run `function` in a spawned process; `env` is added to its environment (the
    process is exec'd with it, so LD_PRELOAD takes effect)."""
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(function, *args, **kwargs).result()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class Row:
    """One line of the table: what runs, and how to start it in a fresh process."""

    name: str  # a strategy of STRATEGY_ROWS, or a peer: pytorch, ddp
    variant: str  # a key of VARIANTS
    function: object
    args: tuple
    kwargs: tuple = ()
    env: tuple = ()
    allocator: str = allocator.GLIBC  # what the row's process runs on

    @property
    def peer(self) -> bool:
        """A float32 peer: plain PyTorch (as it comes or tuned) or DDP."""
        return (self.name == "pytorch" and self.variant in PEER_VARIANTS) or self.name == "ddp"

    def measure(self, common: dict) -> StepTiming:
        return in_fresh_process(self.function, *self.args, env=dict(self.env), **common,
                                **dict(self.kwargs))


def plan_rows(args, model_name: str, num_classes: int, x, y,
              ours: str = allocator.GLIBC) -> list[Row]:
    """The rows of a round; the hybriddl rows run on allocator `ours`."""
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for variant in variants:
        if variant not in VARIANTS:
            raise UsageError(f"--variants {variant}: choose from {', '.join(VARIANTS)}")
    for name in strategies:
        if name not in STRATEGY_ROWS[1:]:
            raise UsageError(f"--strategies {name}: choose from {', '.join(STRATEGY_ROWS[1:])}")
    if "fp32" not in variants:
        raise UsageError("--variants must include fp32: every ratio is taken against the "
                         "float32 rows")
    base = StrategyOptions(workers=args.workers, oversubscribe=args.oversubscribe)
    preloaded = allocator.preload_environment(ours, {})
    on_ours = dict(env=(("LD_PRELOAD", preloaded.get("LD_PRELOAD", "")),
                        (allocator.PRELOADED_ENV, ours)), allocator=ours)
    rows = [Row("sequential", "fp32", measure_strategy,
                ("sequential", base, model_name, num_classes, x, y), **on_ours)]
    for variant in variants:
        numerics = VARIANTS[variant]
        options = StrategyOptions(workers=args.workers, oversubscribe=args.oversubscribe,
                                  precision=numerics.precision,
                                  channels_last=numerics.channels_last,
                                  accumulate=numerics.accumulate)
        for name in strategies:
            make_strategy(name, options)  # refuses an infeasible K before anything runs
            rows.append(Row(name, variant, measure_strategy,
                            (name, options, model_name, num_classes, x, y), **on_ours))
    default_threads = torch.get_num_threads()  # PyTorch's own choice, before anyone pins it
    tcmalloc = tcmalloc_path()
    for variant, (kept, preload, channels_last, compiled) in PEER_VARIANTS.items():
        if (preload and tcmalloc is None) or (compiled and not args.compile_peer):
            continue  # said in the result's notes
        kwargs = (("keep_memory", kept), ("compile", compiled),
                  ("numerics", StrategyOptions(channels_last=channels_last)))
        rows.append(Row("pytorch", variant, measure_pytorch,
                        (default_threads, model_name, num_classes, x, y), kwargs,
                        (("LD_PRELOAD", tcmalloc),) if preload else (),
                        "tcmalloc" if preload else allocator.GLIBC))
        if variant == "fp32":
            rows.append(Row("ddp", "fp32", measure_ddp,
                            (args.workers, model_name, num_classes, x, y)))
    for variant in variants:
        if VARIANTS[variant].precision == "bf16":
            rows.append(Row("pytorch", variant, measure_pytorch,
                            (default_threads, model_name, num_classes, x, y),
                            (("numerics", VARIANTS[variant]),)))
    return rows


def run(args, on_measured=lambda round_, row, timing: None, argv=None,
        on_measuring=lambda names, path: None) -> dict:
    case = get_usecase(args.usecase)
    model_name, _, batch_size = use_case_workload(args.usecase, args.model, args.image_size,
                                                  args.batch_size)
    num_classes = len(SYNTHETIC_CLASSES)
    for flag, value in (("--steps", args.steps), ("--batch-size", batch_size),
                        ("--rounds", args.rounds)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give at least 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: give 0 or more")
    check_image_size(build_model(model_name, num_classes), args.image_size, num_classes)
    x, y = batch(model_name, batch_size, args.image_size, num_classes)
    ours = allocator.settle(allocator.requested_allocator(args.allocator), time_allocators,
                            on_measuring=on_measuring)
    rows = plan_rows(args, model_name, num_classes, x, y, ours.name)
    common = dict(warmup=args.warmup, steps=args.steps, lr=case.lr, momentum=case.momentum)
    rounds: list[list[StepTiming]] = []
    for round_ in range(args.rounds):
        rounds.append([])
        for row in rows:
            timing = row.measure(common)
            rounds[-1].append(timing)
            on_measured(round_, row, timing)
    notes = list(ours.notes)
    if tcmalloc_path() is None:
        notes.append("the tcmalloc peers were left out: tcmalloc is not installed (Debian: "
                     "apt-get install libtcmalloc-minimal4)")
    summary = summarise(rows, rounds)
    plain = [r for r in summary if r["name"] == "pytorch" and r["variant"] in PEER_VARIANTS]
    peers = plain + [r for r in summary if r["name"] == "ddp"]
    return {**results_header("bench_local.py", argv), "usecase": args.usecase,
            "model": model_name, "image_size": args.image_size,
            "batch_size": batch_size, "workers": args.workers, "warmup": args.warmup,
            "steps": args.steps, "rounds": args.rounds, "host": host_info() | library_versions(),
            "hybriddl_allocator": {"name": ours.name, "how": ours.how},
            "tuned_pytorch": min(plain, key=lambda r: r["seconds_per_step"])["variant"],
            "fastest_peer": "{name} {variant}".format(
                **min(peers, key=lambda r: r["seconds_per_step"])),
            "notes": notes, "rows": summary}


def summarise(rows: list[Row], rounds: list[list[StepTiming]]) -> list[dict]:
    """Per row: median and spread of its round medians; ratios taken within each round."""
    def index(name, variant="fp32"):
        return next(i for i, row in enumerate(rows) if (row.name, row.variant) == (name, variant))

    sequential = index("sequential")
    peers = [i for i, row in enumerate(rows) if row.peer]
    summary = []
    for i, row in enumerate(rows):
        timings = [timings[i] for timings in rounds]
        seconds = [t.seconds_per_step for t in timings]
        median = statistics.median(seconds)
        # Within a round the rows ran minutes apart at most: the VM's slow drifts cancel.
        speedups = [r[sequential].seconds_per_step / r[i].seconds_per_step for r in rounds]
        vs_peer = [min(r[p].seconds_per_step for p in peers)
                   / r[i].seconds_per_step for r in rounds]
        # Memory against the peer that is fastest over the rounds (its largest peak).
        peer = min(peers, key=lambda p: statistics.median(
            r[p].seconds_per_step for r in rounds))
        peer_hwm = max(r[peer].peak_hwm_bytes for r in rounds)
        last = timings[-1]
        summary.append({
            "name": row.name, "variant": row.variant, "strategy": last.strategy,
            "allocator": row.allocator,
            "batch_size": last.batch_size, "seconds_per_step": median,
            "seconds_min": min(seconds), "seconds_max": max(seconds),
            "round_seconds": seconds, "images_per_second": last.batch_size / median,
            "speedup": statistics.median(speedups),
            "vs_faster_peer": statistics.median(vs_peer),
            "vs_faster_peer_min": min(vs_peer), "vs_faster_peer_max": max(vs_peer),
            "peak_rss_bytes": max(t.peak_rss_bytes for t in timings),
            "peak_pss_bytes": max(t.peak_pss_bytes for t in timings),
            "peak_hwm_bytes": max(t.peak_hwm_bytes for t in timings),
            "hwm_vs_faster_peer": max(t.peak_hwm_bytes for t in timings) / peer_hwm,
            "step_seconds": [t.step_seconds for t in timings]})
    return summary


def label(strategy: dict) -> str:
    """A strategy's own label; a peer's name and its settings."""
    if strategy["name"] in STRATEGIES:
        return StrategySpec.from_dict(strategy).label
    details = " ".join(f"{k}={v}" for k, v in strategy.items() if k != "name")
    return f"{strategy['name']} {details}".strip()


def table(result: dict) -> Table:
    title = (f"{result['model']}, {result['image_size']} px, batch {result['batch_size']}: "
             f"median of {result['rounds']} interleaved rounds (each the median of "
             f"{result['steps']} steps after {result['warmup']} warm-up); (min-max) over rounds")
    table = Table(title=title)
    for column in ("strategy", "numerics", "s/step (min-max)", "images/s", "speedup",
                   "vs faster peer", "peak RSS MiB", "peak PSS MiB", "peak HWM MiB",
                   "HWM vs peer"):
        table.add_column(column, justify="left" if column in ("strategy", "numerics") else "right",
                         no_wrap=True)
    for row in result["rows"]:
        mib = [f"{row[key] / 2**20:.0f}"
               for key in ("peak_rss_bytes", "peak_pss_bytes", "peak_hwm_bytes")]
        description = {k: v for k, v in row["strategy"].items()
                       if k not in ("precision", "channels_last", "accumulate")}
        table.add_row(label(description), row["variant"],
                      f"{row['seconds_per_step']:.3f} ({row['seconds_min']:.3f}-"
                      f"{row['seconds_max']:.3f})",
                      f"{row['images_per_second']:.1f}", f"{row['speedup']:.2f}x",
                      f"{row['vs_faster_peer']:.2f}x ({row['vs_faster_peer_min']:.2f}-"
                      f"{row['vs_faster_peer_max']:.2f})", *mib,
                      f"{row['hwm_vs_faster_peer']:.2f}x")
    return table


# ---------------------------------------------------------------- its page in docs/benchmarks

def bench_local_table(data: dict) -> str:
    lines = ["| row | numerics | s/step (median, spread) | images/s | speed-up vs sequential "
             "| vs fastest peer (median, spread) | peak HWM MiB | HWM vs that peer |",
             "|---|---|---|---:|---:|---|---:|---:|"]
    for r in data["rows"]:
        if r["name"] in ("pytorch", "ddp"):  # peers, not strategies: their own settings
            details = {k: v for k, v in r["strategy"].items()
                       if k not in ("name", "precision", "channels_last", "accumulate")}
            name = " ".join([r["strategy"]["name"], *(f"{k}={v}" for k, v in details.items())])
        else:
            name = StrategySpec.from_dict(r["strategy"]).label
        lines.append(f"| {name} | {r['variant']} | {r['seconds_per_step']:.3f} "
                     f"({r['seconds_min']:.3f}–{r['seconds_max']:.3f}) | "
                     f"{r['images_per_second']:.1f} | {r['speedup']:.2f} | "
                     f"{r['vs_faster_peer']:.2f} ({r['vs_faster_peer_min']:.2f}–"
                     f"{r['vs_faster_peer_max']:.2f}) | {r['peak_hwm_bytes'] / 2**20:,.0f} | "
                     f"{r['hwm_vs_faster_peer']:.2f} |")
    lines += ["", f"Tuned PyTorch (the fastest plain PyTorch row): `pytorch "
                  f"{data['tuned_pytorch']}`; the fastest peer: `{data['fastest_peer']}`."]
    if "hybriddl_allocator" in data:  # absent in results from before allocators were chosen
        ours = data["hybriddl_allocator"]
        lines += [f"The hybriddl rows ran on {ours['name']} ({ours['how']}: "
                  f"{ALLOCATOR_HOW.get(ours['how'], ours['how'])})."]
    lines += [f"Note: {note}" for note in data.get("notes", [])]
    return "\n".join(lines)


def bench_local_setting(data: dict) -> str:
    return (f"{data['model']}, {data['image_size']} px, batch {data['batch_size']}, "
            f"K = {data['workers']} workers, {data['warmup']} untimed and {data['steps']} timed "
            f"steps per row and round, {data['rounds']} interleaved round(s), one host")


ALLOCATOR_HOW = {"measured": "the allocator hybriddl measured fastest on this host",
                 "cached": "the allocator hybriddl had measured fastest on this host",
                 "asked": "named by --allocator", "inherited": "set by the parent process",
                 "fallback": "the one asked for is not installed"}


BENCH_LOCAL_NOTES = """How to read it: every row trains the same model on the same batch, each in a fresh
process, in interleaved rounds. The peers are PyTorch DDP and plain PyTorch as it comes and
tuned (`fp32-kept`: glibc keeps freed memory, as hybriddl does on glibc; `fp32-tcmalloc`:
tcmalloc preloaded; `-cl`: channels_last). The hybriddl rows run on the allocator hybriddl
chose for this host (see [tuning](../tuning.md#allocator)). *vs fastest peer* is the fastest float32 peer's
step over the row's, within each round. HWM is the kernel's peak resident memory (see
[methodology](../methodology.md))."""


def bench_local_headline(table: Page, data: dict) -> str | None:
    """The fastest hybriddl row against the fastest peer (tuned PyTorch or DDP)."""
    p = provenance(data)
    # float32 rows, in either memory format (as the peers are): no bf16, no accumulation.
    ours = [r for r in data["rows"] if r["name"] not in ("pytorch", "ddp")
            and r["variant"] in ("fp32", "fp32-cl")]
    if not ours:
        return None
    best = min(ours, key=lambda r: r["seconds_per_step"])
    on = " with channels_last" if best["variant"] == "fp32-cl" else ""
    on += f" on {best['allocator']}" if "allocator" in best else ""
    return (f"- **One host, {data['model']}, {data['image_size']} px, batch "
            f"{data['batch_size']}, {p['cores']} cores** — the fastest local strategy "
            f"({best['name']}{on}, {best['seconds_per_step']:.2f} s/step) runs at "
            f"{best['vs_faster_peer']:.2f}× the fastest peer (`{data['fastest_peer']}`; "
            f"tuned PyTorch: the fastest of plain PyTorch with kept memory or tcmalloc, with "
            f"and without channels_last, and DDP; {p['cpu_model']}, torch {p['torch']}; "
            f"[table](docs/benchmarks/{table.name}.md)).")


PAGES = [
    Page("bench_local-SimpleBig", "One host: local strategies against tuned PyTorch, AlexNet",
         "results/bench_local-SimpleBig.json", bench_local_table, bench_local_setting,
         BENCH_LOCAL_NOTES, headline=bench_local_headline),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 160))  # piped output: no truncation
    try:
        result = run(args, on_measured=lambda round_, row, timing: console.print(
            f"round {round_ + 1}: {row.name} {row.variant} {timing.seconds_per_step:.3f} s/step",
            highlight=False), argv=argv, on_measuring=lambda names, path: console.print(
            f"allocator auto: timing {', '.join(names)} once on this host; kept in {path}",
            highlight=False))
    except UsageError as exc:
        Console(stderr=True).print(f"bench_local: error: {exc}", markup=False, soft_wrap=True)
        return 2
    console.print(table(result))
    console.print(f"tuned PyTorch: pytorch {result['tuned_pytorch']}; fastest peer: "
                  f"{result['fastest_peer']}; the hybriddl rows ran on "
                  f"{result['hybriddl_allocator']['name']} "
                  f"({result['hybriddl_allocator']['how']})", highlight=False)
    for note in result["notes"]:
        console.print(f"note: {note}", highlight=False)
    if args.output:
        atomic_write_json(Path(args.output), result)
        console.print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

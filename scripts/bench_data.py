"""Streamed data at scale: peak RSS, images/s and data wait against the data set's size.

One invocation, everything serial (run it under the machine's CPU lock):

1. decode-on-the-fly against the cache at 224 px, per image, on one core: what each
   batch would cost the training host if JPEGs were decoded while it trains;
2. a generated ImageFolder of JPEG files and synthetic:N sets of each size, their
   one-time cache builds timed (seconds per 10,000 images);
3. `hybriddl train --usecase SimpleBig --image-size 64 --max-steps 50` on every size, in
   interleaved rounds (2k, 20k, 100k, 2k, ...): peak RSS of the training process (its
   ru_maxrss, from wait4), images/s and data wait % of the epoch; medians over rounds.

    python scripts/bench_data.py --output results/bench_data.json     # the README's figures
    python scripts/bench_data.py --sizes 300,600 --rounds 1 --max-steps 5 --jpegs 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from hybriddl.data import render_synthetic
from hybriddl.data.loading import load_data
from hybriddl.strategies import StrategyOptions
from hybriddl.tuning.benchmark import measure_strategy

REPO = Path(__file__).resolve().parents[1]


TARGETS = {"rss_growth_mib": 150, "images_per_second_spread_pct": 10, "data_wait_pct": 5}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2000,20000,100000", help="synthetic:N sizes")
    parser.add_argument("--jpegs", type=int, default=20000,
                        help="JPEG files in the generated ImageFolder")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--strategy", default="intraop", help="train's --strategy")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--scratch", default=None, help="where data and caches go "
                        "(default: a new folder under /tmp, removed at the end)")
    parser.add_argument("--output", default="bench_data.json")
    return parser.parse_args(argv)


def write_jpeg_folder(root: Path, n: int, size: tuple[int, int] = (160, 120)) -> None:
    """n JPEG files of `size` px (wider than tall: the centre crop has work to do)."""
    for index in range(n):
        label = index % 3
        folder = root / ["fire", "smoke", "clear"][label]
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(render_synthetic(label, index, 64).transpose(1, 2, 0))
        image.resize(size, Image.BILINEAR).save(folder / f"{index:06d}.jpg", quality=90)


def per_image_costs(folder: Path, cache_dir: Path, n: int = 256) -> dict:
    """Seconds per image at 224 px, one core: decode + scale from JPEG, against a read of
    the same decoded image from the cache (a random batch of 32, as training reads)."""
    torch.set_num_threads(1)
    files = sorted(folder.rglob("*.jpg"))[:n]
    scale = v2.Compose([v2.PILToTensor(), v2.Resize(224, antialias=True), v2.CenterCrop(224)])
    started = time.perf_counter()
    for file in files:
        with Image.open(file) as image:
            scale(image.convert("RGB"))
    decode = (time.perf_counter() - started) / len(files)
    split = load_data(str(folder), variant="big", image_size=224, cache_dir=str(cache_dir))
    index = torch.randperm(len(split.train), generator=torch.Generator().manual_seed(0))
    batches = [index[i:i + 32] for i in range(0, min(n, len(index)), 32)]
    split.train.images[batches[0]]  # first touch of the file, as at a run's start
    started = time.perf_counter()
    for batch in batches:
        split.train.images[batch]
    read = (time.perf_counter() - started) / sum(len(b) for b in batches)
    return {"decode_scale_seconds_per_image": decode, "cache_read_seconds_per_image": read,
            "decode_over_read": decode / read, "images_timed": len(files)}


def alexnet_step_seconds_224(workers: int) -> float:
    """One SimpleBig step (AlexNet, batch 32, 224 px) with intra-op threads, timed as the
    tuner times a strategy: the budget the decode would have to hide in."""
    x, y = torch.randn(32, 3, 224, 224), torch.randint(0, 3, (32,))
    options = StrategyOptions(workers=workers, oversubscribe=True)
    return measure_strategy("intraop", options, "alexnet", 3, x, y, steps=3).seconds_per_step


def timed_build(spec: str, cache_dir: Path, image_size: int = 64) -> dict:
    started = time.perf_counter()
    split = load_data(spec, variant="big", image_size=image_size, cache_dir=str(cache_dir))
    seconds = time.perf_counter() - started
    images = len(split.train) + len(split.val)
    return {"data": spec.split("/")[-1] if "/" in spec else spec, "images": images,
            "seconds": round(seconds, 2), "seconds_per_10000": round(seconds / images * 1e4, 2)}


def train_once(spec: str, cache_dir: Path, run_dir: Path, args) -> dict:
    command = [sys.executable, "-m", "hybriddl", "train", "--usecase", "SimpleBig",
               "--image-size", "64", "--max-steps", str(args.max_steps), "--data", spec,
               "--data-cache", str(cache_dir), "--strategy", args.strategy,
               "--workers", str(args.workers), "--monitor-interval", "0",
               "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "wb") as errors:  # a file, not a pipe: nothing can block the child
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"train on {spec} failed: {log.read_text()[-2000:]}")
    epoch = json.loads((run_dir / "metrics.json").read_text())["epochs"][0]
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "images_per_second": epoch["images_per_second"],
            "data_wait_pct": 100 * epoch["data_wait_seconds"] / epoch["seconds"],
            "steps": epoch["steps"], "wall_seconds": wall}


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="hybriddl-bench-data-"))
    cache_dir = scratch / "cache"
    try:
        folder = scratch / f"jpegs-{args.jpegs}"
        started = time.perf_counter()
        write_jpeg_folder(folder, args.jpegs)
        print(f"wrote {args.jpegs} JPEGs in {time.perf_counter() - started:.0f} s", flush=True)
        builds = [timed_build(str(folder), cache_dir)]
        builds += [timed_build(f"synthetic:{n}", cache_dir) for n in sizes]
        print(json.dumps(builds), flush=True)
        photos = scratch / "photos-500x375"  # the size of a typical ImageNet photo
        write_jpeg_folder(photos, 320, size=(500, 375))
        costs = per_image_costs(photos, cache_dir)
        step = alexnet_step_seconds_224(args.workers)
        costs.update(alexnet_step_seconds_224_batch32=step,
                     decode_share_of_a_step_one_core=32 * costs["decode_scale_seconds_per_image"] / step,
                     read_share_of_a_step=32 * costs["cache_read_seconds_per_image"] / step)
        print(json.dumps(costs), flush=True)
        runs = {n: [] for n in sizes}
        for round_ in range(args.rounds):
            for n in sizes:
                record = train_once(f"synthetic:{n}", cache_dir, scratch / f"run-{n}-{round_}", args)
                runs[n].append(record)
                print(n, json.dumps(record), flush=True)
        table = []
        for n in sizes:
            row = {"images": n}
            for key in ("peak_rss_mib", "images_per_second", "data_wait_pct"):
                values = [r[key] for r in runs[n]]
                row[key] = statistics.median(values)
                row[f"{key}_range"] = [min(values), max(values)]
            table.append(row)
        rates = [row["images_per_second"] for row in table]
        summary = {
            "rss_growth_mib": table[-1]["peak_rss_mib"] - table[0]["peak_rss_mib"],
            "images_per_second_spread_pct": 100 * (max(rates) - min(rates)) / max(rates),
            "data_wait_pct_max": max(row["data_wait_pct"] for row in table),
        }
        summary["met"] = {
            "rss_growth": summary["rss_growth_mib"] < TARGETS["rss_growth_mib"],
            "images_per_second": summary["images_per_second_spread_pct"] <= TARGETS["images_per_second_spread_pct"],
            "data_wait": summary["data_wait_pct_max"] <= TARGETS["data_wait_pct"]}
        result = {
            "command": " ".join(["python", "scripts/bench_data.py", *(argv or sys.argv[1:])]),
            "train_command": f"hybriddl train --usecase SimpleBig --image-size 64 --max-steps "
                             f"{args.max_steps} --data synthetic:N --strategy {args.strategy} "
                             f"--workers {args.workers} --monitor-interval 0",
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
            "rounds": args.rounds, "targets": TARGETS, "cache_builds": builds,
            "decode_vs_cache_224px": costs, "by_size": table, "summary": summary,
            "runs": {str(n): runs[n] for n in sizes}, "numpy": np.__version__,
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({"by_size": table, "summary": summary}, indent=1))
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

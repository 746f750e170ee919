"""What `hybriddl emulate --speedup S` dilates that a faster host may not speed up: the
CPU-side work of an exchange (copies, MPI's own work), bounded per step.

One run: `hybriddl emulate --hosts 2 --cores-per-host 1 --speedup S --bandwidth R --
hybriddl train --host-parallel data ...` (no overlap, so each step's averaging comes after
its compute and the trainer's traffic meter times it alone: `comm_seconds`). Per timed
step and host, the wire time is the bytes its NIC sent over the link's wall rate R/S; the
rest of the averaging (comm_seconds - wire) is time in MPI not spent sending at the link's
rate: MPI's and the kernel's CPU work, copies, and waits for the partner (so an upper
bound on the CPU-side work). The emulation counts it as overhead / S emulated seconds; on a
host whose CPU-side work is no faster than here it would take `overhead` itself, so an
emulated step understates such a host's step by at most overhead x (1 - 1/S). The host
that came to the averaging last waited least for its partner: its overhead (from each
rank's totals over the epoch) is the tighter bound, the headline.

`--bandwidth none` leaves the link unlimited: the averaging's time is then the CPU-side work
itself (copies, MPI's reduction and progress, the kernel's TCP on both ends, at this
machine's speed), with no wire time to subtract.

    flock /tmp/hybriddl-heavy.lock python scripts/speedup_overhead.py --speedup 20 \\
        --bandwidth 1gbit --output results/speedup_overhead-SimpleBig.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import emulated_cell, host_options, results_header
from hybriddl.emulation.hosts import bits_per_second
from hybriddl.files import atomic_write_json
from hybriddl.usecases import get_usecase

HOSTS = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--speedup", type=float, default=20.0)
    parser.add_argument("--bandwidth", default="1gbit",
                        help="the emulated link's rate, or 'none' (unlimited)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    case = get_usecase(args.usecase)
    unlimited = args.bandwidth == "none"
    wall_rate = float("inf") if unlimited else bits_per_second(args.bandwidth) / args.speedup
    with tempfile.TemporaryDirectory(prefix="hybriddl-overhead-") as scratch:
        run_dir = Path(scratch) / "run"
        train = ["hybriddl", "train", "--usecase", args.usecase, "--image-size",
                 str(args.image_size), "--batch-size", str(case.batch_size * HOSTS),
                 "--epochs", "1", "--max-steps", str(args.warmup + args.steps),
                 "--monitor-interval", "0", "--strategy", "intraop", "--workers", "1",
                 "--channels-last", "--host-parallel", "data", "--run-dir", str(run_dir)]
        ran, metrics = emulated_cell(
            host_options(HOSTS, bandwidth=None if unlimited else args.bandwidth,
                         speed=["--speedup", repr(args.speedup)]), train, run_dir)
        if metrics is None:
            sys.exit(f"the run failed ({ran.returncode}):\n{ran.output[-2000:]}")
        emulation = ran.report
    dilation = emulation["dilation"]
    per_step = metrics["epochs"][0]["per_step"]
    timed = slice(args.warmup, None)
    steps = []
    for seconds, comm, nic in zip(per_step["seconds"][timed], per_step["comm_seconds"][timed],
                                  per_step["nic_bytes_sent"][timed]):
        wire = nic * 8 / wall_rate
        overhead = comm - wire
        steps.append({"wall_seconds": seconds, "comm_seconds": comm, "nic_bytes_sent": nic,
                      "wire_seconds": wire, "overhead_seconds": overhead,
                      "emulated_step_seconds": seconds / dilation,
                      # What the step would gain if that work ran no faster than here.
                      "bound_emulated_seconds": max(0.0, overhead) * (1 - 1 / dilation)})
    median = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    # Each rank's totals over the epoch (warm-up included: every step averages the same).
    epoch = metrics["epochs"][0]
    count = len(per_step["seconds"])
    by_rank = []
    for rank, totals in enumerate(epoch["by_rank"]):
        wire = totals["nic_bytes_sent"] * 8 / wall_rate / count
        comm = totals["comm_seconds"] / count
        by_rank.append({"rank": rank, "comm_seconds_per_step": comm,
                        "wire_seconds_per_step": wire, "overhead_seconds_per_step": comm - wire})
    least = min(r["overhead_seconds_per_step"] for r in by_rank)
    bound = max(0.0, least) * (1 - 1 / dilation)
    result = {
        "what": __doc__.splitlines()[0],
        "usecase": args.usecase, "image_size": args.image_size, "hosts": HOSTS,
        "cores_per_host": 1, "host_parallel": "data", "bandwidth": args.bandwidth,
        "speedup": emulation["speedup"], "time_scale": emulation["time_scale"],
        "dilation": dilation,
        "wall_link_bits_per_second": None if unlimited else wall_rate,
        "warmup": args.warmup, "timed_steps": args.steps,
        **results_header("speedup_overhead.py", argv),
        "run_command": ran.shown(),
        "steps_rank0": steps, "median_rank0": median, "by_rank": by_rank,
        # The headline: the least-waiting host's overhead per step (wall), what the
        # emulation counts of it (emulated), and the bound on an emulated step.
        "overhead_wall_seconds_per_step": least,
        "overhead_counted_emulated_seconds": least / dilation,
        "bound_emulated_seconds": bound,
        "emulated_step_seconds": median["emulated_step_seconds"],
        "bound_fraction_of_emulated_step": bound / median["emulated_step_seconds"],
    }
    atomic_write_json(Path(args.output), result)
    print(json.dumps({k: result[k] for k in (
        "speedup", "dilation", "overhead_wall_seconds_per_step", "bound_emulated_seconds",
        "emulated_step_seconds", "bound_fraction_of_emulated_step", "by_rank",
        "median_rank0")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

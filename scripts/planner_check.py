"""The planner's predicted step against the step measured, on 2 emulated hosts side by side.

For each speedup S (and each scheme asked), one run: `hybriddl emulate --hosts 2
--cores-per-host 1 --bandwidth R --speedup S -- hybriddl train --model alexnet ...
--host-parallel H --compression C`. The prediction is the one the run printed and kept
(metrics.json `config.plan`: the chosen row's `step_seconds`), the measurement the median
of the steps after the warm-up (per_step seconds / the emulation's dilation, so emulated
seconds as the prediction's). `error_percent` = (predicted - measured) / measured; the
issue's target is within +-15 %. Per step it also keeps the trainer's split of the step
(communication after backward, and the rest, in which the hybrid's feature exchanges run)
and the NIC bytes, so a miss can be read.

    python scripts/planner_check.py --speedup 1 20 200 \\
        --output results/planner_check-SimpleBig.json

Each scheme is a separate run, the speedups in the order given (runs of minutes each at
S = 200: the link is then 5 Mbit/s of wall time).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import emulated_cell, host_options, results_header
from pages import Page
from hybriddl.files import atomic_write_json

HOSTS = 2
# (host parallel, compression): the exact hybrid, and what --compression auto settles on.
SCHEMES = {"hybrid": ("hybrid", "none"), "auto": ("auto", "auto")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speedup", type=float, nargs="+", default=[1.0, 20.0, 200.0])
    parser.add_argument("--schemes", nargs="+", choices=tuple(SCHEMES), default=list(SCHEMES))
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if any(s < 1 for s in args.speedup) or args.steps < 1 or args.warmup < 0:
        parser.error("--speedup is at least 1, --steps at least 1, --warmup at least 0")
    return args


def run(speedup: float, scheme: str, args: argparse.Namespace, scratch: Path) -> dict:
    host_parallel, compression = SCHEMES[scheme]
    run_dir = scratch / f"{scheme}-S{speedup:g}"
    train = ["hybriddl", "train", "--model", "alexnet", "--image-size", "224",
             "--batch-size", "32", "--epochs", "1",
             "--max-steps", str(args.warmup + args.steps), "--strategy", "sequential",
             "--host-parallel", host_parallel, "--compression", compression,
             "--monitor-interval", "0", "--measure-only", "--run-dir", str(run_dir)]
    print(f"planner_check: S = {speedup:g}, {scheme}", flush=True)
    ran, metrics = emulated_cell(host_options(HOSTS, bandwidth=args.bandwidth,
                                              speed=["--speedup", f"{speedup:g}"]), train, run_dir)
    if metrics is None:
        sys.exit(f"planner_check: the run failed ({ran.returncode}): "
                 f"{ran.shown()}\n{ran.output[-2000:]}")
    command = ran.command
    dilation = ran.dilation
    plan = metrics["config"]["plan"]
    chosen = next(row for row in plan["rows"] if row["scheme"] == plan["chosen"]["scheme"])
    per_step = metrics["epochs"][0]["per_step"]
    timed = slice(args.warmup, None)
    steps = [s / dilation for s in per_step["seconds"][timed]]
    measured = statistics.median(steps)
    predicted = chosen["step_seconds"]
    return {"speedup": speedup, "dilation": dilation, "asked": scheme,
            "command": shlex.join(command), "chosen": chosen["scheme"],
            "exact": chosen["exact"], "predicted_step_seconds": predicted,
            "predicted": {key: chosen[key] for key in (
                "compute_seconds", "wire_seconds", "latency_seconds", "compression_seconds",
                "overlap_seconds", "nic_bytes_per_step")},
            "link_bytes_per_second": plan["inputs"]["link_bytes_per_second"],
            "latency_seconds": plan["inputs"]["latency_seconds"],
            "measured_step_seconds": measured, "measured_steps_seconds": steps,
            "error_percent": 100 * (predicted - measured) / measured,
            "wall_comm_seconds_per_step": per_step["comm_seconds"][timed],
            "wall_compute_seconds_per_step": per_step["compute_seconds"][timed],
            "nic_bytes_per_step": per_step["nic_bytes_sent"][timed],
            "plan_reason": plan["reason"]}


# ---------------------------------------------------------------- its page in docs/benchmarks

def planner_check_table(data: dict) -> str:
    lines = ["| S | asked | chosen | exact | predicted s | measured s (median) | steps | error |",
             "|---:|---|---|---|---:|---:|---|---:|"]
    for r in data["runs"]:
        steps = ", ".join(f"{s:.4f}" for s in r["measured_steps_seconds"])
        lines.append(f"| {r['speedup']:g} | {r['asked']} | {r['chosen']} | "
                     f"{'yes' if r['exact'] else 'no'} | {r['predicted_step_seconds']:.4f} | "
                     f"{r['measured_step_seconds']:.4f} | {steps} | "
                     f"{r['error_percent']:+.1f} % |")
    for earlier in data.get("earlier_runs", []):
        errors = "; ".join(f"S = {r['speedup']:g} {r['asked']} {r['error_percent']:+.1f} %"
                           for r in earlier["runs"])
        lines += ["", f"An earlier run (commit `{earlier['commit'][:7]}`, {earlier['note']}): "
                      f"{errors}."]
    return "\n".join(lines)


def planner_check_setting(data: dict) -> str:
    return (f"AlexNet 224 px, global batch 32, 2 emulated hosts x 1 core side by side (D = 1), "
            f"{data['bandwidth']} links at speedup S, {data['warmup']} warm-up and "
            f"{data['timed_steps']} timed steps per run")


PLANNER_CHECK_NOTES = """How to read it: each row is one run; *predicted* is the step the run's
plan printed for the scheme it chose (metrics.json `config.plan`), *measured* the median of
its timed steps in emulated seconds (wall / S). The issue's target: within ±15 %. S stands
for hosts S times faster than one core here (the link at rate/S of wall time). The
split's feature exchanges run inside forward and backward; per step the results file keeps
the trainer's split of the wall step into communication after backward and the rest."""


PAGES = [
    Page("planner_check-SimpleBig", "The planner's predicted step against the measured one",
         "results/planner_check-SimpleBig.json", planner_check_table, planner_check_setting,
         PLANNER_CHECK_NOTES),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="hybriddl-planner-check-") as scratch:
        for speedup in args.speedup:
            for scheme in args.schemes:
                runs.append(run(speedup, scheme, args, Path(scratch)))
                row = runs[-1]
                print(f"planner_check: S = {speedup:g}, {scheme} -> {row['chosen']}: predicted "
                      f"{row['predicted_step_seconds']:.4f} s, measured "
                      f"{row['measured_step_seconds']:.4f} s ({row['error_percent']:+.1f} %)",
                      flush=True)
    result = {"what": ("the planner's predicted step against the measured one (AlexNet 224 px, "
                       f"global batch 32, {HOSTS} emulated hosts x 1 core side by side, "
                       f"{args.bandwidth}): the chosen scheme's predicted step_seconds "
                       "(metrics.json config.plan) against the median emulated step after "
                       f"{args.warmup} warm-up steps (per_step seconds / dilation)"),
              "bandwidth": args.bandwidth, "warmup": args.warmup, "timed_steps": args.steps,
              **results_header("planner_check.py", argv), "runs": runs}
    atomic_write_json(Path(args.output), result)
    print(f"planner_check: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

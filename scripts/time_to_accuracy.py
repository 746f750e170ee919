"""Time to accuracy of the main job on 1, 2 and 4 emulated hosts: the same training, so
nearly the same loss and validation accuracy per epoch, reached in less emulated time with
more hosts.

Each host count is one `hybriddl emulate --hosts H --cores-per-host C --bandwidth R --
hybriddl train --usecase ComplexSmall ...` run with the same global batch (the use case's),
so every host count takes the same optimizer steps (`--host-parallel` hybrid and data are
both exact to float rounding: each host count sums in another order, and over the epochs
the difference grows; the train loss per epoch is recorded beside the accuracy to show it).
Time is the trainer's own (metrics.json's epoch spans: the epoch's steps, without its
evaluation, which every host runs whole) divided by the emulation's time scale D (emulated
time), epoch by epoch; beside it, the whole command's emulated seconds (start-up and
evaluations included) from the emulation's report.

    python scripts/time_to_accuracy.py --hosts 1 2 4 --epochs 3 \\
        --output results/time_to_accuracy-ComplexSmall-1gbit.json

Exact against compressed (`--compression none powersgd:2 ...`: each scheme is a run of its
own at every host count, on the same data, seed and steps), on a real image set and at an
emulated host speed (`--host-step 10ms`: each host stands for one whose step takes 10 ms,
`hybriddl emulate --host-step`), so that the accuracy each scheme reaches at equal epochs
stands beside the emulated time it took:

    python scripts/digits_imagefolder.py /tmp/digits
    python scripts/time_to_accuracy.py --usecase SimpleBig --data /tmp/digits \\
        --image-size 64 --lr 0.01 --hosts 2 --cores-per-host 1 --runs hybrid/none \\
        hybrid/powersgd:2 data/powersgd:2 --host-step 10ms --epochs 5 \\
        --output results/time_to_accuracy-digits-SimpleBig-1gbit.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import results_header
from hybriddl.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]


# The main job's profiled pick at 224 px on a 2-core host (profiles/); pinned so that no
# host count tunes a profile of its own first (that would be time outside the training).
LOCAL = ["--strategy", "intraop", "--workers", "2", "--channels-last"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="ComplexSmall")
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cores-per-host", type=int, default=2)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--host-parallel", nargs="+", default=["auto"],
                        choices=["auto", "hybrid", "data"],
                        help="schemes across hosts; each with each --compression is a run "
                             "(default: auto)")
    parser.add_argument("--compression", nargs="+", default=["none"],
                        help="schemes to train with, each a run of its own (train's "
                             "--compression values; default: none, exact)")
    parser.add_argument("--runs", nargs="+", metavar="SCHEME/COMPRESSION",
                        help="the runs themselves, e.g. hybrid/none data/powersgd:2, in "
                             "place of every --host-parallel with every --compression (an "
                             "exact data run on a slow link can take hours at a speedup)")
    parser.add_argument("--data", default="synthetic",
                        help="train's --data (default: the embedded set)")
    parser.add_argument("--image-size", type=int, help="train's --image-size")
    parser.add_argument("--model", help="train's --model (default: the use case's)")
    parser.add_argument("--lr", type=float, help="train's --lr")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--speedup", type=float, help="emulate's --speedup S")
    speed.add_argument("--host-step", help="emulate's --host-step (e.g. 10ms): S from a "
                                           "step measured here for --usecase")
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


def run_hosts(args, hosts: int, scratch: Path, compression: str = "none",
              host_parallel: str = "auto") -> dict:
    name = f"h{hosts}-{host_parallel}-{compression.replace(':', '')}"
    run_dir = scratch / name
    report = scratch / f"{name}.report.json"
    sizes = ["--image-size", str(args.image_size)] if args.image_size else []
    sizes += ["--model", args.model] if args.model else []
    local = [*LOCAL[:2], "--workers", str(args.cores_per_host), *LOCAL[4:]]
    train = ["train", "--usecase", args.usecase, "--epochs", str(args.epochs),
             "--data", args.data, *sizes, *(["--lr", str(args.lr)] if args.lr else []),
             "--monitor-interval", "0", "--run-dir", str(run_dir), *local, "--overlap",
             "--host-parallel", host_parallel, "--compression", compression]
    speed = (["--speedup", str(args.speedup)] if args.speedup else
             ["--host-step", args.host_step, "--usecase", args.usecase, *sizes,
              "--channels-last"] if args.host_step else [])
    command = [sys.executable, "-m", "hybriddl", "emulate", "--hosts", str(hosts),
               "--cores-per-host", str(args.cores_per_host), "--bandwidth", args.bandwidth,
               *speed, "--report", str(report), "--", "hybriddl", *train]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return {"hosts": hosts, "failed": done.returncode, "output_tail": lines[-8:]}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    emulation = json.loads(report.read_text())
    # Emulated seconds are wall seconds over the dilation: the time scale D of hosts that
    # take turns times the speedup S of hosts standing for faster ones.
    scale = emulation.get("dilation", emulation.get("time_scale", 1.0))
    epochs, elapsed = [], 0.0
    for epoch in metrics["epochs"]:
        # The epoch's span (its steps), in emulated seconds.
        span = epoch["ended_at"] - epoch["started_at"]
        elapsed += span / scale
        epochs.append({"epoch": epoch["epoch"], "val_accuracy": epoch["val_accuracy"],
                       "train_loss": epoch["train_loss"],
                       "emulated_seconds": round(span / scale, 2),
                       "emulated_seconds_total": round(elapsed, 2)})
    return {"hosts": hosts, "time_scale": emulation.get("time_scale", 1.0),
            "speedup": emulation.get("speedup", 1.0), "dilation": scale,
            "host_step_seconds": (emulation.get("host_step") or {}).get("asked_seconds"),
            "compression": compression,
            "host_parallel": metrics["config"]["host_parallel"]["scheme"],
            "global_batch": metrics["config"]["global_batch"],
            "strategy": metrics["config"]["strategy"], "epochs": epochs,
            "command_emulated_seconds": emulation.get("emulated_seconds"),
            "wall_seconds": round(time.time() - started, 1),
            "command": shlex.join(["hybriddl", *command[3:]])}


def planned_runs(args) -> list[tuple[str, str]]:
    """(--host-parallel, --compression) of each run, in the order they run."""
    if not args.runs:
        return list(itertools.product(args.host_parallel, args.compression))
    runs = [tuple(run.split("/", 1)) for run in args.runs]
    bad = [run for run, pair in zip(args.runs, runs) if len(pair) != 2
           or pair[0] not in ("auto", "hybrid", "data")]
    if bad:
        raise SystemExit(f"time_to_accuracy: --runs {bad[0]}: give SCHEME/COMPRESSION, "
                         "e.g. hybrid/none or data/powersgd:2")
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {
        "what": " ".join(__doc__.split("\n\n")[0 if planned_runs(args) == [("auto", "none")]
                                              else 3].split()), "usecase": args.usecase,
        "cores_per_host": args.cores_per_host, "bandwidth": args.bandwidth,
        "model": args.model, "data": args.data, "compression": args.compression,
        "runs_planned": ["/".join(run) for run in planned_runs(args)],
        **results_header("time_to_accuracy.py", argv),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="hybriddl-tta-") as scratch:
        for hosts in args.hosts:
            for host_parallel, compression in planned_runs(args):
                run = run_hosts(args, hosts, Path(scratch), compression, host_parallel)
                result["runs"].append(run)
                print(json.dumps({k: run.get(k) for k in (
                    "hosts", "compression", "host_parallel", "failed", "wall_seconds")}),
                    flush=True)
            result["summary"] = summarise(result["runs"])
            atomic_write_json(Path(args.output), result)
    return 0


def summarise(runs: list[dict]) -> list[dict]:
    """Per host count and scheme: each epoch's accuracy and emulated time, the speed-up of
    the whole training against one host (same scheme), and the accuracy against the exact
    run at the same host count (points: 100 x the difference, per epoch; hybrid and data
    are both exact, so either is the reference)."""
    done = [r for r in runs if "failed" not in r]
    rows = []
    for run in done:
        scheme = run.get("compression", "none")
        one = next((r for r in done if r["hosts"] == 1 and r["host_parallel"] ==
                    run["host_parallel"] and r.get("compression", "none") == scheme), None)
        exact = next((r for r in done if r["hosts"] == run["hosts"]
                      and r.get("compression", "none") == "none"), None)
        total = run["epochs"][-1]["emulated_seconds_total"]
        accuracy = [e["val_accuracy"] for e in run["epochs"]]
        rows.append({
            "hosts": run["hosts"], "host_parallel": run["host_parallel"],
            "compression": scheme,
            "points_vs_exact": ([round(100 * (a - e["val_accuracy"]), 2)
                                 for a, e in zip(accuracy, exact["epochs"])]
                                if exact else None),
            "speedup_vs_exact": (exact["epochs"][-1]["emulated_seconds_total"] / total)
            if exact else None,
            "val_accuracy": [e["val_accuracy"] for e in run["epochs"]],
            "emulated_seconds_total": total,
            "speedup": (one["epochs"][-1]["emulated_seconds_total"] / total) if one else None,
            "same_accuracy_as_one_host": ([e["val_accuracy"] for e in run["epochs"]] ==
                                          [e["val_accuracy"] for e in one["epochs"]])
            if one else None,
        })
    return rows


if __name__ == "__main__":
    sys.exit(main())

"""One host's training step under one MPI rank (`hybriddl emulate --hosts 1`, every
benchmark's one-host reference), at an earlier commit and at this checkout, in interleaved
rounds: what such a reference paid before e28cbb0, when one rank copied its whole gradient
through fusion buckets and a one-rank allreduce although it had nothing to average.

Each round trains the same seed for --steps steps at each commit (the earlier one from a
temporary git worktree, put first on PYTHONPATH) and reads metrics.json's first epoch; the
two models must be equal bit for bit (the change moves no number).

    python scripts/bench_one_rank.py --before e28cbb0~1 --usecase SimpleBig --data /tmp/mnist \\
        --image-size 64 --steps 40 --rounds 3 --output results/one_rank-SimpleBig-64px.json
"""

from __future__ import annotations

import argparse
import filecmp
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import REPO, emulated_cell, host_options, results_header, spread
from pages import Page
from hybriddl.files import atomic_write_json
from hybriddl.usecases import get_usecase


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit (e.g. e28cbb0~1)")
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--cores", type=int, default=1, help="the host's cores")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


def train(args, tree: Path, run_dir: Path) -> dict:
    """One run of --steps steps with the code of `tree`; its first epoch's figures."""
    usecase = get_usecase(args.usecase)
    # -P: the rank's working directory (this checkout) is not put before PYTHONPATH.
    command = ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", "hybriddl", "train",
               "--usecase", args.usecase, "--data", args.data, "--image-size",
               str(args.image_size), "--batch-size", str(usecase.batch_size), "--seed", "1",
               "--epochs", "1", "--max-steps", str(args.steps), "--strategy", "intraop",
               "--channels-last", "--workers", str(args.cores), "--overlap",
               "--compression", "none", "--monitor-interval", "0", "--run-dir", str(run_dir)]
    ran, metrics = emulated_cell(host_options(1, args.cores, bandwidth="1gbit"), command,
                                 run_dir, timeout=3600)
    if metrics is None:
        raise SystemExit(f"bench_one_rank: the run at {tree} failed: "
                         + " / ".join(ran.tail(3)))
    epoch = metrics["epochs"][0]
    return {key: epoch[key] for key in ("steps", "seconds", "compute_seconds", "comm_seconds",
                                        "mpi_bytes_sent")}


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {**results_header("bench_one_rank.py", argv), "before": subprocess.run(
        ["git", "rev-parse", args.before], capture_output=True, text=True, cwd=REPO,
        check=True).stdout.strip(), "usecase": args.usecase, "data": args.data,
        "image_size": args.image_size, "cores": args.cores, "steps": args.steps, "runs": []}
    with tempfile.TemporaryDirectory(prefix="hybriddl-one-rank-") as scratch:
        earlier = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(earlier), result["before"]],
                       cwd=REPO, check=True, capture_output=True)
        try:
            imported = subprocess.run(
                [sys.executable, "-P", "-c", "import hybriddl; print(hybriddl.__file__)"],
                capture_output=True, text=True, cwd=REPO, check=True,
                env={**os.environ, "PYTHONPATH": str(earlier)}).stdout.strip()
            if not imported.startswith(str(earlier)):
                raise SystemExit(f"bench_one_rank: the earlier commit's code is not what "
                                 f"runs ({imported})")
            for index in range(args.rounds):
                runs = {name: train(args, tree, Path(scratch) / f"{name}-{index}")
                        for name, tree in (("before", earlier), ("after", REPO))}
                runs["same_model"] = filecmp.cmp(Path(scratch) / f"before-{index}" / "model.pt",
                                                 Path(scratch) / f"after-{index}" / "model.pt",
                                                 shallow=False)
                result["runs"].append(runs)
                print(runs, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(earlier)], cwd=REPO,
                           capture_output=True)
    seconds = {name: [r[name]["seconds"] for r in result["runs"]] for name in ("before",
                                                                                 "after")}
    result["seconds"] = {name: spread(values, 2) for name, values in seconds.items()}
    result["before_over_after"] = spread([b / a for b, a in zip(seconds["before"],
                                                                 seconds["after"])], 3)
    result["same_model"] = all(r["same_model"] for r in result["runs"])
    result["median_ratio"] = round(statistics.median(seconds["before"])
                                   / statistics.median(seconds["after"]), 3)
    atomic_write_json(Path(args.output), result)
    return 0


# ------------------------------------------------------------------ its page

def one_rank_table(data: dict) -> str:
    lines = ["| round | before: seconds (compute, exchange) | after | before / after | "
             "same model |", "|---:|---|---|---:|---|"]
    for index, run in enumerate(data["runs"], 1):
        before, after = run["before"], run["after"]
        lines.append(f"| {index} | {before['seconds']:.2f} ({before['compute_seconds']:.2f}, "
                     f"{before['comm_seconds']:.2f}) | {after['seconds']:.2f} "
                     f"({after['compute_seconds']:.2f}, {after['comm_seconds']:.2f}) | "
                     f"{before['seconds'] / after['seconds']:.2f} | "
                     f"{'yes' if run['same_model'] else '**no**'} |")
    return "\n".join(lines)


def one_rank_setting(data: dict) -> str:
    return (f"{data['usecase']} at {data['image_size']} px on `{data['data']}`, one emulated "
            f"host of {data['cores']} core(s), {data['steps']} steps a run, the commit before "
            f"(`{data['before'][:7]}`) and after, in {len(data['runs'])} interleaved rounds; "
            f"median before / after: **{data['median_ratio']:.2f}**")


def slowed_by() -> str:
    """Each measured setting's factor, linked to its page, for the README."""
    import json

    found = [(path.stem, json.loads(path.read_text())) for path in
             sorted((REPO / "results").glob("one_rank-*.json"))]
    return "; ".join(f"[{d['usecase']} {d['image_size']} px on {d['cores']} core(s): "
                     f"{d['median_ratio']:.2f}x](docs/benchmarks/{name}.md)"
                     for name, d in found) or "not measured"


PAGES = [Page("one_rank-*", "One host under one MPI rank, before and after it stopped "
              "averaging", "results/one_rank-*.json", one_rank_table, one_rank_setting,
              "Seconds are the run's first epoch (its --steps steps) as metrics.json records "
              "them: compute, and the exchange that one rank had nothing to exchange in.",
              none_yet="scripts/bench_one_rank.py writes them")]


if __name__ == "__main__":
    sys.exit(main())

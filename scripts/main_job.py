"""What the README's main job gives a new user: accuracy per epoch, minutes, this machine.

The main job is the README's first command after the install (Set up, block 1):

    hybriddl train --usecase ComplexSmall --image-size 64 --epochs 5

run as a new user runs it: from an empty folder (no `profiles/`, so `--strategy auto` tunes
this host first, `--tune-budget` 120 s by default; no `runs/`), with nothing but the
command's own flags. The wall seconds are the whole command's (interpreter start, tuning,
training, evaluations); the epochs' figures are metrics.json's. scripts/write_docs.py writes
the README's line about the main job from the JSON, and tests/test_docs.py checks that the
command it records is the README's.

    python scripts/main_job.py --output results/main_job.json
"""

from __future__ import annotations

import argparse
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

MAIN_JOB = ["train", "--usecase", "ComplexSmall", "--image-size", "64", "--epochs", "5"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


def run_main_job(folder: Path) -> dict:
    """The command in `folder` as its working directory; returns what it gave."""
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDDL_PROFILES"}  # ./profiles
    env["PYTHONPATH"] = str(REPO)  # this checkout, installed or not
    # A new user's cache is empty too: the allocator is timed on this host and the data
    # decoded on this first run (both kept for later runs), so the wall time includes them.
    env["XDG_CACHE_HOME"] = str(folder / "cache")
    env.pop("HYBRIDDL_ALLOCATOR", None)
    env.pop("HYBRIDDL_ALLOCATOR_PRELOADED", None)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hybriddl", *MAIN_JOB], cwd=folder, env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the main job failed (exit {done.returncode}):\n"
                         + (done.stdout + done.stderr)[-3000:])
    metrics = json.loads(next((folder / "runs").glob("*/metrics.json")).read_text())
    epochs = metrics["epochs"]
    choice = metrics["config"].get("strategy_choice") or {}
    profiles = [json.loads(p.read_text()) for p in (folder / "profiles").glob("*.json")]
    return {
        "main_job": shlex.join(["hybriddl", *MAIN_JOB]),
        "wall_seconds": round(wall, 1),
        "epochs": len(epochs),
        "val_accuracy": [round(e["val_accuracy"], 4) for e in epochs],
        "train_loss": [round(e["train_loss"], 5) for e in epochs],
        "epoch_seconds": [round(e["seconds"], 1) for e in epochs],
        "strategy": metrics["config"]["strategy"],
        "strategy_choice": choice.get("message"),
        "tuned": bool(profiles),
        "allocator_timed": "allocator auto: timing" in done.stdout + done.stderr,
        "tune_budget_seconds": profiles[0]["measurement"].get("budget_seconds") if profiles
        else None,
        "rows": [{"epoch": e["epoch"], "val_accuracy": round(e["val_accuracy"], 4),
                  "train_loss": round(e["train_loss"], 5), "seconds": round(e["seconds"], 1)}
                 for e in epochs],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybriddl-main-job-") as folder:
        figures = run_main_job(Path(folder))
    result = {"what": __doc__.splitlines()[0], **results_header("main_job.py", argv),
              **figures}
    atomic_write_json(Path(args.output), result)
    print(json.dumps({k: result[k] for k in ("val_accuracy", "wall_seconds", "cpu_model",
                                              "cores")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

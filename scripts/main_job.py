"""What the README's main job gives a new user: accuracy per epoch, minutes, this machine.

The main job is the README's first command after the install (Set up, block 1):

    hybriddl train --usecase ComplexSmall --image-size 64 --epochs 5

run as a new user runs it: from an empty folder (no `profiles/`, so `--strategy auto` tunes
this host first, `--tune-budget` 120 s by default; no `runs/`), with nothing but the
command's own flags. The wall seconds are the whole command's (interpreter start, tuning,
training, evaluations); the epochs' figures are metrics.json's. Its page (`PAGES`) and the
README's line about the main job (`main_job_line`) are written from the JSON by
scripts/write_docs.py, and tests/test_docs.py checks that the command it records is the
README's.

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

from bench_common import REPO, results_header
from pages import Page, provenance
from hybriddl.files import atomic_write_json


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


# ---------------------------------------------------------------- its page in docs/benchmarks

def main_job_table(data: dict) -> str:
    lines = ["| epoch | validation accuracy | train loss | seconds (the epoch's steps) |",
             "|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['epoch']} | {r['val_accuracy']:.3f} | {r['train_loss']:.5f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"The whole command: {_minutes(data['wall_seconds'])} wall time "
                  f"(start, tuning, the epochs and their evaluations). `--strategy auto` "
                  f"said: {(data.get('strategy_choice') or '').removeprefix('strategy auto: ')}."]
    return "\n".join(lines)


def main_job_setting(data: dict) -> str:
    tuning = (f"tuning this host's local strategies first (budget "
              f"{data['tune_budget_seconds']:g} s)" if data.get("tuned") else "a profile found")
    return (f"`{data['main_job']}` from an empty folder, as a new user runs it, on one host "
            f"of {data['cores']} cores: {tuning}, then {data['epochs']} epochs")


MAIN_JOB_NOTES = """How to read it: the README's first command after the install, measured by
`scripts/main_job.py` in a new folder (no profile, so `--strategy auto` tunes first; the
embedded 3-class data). The README's line about the main job is written from this JSON."""


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"


def main_job_line(data: dict) -> str:
    """What the main job gives: accuracy per epoch, minutes, cores and hardware."""
    p = provenance(data)
    accuracy = ", ".join(f"{a:.3f}" for a in data["val_accuracy"])
    tuning = (f", the first {data['tune_budget_seconds']:g} s at most tuning this host's "
              f"local strategies" if data.get("tuned") else "")
    if data.get("allocator_timed"):
        tuning += ", and about a minute before that timing its allocators"
    if tuning:
        tuning += " (later runs reuse both)" if data.get("allocator_timed") else \
            " (later runs reuse the profile)"
    return (f"Block 1's training (`{data['main_job']}`) reaches validation accuracy {accuracy} "
            f"after epochs 1 to {data['epochs']}, in {_minutes(data['wall_seconds'])} on "
            f"{p['cores']} cores ({p['cpu_model']}, torch {p['torch']}){tuning}; "
            f"[measured](docs/benchmarks/main_job.md) by `scripts/main_job.py`.")


PAGES = [
    Page("main_job", "The main job: VGG16, 64 px, 5 epochs on one host",
         "results/main_job.json", main_job_table, main_job_setting, MAIN_JOB_NOTES),
]


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

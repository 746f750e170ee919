"""One command that checks a GPU host: its tests, benchmarks, tuning, two ranks sharing the
GPU and a short training run per use case, every outcome recorded in results/.

    python scripts/gpu_check.py            # at most 20 minutes on one GPU
    python scripts/gpu_check.py --plan     # the steps, their commands and time limits; runs nothing

Each step runs as a process of its own under a time limit (and never past the check's 20
minutes); a step that fails or reaches its limit is recorded with its exit code and last
lines, and the next step runs:

- gpu-tests: `scripts/gpu_tests.py` (pytest -m gpu) -> results/gpu_tests.json
- powersgd-cost: `scripts/powersgd_cost.py` (PowerSGD's compute a step, hybriddl's and DDP's
  hook, and a gradient's copy to the host and back) -> results/powersgd_cost-gpu.json
- bench-SimpleBig, bench-ComplexSmall: `scripts/bench_gpu.py` (hybriddl's GPU step against
  plain PyTorch, then the data wait of a training run) -> results/bench_gpu-<usecase>.json
- tune-SimpleBig: `hybriddl tune --precision auto` with a budget that fits ->
  results/tune_gpu-SimpleBig.json (the profile, with where and how it was measured)
- two-ranks: `mpirun -np 2` ranks sharing the GPU, `--host-parallel auto` ->
  results/gpu_check-two_ranks.json
- train-SimpleBig, train-ComplexSmall: `hybriddl train --strategy gpu` for a few epochs'
  steps -> results/gpu_check-train-<usecase>.json

A lease of a GPU is short (15 minutes of device time, 10 a command, the machine's start
counted): `--within SECONDS` runs the steps that matter most first (PRIORITY: the GPU tests
at this commit, AlexNet's step against PyTorch's, PowerSGD's compute), as many as fit in
SECONDS by their limits, and prints the `--only` line that runs the rest as a second part:

    python scripts/gpu_check.py --within 540    # one device call of at most 10 minutes

Then results/gpu_check.json lists every step: command, limit, seconds, exit code, outcome.
Every results file names the GPU (gpu_name), torch, commit and command. Without a CUDA
device it writes nothing and exits 2: no GPU figure is written where none was measured.
Exit code: 0 when every step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench_common import REPO, results_header, run_limited
from pages import Page
from hybriddl.files import atomic_write_json

TOTAL_SECONDS = 20 * 60
TUNE_BUDGET_SECONDS = 100  # SimpleBig's candidates at 224 px (33 s on an H200, 2026-11-28)
MIN_STEP_SECONDS = 10  # a step given less than this is not started
# What a short lease runs first (`--within`): issue 54's GPU path at this commit, then
# AlexNet's keyed dropout against PyTorch's step, then PowerSGD's compute on the GPU.
PRIORITY = ("gpu-tests", "bench-SimpleBig", "powersgd-cost", "two-ranks", "bench-ComplexSmall",
            "train-SimpleBig", "train-ComplexSmall", "tune-SimpleBig")
RESULTS = REPO / "results"


@dataclass
class Step:
    """One part of the check: a command, its time limit, what it leaves in results/."""

    name: str
    command: list[str]  # after the interpreter: `python COMMAND...` (mpirun: the whole line)
    limit: float  # seconds
    results: list[str]  # the results files it leaves, relative to the repository
    # Turns the step's scratch output into its results file (tune, train, two ranks).
    record: Callable[[Path, dict], None] | None = None
    interpreter: bool = True  # False: `command` is a whole command line (mpirun)
    needs: str | None = None  # why it cannot start here, decided before the check runs

    def argv(self) -> list[str]:
        return [sys.executable, *self.command] if self.interpreter else list(self.command)

    def shown(self) -> str:
        return shlex.join(["python", *self.command] if self.interpreter else self.command)


def plan(scratch: Path, mpirun: str | None = None) -> list[Step]:
    """The check's steps, in order, their limits summing to TOTAL_SECONDS at most."""
    hybriddl = ["-m", "hybriddl"]
    steps = [Step("gpu-tests", ["scripts/gpu_tests.py", "--timeout", "190"], 200,
                  ["results/gpu_tests.json"])]
    # PowerSGD's compute on the GPU, hybriddl's and the hook's (its Gram-Schmidt since
    # 9cfbb0f: QR's was 13.3 / 31.3 ms a step against the hook's 4.7 / 4.1 ms).
    steps.append(Step("powersgd-cost", ["scripts/powersgd_cost.py", "--output",
                                        "results/powersgd_cost-gpu.json"], 90,
                      ["results/powersgd_cost-gpu.json"]))
    # AlexNet's also trains against PyTorch with a DataLoader (issue: >= 0.95x its images/s).
    for usecase, limit, loader_rounds in (("SimpleBig", 210, 2), ("ComplexSmall", 210, 0)):
        steps.append(Step(f"bench-{usecase}", ["scripts/bench_gpu.py", "--usecase", usecase,
                                               "--rounds", "3", "--train-steps", "150",
                                               "--loader-rounds", str(loader_rounds)],
                          limit, [f"results/bench_gpu-{usecase}.json"]))
    profile = scratch / "tune-SimpleBig.json"
    steps.append(Step("tune-SimpleBig", [*hybriddl, "tune", "--usecase", "SimpleBig",
                                         "--image-size", "224", "--precision", "auto",
                                         "--budget", str(TUNE_BUDGET_SECONDS),
                                         "--output", str(profile)],
                      TUNE_BUDGET_SECONDS + 60, ["results/tune_gpu-SimpleBig.json"],
                      record=lambda gpu, header: record_tune(profile, gpu, header)))
    two_ranks = scratch / "two_ranks"
    mpirun = mpirun if mpirun is not None else find_mpirun()
    steps.append(Step("two-ranks", [mpirun or "mpirun", "--oversubscribe", "--mca", "btl",
                                    "tcp,self", "--mca", "btl_tcp_if_include", "lo", "-np", "2",
                                    sys.executable, *hybriddl, "train", "--usecase",
                                    "SimpleBig", "--strategy", "gpu", "--devices", "cuda:0",
                                    "--host-parallel", "auto", "--max-steps", "40",
                                    "--run-dir", str(two_ranks)],
                      120, ["results/gpu_check-two_ranks.json"], interpreter=False,
                      needs=None if mpirun else "no mpirun beside this Python or on PATH",
                      record=lambda gpu, header: record_training(two_ranks, "two_ranks", gpu,
                                                                 header)))
    for usecase, steps_, limit in (("SimpleBig", 150, 90), ("ComplexSmall", 90, 120)):
        run_dir = scratch / f"train-{usecase}"
        steps.append(Step(f"train-{usecase}", [*hybriddl, "train", "--usecase", usecase,
                                               "--strategy", "gpu", "--max-steps", str(steps_),
                                               "--run-dir", str(run_dir)],
                          limit, [f"results/gpu_check-train-{usecase}.json"],
                          record=lambda gpu, header, run_dir=run_dir, usecase=usecase:
                          record_training(run_dir, f"train-{usecase}", gpu, header)))
    return steps


def find_mpirun() -> str | None:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


# ------------------------------------------------------------------ results of the steps

def record_tune(profile: Path, gpu: str, header: dict) -> None:
    """The tune's profile as a results file: its candidates as rows, its pick, the line
    `train --strategy auto` would log about bf16, and where and how it was measured."""
    from hybriddl.tuning.profiles import load_profile
    from hybriddl.tuning.tuner import bf16_gain

    record = json.loads(profile.read_text())
    settings = record["settings"]
    atomic_write_json(RESULTS / f"tune_gpu-{settings['usecase']}.json", {
        **header, "gpu_name": gpu, "settings": settings, "measurement": record["measurement"],
        "fingerprint": record["fingerprint"], "rows": record["candidates"],
        "pick": next(c["label"] for c in record["candidates"]
                     if c["strategy"] == record["pick"] and c["status"] == "measured"),
        "bf16_gain": bf16_gain(load_profile(profile))})


def record_training(run_dir: Path, name: str, gpu: str, header: dict) -> None:
    """A training run's metrics.json, summed up: its settings and every epoch's figures."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    keep = ("epoch", "steps", "samples", "seconds", "images_per_second", "train_loss",
            "val_accuracy", "data_wait_seconds", "mpi_bytes_sent", "comm_seconds",
            "compute_seconds")
    config = metrics["config"]
    atomic_write_json(RESULTS / f"gpu_check-{name}.json", {
        **header, "gpu_name": gpu,
        "config": {k: config.get(k) for k in ("usecase", "model", "strategy", "hosts",
                                               "batch_size", "image_size", "max_steps",
                                               "host_parallel", "dropout_masks")},
        "rows": [{k: epoch.get(k) for k in keep} for epoch in metrics["epochs"]]})


# ------------------------------------------------------------------ running a step

def run_step(step: Step, limit: float, gpu: str, argv: list[str] | None) -> dict:
    """Run one step under `limit` seconds; its outcome, whatever happened."""
    outcome = {"step": step.name, "command": step.shown(), "limit_seconds": round(limit),
               "results": step.results}
    if step.needs:
        return {**outcome, "outcome": "not started", "why": step.needs}
    if limit < MIN_STEP_SECONDS:
        return {**outcome, "outcome": "not started",
                "why": f"the check's {TOTAL_SECONDS // 60} minutes were spent"}
    print(f"gpu_check: {step.name} (at most {limit:.0f} s): {step.shown()}", flush=True)
    started = time.monotonic()
    code, tail, timed_out = run_limited(step.argv(), limit)
    outcome.update(seconds=round(time.monotonic() - started, 1), exit_code=code)
    if timed_out:
        outcome.update(outcome="timed out", last_lines=tail)
    elif code != 0:
        outcome.update(outcome="failed", last_lines=tail)
    else:
        outcome["outcome"] = "passed"
        if step.record is not None:
            header = results_header("gpu_check.py", argv)
            header.update(check_command=header["command"], command=step.shown())
            try:
                step.record(gpu, header)
            except Exception as exc:  # noqa: BLE001 - recorded; the next step still runs
                outcome.update(outcome="failed", why=f"its results could not be recorded: "
                                                     f"{type(exc).__name__}: {exc}")
    print(f"gpu_check: {step.name}: {outcome['outcome']}", flush=True)
    return outcome


# ------------------------------------------------------------------ its page in docs/benchmarks

def tune_gpu_table(data: dict) -> str:
    lines = ["| candidate | status | s/step (median) | spread | img/s | × one core | × one GPU | note |",
             "|---|---|---:|---|---:|---:|---:|---|"]
    for r in data["rows"]:
        measured = r["status"] == "measured"
        low, high = r.get("spread_seconds") or (None, None)
        cells = ([f"{r['seconds_per_step']:.4f}", f"{low:.4f}–{high:.4f}" if low else "—",
                  f"{r['images_per_second']:.1f}",
                  *("—" if r.get(k) is None else f"{r[k]:.2f}×" for k in ("speedup",
                                                                        "speedup_over_gpu"))]
                 if measured else ["—"] * 5)
        note = (r.get("note") or "").replace("|", "/")
        lines.append(f"| {r['label']} | {r['status']} | {' | '.join(cells)} | {note} |")
    lines += ["", f"Pick: **{data['pick']}**."]
    if data.get("bf16_gain"):
        lines[-1] += f" The line `train --strategy auto` logs with it: {data['bf16_gain']}."
    return "\n".join(lines)


def tune_gpu_setting(data: dict) -> str:
    s, m = data["settings"], data["measurement"]
    return (f"`hybriddl tune` of {s['usecase']} ({s['model']} at {s['image_size']} px, batch "
            f"{s['batch_size']}, precision {s['precision']}): budget {m['budget_seconds']:g} s, "
            f"{m['rounds']} interleaved rounds of {m['warmup_steps']} warm-up and "
            f"{m['timed_steps']} timed steps per visit, {m['second_look_rounds']} second-look "
            f"rounds; {m['seconds_spent']:.0f} s spent")


TUNE_GPU_NOTES = """How to read it: the profile `hybriddl tune` wrote on a GPU host, as
`scripts/gpu_check.py` recorded it. *× one core* is the speedup over sequential on one CPU
core, *× one GPU* over the `gpu` strategy in float32; a dropped candidate's note says why
(a kind outrun, the budget)."""


PAGES = [
    # One page per file the glob finds (none until a GPU host has run scripts/gpu_check.py).
    Page("tune_gpu-*", "Tuning a GPU host", "results/tune_gpu-*.json", tune_gpu_table,
         tune_gpu_setting, TUNE_GPU_NOTES),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true",
                        help="print the steps, their commands and time limits; run nothing")
    parser.add_argument("--only", nargs="+", metavar="STEP",
                        help="run these steps only (names as --plan shows them)")
    parser.add_argument("--within", type=float, metavar="SECONDS",
                        help="run the steps that matter most (PRIORITY) that fit in SECONDS "
                             "by their limits, in plan order, and print the rest's --only")
    args = parser.parse_args(argv)
    if args.within is not None and (args.only or not args.within > 0):
        parser.error("--within SECONDS: give a positive number of seconds, without --only")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        steps = plan(Path(scratch))
        known = [s.name for s in steps]
        unknown = [name for name in args.only or [] if name not in known]
        if unknown:
            print(f"gpu_check: no step {', '.join(unknown)}: choose from {', '.join(known)}",
                  file=sys.stderr)
            return 2
        if args.only:
            steps = [s for s in steps if s.name in args.only]
        if args.within is not None:
            steps, rest = within(steps, args.within)
            print(f"gpu_check: {' '.join(s.name for s in steps) or 'no step'} within "
                  f"{args.within:g} s" + (f"; the rest: python scripts/gpu_check.py --only "
                                          f"{' '.join(s.name for s in rest)}" if rest else ""))
        if args.plan:
            for step in steps:
                print(f"{step.name:20} {step.limit:5.0f} s  {step.shown()}"
                      + (f"  (not here: {step.needs})" if step.needs else ""))
            print(f"{'total':20} {sum(s.limit for s in steps):5.0f} s  "
                  f"(at most {TOTAL_SECONDS} s)")
            return 0
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here: run it on a GPU host (nothing written: no "
                  "GPU figure without a GPU)", file=sys.stderr)
            return 2
        return check(steps, torch.cuda.get_device_name(0), argv, known)


def within(steps: list[Step], seconds: float) -> tuple[list[Step], list[Step]]:
    """(The steps run now, in plan order; the rest, in PRIORITY's): PRIORITY's first steps
    whose limits sum to at most `seconds` (one that does not fit is passed over for a
    shorter one after it)."""
    chosen, left = set(), seconds
    ranked = sorted(steps, key=lambda s: PRIORITY.index(s.name))
    for step in ranked:
        if step.limit <= left:
            chosen.add(step.name)
            left -= step.limit
    return [s for s in steps if s.name in chosen], [s for s in ranked if s.name not in chosen]


def earlier_rows(gpu: str, order: list[str], rerun: list[str]) -> list[dict]:
    """The rows of results/gpu_check.json from an earlier check on the same GPU model for
    the steps not run again now (`--only` runs a check in parts: each part keeps the
    others' outcomes, each row with its own commit and date)."""
    try:
        earlier = json.loads((RESULTS / "gpu_check.json").read_text())
    except (OSError, ValueError):
        return []
    if earlier.get("gpu_name") != gpu:
        return []
    return [{"commit": earlier.get("commit"), "date": earlier.get("date"), **row}
            for row in earlier.get("rows", [])
            if row.get("step") in order and row.get("step") not in rerun]


def check(steps: list[Step], gpu: str, argv=None, order: list[str] | None = None) -> int:
    """Run the steps in order within TOTAL_SECONDS; results/gpu_check.json lists them. A part
    of the check (`order`: all the check's steps, in order) keeps an earlier check's rows on
    the same GPU model for the steps it does not run."""
    order = order or [s.name for s in steps]
    deadline = time.monotonic() + TOTAL_SECONDS
    header = results_header("gpu_check.py", argv)
    kept = earlier_rows(gpu, order, [s.name for s in steps])
    outcomes = []
    for step in steps:
        limit = min(step.limit, deadline - time.monotonic())
        outcomes.append({"commit": header["commit"], "date": header["date"],
                         **run_step(step, limit, gpu, argv)})
        rows = sorted(kept + outcomes, key=lambda row: order.index(row["step"]))
        # Written after every step: a check cut short still says how far it got.
        atomic_write_json(RESULTS / "gpu_check.json", {
            **header, "gpu_name": gpu,
            "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "rows": rows})
    passed = sum(o["outcome"] == "passed" for o in outcomes)
    print(f"gpu_check: {passed} of {len(outcomes)} steps passed; results/gpu_check.json")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

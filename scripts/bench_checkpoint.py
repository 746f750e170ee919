"""How long training pauses for an end-of-epoch checkpoint: written in the background vs
written while training waits (what hybriddl did before background checkpoints).

    python scripts/bench_checkpoint.py --usecase ComplexSmall --image-size 32 --rounds 3 \
        --before 0df1e00

Each round runs `train` in child processes, once per mode, the order rotating between
rounds: a full epoch, then a few steps of the next. Modes: "background" (this code),
"wait" (this code, waiting for each write inside the checkpoint call) and, with
--before REV, "before": the hybriddl of that git revision, run from a copy of it.
The pause is measured from the trainer's own events: from the end of epoch 1
(validated, recorded) to the start of epoch 2, which is the checkpoint and nothing else.
Also reported: the steps of epoch 2 that ran while the write was under way, against
epoch 1's steps (the write competes for memory bandwidth and a core). The image size
changes the step time, not the
checkpoint: VGG16's is ~1 GB (parameters and momentum) at any size.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench_common import spread
from hybriddl.files import atomic_write_json
from hybriddl.rundir import CHECKPOINT

REPO = Path(__file__).resolve().parents[1]


MODES = ("before", "wait", "background")
EPOCH_2_STEPS = 6


def child(args: argparse.Namespace) -> None:
    """One run; prints its events as one JSON line."""
    from hybriddl.run import checkpointer, trainer
    from hybriddl.strategies import StrategyOptions

    if args.child == "wait":
        background_save = checkpointer.Checkpointer.save

        def save_and_wait(self, *a, **k):
            background_save(self, *a, **k)
            self.wait_for_write()

        checkpointer.Checkpointer.save = save_and_wait

    events: dict = {"epoch_end": {}, "epoch_start": {}, "steps": {}}

    class Clock(trainer.TrainingObserver):
        def on_epoch_start(self, epoch, steps):
            events["epoch_start"][epoch] = time.perf_counter()

        def on_step(self, epoch, step, samples, seconds, loss):
            events["steps"].setdefault(epoch, []).append(seconds)

        def on_epoch_end(self, record):
            events["epoch_end"][record["epoch"] - 1] = time.perf_counter()

    config = trainer.TrainConfig(usecase=args.usecase, model=args.model,
                                 image_size=args.image_size, epochs=2,
                                 strategy=args.strategy, run_dir=args.run_dir,
                                 strategy_options=StrategyOptions(workers=args.workers),
                                 monitor_interval=0)
    prepared = trainer.prepare(config.resolved())
    case_steps = -(-len(prepared.split.train) // prepared.config.batch_size)
    prepared.config = replace(prepared.config, max_steps=case_steps + EPOCH_2_STEPS)
    trainer.run(prepared, Clock())
    print(json.dumps({
        "pause_seconds": events["epoch_start"][1] - events["epoch_end"][0],
        "epoch_1_step_seconds": events["steps"][0],
        "epoch_2_step_seconds": events["steps"][1],
        "checkpoint_bytes": (Path(args.run_dir) / CHECKPOINT).stat().st_size,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="ComplexSmall")
    parser.add_argument("--model", help="default: the use case's")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--strategy", default="processes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="results/checkpoint_pause.json")
    parser.add_argument("--before", metavar="REV",
                        help="also run the hybriddl of this git revision (e.g. the last commit "
                             "before background checkpoints)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    modes = MODES if args.before else MODES[1:]
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint-") as scratch:
        env = {mode: dict(os.environ) for mode in modes}
        if args.before:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before, "hybriddl"],
                                     capture_output=True, check=True).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(Path(scratch) / "before", filter="data")
            # The copy goes first on the path, ahead of the installed hybriddl.
            env["before"]["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(Path(scratch) / "before"), os.environ.get("PYTHONPATH")]))
        for round_ in range(args.rounds):
            order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
            for mode in order:
                run_dir = Path(scratch) / f"{mode}-{round_}"
                done = subprocess.run(
                    [sys.executable, __file__, "--child", mode, "--run-dir", str(run_dir),
                     "--usecase", args.usecase, "--image-size", str(args.image_size),
                     *(["--model", args.model] if args.model else []),
                     "--strategy", args.strategy, "--workers", str(args.workers)],
                    capture_output=True, text=True, check=False, env=env[mode])
                if done.returncode != 0:
                    sys.exit(f"{mode} run failed:\n{done.stderr[-3000:]}")
                runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {round_ + 1} {mode}: pause "
                      f"{runs[mode][-1]['pause_seconds']:.3f} s", flush=True)

    pauses = {mode: [r["pause_seconds"] for r in runs[mode]] for mode in modes}
    result = {
        "command": " ".join(["python", "scripts/bench_checkpoint.py", *sys.argv[1:]]),
        "usecase": args.usecase, "model": args.model, "image_size": args.image_size,
        "strategy": args.strategy,
        "workers": args.workers, "rounds": args.rounds,
        "checkpoint_bytes": runs["background"][0]["checkpoint_bytes"],
        "before": args.before,
        "pause_seconds": {mode: {**spread(values), "values": values}
                          for mode, values in pauses.items()},
        # Epoch 1's steps against epoch 2's first steps, which overlap the background write.
        "step_seconds": {mode: {
            "epoch_1_median": statistics.median(
                s for r in runs[mode] for s in r["epoch_1_step_seconds"]),
            "epoch_2_first_steps_median": statistics.median(
                s for r in runs[mode] for s in r["epoch_2_step_seconds"])} for mode in modes},
    }
    atomic_write_json(Path(args.output), result)
    print(json.dumps({mode: result["pause_seconds"][mode]["median"] for mode in modes}))


if __name__ == "__main__":
    main()

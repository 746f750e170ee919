"""Is the tuner's pick really the fastest? Tune (or take a profile), then re-measure.

Right after a tune, every measured candidate is timed again the same way
(benchmark.measure_strategy: warm-up, then the median of timed steps, on the same
batch), and the pick passes when its re-measured seconds per step are within
--tolerance (default 5%) of the fastest re-measured candidate.

    python scripts/check_tune.py --usecase ComplexSmall --image-size 32 --batch-size 4 --steps 1
    python scripts/check_tune.py --profile profiles/node1-SimpleBig.json

Prints a rich table, writes JSON (--output), exits 0 when the pick is within tolerance,
1 when it is not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybriddl.tuning import profiles, tuner
from hybriddl.tuning.benchmark import measure_strategy, sample_batch
from hybriddl.errors import UsageError
from hybriddl.run.rundir import atomic_write_json

console = Console(stderr=True)
out = Console()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="check this profile instead of tuning first")
    parser.add_argument("--usecase", default="ComplexSmall")
    parser.add_argument("--model", help="default: the use case's")
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--budget", type=float, default=600.0, help="tuning budget in seconds")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: the profile's, else 1)")
    parser.add_argument("--steps", type=int,
                        help="timed steps for the tune and the re-measure (default: the profile's, else 5)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="how much slower than the fastest the pick may be (default: 0.05)")
    parser.add_argument("--profile-dir", help="where a fresh tune's profile goes (default: as hybriddl tune)")
    parser.add_argument("--output", help="JSON result (default: runs/check_tune-<host>-<usecase>.json)")
    return parser.parse_args(argv)


def tune_or_load(args) -> tuple[profiles.Profile, Path]:
    if args.profile:
        return profiles.load_profile(args.profile), Path(args.profile)
    settings = tuner.tune_settings(args.usecase, args.model, args.image_size, args.batch_size)
    with console.status(f"tuning {settings.describe()} (budget {args.budget:.0f} s)"):
        profile = tuner.tune_host(settings, tuner.embedded_images(settings), budget=args.budget,
                                  warmup=1 if args.warmup is None else args.warmup,
                                  steps=args.steps or 5)
    path = profiles.profile_path(profiles.profile_dir(args.profile_dir), settings.usecase)
    return profile, profiles.save_profile(profile, path)


def remeasure(profile: profiles.Profile, warmup: int, steps: int) -> list[dict]:
    """Each measured candidate timed again on the tune's batch; dropped ones are left out."""
    settings = profile.settings
    images = tuner.embedded_images(settings)
    x, y = sample_batch(images, settings.batch_size, settings.image_size)
    rows = []
    measured = [c for c in profile.candidates if c.measured]
    for index, candidate in enumerate(measured, 1):
        reason = candidate.choice.infeasibility()
        if reason:
            raise UsageError(f"{candidate.choice.label} cannot run on this host ({reason}): "
                             "check a profile on the host that measured it")
        with console.status(f"re-measuring {index}/{len(measured)}: {candidate.choice.label}"):
            timing = measure_strategy(candidate.choice.name, candidate.choice.options(),
                                      settings.model, len(images.classes), x, y,
                                      warmup=warmup, steps=steps)
        rows.append({"strategy": candidate.choice.to_dict(), "label": candidate.choice.label,
                     "picked": candidate.choice == profile.pick,
                     "tuned_seconds_per_step": candidate.seconds_per_step,
                     "seconds_per_step": timing.seconds_per_step,
                     "step_seconds": timing.step_seconds})
    fastest = min(row["seconds_per_step"] for row in rows)
    for row in rows:
        row["over_fastest"] = row["seconds_per_step"] / fastest
    return rows


def result_table(profile: profiles.Profile, rows: list[dict], tolerance: float) -> Table:
    s = profile.settings
    table = Table(title=f"Re-measured after the tune: {s.describe()}, tolerance {tolerance:.0%}")
    for column in ("", "strategy", "tuned s/step", "re-measured s/step", "vs fastest"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in sorted(rows, key=lambda r: r["seconds_per_step"]):
        table.add_row("pick" if row["picked"] else "", row["label"],
                      f"{row['tuned_seconds_per_step']:.3f}", f"{row['seconds_per_step']:.3f}",
                      f"{row['over_fastest']:.3f}x", style="bold" if row["picked"] else None)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.tolerance < 0:
            raise UsageError(f"--tolerance {args.tolerance}: give a fraction such as 0.05")
        profile, profile_file = tune_or_load(args)
        warmup = args.warmup if args.warmup is not None else profile.measurement.get("warmup_steps", 1)
        rows = remeasure(profile, warmup, args.steps or profile.measurement.get("timed_steps", 5))
    except UsageError as exc:
        console.print(f"check_tune: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    pick = next(row for row in rows if row["picked"])
    passed = pick["over_fastest"] <= 1 + args.tolerance
    output = Path(args.output) if args.output else Path(
        "runs") / f"check_tune-{profile.host}-{profile.settings.usecase}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output, {"profile": str(profile_file), "settings": profile.to_dict()["settings"],
                               "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "tolerance": args.tolerance, "pick": pick["label"],
                               "pick_over_fastest": pick["over_fastest"], "passed": passed,
                               "candidates": rows})
    out.print(result_table(profile, rows, args.tolerance))
    verdict = "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"
    out.print(f"{verdict}: the pick {pick['label']} re-measured at {pick['over_fastest']:.3f}x the "
              f"fastest (tolerance {1 + args.tolerance:.2f}x); profile {profile_file}, result {output}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

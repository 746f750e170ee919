"""Is the tuner's pick really the fastest? Tune (or take a profile), then re-measure.

Right after a tune, every measured candidate is timed again on the same batch in
interleaved rounds, as the tuner does (A B C A B C ...; each visit warm-up then timed
steps through benchmark.measure_strategy, its figure the median of those; a candidate's
figure the median of its visits), and the pick passes when its re-measured seconds per
step are within --tolerance (default 5%) of the fastest re-measured candidate.

    python scripts/check_tune.py --usecase ComplexSmall --image-size 32 --batch-size 4 --steps 1
    python scripts/check_tune.py --profile profiles/node1-SimpleBig-alexnet-b32-224px.json

Prints a rich table, writes JSON (--output), exits 0 when the pick is within tolerance,
1 when it is not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybriddl.tuning import profiles, tuner
from hybriddl.tuning.tuner import tune_settings
from hybriddl.tuning.benchmark import measure_strategy, sample_batch
from hybriddl.errors import UsageError
from hybriddl.files import atomic_write_json

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
    parser.add_argument("--steps", type=int, help="timed steps per visit, for the tune and the "
                        "re-measure (default: the profile's, else 2)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds, for the tune and the "
                        "re-measure (default: the profile's, else 3)")
    parser.add_argument("--second-look", type=int, default=tuner.SECOND_LOOK_ROUNDS,
                        metavar="ROUNDS", help="the tune's extra rounds for the fastest "
                        f"(default: {tuner.SECOND_LOOK_ROUNDS})")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="how much slower than the fastest the pick may be (default: 0.05)")
    parser.add_argument("--profile-dir", help="where a fresh tune's profile goes (default: as hybriddl tune)")
    parser.add_argument("--output", help="JSON result (default: runs/check_tune-<profile name>.json)")
    return parser.parse_args(argv)


def tune_or_load(args) -> tuple[profiles.Profile, Path]:
    if args.profile:
        return profiles.load_profile(args.profile), Path(args.profile)
    settings = tune_settings(args.usecase, args.model, args.image_size, args.batch_size)
    with console.status(f"tuning {settings.describe()} (budget {args.budget:.0f} s)"):
        profile = tuner.tune_host(settings, tuner.embedded_images(settings), budget=args.budget,
                                  warmup=1 if args.warmup is None else args.warmup,
                                  steps=args.steps or 2, rounds=args.rounds or tuner.TUNE_ROUNDS,
                                  second_look=args.second_look)
    path = profiles.profile_path(profiles.profile_dir(args.profile_dir), settings)
    return profile, profiles.save_profile(profile, path)


def remeasure(profile: profiles.Profile, warmup: int, steps: int, rounds: int) -> list[dict]:
    """Each measured candidate timed again on the tune's batch in interleaved rounds."""
    settings = profile.settings
    images = tuner.embedded_images(settings)
    x, y = sample_batch(images, settings.batch_size, settings.image_size)
    measured = [c for c in profile.candidates if c.measured]
    for candidate in measured:
        reason = candidate.choice.infeasibility()
        if reason:
            raise UsageError(f"{candidate.choice.label} cannot run on this host ({reason}): "
                             "check a profile on the host that measured it")
    rounds_seconds = {c.choice: [] for c in measured}
    steps_seconds = {c.choice: [] for c in measured}
    for number in range(1, rounds + 1):
        for index, candidate in enumerate(measured, 1):
            with console.status(f"re-measuring, round {number}/{rounds}, {index}/{len(measured)}: "
                                f"{candidate.choice.label}"):
                timing = measure_strategy(candidate.choice.name, candidate.choice.options(),
                                          settings.model, len(images.classes), x, y,
                                          warmup=warmup, steps=steps)
            rounds_seconds[candidate.choice].append(timing.seconds_per_step)
            steps_seconds[candidate.choice].append(timing.step_seconds)
    rows = []
    for candidate in measured:
        figures = rounds_seconds[candidate.choice]
        rows.append({"strategy": candidate.choice.to_dict(), "label": candidate.choice.label,
                     "picked": candidate.choice == profile.pick,
                     "tuned_seconds_per_step": candidate.seconds_per_step,
                     "tuned_spread_seconds": (list(candidate.spread_seconds)
                                              if candidate.spread_seconds else None),
                     "seconds_per_step": statistics.median(figures),
                     "spread_seconds": [min(figures), max(figures)],
                     "round_seconds": figures, "step_seconds": steps_seconds[candidate.choice],
                     "peak_rss_bytes": candidate.peak_rss_bytes})
    fastest = min(row["seconds_per_step"] for row in rows)
    for row in rows:
        row["over_fastest"] = row["seconds_per_step"] / fastest
    return rows


def result_table(profile: profiles.Profile, rows: list[dict], tolerance: float) -> Table:
    s = profile.settings
    table = Table(title=f"Re-measured after the tune: {s.describe()}, tolerance {tolerance:.0%}")
    for column in ("", "strategy", "tuned median s/step", "re-measured median", "spread",
                   "vs fastest"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in sorted(rows, key=lambda r: r["seconds_per_step"]):
        table.add_row("pick" if row["picked"] else "", row["label"],
                      f"{row['tuned_seconds_per_step']:.3f}", f"{row['seconds_per_step']:.3f}",
                      "{:.3f}-{:.3f}".format(*row["spread_seconds"]), f"{row['over_fastest']:.3f}x", style="bold" if row["picked"] else None)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.tolerance < 0:
            raise UsageError(f"--tolerance {args.tolerance}: give a fraction such as 0.05")
        for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} {value}: give at least 1")
        profile, profile_file = tune_or_load(args)
        warmup = args.warmup if args.warmup is not None else profile.measurement.get("warmup_steps", 1)
        steps = args.steps or profile.measurement.get("timed_steps", 2)
        rounds = args.rounds or profile.measurement.get("rounds", tuner.TUNE_ROUNDS)
        rows = remeasure(profile, warmup, steps, rounds)
    except UsageError as exc:
        console.print(f"check_tune: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    pick = next(row for row in rows if row["picked"])
    passed = pick["over_fastest"] <= 1 + args.tolerance
    output = Path(args.output) if args.output else Path(
        "runs") / f"check_tune-{profiles.profile_path('.', profile.settings, profile.host).name}"
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output, {"profile": str(profile_file), "settings": profile.to_dict()["settings"],
                               "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "tolerance": args.tolerance,
                               "remeasure": {"warmup_steps": warmup, "timed_steps": steps,
                                             "rounds": rounds},
                               "pick": pick["label"], "pick_over_fastest": pick["over_fastest"],
                               "passed": passed, "candidates": rows,
                               "tuned_profile": profile.to_dict()})
    out.print(result_table(profile, rows, args.tolerance))
    verdict = "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"
    out.print(f"{verdict}: the pick {pick['label']} re-measured at {pick['over_fastest']:.3f}x the "
              f"fastest (tolerance {1 + args.tolerance:.2f}x); profile {profile_file}, result {output}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

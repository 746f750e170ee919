"""`hybriddl tune`: measure every feasible local strategy here and keep this host's profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybriddl.config import add_accumulate_arg, add_numerics_args
from hybriddl.display import TrainDisplay, TuneDisplay, show_pick
from hybriddl.errors import UsageError
from hybriddl.tuning.tuner import tune_settings
from hybriddl.usecases import DEFAULT_USECASE, USECASES


def add_parser(commands) -> argparse.ArgumentParser:
    tune = commands.add_parser("tune", help="measure every feasible local strategy here, keep the "
                               "fastest as this host's profile")
    add_tune_args(tune)
    tune.set_defaults(handler=cmd_tune)
    return tune


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--usecase", default=DEFAULT_USECASE, help=f"one of {', '.join(USECASES)}")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--image-size", type=int, help="pixels per side (default: the use case's, 224)")
    parser.add_argument("--batch-size", type=int, help="this host's batch (default: the use case's)")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="seconds for all candidates together; a candidate that cannot "
                             "finish within its share is dropped (default: 600)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--second-look", type=int, default=2,
                        help="extra rounds for the two fastest and any other whose fastest "
                             "round is within 10%% of the fastest, at most 4 (default: 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per visit (default: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per visit (default: 1)")
    parser.add_argument("--output", help="profile file (default: one per setting in PROFILE_DIR)")
    parser.add_argument("--data", help="measure on batches of this data, as train's --data "
                        "(default: the use case's embedded set)")
    parser.add_argument("--data-cache", metavar="DIR", help="as train's --data-cache")
    parser.add_argument("--profile-dir", help="default: $HYBRIDDL_PROFILES or ./profiles")
    add_numerics_args(parser, channels_last=False)
    add_accumulate_arg(parser, "every candidate computes the batch in N chunks; train "
                               "--accumulate N with --strategy auto uses this profile")



def cmd_tune(args: argparse.Namespace) -> int:
    from hybriddl.data.loading import image_notes
    from hybriddl.tuning import profiles, tuner

    settings = tune_settings(args.usecase, args.model, args.image_size, args.batch_size,
                             args.precision, args.accumulate)
    output = Path(args.output or profiles.profile_path(profiles.profile_dir(args.profile_dir), settings))
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory: give a file path such as "
                         f"{profiles.profile_path(output, settings)}")
    loading = TrainDisplay()
    try:
        images = tuner.tune_images(settings, args.data, args.data_cache, loading.on_data_progress)
        for line in image_notes(images):
            loading.warn(line)
    finally:
        loading.stop()
    display = TuneDisplay()
    try:
        rounds = {key: getattr(args, key) for key in ("warmup", "steps", "rounds", "second_look")}
        profile = tuner.tune_host(settings, images, budget=args.budget, observer=display, **rounds)
    finally:
        display.stop()
    profiles.save_profile(profile, output)
    show_pick(profile, output)
    return 0

"""`hybriddl tune`: measure every feasible local strategy here and keep this host's profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybriddl.cli.commands import COMMANDS
from hybriddl.cli.flags import (add_accumulate_flag, add_data_flags, add_numerics_flags,
                                add_profile_dir_flag, add_tuning_flags)
from hybriddl.cli.workload_flags import add_workload_flags
from hybriddl.display import TrainDisplay, TuneDisplay, show_pick
from hybriddl.errors import UsageError
from hybriddl.files import check_writable
from hybriddl.tuning.tuner import tune_settings


def add_parser(commands) -> argparse.ArgumentParser:
    tune = commands.add_parser("tune", help=COMMANDS["tune"])
    add_tune_args(tune)
    tune.set_defaults(handler=cmd_tune)
    return tune


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    add_workload_flags(parser, batch="this host's batch")
    add_tuning_flags(parser)
    parser.add_argument("--output", help="profile file (default: one per setting in PROFILE_DIR)")
    add_data_flags(parser)
    add_profile_dir_flag(parser, "where profiles are kept")
    add_numerics_flags(parser, channels_last=False)
    add_accumulate_flag(parser, "every candidate computes the batch in N chunks; train "
                                "--accumulate N with --strategy auto uses this profile")


def cmd_tune(args: argparse.Namespace) -> int:
    from hybriddl.data.loading import image_notes
    from hybriddl.tuning import profiles, tuner

    settings = tune_settings(args.usecase, args.model, args.image_size, args.batch_size,
                             args.precision, args.accumulate)
    output = Path(args.output or profiles.profile_path(profiles.profile_dir(args.profile_dir), settings))
    try:
        is_folder = output.is_dir()
    except OSError:  # a folder on the way this user cannot search: check_writable says so
        is_folder = False
    if is_folder:
        raise UsageError(f"--output {output} is a directory: give a file path such as "
                         f"{profiles.profile_path(output, settings)}")
    # Where the profile goes can take it, before the tuning the budget pays for.
    check_writable(output, "--output" if args.output else "--profile-dir", folder=False)
    loading = TrainDisplay()
    try:
        images = tuner.tune_images(settings, args.data, args.data_cache, loading.on_data_progress)
        for line in image_notes(images):
            loading.warn(line)
    finally:
        loading.stop()
    display = TuneDisplay()
    try:
        rounds = {key: getattr(args, key) for key in ("warmup", "steps", "rounds", "second_look")
                  if getattr(args, key) is not None}
        profile = tuner.tune_host(settings, images, budget=args.budget, observer=display, **rounds)
    finally:
        display.stop()
    profiles.save_profile(profile, output)
    show_pick(profile, output)
    return 0

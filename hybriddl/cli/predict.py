"""`hybriddl predict`: a run's model on images, one CSV row per image."""

from __future__ import annotations

import argparse
import os
import sys

from hybriddl.cli.commands import COMMANDS, a_path
from hybriddl.display import out


def add_parser(commands) -> argparse.ArgumentParser:
    predict = commands.add_parser("predict", help=COMMANDS["predict"])
    predict.add_argument("run_dir", metavar="RUN_DIR", type=a_path, help="a finished run of 'train'")
    predict.add_argument("images", nargs="+", metavar="IMAGE_OR_DIR", type=a_path,
                         help="image files, or folders searched for image files")
    predict.add_argument("--output", metavar="FILE", type=a_path,
                         help="write to FILE instead, CSV or JSON by its extension")
    predict.add_argument("--batch-size", type=int, default=32,
                         help="images per forward pass (default: 32)")
    predict.set_defaults(handler=cmd_predict)
    return predict


def cmd_predict(args: argparse.Namespace) -> int:
    from hybriddl.inference.images import check_exist, check_headers
    from hybriddl.inference.predict import output_format, predict, save_predictions, write_csv
    from hybriddl.inference.trained import load_trained

    if args.output:
        output_format(args.output)  # a wrong name is refused before any image is read
    check_exist(args.images)
    trained = load_trained(args.run_dir)
    predictions = predict(trained, args.images, args.batch_size)
    if args.output:
        count = save_predictions(predictions, args.output)
        out.print(f"{count} predictions written to {args.output}", highlight=False)
        return 0
    check_headers(args.images)  # stdout cannot be taken back: no row before a bad file
    try:
        write_csv(predictions, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`| head`): not an error; Python must not complain at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

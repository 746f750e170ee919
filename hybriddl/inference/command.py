"""`hybriddl evaluate` and `hybriddl predict`: their arguments and what they show."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hybriddl.display import evaluation_table, files_table, out


def add_inference_parsers(commands) -> None:
    """Register `evaluate` and `predict` on the CLI's subparsers."""
    evaluate = commands.add_parser(
        "evaluate", help="a run's model on a labelled ImageFolder: accuracy, per-class "
                         "precision, recall and F1, confusion matrix (JSON and PNG)")
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a finished run of 'train'")
    evaluate.add_argument("--data", required=True, metavar="DIR",
                          help="an ImageFolder (one subfolder per class) whose class names are "
                               "the run's")
    evaluate.add_argument("--output", metavar="DIR",
                          help="folder for evaluation.json and confusion_matrix.png "
                               "(default: RUN_DIR/evaluation)")
    evaluate.add_argument("--batch-size", type=int, default=32,
                          help="images per forward pass (default: 32)")
    evaluate.set_defaults(handler=cmd_evaluate)

    predict = commands.add_parser(
        "predict", help="a run's model on images: file, class and probability per image, "
                        "as CSV on stdout (or --output FILE)")
    predict.add_argument("run_dir", metavar="RUN_DIR", help="a finished run of 'train'")
    predict.add_argument("images", nargs="+", metavar="IMAGE_OR_DIR",
                         help="image files, or folders searched for image files")
    predict.add_argument("--output", metavar="FILE",
                         help="write to FILE instead, CSV or JSON by its extension")
    predict.add_argument("--batch-size", type=int, default=32,
                         help="images per forward pass (default: 32)")
    predict.set_defaults(handler=cmd_predict)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from hybriddl.inference.evaluate import evaluate, save_evaluation
    from hybriddl.inference.trained import load_trained

    trained = load_trained(args.run_dir)
    evaluation = evaluate(trained, args.data, args.batch_size)
    written = save_evaluation(evaluation, args.output or Path(args.run_dir) / "evaluation")
    out.print(f"accuracy [bold]{evaluation.accuracy:.3f}[/] of {evaluation.model} on "
              f"{evaluation.images} images of {evaluation.data}", highlight=False)
    out.print(evaluation_table(evaluation))
    out.print(files_table("Written", written))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from hybriddl.inference.images import check_exist
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
    try:
        write_csv(predictions, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`| head`): not an error; Python must not complain at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

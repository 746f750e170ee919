"""`hybriddl evaluate`: a run's model on a labelled ImageFolder, its scores shown and written."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybriddl.cli.commands import COMMANDS, a_path
from hybriddl.display import evaluation_table, files_table, out


def add_parser(commands) -> argparse.ArgumentParser:
    evaluate = commands.add_parser("evaluate", help=COMMANDS["evaluate"])
    evaluate.add_argument("run_dir", metavar="RUN_DIR", type=a_path, help="a finished run of 'train'")
    evaluate.add_argument("--data", required=True, metavar="DIR", type=a_path,
                          help="an ImageFolder (one subfolder per class) whose class names are "
                               "the run's")
    evaluate.add_argument("--output", metavar="DIR", type=a_path,
                          help="folder for evaluation.json and confusion_matrix.png "
                               "(default: RUN_DIR/evaluation)")
    evaluate.add_argument("--batch-size", type=int, default=32,
                          help="images per forward pass (default: 32)")
    evaluate.set_defaults(handler=cmd_evaluate)
    return evaluate


def cmd_evaluate(args: argparse.Namespace) -> int:
    from hybriddl.inference.evaluate import evaluate, save_evaluation
    from hybriddl.files import check_writable
    from hybriddl.inference.trained import load_trained

    output = args.output or Path(args.run_dir) / "evaluation"
    if Path(args.run_dir).is_dir():  # (a missing run is named first, by load_trained)
        check_writable(output, "--output")  # before the whole evaluation
    trained = load_trained(args.run_dir)
    evaluation = evaluate(trained, args.data, args.batch_size)
    written = save_evaluation(evaluation, output)
    out.print(f"accuracy [bold]{evaluation.accuracy:.3f}[/] of {evaluation.model} on "
              f"{evaluation.images} images of {evaluation.data}", highlight=False)
    out.print(evaluation_table(evaluation))
    out.print(files_table("Written", written))
    return 0

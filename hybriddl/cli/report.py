"""`hybriddl report`: PNG charts and a Markdown table from run directories."""

from __future__ import annotations

import argparse

from hybriddl.cli.commands import COMMANDS, a_path
from hybriddl.display import files_table, out


def add_parser(commands) -> argparse.ArgumentParser:
    report = commands.add_parser("report", help=COMMANDS["report"])
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=a_path,
                        help="run directories made by 'train'")
    report.add_argument("--output", default="report", type=a_path, help="folder for the charts and report.md "
                        "(default: ./report)")
    report.set_defaults(handler=cmd_report)
    return report


def cmd_report(args: argparse.Namespace) -> int:
    from hybriddl.monitoring.report import write_report

    from hybriddl.files import check_writable

    check_writable(args.output, "--output")  # before the charts are drawn
    written = write_report(args.run_dirs, args.output)
    out.print(files_table(f"Report of {len(args.run_dirs)} run(s)", written))
    return 0

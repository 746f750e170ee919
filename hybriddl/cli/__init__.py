"""The command line: parses, reports with rich, and leaves the computing to the library.

One module per command, each with its parser (`add_parser`) and its `cmd_*`; the flags
several commands share are defined once, in `flags.py`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hybriddl import __version__
from hybriddl.cli.allocator import (add_flag as add_allocator_flag, run_on_chosen_allocator,
                                    start_on_settled_allocator)
from hybriddl.cli.commands import COMMANDS
from hybriddl.display import console, show_error
from hybriddl.errors import StorageError, TrainingError, TrainingInterrupted, UsageError


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit code 2, like every other bad input."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(command: str | None = None, names_only: bool = False) -> argparse.ArgumentParser:
    """The command line; with `command`, only that command's parser: its module alone is
    imported, so that emulate and launch, which only start processes, start in a fraction
    of a second without loading torch. With `names_only`, the commands by name and help
    line alone (COMMANDS), no module imported: what `--help`, `--version` and a mistyped
    command need, answered in a fraction of a second too."""
    parser = OneLineErrorParser(prog="hybriddl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hybriddl {__version__}")
    add_allocator_flag(parser)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    for name in COMMANDS if command is None else (command,):
        if names_only:
            commands.add_parser(name, help=COMMANDS[name])
        else:
            importlib.import_module(f"hybriddl.cli.{name}").add_parser(commands)
    return parser


def command_named(argv: list[str]) -> str | None:
    """The command `argv` runs, read past the options before it; None where it names none
    (`--help`, `--version`, a typo), which the whole parser then answers."""
    words = iter(argv)
    for word in words:
        if word in COMMANDS:
            return word
        if word == "--allocator":
            next(words, None)
        elif word in ("-h", "--help", "--version") or not word.startswith("-"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    """The console script. Run as one (`argv` None) it first settles the allocator and,
    where needed, starts again on it; called with `argv` it runs in this process as it is."""
    if argv is None:
        start_on_settled_allocator(sys.argv[1:])  # before torch is imported, where it can
    named = command_named(sys.argv[1:] if argv is None else argv)
    if named is None:  # --help, --version or no command: argparse answers and exits here
        build_parser(names_only=True).parse_args(argv)
    args = build_parser(named).parse_args(argv)
    try:
        if argv is None:
            run_on_chosen_allocator(args)
        return args.handler(args)
    except UsageError as exc:
        show_error("error: ", exc)
        return 2
    except TrainingError as exc:  # a StorageError may come from tune or compare too
        show_error("error: " if isinstance(exc, StorageError) else "training stopped: ", exc)
        return 1
    except TrainingInterrupted as exc:
        show_error("", exc)
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("hybriddl: interrupted", markup=False)
        return 130
    except OSError as exc:  # a file or folder no check foresaw: one line naming it
        where = f"{exc.filename}: " if exc.filename else ""
        show_error("error: ", f"{where}{exc.strerror or exc}")
        return 1


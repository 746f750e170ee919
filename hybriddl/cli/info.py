"""`hybriddl info`: this host's cores, RAM, GPUs, library versions and the allocator this
command runs on."""

from __future__ import annotations

import argparse
import json

from hybriddl.cli.commands import COMMANDS
from hybriddl.display import host_table, out


def add_parser(commands) -> argparse.ArgumentParser:
    info = commands.add_parser("info", help=COMMANDS["info"])
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(handler=cmd_info)
    return info


def cmd_info(args: argparse.Namespace) -> int:
    from hybriddl.hosts.mpi import library_versions
    from hybriddl.machine.allocator import loaded_allocator
    from hybriddl.machine.hostinfo import host_info

    info = host_info() | library_versions() | {"allocator": loaded_allocator()}
    if args.json:
        out.print_json(json.dumps(info))
        return 0
    out.print(host_table(info))
    return 0

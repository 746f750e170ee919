"""The flags that name a workload (use case, model, image size, batch) and the emulated
links and Open MPI parameters it runs with: shared by train, tune, compare, emulate and
launch. Apart from flags.py because emulate and launch, which only start processes, import
nothing that loads torch (tests/test_cli.py checks it): these flags quote only the use
cases' data.
"""

from __future__ import annotations

import argparse

from hybriddl.usecases import DEFAULT_USECASE, USECASES, get_usecase


def add_workload_flags(parser: argparse.ArgumentParser, *, batch: str,
                       typed_only: bool = False) -> None:
    """--usecase, --model, --image-size, --batch-size: what every command trains or times.
    `batch` says whose batch --batch-size is; with `typed_only` --usecase is None unless
    typed (train's --resume takes the checkpoint's then)."""
    case = get_usecase(DEFAULT_USECASE)
    parser.add_argument("--usecase", default=None if typed_only else DEFAULT_USECASE,
                        help=f"one of {', '.join(USECASES)} (default: {DEFAULT_USECASE})")
    parser.add_argument("--model", help="any torchvision classifier name (default: the use case's)")
    parser.add_argument("--image-size", type=int,
                        help=f"pixels per side (default: the use case's, {case.image_size})")
    parser.add_argument("--batch-size", type=int, help=f"{batch} (default: the use case's)")


def add_link_flags(parser: argparse.ArgumentParser) -> None:
    """--bandwidth and --latency: every emulated host's link (emulate, compare)."""
    parser.add_argument("--bandwidth", help="every host's link rate in both directions, tc units "
                        "(e.g. 1gbit, 100mbit; default: unlimited)")
    parser.add_argument("--latency", help="every link's one-way delay, tc units (e.g. 0.1ms; "
                        "needs the kernel's netem)")


def add_mca_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mca", nargs=2, action="append", metavar=("KEY", "VALUE"),
                        help="extra Open MPI parameter for mpirun (repeatable)")

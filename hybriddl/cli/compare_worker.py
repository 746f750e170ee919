"""The command line of one rank of an MPI contender of `hybriddl compare` (hybrid or flat),
as compare.compare.plan starts it; the rank's work is hybriddl.compare.worker's.

    mpirun ... python -m hybriddl.cli.compare_worker --strategy S [--workers K] [--overlap] ... --result-dir D
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybriddl.cli.flags import add_data_flags, add_hosts_flags, add_measure_flags, add_strategy_flags
from hybriddl.cli.settings import hosts_options, measure_settings, typed_strategy_options
from hybriddl.cli.workload_flags import add_workload_flags
from hybriddl.compare.settings import MeasureSettings
from hybriddl.display import show_host_failure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybriddl.cli.compare_worker",
                                     description=__doc__.splitlines()[0])
    add_workload_flags(parser, batch="global batch over all hosts and workers")
    add_data_flags(parser, cache=False)
    add_measure_flags(parser, MeasureSettings)
    add_strategy_flags(parser, required=True)
    add_hosts_flags(parser)
    parser.add_argument("--result-dir", required=True, help="where rank<R>.json goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    from hybriddl.compare.stepmeter import write_rank_result
    from hybriddl.compare.worker import measure_training
    from hybriddl.hosts.cluster import connect
    from hybriddl.run.shutdown import stop_every_host
    from hybriddl.strategies import StrategyOptions

    args = build_parser().parse_args(argv)
    settings = measure_settings(args)
    options = StrategyOptions(**typed_strategy_options(args))
    scheme = {"host_parallel": args.host_parallel} if args.host_parallel else {}
    hosts = connect(**hosts_options(args))
    try:
        record = measure_training(settings, args.strategy, options, hosts,
                                  Path(args.result_dir) / "run", **scheme)
        write_rank_result(args.result_dir, hosts.rank, record)
    except BaseException as exc:
        stop_every_host(hosts, exc, show_host_failure)
        raise
    hosts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of an MPI contender of `hybriddl compare` (hybrid or flat).

    mpirun ... python -m hybriddl.compare.worker --strategy S [--workers K] [--overlap] ... --result-dir D

Each rank runs `trainer.run` itself (its local strategy, the fused allreduce, SGD), so
the comparison times exactly what `hybriddl train` does; it counts what its emulated
host's NIC sent over the timed steps. Every rank writes what it measured to D/rank<R>.json; the
run's own metrics.json stays in D/run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from hybriddl.hosts import cluster
from hybriddl.hosts.compression import Compression
from hybriddl.run import trainer
from hybriddl.compare.compare import MeasureSettings
from hybriddl.display import show_host_failure
from hybriddl.rundir import CHECKPOINT, MODEL
from hybriddl.run.shutdown import stop_every_host
from hybriddl.compare.stepmeter import StepMeter, gradient_bytes, write_rank_result
from hybriddl.strategies import StrategyOptions


def measure_training(settings: MeasureSettings, strategy: str, options: StrategyOptions,
                     hosts, run_dir: Path, host_parallel: str = "data") -> dict:
    """Train warm-up plus timed steps with `trainer.run`; this rank's figures."""
    steps = settings.warmup + settings.steps
    # Every epoch has at least one step, so `steps` epochs always reach max_steps.
    config = replace(settings.train_config(strategy, options), run_dir=str(run_dir),
                     max_steps=steps, epochs=steps, host_parallel=host_parallel)
    prepared = trainer.prepare(config, hosts_count=hosts.size)
    meter = StepMeter(settings.warmup, settings.steps, comm_bytes=lambda: hosts.traffic.bytes_sent)
    metrics = trainer.run(prepared, meter, hosts)
    if hosts.rank == 0:
        # The comparison's output is its figures; the trained weights and checkpoint
        # (0.5 and 1 GB for VGG16) would only fill the disk.
        for name in (MODEL, CHECKPOINT):
            (run_dir / name).unlink(missing_ok=True)
    return {**meter.result(), "strategy": metrics["config"]["strategy"],
            "hosts": metrics["config"]["hosts"], "gradient_bytes": gradient_bytes(prepared.model),
            "host_parallel": metrics["config"]["host_parallel"],
            "monitor": metrics.get("monitor")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybriddl.compare.worker",
                                     description=__doc__.splitlines()[0])
    MeasureSettings.add_arguments(parser)
    parser.add_argument("--strategy", required=True, help="the local strategy of every rank")
    parser.add_argument("--workers", type=int, help="local workers K of every rank")
    parser.add_argument("--oversubscribe", action="store_true")
    parser.add_argument("--overlap", action="store_true",
                        help="send gradient buckets while backward runs (as Horovod does)")
    parser.add_argument("--fusion-mib", type=float, default=64, help="fusion buffer size")
    parser.add_argument("--host-parallel", default="data", choices=("auto", "data", "hybrid"),
                        help="as for 'hybriddl train'")
    parser.add_argument("--result-dir", required=True, help="where rank<R>.json goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = MeasureSettings.from_args(args)
    options = StrategyOptions(workers=args.workers, oversubscribe=args.oversubscribe)
    hosts = cluster.connect(overlap=args.overlap, bucket_bytes=int(args.fusion_mib * 2**20),
                            compression=Compression.fp16 if settings.fp16_allreduce
                            else Compression.none)
    try:
        record = measure_training(settings, args.strategy, options, hosts,
                                  Path(args.result_dir) / "run", args.host_parallel)
        write_rank_result(args.result_dir, hosts.rank, record)
    except BaseException as exc:
        stop_every_host(hosts, exc, show_host_failure)
        raise
    hosts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

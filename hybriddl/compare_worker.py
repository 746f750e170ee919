"""One rank of an MPI contender of `hybriddl compare` (hybrid or flat).

    mpirun -np N python -m hybriddl.compare_worker --strategy S [--workers K] ... --result-dir D

Each rank is a host to the MPI layer and runs the trainer's own steps (its local
strategy, the fused allreduce, SGD), so the comparison times exactly what
`hybriddl train` does. Every rank writes what it measured to D/rank<R>.json.
"""

from __future__ import annotations

import argparse
import sys

import torch

from hybriddl import cluster, trainer
from hybriddl.compare import MeasureSettings
from hybriddl.data import BatchTransform, epoch_batches
from hybriddl.stepmeter import StepMeter, gradient_bytes, write_rank_result
from hybriddl.strategies import StrategyOptions


def measure_training(prepared: trainer.PreparedRun, hosts, warmup: int, steps: int) -> dict:
    """Run warm-up and timed optimizer steps of the trainer; this rank's figures."""
    config, split, model = prepared.config, prepared.split, prepared.model
    meter = StepMeter(warmup, steps, comm_bytes=lambda: hosts.bytes_sent)
    with prepared.strategy as strategy:
        strategy.setup(model)
        hosts.broadcast_parameters(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
        transform = BatchTransform(config.image_size)
        epoch = 0
        while meter.remaining:
            batches = epoch_batches(len(split.train), config.batch_size, config.seed, epoch)
            trainer.train_epoch(epoch, batches[: meter.remaining], split, transform, model,
                                strategy, optimizer, hosts, meter)
            epoch += 1
        description = strategy.describe()
    return {**meter.result(), "strategy": description, "hosts": hosts.describe(),
            "gradient_bytes": gradient_bytes(model)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybriddl.compare_worker",
                                     description=__doc__.splitlines()[0])
    MeasureSettings.add_arguments(parser)
    parser.add_argument("--strategy", required=True, help="the local strategy of every rank")
    parser.add_argument("--workers", type=int, help="local workers K of every rank")
    parser.add_argument("--oversubscribe", action="store_true")
    parser.add_argument("--result-dir", required=True, help="where rank<R>.json goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = MeasureSettings.from_args(args)
    options = StrategyOptions(workers=args.workers, oversubscribe=args.oversubscribe)
    hosts = cluster.connect(fp16_allreduce=settings.fp16_allreduce)
    prepared = trainer.prepare(settings.train_config(args.strategy, options))
    record = measure_training(prepared, hosts, settings.warmup, settings.steps)
    write_rank_result(args.result_dir, hosts.rank, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

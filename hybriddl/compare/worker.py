"""One rank of an MPI contender of `hybriddl compare` (hybrid or flat); its command line is
hybriddl.cli.compare_worker:

    mpirun ... python -m hybriddl.cli.compare_worker --strategy S [--workers K] [--overlap] ... --result-dir D

Each rank runs `trainer.run` itself (its local strategy, the fused allreduce, SGD), so
the comparison times exactly what `hybriddl train` does; it counts what its emulated
host's NIC sent over the timed steps. Every rank writes what it measured to D/rank<R>.json; the
run's own metrics.json stays in D/run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hybriddl.compare.settings import MeasureSettings
from hybriddl.compare.stepmeter import StepMeter, gradient_bytes
from hybriddl.hybrid.parallel import DataParallel
from hybriddl.run import trainer
from hybriddl.strategies import StrategyOptions


def measure_training(settings: MeasureSettings, strategy: str, options: StrategyOptions,
                     hosts, run_dir: Path, host_parallel: str = DataParallel.name) -> dict:
    """Train warm-up plus timed steps with `trainer.run`; this rank's figures."""
    steps = settings.warmup + settings.steps
    # Every epoch has at least one step, so `steps` epochs always reach max_steps.
    config = replace(settings.train_config(strategy, options), run_dir=str(run_dir),
                     max_steps=steps, epochs=steps, host_parallel=host_parallel,
                     compression=hosts.compression.name)  # as connect was told
    prepared = trainer.prepare(config, hosts=hosts)
    meter = StepMeter(settings.warmup, settings.steps, comm_bytes=lambda: hosts.traffic.bytes_sent)
    # The comparison's output is its figures: no checkpoint (1 GB for VGG16), validation
    # or trained weights, which took a rank's time and its disk between contenders.
    metrics = trainer.run(prepared, meter, hosts, figures_only=True)
    return {**meter.result(), "strategy": metrics["config"]["strategy"],
            "hosts": metrics["config"]["hosts"], "gradient_bytes": gradient_bytes(prepared.model),
            "host_parallel": metrics["config"]["host_parallel"],
            "plan": metrics["config"].get("plan"),
            "monitor": metrics.get("monitor")}

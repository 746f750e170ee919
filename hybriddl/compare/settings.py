"""What a comparison is given: the workload every contender measures (`MeasureSettings`)
and the emulated hosts, workers and contenders (`CompareConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybriddl.run.settings import TrainConfig
from hybriddl.strategies import IntraOp, StrategyOptions
from hybriddl.usecases import DEFAULT_USECASE, NamesAUseCase, use_case_workload

FLAT_MPI, FLAT_RING = "flat-mpi", "flat-ring"
CONTENDERS = ("hybrid", "data", FLAT_MPI, FLAT_RING, "ddp")


@dataclass(frozen=True)
class MeasureSettings(NamesAUseCase):
    """What every contender is given: the same model, data, batch, image size and steps."""

    usecase: str = DEFAULT_USECASE
    model: str | None = None
    data: str = TrainConfig.data  # train's defaults, where train has the flag
    image_size: int | None = None
    batch_size: int | None = None  # global batch, over all hosts and workers
    steps: int = 5  # timed steps
    warmup: int = 1
    seed: int = TrainConfig.seed
    fp16_allreduce: bool = False

    def to_argv(self) -> list[str]:
        argv = ["--usecase", self.usecase, "--data", self.data, "--steps", str(self.steps),
                "--warmup", str(self.warmup), "--seed", str(self.seed)]
        for flag, value in (("--model", self.model), ("--image-size", self.image_size),
                            ("--batch-size", self.batch_size)):
            if value is not None:
                argv += [flag, str(value)]
        return argv + (["--fp16-allreduce"] if self.fp16_allreduce else [])

    def resolved(self) -> MeasureSettings:
        """The use case's model, image size and batch where left out, checked as for train."""
        model, image_size, batch_size = use_case_workload(self.usecase, self.model,
                                                          self.image_size, self.batch_size)
        return replace(self, model=model, image_size=image_size, batch_size=batch_size)

    def train_config(self, strategy: str, options: StrategyOptions = StrategyOptions()) -> TrainConfig:
        """The trainer's configuration for one contender's ranks (no run directory is written)."""
        return TrainConfig(usecase=self.usecase, model=self.model, data=self.data,
                           image_size=self.image_size, batch_size=self.batch_size,
                           seed=self.seed, strategy=strategy, strategy_options=options)


@dataclass(frozen=True)
class CompareConfig:
    settings: MeasureSettings = field(default_factory=MeasureSettings)
    hosts: int = 2  # H
    workers_per_host: int = 2  # K
    # The hybrid hosts' strategy: one that runs the convolutions apart from the classifier,
    # so the hybrid contender splits it (worker processes cannot: with them the hybrid
    # contender averages the whole gradient, as data does, and the table says so). intraop
    # was the fastest local strategy for AlexNet in scripts/scaling_e2e.py's cells.
    local_strategy: str = IntraOp.name
    contenders: tuple[str, ...] = CONTENDERS
    output: str | None = None
    bandwidth: str | None = None  # every host's link rate, tc's units (1gbit)
    latency: str | None = None  # every link's one-way delay (needs netem)

    @property
    def workers(self) -> int:
        return self.hosts * self.workers_per_host


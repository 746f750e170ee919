"""What a comparison is given: the workload every contender measures (`MeasureSettings`)
and the emulated hosts, workers and contenders (`CompareConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybriddl.hosts.compression import EXACT, FP16Compression
from hybriddl.hosts.powersgd import PowerSGD
from hybriddl.run.settings import TrainConfig
from hybriddl.strategies import IntraOp, StrategyOptions
from hybriddl.usecases import DEFAULT_USECASE, NamesAUseCase, use_case_workload

FLAT_MPI, FLAT_RING = "flat-mpi", "flat-ring"
DDP_FP16, DDP_POWERSGD, FLAT_FP16 = "ddp-fp16", "ddp-powersgd", "flat-fp16"
HYBRID_POWERSGD, DATA_POWERSGD = "hybrid-powersgd", "data-powersgd"
# The registered schemes the compressed contenders (and their DDP peers) send gradients in.
FP16, POWERSGD = FP16Compression.name, PowerSGD.name


@dataclass(frozen=True)
class ContenderKind:
    """What one contender runs: a scheme (how its hosts average, compare.plan's launches) and
    what its gradients look like on the wire (none, fp16, powersgd at CompareConfig's rank)."""

    scheme: str
    compression: str = EXACT


# Every contender compare knows, by name; a compressed one is its scheme with a compression.
KNOWN = {name: ContenderKind(name) for name in ("hybrid", "data", FLAT_MPI, FLAT_RING, "ddp")}
KNOWN |= {DDP_FP16: ContenderKind("ddp", FP16),  # torch's fp16_compress_hook
          DDP_POWERSGD: ContenderKind("ddp", POWERSGD),  # torch's powerSGD_hook
          FLAT_FP16: ContenderKind(FLAT_MPI, FP16),  # Horovod's Compression.fp16
          # hybriddl's own PowerSGD (--compression powersgd:R): the hybrid's on its
          # convolutions' gradients, data's on the whole gradient.
          HYBRID_POWERSGD: ContenderKind("hybrid", POWERSGD),
          DATA_POWERSGD: ContenderKind("data", POWERSGD)}


def idle_powersgd_rank(rank: int | None, contenders) -> str | None:
    """The line that says a --powersgd-rank typed does nothing: no contender is PowerSGD."""
    if rank is None or any(KNOWN[name].compression == POWERSGD for name in contenders):
        return None
    with_rank = ", ".join(name for name, kind in KNOWN.items() if kind.compression == POWERSGD)
    return (f"--powersgd-rank {rank} does nothing: no contender runs PowerSGD (these do: "
            f"{with_rank})")


# What runs when --contenders is left out: the exact contenders. The compressed peers
# are asked for by name (each is one more run).
CONTENDERS = tuple(name for name, c in KNOWN.items() if c.compression == EXACT)


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
        """The trainer's configuration for one contender's ranks (no run directory is
        written), resolved."""
        return TrainConfig(usecase=self.usecase, model=self.model, data=self.data,
                           image_size=self.image_size, batch_size=self.batch_size,
                           seed=self.seed, strategy=strategy, strategy_options=options).resolved()


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
    # The rank of every powersgd contender; 2 matched full SGD on ResNet-18 / CIFAR-10
    # (Vogels et al., NeurIPS 2019).
    powersgd_rank: int = 2

    @property
    def workers(self) -> int:
        return self.hosts * self.workers_per_host


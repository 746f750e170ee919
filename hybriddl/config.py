"""A run's settings, settled before anything starts: use-case defaults, checks, --resume.

`train`, `tune` and `compare` all read their settings through here, so a default or a
check lives in one place; the trainer receives a finished TrainConfig and never changes it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field, fields, replace

from hybriddl.errors import UsageError
from hybriddl.hosts.base import DEFAULT_TIMEOUT_SECONDS
from hybriddl.hosts.compression import Compression
from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES
from hybriddl.hybrid.parallel import HOST_PARALLEL
from hybriddl.run import checkpoint
from hybriddl.strategies import PRECISIONS, STRATEGIES, StrategyOptions
from hybriddl.strategies.base import CoreWorkersStrategy
from hybriddl.tuning.profiles import Settings
from hybriddl.tuning.tuner import AUTO, AUTO_BUDGET_SECONDS, NUMERICS, auto_strategy
from hybriddl.usecases import get_usecase

DEFAULT_USECASE = "ComplexSmall"


def use_case_workload(usecase: str, model: str | None, image_size: int | None,
                      batch_size: int | None) -> tuple[str, int, int]:
    """The model, image size and batch, the use case's where left out, checked: what
    train, tune and compare all start from."""
    case = get_usecase(usecase)
    model = model or case.model
    image_size = image_size if image_size is not None else case.image_size
    batch_size = batch_size if batch_size is not None else case.batch_size
    for flag, value in (("--batch-size", batch_size), ("--image-size", image_size)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give at least 1")
    return model, image_size, batch_size


def tune_settings(usecase: str, model: str | None = None, image_size: int | None = None,
                  batch_size: int | None = None, precision: str | None = None,
                  accumulate: int | None = None) -> Settings:
    """What a profile is measured at: the use case's defaults for what was left out
    (precision: fp32, accumulate: 1), every number checked as for training."""
    precision = precision or "fp32"
    if precision not in NUMERICS:
        raise UsageError(f"--precision {precision}: choose one of {', '.join(NUMERICS)}")
    model, image_size, batch_size = use_case_workload(usecase, model, image_size, batch_size)
    accumulate = 1 if accumulate is None else accumulate
    check_accumulate(accumulate, batch_size)
    return Settings(usecase=get_usecase(usecase).name, model=model, image_size=image_size,
                    batch_size=batch_size, precision=precision, accumulate=accumulate)


def check_accumulate(accumulate: int, batch_size: int) -> None:
    if not 1 <= accumulate <= batch_size:
        raise UsageError(f"--accumulate {accumulate}: give 1 to the batch size ({batch_size}); "
                         "each chunk needs a sample")


@dataclass
class TrainConfig:
    usecase: str = DEFAULT_USECASE
    model: str | None = None  # None: the use case's model
    data: str = "synthetic"
    data_cache: str | None = None  # None: hybriddl.data.cache.default_cache_dir()
    strict_data: bool = False  # a file that is no usable image stops the run (data/loading.py)
    classes: int | None = None
    val_fraction: float = 0.2
    image_size: int | None = None
    batch_size: int | None = None  # the global batch
    epochs: int | None = None
    lr: float | None = None
    momentum: float | None = None
    dropout: float | None = None  # None: torchvision's default
    seed: int = 0
    max_steps: int | None = None
    run_dir: str | None = None
    checkpoint_every: int | None = None  # steps; a checkpoint ends every epoch regardless
    strategy: str = AUTO  # this host's profiled pick (tuning/tuner.py), or a strategy's name
    strategy_options: StrategyOptions = field(default_factory=StrategyOptions)
    profile_dir: str | None = None  # None: $HYBRIDDL_PROFILES or ./profiles
    tune_budget: float = AUTO_BUDGET_SECONDS  # when auto finds no usable profile
    monitor_interval: float = 1.0  # seconds between monitor samples; 0 disables
    balance: str | None = None  # hosts' shares: "throughput", "even"; None: decide (hosts/base.py)
    throughput: float | None = None  # this host's images/s (its profile's) for --balance
    host_parallel: str = "auto"  # across hosts: "data", "hybrid" or "auto" (hybrid/parallel.py)
    weights: str | None = None  # a state_dict to start from (run/weights.py); None: fresh

    def resolved(self) -> TrainConfig:
        """Fill what was left out from the use case, and check every number."""
        case = get_usecase(self.usecase)
        filled = TrainConfig(**{**asdict(self), "strategy_options": self.strategy_options})
        filled.model, filled.image_size, filled.batch_size = use_case_workload(
            self.usecase, self.model, self.image_size, self.batch_size)
        filled.epochs = self.epochs if self.epochs is not None else case.epochs
        filled.lr = self.lr if self.lr is not None else case.lr
        filled.momentum = self.momentum if self.momentum is not None else case.momentum
        if filled.epochs < 1:
            raise UsageError(f"--epochs {filled.epochs}: give at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError(f"--max-steps {self.max_steps}: give at least 1")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every {self.checkpoint_every}: give at least 1 step")
        if not 0 <= self.monitor_interval < float("inf"):
            raise UsageError(f"--monitor-interval {self.monitor_interval}: give seconds >= 0 "
                             "(0 disables monitoring)")
        options = self.strategy_options
        if self.strategy == AUTO and (options.workers is not None or options.devices
                                      or options.channels_last):
            raise UsageError("--workers, --devices and --channels-last go with a named "
                             "--strategy; with auto the profile decides (or name the strategy)")
        check_accumulate(options.accumulate, filled.batch_size)
        if not math.isfinite(filled.lr) or filled.lr <= 0:
            raise UsageError(f"--lr {filled.lr}: give a positive, finite learning rate")
        if not 0 <= filled.momentum < 1:
            raise UsageError(f"--momentum {filled.momentum}: give a value in [0, 1)")
        if filled.host_parallel not in HOST_PARALLEL:
            raise UsageError(f"--host-parallel {filled.host_parallel}: choose one of "
                             f"{', '.join(HOST_PARALLEL)}")
        return filled


# The command line's training flags are TrainConfig's fields, under the same names.
TRAINING_FLAGS = tuple(f.name for f in fields(TrainConfig) if f.name != "strategy_options")


def given_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the user typed; strategy_options holds the typed options."""
    given = {name: getattr(args, name) for name in TRAINING_FLAGS
             if getattr(args, name) is not None}
    devices = tuple(d.strip() for d in args.devices.split(",")) if args.devices else None
    options = {"workers": args.workers, "micro_batches": args.micro_batches, "devices": devices,
               "oversubscribe": args.oversubscribe or None, "precision": args.precision,
               "channels_last": args.channels_last or None,
               "accumulate": getattr(args, "accumulate", None)}
    given["strategy_options"] = {k: v for k, v in options.items() if v is not None}
    return given


def add_numerics_args(parser: argparse.ArgumentParser, *, channels_last: bool) -> None:
    """--precision (train and tune) and --channels-last (train): the strategy's numerics."""
    parser.add_argument("--precision", choices=(*PRECISIONS, AUTO),
                        help="fp32 (default); bf16: autocast forward, float32 weights and "
                             "optimizer; auto: the tuner tries both (with --strategy auto)")
    if channels_last:
        parser.add_argument("--channels-last", action="store_true",
                            help="images and convolution weights in channels_last memory "
                                 "format (with a named --strategy; auto decides itself)")


def add_accumulate_arg(parser: argparse.ArgumentParser, where: str) -> None:
    """--accumulate (train and tune): gradient accumulation, a strategy option."""
    parser.add_argument("--accumulate", type=int, metavar="N",
                        help="compute each host batch in N sequential chunks and add their "
                             "gradients: the same step with activations for one chunk at a "
                             f"time (less memory; default: 1); {where}")


def resume_if_exists(args: argparse.Namespace) -> bool:
    """Turn --resume-if-exists into --resume or --run-dir; False if its run already finished."""
    run_dir = args.resume_if_exists
    if run_dir is None:
        return True
    if args.resume is not None or args.run_dir not in (None, run_dir):
        raise UsageError(f"--resume-if-exists {run_dir} names the run directory already: leave "
                         "--resume and --run-dir out")
    state = checkpoint.run_state(run_dir)
    if state == checkpoint.FINISHED:
        return False
    if state == checkpoint.RESUMABLE:
        args.resume, args.run_dir = run_dir, None
    else:
        args.run_dir = run_dir
    return True


def training_config(args: argparse.Namespace):
    """The run's TrainConfig, and with --resume the checkpoint it continues from."""
    settings, resume = given_settings(args), None
    if args.resume is not None:
        if args.run_dir is not None and args.run_dir != args.resume:
            raise UsageError(f"--run-dir {args.run_dir} and --resume {args.resume}: a resumed "
                             "run continues in its own directory; leave --run-dir out")
        resume = checkpoint.load(args.resume)
        settings = checkpoint.resumed_settings(resume, settings, args.resume)
    else:
        settings.setdefault("strategy", AUTO)
    options = StrategyOptions(**settings.pop("strategy_options"))
    known = {f.name for f in fields(TrainConfig)}
    settings = {name: value for name, value in settings.items() if name in known}
    return TrainConfig(**settings, strategy_options=options), resume


def auto_pick(config: TrainConfig, images, observer, hosts_count: int) -> tuple[TrainConfig, dict]:
    """`--strategy auto` settled: this host's profiled pick (tuned first when no profile fits).

    The profile is measured at this host's share of the global batch. Returns the
    config naming the picked strategy (and, unless given, this host's images/s for
    --balance throughput) and the record of the choice for metrics.json.
    """
    host_batch = -(-config.batch_size // hosts_count)
    decision = auto_strategy(tune_settings(config.usecase, config.model, config.image_size,
                                           host_batch, config.strategy_options.precision,
                                           config.strategy_options.accumulate),
                             images, directory=config.profile_dir, budget=config.tune_budget,
                             observer=observer)
    throughput = (config.throughput if config.throughput is not None
                  else decision.profile.pick_result.images_per_second)
    # The profile was measured with the run's --accumulate (it is one of its settings).
    settled = replace(config, strategy=decision.choice.name, throughput=throughput,
                      strategy_options=decision.choice.options(config.strategy_options.oversubscribe))
    return settled, {**decision.describe(), "message": decision.message()}


# The across-hosts flags, which do something only when there are other hosts.
HOSTS_FLAGS = {"overlap": "--overlap", "fp16_allreduce": "--fp16-allreduce",
               "fusion_mib": "--fusion-mib", "host_timeout": "--host-timeout",
               "balance": "--balance", "throughput": "--throughput"}


def hosts_options(args: argparse.Namespace) -> dict:
    """`hosts.cluster.connect`'s keywords from the across-hosts flags."""
    return {"overlap": args.overlap,
            "compression": Compression.fp16 if args.fp16_allreduce else Compression.none,
            "bucket_bytes": (DEFAULT_BUCKET_BYTES if args.fusion_mib is None
                             else int(args.fusion_mib * 2**20)),
            "timeout": DEFAULT_TIMEOUT_SECONDS if args.host_timeout is None else args.host_timeout}


def ignored_flags(args: argparse.Namespace, config: TrainConfig, hosts_count: int) -> list[str]:
    """One line for each flag given that does nothing in this run, so none is ignored silently."""
    lines = []
    strategy = STRATEGIES.get(config.strategy)
    if args.workers is not None and strategy and not issubclass(strategy, CoreWorkersStrategy):
        with_workers = ", ".join(name for name, cls in STRATEGIES.items()
                                 if issubclass(cls, CoreWorkersStrategy))
        lines.append(f"--workers {args.workers} does nothing with --strategy {config.strategy}, "
                     f"which has no local workers (these have: {with_workers})")
    if hosts_count == 1:
        lines += [f"{flag} does nothing on a single host: it acts when mpirun starts one rank "
                  "on each of several hosts"
                  for name, flag in HOSTS_FLAGS.items() if getattr(args, name) not in (None, False)]
    return lines

"""A run's settings, settled before anything starts: `TrainConfig`, the use case's defaults
filled in and every number checked. The trainer receives a resolved TrainConfig and never
changes it. `settled_config` makes one from the settings typed (hybriddl.cli.settings reads
the command line into them) and, with --resume, the checkpoint's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from hybriddl.errors import UsageError
from hybriddl.hosts.compression import EXACT, parse_compression
from hybriddl.hybrid.parallel import HOST_PARALLEL
from hybriddl.hybrid.planner import FEATURE_DTYPES
from hybriddl.run import resumption
from hybriddl.strategies import StrategyOptions, idle_devices, idle_workers
from hybriddl.strategies.spec import check_accumulate
from hybriddl.tuning.tuner import AUTO, AUTO_BUDGET_SECONDS
from hybriddl.usecases import DEFAULT_USECASE, NamesAUseCase, use_case_workload


@dataclass(frozen=True)
class TrainConfig(NamesAUseCase):
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
    # What gradients look like on the wire (hosts/compression.py): a registered scheme's
    # text (EXACT, the default, sends them as they are), or "auto" (the planner's pick).
    compression: str = EXACT
    # The split's features and their gradients on the wire (--feature-dtype, hybrid only):
    # "float32" (exact), "bfloat16"; None: float32, or the planner's under --compression auto.
    feature_dtype: str | None = None
    # Time to accuracy (run/target.py): the validation accuracy timed, in (0, 1]; validation
    # every N steps besides every epoch's end; the run ended once the target is reached.
    target_accuracy: float | None = None
    eval_every: int | None = None
    stop_at_target: bool = False
    # Hosts checked to hold the same model (hosts/replicas.py): every N steps (None: as
    # often as costs 1% of a step) and at every epoch's end; a mismatch stops the run.
    check_every: int | None = None
    strict_equal: bool = False

    def resolved(self) -> TrainConfig:
        """Fill what was left out from the use case, and check every number."""
        case = self.case
        model, image_size, batch_size = use_case_workload(
            self.usecase, self.model, self.image_size, self.batch_size)
        filled = replace(self, model=model, image_size=image_size, batch_size=batch_size,
                         epochs=self.epochs if self.epochs is not None else case.epochs,
                         lr=self.lr if self.lr is not None else case.lr,
                         momentum=self.momentum if self.momentum is not None else case.momentum)
        if filled.epochs < 1:
            raise UsageError(f"--epochs {filled.epochs}: give at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError(f"--max-steps {self.max_steps}: give at least 1")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every {self.checkpoint_every}: give at least 1 step")
        if not 0 < self.tune_budget < float("inf"):  # nan too
            raise UsageError(f"--tune-budget {self.tune_budget}: give a positive number of "
                             "seconds")
        if not 0 <= self.seed < 2 ** 63:  # torch's seeds are 64-bit
            raise UsageError(f"--seed {self.seed}: give a whole number from 0 to 2**63 - 1")
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
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise UsageError(f"--target-accuracy {self.target_accuracy}: give a validation "
                             "accuracy in (0, 1], e.g. 0.9")
        if self.eval_every is not None and self.eval_every < 1:
            raise UsageError(f"--eval-every {self.eval_every}: give at least 1 step (left "
                             "out, validation runs at every epoch's end)")
        if self.check_every is not None and self.check_every < 1:
            raise UsageError(f"--check-every {self.check_every}: give at least 1 step (left "
                             "out, as often as costs 1% of a step)")
        if self.stop_at_target and self.target_accuracy is None:
            raise UsageError("--stop-at-target needs --target-accuracy A: the accuracy to "
                             "stop at")
        parse_compression(filled.compression)  # auto: the planner settles it at start
        if filled.feature_dtype is not None and filled.feature_dtype not in FEATURE_DTYPES:
            raise UsageError(f"--feature-dtype {filled.feature_dtype}: choose one of "
                             f"{', '.join(FEATURE_DTYPES)}")
        if filled.host_parallel not in HOST_PARALLEL:
            raise UsageError(f"--host-parallel {filled.host_parallel}: choose one of "
                             f"{', '.join(HOST_PARALLEL)}")
        return filled


def settled_config(given: dict, resume: str | None = None
                   ) -> tuple[TrainConfig, resumption.Checkpoint | None, list[str]]:
    """The run's TrainConfig from the settings typed (`given`: TrainConfig's fields, its
    strategy_options a dict of the options typed) and, resuming the run in `resume`, its
    checkpoint's settings under them, resolved; that checkpoint (None for a new run); and a
    line for each of its settings that does nothing in it (whatever the hosts)."""
    settings, checkpoint = dict(given), None
    if resume is not None:
        checkpoint = resumption.load(resume)
        settings = resumption.resumed_settings(checkpoint, settings, resume)
    else:
        settings.setdefault("strategy", AUTO)
    options = StrategyOptions(**settings.pop("strategy_options", {}))
    known = {f.name for f in fields(TrainConfig)}
    settings = {name: value for name, value in settings.items() if name in known}
    config = TrainConfig(**settings, strategy_options=options).resolved()
    if checkpoint is not None:
        done = checkpoint.position
        # Fewer than it has done would train a whole epoch more (no step is taken back).
        if config.max_steps is not None and config.max_steps < done.steps_done:
            raise UsageError(f"--max-steps {config.max_steps}: the run in {resume} has done "
                             f"{done.steps_done} steps already; give more to continue it, "
                             "or leave --max-steps out")
        if config.epochs < done.epoch:
            raise UsageError(f"--epochs {config.epochs}: the run in {resume} has done "
                             f"{done.epoch} epochs already; give more to continue it, or "
                             "leave --epochs out")
        if config.epochs == done.epoch and done.step > 0:  # it has trained past them
            raise UsageError(f"--epochs {config.epochs}: the run in {resume} is {done.step} "
                             f"step(s) into epoch {done.epoch + 1} already; give more to "
                             "continue it, or leave --epochs out")
    idle = [line for line in (
        idle_workers(config.strategy, options.workers),
        idle_devices(config.strategy, options.devices),
        "--val-fraction does nothing with --data synthetic, whose validation images are fixed"
        if "val_fraction" in given and config.data == "synthetic" else None) if line]
    return config, checkpoint, idle

"""The training loop: data, forward/backward (by the host's strategy), average, step, log.

One step reads like the paper's description of it: the host takes its part of the
global batch, its local strategy leaves the host's mean gradient in the master
parameters, the hosts average those gradients, and every host applies the same SGD
update. Nothing here knows which strategy ran.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybriddl import data as datamod
from hybriddl.cluster import SingleHost
from hybriddl.errors import TrainingError, UsageError
from hybriddl.rundir import (CHECKPOINT, METRICS, MODEL, atomic_write_json, atomic_torch_save,
                             check_new_run_dir, default_run_dir)
from hybriddl.strategies import LocalStrategy, StrategyOptions, make_strategy
from hybriddl.usecases import build_model, check_image_size, get_usecase


@dataclass
class TrainConfig:
    usecase: str = "ComplexSmall"
    model: str | None = None  # None: the use case's model
    data: str = "synthetic"
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
    strategy: str = "sequential"
    strategy_options: StrategyOptions = field(default_factory=StrategyOptions)

    def resolved(self) -> TrainConfig:
        """Fill what was left out from the use case, and check every number."""
        case = get_usecase(self.usecase)
        filled = TrainConfig(**{**asdict(self), "strategy_options": self.strategy_options})
        filled.model = self.model or case.model
        filled.image_size = self.image_size if self.image_size is not None else case.image_size
        filled.batch_size = self.batch_size if self.batch_size is not None else case.batch_size
        filled.epochs = self.epochs if self.epochs is not None else case.epochs
        filled.lr = self.lr if self.lr is not None else case.lr
        filled.momentum = self.momentum if self.momentum is not None else case.momentum
        for flag, value, low in (("--batch-size", filled.batch_size, 1), ("--epochs", filled.epochs, 1),
                                 ("--image-size", filled.image_size, 1)):
            if value < low:
                raise UsageError(f"{flag} {value}: give at least {low}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError(f"--max-steps {self.max_steps}: give at least 1")
        if filled.lr <= 0:
            raise UsageError(f"--lr {filled.lr}: give a positive learning rate")
        if not 0 <= filled.momentum < 1:
            raise UsageError(f"--momentum {filled.momentum}: give a value in [0, 1)")
        return filled


class TrainingObserver:
    """What the trainer reports while it runs; the CLI draws it, tests may record it."""

    def on_data_progress(self, done: int, total: int) -> None: ...
    def on_start(self, info: dict) -> None: ...
    def on_epoch_start(self, epoch: int, steps: int) -> None: ...
    def on_step(self, epoch: int, step: int, samples: int, seconds: float, loss: float) -> None: ...
    def on_epoch_end(self, record: dict) -> None: ...


@dataclass
class PreparedRun:
    """Everything checked and loaded; nothing written yet."""

    config: TrainConfig
    split: datamod.DataSplit
    model: torch.nn.Module
    strategy: LocalStrategy
    run_dir: Path


def prepare(config: TrainConfig, observer: TrainingObserver | None = None) -> PreparedRun:
    """Validate the whole configuration and load the data before any file is written."""
    observer = observer or TrainingObserver()
    config = config.resolved()
    case = get_usecase(config.usecase)
    run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(config.usecase)
    check_new_run_dir(run_dir)
    strategy = make_strategy(config.strategy, config.strategy_options)
    split = datamod.load_data(config.data, variant=case.dataset, image_size=config.image_size,
                              classes=config.classes, val_fraction=config.val_fraction,
                              progress=observer.on_data_progress)
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(split.classes), config.dropout)
    check_image_size(model, config.image_size, len(split.classes))
    return PreparedRun(config, split, model, strategy, run_dir)


def run(prepared: PreparedRun, observer: TrainingObserver | None = None,
        hosts=None) -> dict:
    """Train; returns the metrics dict that is also written to metrics.json."""
    observer = observer or TrainingObserver()
    hosts = hosts or SingleHost()
    config, split, model, strategy = prepared.config, prepared.split, prepared.model, prepared.strategy
    transform = datamod.BatchTransform(config.image_size)
    run_dir = prepared.run_dir
    metrics = {"config": config_record(prepared, hosts), "epochs": []}
    steps_done = 0
    with strategy:
        strategy.setup(model)
        hosts.broadcast_parameters(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
        if hosts.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / METRICS, metrics)
        observer.on_start(metrics["config"])
        for epoch in range(config.epochs):
            batches = datamod.epoch_batches(len(split.train), config.batch_size, config.seed, epoch)
            if config.max_steps is not None:
                batches = batches[: config.max_steps - steps_done]
            if not batches:
                break
            record = train_epoch(epoch, batches, split, transform, model, strategy, optimizer,
                                 hosts, observer)
            steps_done += record["steps"]
            record["val_accuracy"] = evaluate(strategy, split.val, transform,
                                              2 * config.batch_size)
            metrics["epochs"].append(record)
            if hosts.rank == 0:
                atomic_write_json(run_dir / METRICS, metrics)
            observer.on_epoch_end(record)
            if config.max_steps is not None and steps_done >= config.max_steps:
                break
        if hosts.rank == 0:
            atomic_torch_save(run_dir / MODEL, model.state_dict())
    return metrics


def train_epoch(epoch, batches, split, transform, model, strategy, optimizer, hosts,
                observer) -> dict:
    model.train()
    observer.on_epoch_start(epoch, len(batches))
    started = time.perf_counter()
    loss_sum, samples = 0.0, 0
    host_part = hosts.host_part
    with datamod.BatchPrefetcher(split.train, batches, transform, part=host_part) as prefetch:
        for batch, x, y in prefetch:
            step_started = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            stats = strategy.compute_gradients(x, y)
            if not torch.isfinite(torch.tensor(stats.loss)):
                raise TrainingError(f"loss became {stats.loss} at epoch {epoch + 1}, step "
                                    f"{batch.step + 1}: lower --lr")
            hosts.average_gradients(model, stats.samples)
            optimizer.step()
            strategy.after_step()
            loss_sum += stats.loss_sum
            samples += stats.samples
            observer.on_step(epoch, batch.step, len(batch.indices),
                             time.perf_counter() - step_started, stats.loss)
        data_wait = prefetch.wait_seconds
    seconds = time.perf_counter() - started
    global_samples = sum(len(b.indices) for b in batches)
    return {"epoch": epoch + 1, "steps": len(batches), "samples": global_samples,
            "seconds": seconds, "images_per_second": global_samples / seconds,
            "train_loss": hosts.mean_over_hosts(loss_sum, samples),
            "data_wait_seconds": data_wait, "mpi_bytes_sent": hosts.bytes_sent}


def evaluate(strategy: LocalStrategy, images: datamod.ImageSet, transform, batch_size: int) -> float:
    """Validation accuracy of the current master parameters (no augmentation)."""
    model = strategy.model
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(images), batch_size):
        x = transform(images.images[start:start + batch_size])
        logits = strategy.evaluate(x)
        correct += int((logits.argmax(1) == images.labels[start:start + batch_size]).sum())
    model.train(was_training)
    return correct / len(images)


def config_record(prepared: PreparedRun, hosts) -> dict:
    config = prepared.config
    return {
        "usecase": config.usecase, "model": config.model, "data": datamod.describe(prepared.split),
        "strategy": prepared.strategy.describe(), "hosts": hosts.describe(),
        "global_batch": config.batch_size, "image_size": config.image_size,
        "epochs": config.epochs, "max_steps": config.max_steps, "lr": config.lr,
        "momentum": config.momentum, "dropout": config.dropout, "seed": config.seed,
        "torch": torch.__version__, "python": platform.python_version(),
    }

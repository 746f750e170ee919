"""The one contract every local strategy keeps (ARCHITECTURE.md).

After `compute_gradients(x, y)` the master model's `.grad` fields hold the **mean
gradient over the host's batch**, exactly what sequential SGD would have. The
trainer, the MPI layer, the optimizer and checkpoints rely on nothing else.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from hybriddl.strategies.resources import local_workers
from hybriddl.strategies.spec import StrategyOptions


@dataclass
class StepStats:
    samples: int
    loss_sum: float  # sum of per-sample losses; mean loss = loss_sum / samples
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.samples, 1)


def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The use cases' loss: cross-entropy, mean over the (sub-)batch."""
    return F.cross_entropy(logits, targets)


class LocalStrategy(ABC):
    """How one host computes the gradient of its batch."""

    name: str = ""
    # True when one backward pass in this process writes each master parameter's .grad
    # exactly once per step (no sub-batch accumulation into it): a hook run after that
    # write sees the host's final mean gradient, so hosts may send it while backward
    # still runs (--overlap). Strategies that accumulate or copy gradients keep False.
    writes_gradients_once: bool = False

    def __init__(self, options: StrategyOptions = StrategyOptions()):
        self.options = options
        self.model: nn.Module | None = None

    @classmethod
    def check_feasible(cls, options: StrategyOptions) -> None:
        """Raise UsageError, before anything starts, when this host cannot run it."""

    def describe(self) -> dict:
        """The strategy and its parameters, as recorded in metrics.json and profiles."""
        return {"name": self.name}

    @property
    def device(self) -> torch.device:
        """Where inputs go for evaluation and where the master parameters live."""
        return torch.device("cpu")

    def setup(self, model: nn.Module) -> None:
        """Place the model and start local workers; `model` holds the master parameters."""
        self.model = model

    @abstractmethod
    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        """Leave the mean gradient over (x, y) in the master parameters' .grad."""

    def after_step(self) -> None:
        """Called after the optimizer updated the master parameters."""

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for x in eval mode (validation); strategies may override for speed."""
        assert self.model is not None
        with torch.no_grad():
            return self.model(x.to(self.device)).cpu()

    def close(self) -> None:
        """Stop every worker; safe to call twice and after a failed setup."""

    def __enter__(self) -> LocalStrategy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CoreWorkersStrategy(LocalStrategy):
    """A strategy with K local workers on CPU cores (K = --workers, checked up front)."""

    @classmethod
    def check_feasible(cls, options: StrategyOptions) -> None:
        local_workers(options)

    def __init__(self, options: StrategyOptions = StrategyOptions()):
        super().__init__(options)
        self.workers = local_workers(options)

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers}


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepStats:
    """One forward and backward of the whole batch: the mean gradient lands in .grad."""
    started = time.perf_counter()
    loss = criterion(model(x), y)
    loss.backward()
    return StepStats(len(y), loss.item() * len(y), time.perf_counter() - started)

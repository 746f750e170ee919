"""The GPU baseline: the plain loop, with the model on one CUDA device."""

from __future__ import annotations

import time

import torch

from hybriddl.errors import UsageError
from hybriddl.strategies.base import LocalStrategy, PlainConvolutions, StepStats, criterion, run_forward
from hybriddl.strategies.resources import parse_devices, require_cuda
from hybriddl.strategies.spec import StrategySpec


class Gpu(PlainConvolutions, LocalStrategy):
    name = "gpu"
    summary = "one GPU, the plain loop: the GPU baseline"
    needs_gpu = True

    @classmethod
    def tuning_candidates(cls, host, batch_size: int) -> list[StrategySpec]:
        return [StrategySpec(cls.name, devices=(device,)) for device in host.gpus]
    writes_gradients_once = True  # one backward pass: buckets may leave during it

    @classmethod
    def check_feasible(cls, options) -> None:
        require_cuda(cls.name)
        devices = parse_devices(options, ("cuda:0",))
        if len(devices) != 1 or devices[0].type != "cuda":
            raise UsageError(f"--devices {','.join(options.devices)}: strategy 'gpu' takes one "
                             "CUDA device, e.g. --devices cuda:0")

    def __init__(self, options):
        super().__init__(options)
        self._device = parse_devices(options, ("cuda:0",))[0]

    def describe(self) -> dict:
        return {"name": self.name, "devices": [str(self._device)], **self.numerics()}

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, model) -> None:
        super().setup(model.to(self._device))

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        x = x.to(self._device, non_blocking=True)
        y = y.to(self._device, non_blocking=True)
        loss = criterion(run_forward(self.model, x, self.options), y)
        loss.backward()
        return StepStats(len(y), loss.item() * len(y), time.perf_counter() - started)

"""The GPU baseline: the plain loop, with the model on one CUDA device.

At plain PyTorch's speed (torchvision's reference training script does the same): the
prefetch thread gathers the next batch's uint8 rows and labels into pinned memory
(`batch_rows`), copies the rows to the device and augments them there, on a side stream
(`prepare_batch`, base.StagedBatches), while the current step computes; nothing in the
step makes the host wait for the device (dropout masks are drawn on the device, the loss stays there until the
trainer reads it for progress), so the host queues the next step's kernels while the
device runs this one. `--devices cpu` runs the same code on the CPU (how CI tests it).
"""

from __future__ import annotations

import time

import torch

from hybriddl.dropout import current_keys, dropout_keys
from hybriddl.errors import UsageError
from hybriddl.strategies.base import (LocalStrategy, PlainConvolutions, StagedBatches, StepStats,
                                      criterion, run_forward, to_device)
from hybriddl.strategies.resources import parse_devices, require_cuda
from hybriddl.strategies.spec import StrategyOptions, StrategySpec


class Gpu(PlainConvolutions, LocalStrategy):
    name = "gpu"
    summary = "one GPU, the plain loop: the GPU baseline"
    needs_gpu = True
    example_options = StrategyOptions(devices=("cpu",))

    @classmethod
    def tuning_candidates(cls, host, batch_size: int) -> list[StrategySpec]:
        return [StrategySpec(cls.name, devices=(device,)) for device in host.gpus]
    writes_gradients_once = True  # one backward pass: buckets may leave during it

    @classmethod
    def check_feasible(cls, options) -> None:
        if not options.devices:
            require_cuda(cls.name)
        devices = parse_devices(options, ("cuda:0",))
        if len(devices) != 1:
            raise UsageError(f"--devices {','.join(options.devices)}: strategy 'gpu' takes one "
                             "device, e.g. --devices cuda:0")

    def __init__(self, options):
        super().__init__(options)
        self._device = parse_devices(options, ("cuda:0",))[0]
        self._batches = StagedBatches(torch.device("cpu"))  # the device's, from setup on

    def describe(self) -> dict:
        return {"name": self.name, "devices": [str(self._device)], **self.numerics()}

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, model) -> None:
        super().setup(model.to(self._device))
        self._batches = StagedBatches(self._device)

    def batch_rows(self, source, indices: torch.Tensor) -> torch.Tensor:
        return self._batches.rows(source, indices)

    def stage_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The batch's images on the device, copied from pinned memory on the side stream;
        called by the prefetch thread ahead of the step that uses them."""
        return self._batches.stage(x)

    def prepare_batch(self, rows: torch.Tensor, flips: torch.Tensor, transform) -> torch.Tensor:
        """The uint8 rows copied and augmented on the device, on the side stream."""
        return self._batches.prepare(rows, flips, transform)

    def convolutions_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._batches.arrived(x)  # the classifier split across hosts starts here
        return super().convolutions_forward(to_device(x, self._device))

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        self._batches.arrived(x)
        x, y = to_device(x, self._device), to_device(y, self._device)
        with dropout_keys(to_device(current_keys(), self._device)):
            loss = criterion(run_forward(self.model, x, self.options), y)
        loss.backward()
        # The loss stays on the device: reading it would make the host wait for the step.
        return StepStats(len(y), loss.detach() * len(y), time.perf_counter() - started)

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

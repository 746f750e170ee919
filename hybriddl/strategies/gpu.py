"""The GPU baseline: the plain loop, with the model on one CUDA device.

At plain PyTorch's speed (torchvision's reference training script does the same): the
prefetch thread pins the next batch's uint8 rows, copies them to the device and augments
them there, on a side stream (`prepare_batch`), while the current step computes; nothing in the step makes the host wait
for the device (dropout masks are drawn on the device, the loss stays there until the
trainer reads it for progress), so the host queues the next step's kernels while the
device runs this one. `--devices cpu` runs the same code on the CPU (how CI tests it).
"""

from __future__ import annotations

import time

import torch

from hybriddl.dropout import current_keys, dropout_keys
from hybriddl.errors import UsageError
from hybriddl.strategies.base import LocalStrategy, PlainConvolutions, StepStats, criterion, run_forward
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
        self._copies: torch.cuda.Stream | None = None  # the side stream batches arrive on
        self._ready: dict[int, torch.cuda.Event] = {}  # a staged batch's storage -> its event

    def describe(self) -> dict:
        return {"name": self.name, "devices": [str(self._device)], **self.numerics()}

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, model) -> None:
        super().setup(model.to(self._device))
        if self._device.type == "cuda":
            self._copies = torch.cuda.Stream(self._device)

    def stage_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The batch's images on the device, copied from pinned memory on the side stream;
        called by the prefetch thread ahead of the step that uses them."""
        if self._copies is None:
            return x
        with torch.cuda.stream(self._copies):
            return self._arriving(self._copied(x))

    def prepare_batch(self, rows: torch.Tensor, flips: torch.Tensor, transform) -> torch.Tensor:
        """The uint8 rows copied (a quarter of the float32 bytes) and augmented on the
        device, on the side stream: at AlexNet's thousands of images per second on a GPU
        the CPU's crop, flip and normalisation would keep the device waiting."""
        if self._copies is None:
            return transform(rows, flips)
        with torch.cuda.stream(self._copies):
            return self._arriving(transform(self._copied(rows), flips))

    def _copied(self, x: torch.Tensor) -> torch.Tensor:
        """`x` on the device, copied from pinned memory (by DMA, not through a staging copy)
        on the current stream: call it on the side stream."""
        return x.pin_memory().to(self._device, non_blocking=True)

    def _arriving(self, x: torch.Tensor) -> torch.Tensor:
        """Note the event after which the side stream has made `x` (the step waits for that
        batch only, not for the next one the prefetch thread may have queued since)."""
        event = torch.cuda.Event()
        event.record(self._copies)
        self._ready[x.untyped_storage().data_ptr()] = event
        return x

    def _arrived(self, x: torch.Tensor) -> None:
        """Make the step's stream wait until the side stream has made `x`."""
        if self._copies is None:
            return
        compute = torch.cuda.current_stream(self._device)
        event = self._ready.pop(x.untyped_storage().data_ptr(), None) if x.is_cuda else None
        if event is not None:
            compute.wait_event(event)  # the staged batch has arrived
        else:
            compute.wait_stream(self._copies)
        if x.device == self._device:
            x.record_stream(compute)  # allocated on the side stream, freed after this one

    def convolutions_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._arrived(x)  # the classifier split across hosts starts here
        return super().convolutions_forward(x)

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        self._arrived(x)
        x = x.to(self._device, non_blocking=True)
        y = y.to(self._device, non_blocking=True)
        keys = current_keys()
        with dropout_keys(None if keys is None else keys.to(self._device, non_blocking=True)):
            loss = criterion(run_forward(self.model, x, self.options), y)
        loss.backward()
        # The loss stays on the device: reading it would make the host wait for the step.
        return StepStats(len(y), loss.detach() * len(y), time.perf_counter() - started)

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

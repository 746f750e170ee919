"""The one contract every local strategy keeps (ARCHITECTURE.md).

After `compute_gradients(x, y)` the master model's `.grad` fields hold the **mean
gradient over the host's batch**, exactly what sequential SGD would have. The
trainer, the MPI layer, the optimizer and checkpoints rely on nothing else.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from hybriddl.data.sharding import split_bounds
from hybriddl.dropout import current_keys, dropout_keys
from hybriddl.errors import UsageError
from hybriddl.machine.allocator import keep_freed_memory
from hybriddl.strategies.resources import HostResources, local_workers, worker_counts
from hybriddl.strategies.spec import PRECISIONS, StrategyOptions, StrategySpec


@dataclass(frozen=True)
class LocalUpdate:
    """The parameters no host averages (`parameters`, their id()s: each host holds its own,
    as the hybrid scheme's classifier slices) and `finish`, the work their gradients still
    wait for once the gradients' call has returned: step.py's `optimizer_step` finishes and
    updates them before the averaging waits, while the averaged gradients cross the wire."""

    parameters: frozenset[int]
    finish: Callable[[], None] = lambda: None

    def holds(self, parameter: torch.Tensor) -> bool:
        return id(parameter) in self.parameters


@dataclass
class StepStats:
    samples: int
    loss_sum: float  # sum of per-sample losses; mean loss = loss_sum / samples
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    local: LocalUpdate | None = None  # what the hosts' scheme leaves this host to finish

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.samples, 1)


def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The use cases' loss: cross-entropy, mean over the (sub-)batch."""
    return F.cross_entropy(logits, targets)


class LocalStrategy(ABC):
    """How one host computes the gradient of its batch."""

    name: str = ""
    # One line for the command line's list of strategies (strategies.strategy_summaries).
    summary: str = ""
    # True when the strategy's default devices are CUDA devices: it runs without a GPU only
    # where its options name CPU devices (tests do), and the tuner offers it on GPU hosts.
    needs_gpu: bool = False
    # Options that exercise its local parallelism on any host that can run it (CPU devices
    # where it takes devices): each registered strategy's equivalence test runs at these.
    example_options: StrategyOptions = StrategyOptions()
    # True when its local workers are processes of their own (a worker's page faults and
    # allocator settings are not the master's).
    worker_processes: bool = False
    # False for strategies that run the model in pieces of their own (pipeline stages,
    # device replicas): they do not go through run_forward, so they refuse other numerics.
    honours_numerics: bool = True
    # True when one backward pass in this process writes each master parameter's .grad
    # exactly once per step (no sub-batch accumulation into it): a hook run after that
    # write sees the host's final mean gradient, so hosts may send it while backward
    # still runs (--overlap). Strategies that accumulate or copy gradients keep False.
    writes_gradients_once: bool = False

    def __init__(self, options: StrategyOptions = StrategyOptions()):
        self.options = options
        self.model: nn.Module | None = None
        if options.accumulate > 1:  # chunks add into .grad: no hook sees a final gradient
            self.writes_gradients_once = False

    @classmethod
    def check_feasible(cls, options: StrategyOptions) -> None:
        """Raise UsageError, before anything starts, when this host cannot run it."""

    @classmethod
    def unavailable_here(cls, options: StrategyOptions | None = None) -> str | None:
        """Why this host cannot run it at `options` (default: `example_options`), or None."""
        try:
            cls.check_feasible(cls.example_options if options is None else options)
        except UsageError as exc:
            return str(exc)
        return None

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        """Raise UsageError when this strategy cannot run `model` (the tuner skips it then)."""

    @classmethod
    def tuning_candidates(cls, host: HostResources, batch_size: int) -> list[StrategySpec]:
        """The variants of this strategy the tuner measures on `host` for a host batch."""
        return []

    def describe(self) -> dict:
        """The strategy and its parameters, as recorded in metrics.json and profiles."""
        return {"name": self.name, **self.numerics()}

    def numerics(self) -> dict:
        """Precision, memory format and gradient accumulation, where they differ from the
        default."""
        default = StrategyOptions()
        return {key: getattr(self.options, key) for key in ("precision", "channels_last",
                                                            "accumulate")
                if getattr(self.options, key) != getattr(default, key)}

    @property
    def device(self) -> torch.device:
        """Where inputs go for evaluation and where the master parameters live."""
        return torch.device("cpu")

    def setup(self, model: nn.Module) -> None:
        """Place the model and start local workers; `model` holds the master parameters."""
        keep_freed_memory()  # every step reuses the last step's pages (machine/allocator.py)
        prepare_model(model, self.options)
        self.model = model

    @abstractmethod
    def compute_gradients(self, x: torch.Tensor, y: torch.Tensor) -> StepStats:
        """Leave the mean gradient over (x, y) in the master parameters' .grad."""

    def after_step(self) -> None:
        """Called after the optimizer updated the master parameters."""

    def batch_rows(self, source, indices: torch.Tensor) -> torch.Tensor:
        """`source[indices]` (a batch's uint8 images or its labels), in the memory the step
        copies them from: a GPU strategy gathers them straight into pinned memory. Called by
        the prefetch thread."""
        return source[indices]

    def stage_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The next batch's images where the step will want them; called by the prefetch
        thread while the current step computes (a GPU strategy copies them to its device
        there). The images as they are by default."""
        return x

    def prepare_batch(self, rows: torch.Tensor, flips: torch.Tensor, transform) -> torch.Tensor:
        """The next batch made from its uint8 rows by `transform` (crop/scale, flip,
        normalise), where the step will want it; called by the prefetch thread."""
        return self.stage_batch(transform(rows, flips))

    def synchronize(self) -> None:
        """Wait until the work queued so far on this strategy's devices is done: before a
        clock is read (a GPU step returns when its kernels are queued, not run)."""

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for x in eval mode (validation); strategies may override for speed."""
        assert self.model is not None
        with torch.no_grad():
            return run_forward(self.model, x.to(self.device), self.options).cpu()

    # The convolutions alone, for a classifier split across hosts (hybriddl.hybrid): the
    # strategies that can run them set this and implement the two calls below.
    runs_convolutions_alone: bool = False

    def convolutions_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The features (features + avgpool + flatten) of x, detached; the graph is kept
        for `convolutions_backward`."""
        raise UsageError(f"strategy {self.name!r} cannot run the convolutions alone")

    def convolutions_backward(self, features_grad: torch.Tensor) -> None:
        """Backward of the last `convolutions_forward` from its features' gradient, added
        into the convolutions' .grad."""
        raise UsageError(f"strategy {self.name!r} cannot run the convolutions alone")

    def close(self) -> None:
        """Stop every worker; safe to call twice and after a failed setup."""

    def __enter__(self) -> LocalStrategy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CoreWorkersStrategy(LocalStrategy):
    """A strategy with K local workers on CPU cores (K = --workers, checked up front)."""

    # True when each worker takes a slice of the batch: a worker without a sample of
    # the batch only adds overhead, so no candidate has more workers than samples.
    splits_batch: bool = True
    example_options = StrategyOptions(workers=2, oversubscribe=True)

    @classmethod
    def tuning_candidates(cls, host: HostResources, batch_size: int) -> list[StrategySpec]:
        return [StrategySpec(cls.name, workers=k) for k in worker_counts(host.cores)
                if not cls.splits_batch or k <= batch_size]

    @classmethod
    def check_feasible(cls, options: StrategyOptions) -> None:
        local_workers(options)

    def __init__(self, options: StrategyOptions = StrategyOptions()):
        super().__init__(options)
        self.workers = local_workers(options)

    def describe(self) -> dict:
        return {"name": self.name, "workers": self.workers, **self.numerics()}


class StagedOnDevices:
    """The batch path of a strategy over several devices (`gpu-threads`, `pipeline`): the
    batch as the gpu strategy has it (`StagedBatches` in `self._batches`, on the first
    device: uint8 rows gathered into pinned memory, copied and augmented on a side stream),
    and a clock read only once every device in `self.devices` finished its queued work."""

    def batch_rows(self, source, indices: torch.Tensor) -> torch.Tensor:
        return self._batches.rows(source, indices)

    def stage_batch(self, x: torch.Tensor) -> torch.Tensor:
        return self._batches.stage(x)

    def prepare_batch(self, rows: torch.Tensor, flips: torch.Tensor, transform) -> torch.Tensor:
        return self._batches.prepare(rows, flips, transform)

    def synchronize(self) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)


class StagedBatches:
    """The batches a strategy computes on one device, made ready by the prefetch thread
    while the step before computes: on a CUDA device their rows are gathered into pinned
    memory, copied (by DMA) and augmented on a side stream, and a step waits for its own
    batch's event only. On any other device they are made as on the CPU. The data path of
    `gpu`, `pipeline` (its first stage) and `gpu-threads` (its first device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}  # a staged batch's storage -> its event

    def rows(self, source, indices: torch.Tensor) -> torch.Tensor:
        """`source[indices]`, gathered straight into pinned memory for a CUDA device (one
        host copy, not an indexed copy and then a pinned one)."""
        if self.stream is None or not isinstance(source, torch.Tensor):
            return source[indices]
        out = torch.empty((len(indices), *source.shape[1:]), dtype=source.dtype, pin_memory=True)
        return torch.index_select(source, 0, indices, out=out)

    def stage(self, x: torch.Tensor) -> torch.Tensor:
        """`x` on the device, copied on the side stream."""
        if self.stream is None:
            return x
        with torch.cuda.stream(self.stream):
            return self._arriving(to_device(x, self.device))

    def prepare(self, rows: torch.Tensor, flips: torch.Tensor, transform) -> torch.Tensor:
        """The uint8 rows copied (a quarter of the float32 bytes) and augmented on the
        device, on the side stream: at AlexNet's thousands of images per second on a GPU
        the CPU's crop, flip and normalisation would keep the device waiting."""
        if self.stream is None:
            return transform(rows, flips)
        with torch.cuda.stream(self.stream):
            # The flips stay on the host (the transform asks whether any is set: on the
            # device that would wait for it), pinned so that their copy there is a DMA.
            if flips is not None and not flips.is_pinned():
                flips = flips.pin_memory()
            return self._arriving(transform(to_device(rows, self.device), flips))

    def _arriving(self, x: torch.Tensor) -> torch.Tensor:
        """Note the event after which the side stream has made `x` (the step waits for that
        batch only, not for the next one the prefetch thread may have queued since)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self._ready[x.untyped_storage().data_ptr()] = event
        return x

    def arrived(self, x: torch.Tensor, *streams) -> None:
        """Make the device's current stream wait until the side stream has made `x`;
        `streams`: others of the device that will read it too."""
        if self.stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        event = self._ready.pop(x.untyped_storage().data_ptr(), None) if x.is_cuda else None
        if event is not None:
            compute.wait_event(event)  # the staged batch has arrived
        else:
            compute.wait_stream(self.stream)
        if x.device == self.device:  # allocated on the side stream, freed after these
            for stream in (compute, *streams):
                x.record_stream(stream)


def to_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """`tensor` on `device` without making the host wait: a CPU tensor goes to a GPU from
    pinned memory (pinned first where it is not: a small host copy, then a real DMA)."""
    if tensor is None or tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class PlainConvolutions:
    """convolutions_forward/backward as one plain loop: for strategies whose step is one
    forward and one backward of the whole batch in this process (sequential, intraop, gpu)."""

    runs_convolutions_alone = True
    _convolutions: nn.Module | None = None
    _features: torch.Tensor | None = None

    def convolutions_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._convolutions is None:
            self._convolutions = split_at_classifier(self.model, self.name)[0]
        self._features = run_forward(self._convolutions, x.to(self.device), self.options)
        return self._features.detach()

    def convolutions_backward(self, features_grad: torch.Tensor) -> None:
        features, self._features = self._features, None
        features.backward(features_grad.to(features.device, features.dtype))


MODEL_SHAPE = "features -> avgpool -> flatten -> classifier"


def split_at_classifier(model: nn.Module, who: str = "this strategy",
                        advice: str = "use another --strategy") -> tuple[nn.Module, nn.Module]:
    """(features + avgpool + flatten, classifier) of a torchvision model built that way
    (AlexNet, VGG, MobileNetV3, EfficientNet); UsageError for any other."""
    parts = [getattr(model, name, None) for name in ("features", "avgpool", "classifier")]
    if not all(isinstance(part, nn.Module) for part in parts):
        raise UsageError(f"{who} needs a model made of {MODEL_SHAPE} (AlexNet, VGG, ...); "
                         f"{type(model).__name__} is not: {advice}")
    features, avgpool, classifier = parts
    return nn.Sequential(features, avgpool, nn.Flatten(1)), classifier


def cut_computes_model(model: nn.Module, probe: torch.Tensor) -> bool:
    """Whether classifier(convolutions(x)) is the model's own forward: torchvision models
    with these attributes whose forward does more (DenseNet's final ReLU) are not."""
    convolutions, classifier = split_at_classifier(model)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = model(probe)
            try:
                cut = classifier(convolutions(probe))
            except RuntimeError:
                return False
    finally:
        model.train(training)
    return cut.shape == whole.shape and torch.allclose(cut, whole, rtol=1e-4, atol=1e-5)


def check_numerics(strategy: type[LocalStrategy], options: StrategyOptions) -> None:
    """Raise UsageError when `strategy` cannot run in the numerics `options` ask for."""
    if options.accumulate < 1:
        raise UsageError(f"--accumulate {options.accumulate}: give at least 1 (1 computes the "
                         "whole host batch at once)")
    if options.precision not in PRECISIONS:
        raise UsageError(f"--precision {options.precision} goes with --strategy auto (the tuner "
                         f"tries both); with a named strategy choose {' or '.join(PRECISIONS)}")
    if not strategy.honours_numerics and (options.precision != "fp32" or options.channels_last):
        raise UsageError(f"strategy {strategy.name!r} runs in float32 with the default memory "
                         "format only: leave out --precision bf16 and --channels-last")


def host_gradients(strategy: LocalStrategy, x: torch.Tensor, y: torch.Tensor) -> StepStats:
    """The host batch's mean gradient in .grad, computed in `options.accumulate` chunks.

    Each chunk goes through the strategy's own compute_gradients, which adds the chunk's
    mean gradient into .grad. Rescaling .grad between chunks keeps the invariant
    .grad = (sum of the chunks' size * mean gradient so far) / (size of the last chunk),
    and the last rescale divides by the batch size: the batch's mean gradient, as
    sequential SGD has it, with activations held for one chunk at a time. Each chunk
    draws the dropout masks of its own samples (their slice of the keys).
    """
    chunks = sub_batches(len(y), strategy.options.accumulate)
    if len(chunks) == 1:
        return strategy.compute_gradients(x, y)
    total, last = StepStats(0, 0.0), None
    for a, b in chunks:
        if last is not None and last != b - a:
            _scale_gradients(strategy.model, last / (b - a))
        with dropout_keys(current_keys(a, b)):
            stats = strategy.compute_gradients(x[a:b], y[a:b])
        total = StepStats(total.samples + stats.samples, total.loss_sum + stats.loss_sum,
                          total.seconds + stats.seconds, {**stats.extra, "chunks": len(chunks)})
        last = b - a
    _scale_gradients(strategy.model, last / len(y))
    return total


def _scale_gradients(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def prepare_model(model: nn.Module, options: StrategyOptions) -> None:
    """Lay the master parameters out as the strategy's numerics ask (in place)."""
    if options.channels_last:
        model.to(memory_format=torch.channels_last)


def run_forward(module: nn.Module, x: torch.Tensor, options: StrategyOptions) -> torch.Tensor:
    """module(x) in the strategy's numerics; the result in float32 for the loss.

    bf16 is autocast (torch.amp): matrix products and convolutions run in bfloat16 on
    float32 weights, so no float32 master copy is needed and backward needs no loss
    scaling (bfloat16 has float32's exponent range). Autocast is thread-local: every
    thread that runs a forward enters it itself.
    """
    if options.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=options.precision == "bf16"):
        out = module(x)
    return out.float()


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               options: StrategyOptions = StrategyOptions()) -> StepStats:
    """One forward and backward of the whole batch: the mean gradient lands in .grad."""
    started = time.perf_counter()
    loss = criterion(run_forward(model, x, options), y)
    loss.backward()
    return StepStats(len(y), loss.item() * len(y), time.perf_counter() - started)


# The sub-batch data parallelism of threads, processes and gpu-threads, written once: the
# batch is cut into equal sub-batches, each worker's loss is weighted by its share of the
# batch, so the sum of the workers' gradients is the batch's mean gradient.

def sub_batches(n: int, workers: int) -> list[tuple[int, int]]:
    """Each worker's [start, stop) of a batch of n samples; empty sub-batches left out."""
    return [(a, b) for a, b in split_bounds(n, [1.0] * workers) if b > a]


def weighted_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int,
                  options: StrategyOptions = StrategyOptions(),
                  keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sub-batch of a batch of n samples: its mean loss, and that loss weighted by its
    share of the batch (what its backward differentiates). `keys` are the sub-batch's
    dropout keys."""
    with dropout_keys(keys):
        loss = criterion(run_forward(model, x, options), y)
    return loss, loss * (len(y) / n)


def worker_gradients(model: nn.Module, params, x: torch.Tensor, y: torch.Tensor, n: int,
                     options: StrategyOptions = StrategyOptions(),
                     keys: torch.Tensor | None = None) -> tuple[float, tuple]:
    """A local worker's sub-batch: its sum of losses and its weighted gradients (not in .grad).

    `keys` are the sub-batch's dropout keys: worker threads do not see the master's.
    """
    loss, weighted = weighted_loss(model, x, y, n, options, keys)
    grads = torch.autograd.grad(weighted, params, allow_unused=True)
    return loss.item() * len(y), grads


def sub_batch_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int,
                       options: StrategyOptions = StrategyOptions(),
                       keys: torch.Tensor | None = None) -> float:
    """Backward of a sub-batch's weighted loss into `model`'s .grad; returns its sum of
    losses. A worker process, whose .grad fields are its own buffer, runs it as the
    master does."""
    loss, weighted = weighted_loss(model, x, y, n, options, keys)
    weighted.backward()
    return loss.item() * len(y)


def master_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int,
                    options: StrategyOptions = StrategyOptions(), start: int = 0) -> float:
    """Backward of the master's own sub-batch, x = batch[start:start + len(x)], into .grad;
    returns its sum of losses."""
    return sub_batch_backward(model, x, y, n, options, current_keys(start, start + len(x)))


def add_gradients(params, grads) -> None:
    """Add one worker's gradients into the master parameters' .grad (call under no_grad).

    A parameter the worker's sub-batch did not reach (None) adds nothing; a master
    parameter without .grad yet gets a copy, never the worker's own tensor.
    """
    for p, g in zip(params, grads):
        if g is None:
            continue
        # Into a device: queued on its stream, the host does not wait (into host memory a
        # copy must be complete before it is read).
        queued = p.device.type != "cpu"
        if p.grad is None:
            p.grad = g.to(p.device, copy=True, non_blocking=queued)
        else:
            p.grad.add_(g.to(p.device, non_blocking=queued))

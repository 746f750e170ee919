"""The paper's fastest GPU strategy: the model in two stages on two devices, pipelined.

The batch is cut into M micro-batches (GPipe, Huang et al. 2019). Stage 1 runs in the
master thread: forward of every micro-batch (fill), then, as stage 2 hands back the
gradient of each micro-batch's activation, its backward (drain). Stage 2 runs in its
own persistent thread and does forward + backward of each micro-batch as soon as it
arrives, so while it works on micro-batch j stage 1 already computes j + 1.

Each micro-batch's loss is weighted by m_j / n, so the gradients accumulated over the
micro-batches are exactly the mean gradient of the batch. The two threads accumulate
into disjoint parameters (one stage each), so no .grad is shared between threads.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch
import torchvision
from torch import nn

from hybriddl.dropout import current_keys, dropout_keys
from hybriddl.errors import UsageError
from hybriddl.data.sharding import split_bounds
from hybriddl.strategies.base import (LocalStrategy, StagedBatches, StagedOnDevices, StepStats,
                                      criterion, to_device)
from hybriddl.strategies.resources import parse_devices
from hybriddl.strategies.spec import StrategyOptions, StrategySpec
from hybriddl.usecases import PIPELINE_SPLITS

MICRO_BATCHES = (1, 2, 4, 8)  # M the tuner tries

DEFAULT_DEVICES = ("cuda:0", "cuda:1")


def _on(stream):
    """Queue on `stream` (a CUDA stream), or as usual where it is None (a CPU stage)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _ready(stream):
    """An event marking what `stream` has queued so far (None on a CPU stage)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _follow(stream, event) -> None:
    """Make `stream` wait for `event`, or for its device's current stream where None."""
    if stream is None:
        return
    if event is None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    else:
        stream.wait_event(event)


def _rows(keys: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if keys is None else keys[a:b]


def pipeline_model_name(model: nn.Module) -> str:
    """The PIPELINE_SPLITS name of a model, or UsageError for models with no paper split."""
    if isinstance(model, torchvision.models.AlexNet):
        return "alexnet"
    convolutions = sum(isinstance(m, nn.Conv2d) for m in getattr(model, "features", []))
    if isinstance(model, torchvision.models.VGG) and convolutions == 13:
        return "vgg16"
    raise UsageError(f"strategy 'pipeline' splits only alexnet and vgg16 (the paper's split), "
                     f"not {type(model).__name__}: use another --strategy or --model")


def split_stages(model: nn.Module) -> tuple[nn.Sequential, nn.Sequential]:
    """The two stages, made of the model's own modules (so of its own parameters)."""
    cut = PIPELINE_SPLITS[pipeline_model_name(model)]
    first = model.features[:cut]
    second = nn.Sequential(model.features[cut:], model.avgpool, nn.Flatten(1), model.classifier)
    return first, second


class Pipeline(StagedOnDevices, LocalStrategy):
    name = "pipeline"
    summary = "the model in two stages on two devices, M micro-batches in flight"
    needs_gpu = True
    example_options = StrategyOptions(micro_batches=2, devices=("cpu", "cpu"))
    honours_numerics = False

    @classmethod
    def tuning_candidates(cls, host, batch_size: int) -> list[StrategySpec]:
        # One GPU: both stages on it still overlap the stages' kernels.
        stages = tuple(host.gpus[:2]) if len(host.gpus) >= 2 else tuple(host.gpus * 2)
        if not stages:
            return []
        return [StrategySpec(cls.name, micro_batches=m, devices=stages)
                for m in MICRO_BATCHES if m <= batch_size]

    @classmethod
    def check_feasible(cls, options) -> None:
        if options.micro_batches < 1:
            raise UsageError(f"--micro-batches {options.micro_batches}: give at least 1")
        if not options.devices and not torch.cuda.is_available():
            raise UsageError("no CUDA device: strategy 'pipeline' defaults to cuda:0,cuda:1; give "
                             "--devices cpu,cpu or use --strategy sequential/threads/processes")
        devices = parse_devices(options, DEFAULT_DEVICES)
        if len(devices) != 2:
            raise UsageError(f"--devices {','.join(options.devices)}: strategy 'pipeline' takes "
                             "two devices, one per stage, e.g. cuda:0,cuda:1 or cpu,cpu")

    def __init__(self, options):
        super().__init__(options)
        self.devices = parse_devices(options, DEFAULT_DEVICES)
        self.micro_batches = options.micro_batches
        self.stages: tuple[nn.Module, nn.Module] | None = None
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.second_stage: threading.Thread | None = None
        self.streams: tuple = (None, None)
        self._marks = []
        self._origins: dict | None = None  # the timeline's reference marks, one per clock
        self._batches = StagedBatches(torch.device("cpu"))  # the first stage's, from setup on

    def describe(self) -> dict:
        return {"name": self.name, "micro_batches": self.micro_batches,
                "devices": [str(d) for d in self.devices]}

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def setup(self, model) -> None:
        first, second = split_stages(model)
        # Module.to() moves parameters in place: the model's own parameters now live on
        # the stage devices, and the optimizer built on model.parameters() updates them.
        self.stages = (first.to(self.devices[0]), second.to(self.devices[1]))
        # On CUDA each stage queues on a stream of its own, so that micro-batch m + 1's
        # first stage runs on the device while m's second stage does, even with both
        # stages on one GPU (one stream would run them one after the other).
        self.streams = tuple(torch.cuda.Stream(d) if d.type == "cuda" else None
                             for d in self.devices)
        self._batches = StagedBatches(self.devices[0])
        super().setup(model)
        self.second_stage = threading.Thread(target=self._second_stage_loop,
                                             name="hybriddl-pipeline-stage-2", daemon=True)
        self.second_stage.start()

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        first, _ = self.stages
        n = len(y)
        parts = [(a, b) for a, b in split_bounds(n, [1.0] * self.micro_batches) if b > a]
        self._batches.arrived(x, *[s for s in self.streams[:1] if s is not None])
        x = to_device(x, self.devices[0])
        y = to_device(y, self.devices[1])
        keys = current_keys()  # each stage's on its device (the stage-2 thread sees no keys)
        keys = (to_device(keys, self.devices[0]), to_device(keys, self.devices[1])) \
            if keys is not None else (None, None)
        for stream in self.streams:  # after the optimizer's update and these copies
            _follow(stream, None)
        if self.record_timeline and self._origins is None:
            self._origins = self._reference_marks()
        activations = []
        with _on(self.streams[0]):
            for m, (a, b) in enumerate(parts):  # fill
                with dropout_keys(_rows(keys[0], a, b)), self._busy(0, m):
                    activation = first(x[a:b])
                activations.append(activation)
                self.inbox.put((activation.detach().to(self.devices[1]), y[a:b], (b - a) / n,
                                _rows(keys[1], a, b), m, _ready(self.streams[0])))
        loss_sum, failure = 0.0, None
        with _on(self.streams[0]):
            for m, activation in enumerate(activations):  # drain, in micro-batch order
                reply = self.outbox.get()
                if reply[0] == "error":
                    failure = failure or reply[1]
                elif failure is None:
                    # loss_sum: the step's so far, summed by stage 2 on its own stream (an
                    # add queued here would run on its device's current stream, which on
                    # two GPUs never waited for stage 2's).
                    _, activation_grad, loss_sum, ready = reply
                    _follow(self.streams[0], ready)
                    if self.streams[0] is not None:  # made on the second stage's stream
                        activation_grad.record_stream(self.streams[0])
                    with self._busy(0, m):
                        activation.backward(activation_grad.to(self.devices[0]))
        if failure is not None:
            raise failure
        for device, stream in zip(self.devices, self.streams):  # the optimizer runs after
            if stream is not None:
                torch.cuda.current_stream(device).wait_stream(stream)
        if self.streams[1] is not None:  # read (and freed) on its device's current stream
            loss_sum.record_stream(torch.cuda.current_stream(self.devices[1]))
        return StepStats(n, loss_sum, time.perf_counter() - started,
                         {"micro_batches": len(parts)})

    def _second_stage_loop(self) -> None:
        _, second = self.stages
        stream = self.streams[1]
        loss_sum = None  # the step's sum of losses so far, on this stage's stream
        while (message := self.inbox.get()) is not None:
            activation, y, weight, keys, m, ready = message
            try:
                with _on(stream):
                    _follow(stream, ready)
                    if stream is not None:
                        activation.record_stream(stream)  # made on the first stage's stream
                    activation.requires_grad_()
                    with dropout_keys(keys), self._busy(1, m):
                        loss = criterion(second(activation), y)
                        (loss * weight).backward()
                    micro = loss.detach() * len(y)
                    loss_sum = micro if m == 0 else loss_sum + micro
                    self.outbox.put(("grad", activation.grad, loss_sum, _ready(stream)))
            except Exception as exc:  # handed to the master, which raises it
                self.outbox.put(("error", exc))

    # ------------------------------------------------------------------ timeline
    # Per-stage busy time, to show that the stages overlap (scripts/bench_gpu.py): with
    # `record_timeline` set, each stage's work on each micro-batch is bracketed by CUDA
    # events (a clock on CPU devices); `timeline()` reads them after the step. CUDA times an
    # event only against another of its own device: each device's events are read against
    # a reference event of that device (`_reference_marks`).
    record_timeline = False

    def _reference_marks(self) -> dict:
        """Where the timeline counts from, one mark per clock: the host's, and an event on
        each CUDA device, recorded while every device is idle so that they mark the same
        moment (to within a few launches). Only when a timeline is recorded: it waits."""
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        marks = {"host": time.perf_counter()}
        for stream in self.streams:
            if stream is not None and stream.device not in marks:
                marks[stream.device] = torch.cuda.Event(enable_timing=True)
                marks[stream.device].record(stream)
        return marks

    @contextlib.contextmanager
    def _busy(self, stage: int, micro_batch: int):
        if not self.record_timeline:
            yield
            return
        stream = self.streams[stage]
        if stream is None:
            began = time.perf_counter()
            yield
            self._marks.append((stage, micro_batch, began, time.perf_counter()))
            return
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(stream)
        yield
        ended.record(stream)
        self._marks.append((stage, micro_batch, began, ended))

    def timeline(self) -> list[dict]:
        """The recorded intervals since the last call, in milliseconds from the first:
        [{"stage": 1 or 2, "micro_batch": m, "start_ms", "end_ms"}]."""
        marks, self._marks = self._marks, []
        origins, self._origins = self._origins, None
        if not marks:
            return []
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def ms(stage: int, mark) -> float:
            if isinstance(mark, float):  # a CPU stage's clock
                return (mark - origins["host"]) * 1e3
            return origins[self.streams[stage].device].elapsed_time(mark)

        rows = [{"stage": stage + 1, "micro_batch": m, "start_ms": ms(stage, a),
                 "end_ms": ms(stage, b)} for stage, m, a, b in marks]
        first = min(r["start_ms"] for r in rows)
        for r in rows:
            r["start_ms"] -= first
            r["end_ms"] -= first
        return sorted(rows, key=lambda r: r["start_ms"])

    def evaluate(self, x):
        first, second = self.stages
        with torch.no_grad():
            return second(first(x.to(self.devices[0])).to(self.devices[1])).cpu()

    def close(self) -> None:
        if self.second_stage is not None:
            self.inbox.put(None)
            self.second_stage.join()
            self.second_stage = None

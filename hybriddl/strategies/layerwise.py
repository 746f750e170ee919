"""Layer-wise parallelism: data-parallel convolutions, one classifier over the whole batch.

On AlexNet the two kinds of layers want opposite treatment (measured per phase
of a step, 224 px, batch 32, 2 cores): the convolutions are
compute-bound and scale across data-parallel workers, while the 57 M-parameter
classifier is memory-bound at a few samples per worker, so K workers that each run
it on their sub-batch each stream all of its weights. This strategy cuts the model
between the two (`features` + `avgpool` | `classifier`) and runs each part the way it
scales (the idea of Krizhevsky's "one weird trick", arXiv:1404.5997: data parallelism
for the convolutions, another parallelism for the fully-connected layers):

1. K local workers (the master thread and K - 1 pool threads, one core each) run the
   convolutional part forward on their sub-batches.
2. The master concatenates their outputs and runs the classifier forward and backward
   once, on the whole host batch, with K intra-op threads (the workers are idle).
3. The gradient of the classifier's input, cut into the same sub-batches, goes back
   to the workers, which run the convolutional part backward.

In float32 the classifier's linear layers add their weight gradient straight into .grad
(`AccumulatingLinear`, the "gradient accumulation fusion" of Megatron-LM's linear layers):
autograd would first compute it into a tensor of the weight's size (411 MB for VGG16's
first classifier layer), then add that to .grad and free it, which costs the memory of the
temporary at the moment every activation of the convolutions is still held, and one more
pass over it.

The loss is the mean over the whole batch, so the classifier's gradient is exactly
sequential's and each worker's backward leaves exactly its share of the convolutions'
mean gradient: their sum is sequential's. As in `threads`, only the master thread
accumulates into .grad (concurrent accumulation into one .grad races); the pool
threads' gradients come from torch.autograd.grad and the master adds them.

Threads rather than processes: the activations cross between the two parts twice per
step, which threads do without a copy through shared memory, and on the convolutions
alone they were not slower (AlexNet features with a one-layer classifier, 224 px, batch 32,
K = 2, 3 interleaved rounds: threads 1.10-2.20 s/step, processes 1.13-1.59 s/step, round 3
1.10 against 1.13 s: within this VM's noise).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import nn

from hybriddl.dropout import current_keys, dropout_keys
from hybriddl.errors import UsageError
from hybriddl.machine.cpu_threads import set_torch_threads
from hybriddl.machine.hostinfo import usable_cores
from hybriddl.strategies.base import (MODEL_SHAPE, CoreWorkersStrategy, StepStats, add_gradients,
                                      criterion, cut_computes_model, run_forward,
                                      split_at_classifier, sub_batches)


class LayerWise(CoreWorkersStrategy):
    name = "layerwise"
    summary = "convolutions data-parallel over K threads, the classifier once over the batch"

    def __init__(self, options):
        super().__init__(options)
        self.pool: ThreadPoolExecutor | None = None
        self.convolutions: nn.Module | None = None
        self.classifier: nn.Module | None = None
        self.cut_checked = False
        self.fused: list[nn.Linear] = []
        self._parts: list[tuple[int, int]] = []
        self._outputs: list[torch.Tensor] = []

    @classmethod
    def check_model(cls, model) -> None:
        split_at_classifier(model, f"strategy {cls.name!r}")

    def setup(self, model) -> None:
        self.convolutions, self.classifier = split_at_classifier(model, f"strategy {self.name!r}")
        if self.options.precision == "fp32":  # bf16 keeps autocast's own linear
            self.fused = accumulate_linear_gradients(self.classifier)
        # Never more threads than cores this process may use (ranks sharing a machine
        # are pinned to their own cores): oversubscribed matrix products crawl.
        self.classifier_threads = max(1, min(self.workers, usable_cores()))
        super().setup(model)
        if self.workers > 1:
            self.pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="hybriddl-layer")

    runs_convolutions_alone = True

    def compute_gradients(self, x, y) -> StepStats:
        started = time.perf_counter()
        if not self.cut_checked:
            self._check_cut(x[:1])
        n = len(y)
        features = self.convolutions_forward(x).requires_grad_()
        classifier_started = time.perf_counter()
        loss = criterion(run_forward(self.classifier, features, self.options), y)
        loss.backward()
        classifier_seconds = time.perf_counter() - classifier_started
        self.convolutions_backward(features.grad)
        return StepStats(n, loss.item() * n, time.perf_counter() - started,
                         {"parts": len(self._parts), "classifier_seconds": classifier_seconds})

    def convolutions_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The K workers' features of their sub-batches, concatenated (detached); the
        master's threads are the classifier's when it returns."""
        self._parts = sub_batches(len(x), self.workers)
        set_torch_threads(1)
        # Each sub-batch's samples' keys (stochastic depth in the convolutions: EfficientNet's),
        # set in the thread that runs it: a pool thread has none of its own.
        futures = [self.pool.submit(_convolutions_forward, self.convolutions, x[a:b], self.options,
                                    current_keys(a, b))
                   for a, b in self._parts[1:]]
        try:
            a, b = self._parts[0]
            outputs = [_convolutions_forward(self.convolutions, x[a:b], self.options,
                                             current_keys(a, b))]
        finally:
            wait(futures)  # no worker may still run when this step ends, even on error
        self._outputs = outputs + [future.result() for future in futures]
        set_torch_threads(self.classifier_threads)
        return torch.cat([out.detach() for out in self._outputs])

    def convolutions_backward(self, features_grad: torch.Tensor) -> None:
        """The workers' backward of their sub-batches, their gradients added into .grad."""
        outputs, parts, self._outputs = self._outputs, self._parts, []
        features_grad = features_grad.to(outputs[0].dtype)
        conv_params = [p for p in self.convolutions.parameters() if p.requires_grad]
        set_torch_threads(1)
        futures = [self.pool.submit(_convolutions_backward, out, conv_params, features_grad[a:b])
                   for out, (a, b) in zip(outputs[1:], parts[1:])]
        try:
            a, b = parts[0]
            outputs[0].backward(features_grad[a:b])
        finally:
            wait(futures)
        set_torch_threads(self.classifier_threads)
        with torch.no_grad():
            for future in futures:
                add_gradients(conv_params, future.result())

    def _check_cut(self, probe: torch.Tensor) -> None:
        if not cut_computes_model(self.model, probe):
            raise UsageError(f"{MODEL_SHAPE} does not compute this model "
                             f"({type(self.model).__name__}): use another --strategy")
        self.cut_checked = True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        for linear in self.fused:  # the model leaves as it came
            linear.__class__ = nn.Linear
        self.fused = []


def _convolutions_forward(convolutions: nn.Module, x: torch.Tensor, options,
                          keys: torch.Tensor | None = None) -> torch.Tensor:
    set_torch_threads(1)  # OpenMP thread counts are per calling thread
    if options.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # Autocast is thread-local, so each worker enters it; the output stays bfloat16
    # under bf16 (the classifier would cast it to bfloat16 again anyway).
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=options.precision == "bf16"), \
            dropout_keys(keys):
        return convolutions(x)


def _convolutions_backward(output: torch.Tensor, params: list[torch.Tensor],
                           output_grad: torch.Tensor):
    set_torch_threads(1)
    return torch.autograd.grad(output, params, output_grad, allow_unused=True)


class AccumulatingLinear(nn.Linear):
    """nn.Linear whose backward adds its weight and bias gradients into .grad in place
    (one addmm_) instead of returning them to autograd. Only for a module whose backward
    runs in one thread per step (the classifier here, in the master thread)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x)
        return _AccumulatingLinearFunction.apply(x, self.weight, self.bias)


class _AccumulatingLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        # Rows of x and grad_out are samples: weight.grad += grad_out^T x, bias += sum.
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        with torch.no_grad():
            if weight.requires_grad:
                if weight.grad is None:
                    weight.grad = flat_g.t().mm(flat_x)
                else:
                    weight.grad.addmm_(flat_g.t(), flat_x)
            if bias is not None and bias.requires_grad:
                if bias.grad is None:
                    bias.grad = flat_g.sum(0)
                else:
                    bias.grad.add_(flat_g.sum(0))
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def accumulate_linear_gradients(module: nn.Module) -> list[nn.Linear]:
    """Turn the float32 nn.Linear layers of `module` into AccumulatingLinear, in place
    (same parameters, same state_dict); returns them so that close() can turn them back."""
    fused = []
    for linear in module.modules():
        if type(linear) is nn.Linear and linear.weight.dtype == torch.float32:
            linear.__class__ = AccumulatingLinear
            fused.append(linear)
    return fused

"""One optimizer step, written once: training runs it and the tuner times it.

What is tuned is therefore exactly what is trained: zero the gradients, let the local
strategy leave the host's mean gradient in .grad, average it over hosts, update, resync.
Where a hosts' scheme holds parameters that no host averages (a `LocalUpdate`, returned
with the gradients: the hybrid scheme's classifier slices), those are finished and updated
while the averaged gradients are still on the wire, then the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import Optimizer

from hybriddl.strategies import LocalStrategy, StepStats
from hybriddl.strategies.base import host_gradients


def make_optimizer(parameters, lr: float, momentum: float) -> torch.optim.SGD:
    """The use cases' SGD with momentum, its update fused into one kernel per tensor
    (torch's `fused=True`): the update reads and writes each parameter, gradient and
    momentum buffer once, where the default loop passes over them several times; measured
    on AlexNet's 61 M parameters (2 cores, AMD EPYC): 19.8 ms against 32.7 ms a step, 1.8 %
    of its 0.74 s. The same arithmetic: every strategy, host and resume uses this one."""
    return torch.optim.SGD(parameters, lr=lr, momentum=momentum, fused=True)


def unfuse_where_layouts_differ(optimizer: Optimizer) -> None:
    """torch's fused SGD (2.14, on the CPU) pairs a parameter's elements with its
    gradient's in memory order, whatever their strides: where a gradient is laid out unlike
    its parameter (a fusion bucket's contiguous view, hosts/fusion.py, of a channels_last
    weight), the update is scrambled. Measured: AlexNet, 2 hosts, --channels-last, one
    step: every convolution's update off by 90-124 % of its norm. Such a group steps with
    torch's foreach loop from then on, which pairs elements by index; its momentum is the
    same state. A few comparisons of strides a step."""
    for group in optimizer.param_groups:
        if group.get("fused") and any(p.grad is not None and p.grad.stride() != p.stride()
                                      for p in group["params"]):
            group["fused"], group["foreach"] = False, True


def optimizer_step(strategy: LocalStrategy, optimizer: Optimizer, x, y,
                   average: Callable[[StepStats], None] | None = None,
                   gradients: Callable[[LocalStrategy, object, object], StepStats] | None = None
                   ) -> StepStats:
    """One step on (x, y); `gradients` leaves the host's gradient in .grad (the hosts'
    scheme's, hybriddl.hybrid.parallel; by default the strategy's over the host batch),
    `average` turns it into the global one. Where `gradients` returns a `LocalUpdate`
    (`StepStats.local`), its parameters' gradients are finished and those parameters
    updated before `average` waits: while the averaged gradients' last buckets cross the
    wire. Every tensor's SGD update is its own, so the order changes no bit."""
    zero_gradients(optimizer)
    if gradients is not None:
        stats = gradients(strategy, x, y)
    else:
        # A host whose share of a short batch is empty contributes a zero gradient.
        stats = host_gradients(strategy, x, y) if len(y) else StepStats(0, 0.0)
    local = stats.local
    if local is not None:
        local.finish()
        _step_only(optimizer, local.holds)
    if average is not None:
        average(stats)
    if local is None:
        _absent_as_zero(optimizer)
        unfuse_where_layouts_differ(optimizer)
        optimizer.step()
    else:
        _step_only(optimizer, lambda p: not local.holds(p))
    strategy.after_step()
    return stats


def _step_only(optimizer: Optimizer, keep: Callable[[torch.Tensor], bool]) -> None:
    """optimizer.step() over the parameters `keep` keeps: each group's list narrowed for
    the call (its state, keyed by parameter, is the same), then restored. Whether a group
    steps fused is decided on all of its parameters, as one whole step would."""
    unfuse_where_layouts_differ(optimizer)
    whole = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if keep(p)]
        _absent_as_zero(optimizer)
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, whole):
            group["params"] = params


def zero_gradients(optimizer: Optimizer) -> None:
    """Clear the gradients before a step: a gradient that is a view of another buffer (a
    fusion bucket, hosts/fusion.py, which MPI sends from) is zeroed in place so that
    backward keeps adding into the buffer; every other one is dropped (None), so backward
    hands its fresh gradient over instead of adding it into zeros. Zeroing then adding
    reads and writes every gradient once more per step (on a GPU, a kernel more per
    tensor: issue 39); plain PyTorch drops them too (its default since 2.0)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad._base is not None:
                p.grad.zero_()
            else:
                p.grad = None


def _absent_as_zero(optimizer: Optimizer) -> None:
    """A trained parameter that got no gradient this step updates as with a zero gradient
    (momentum still moves it), as it did when gradients were zeroed rather than dropped:
    SGD skips a parameter whose .grad is None. Costs nothing where every one has one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)

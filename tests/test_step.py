"""hybriddl/step.py: the one optimizer step, and how it clears gradients between steps."""

import torch
from torch import nn

from hybriddl.hosts.compression import Compression
from hybriddl.hosts.fusion import GradientBuckets
from hybriddl.step import make_optimizer, optimizer_step
from hybriddl.strategies import StepStats, StrategyOptions, make_strategy
from hybriddl.strategies.base import LocalUpdate, host_gradients


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3))


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 2, 2, generator=generator), torch.randint(3, (4,), generator=generator)


def steps_seeing_gradients(model, steps=2, **step_options):
    """Run `steps` optimizer steps; what each step's gradients were when it started."""
    seen = []

    def gradients(strategy, x, y):
        seen.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        return host_gradients(strategy, x, y)

    x, y = batch()
    with make_strategy("sequential", StrategyOptions()) as strategy:
        strategy.setup(model)
        optimizer = make_optimizer(model.parameters(), 0.01, 0.9)
        for _ in range(steps):
            optimizer_step(strategy, optimizer, x, y, gradients=gradients, **step_options)
    return seen


def test_gradients_are_dropped_between_steps_where_no_buffer_views_them():
    """Plain PyTorch's set_to_none: backward hands its gradient over instead of adding it
    into zeros (a pass over every gradient less per step)."""
    model = tiny_model()
    seen = steps_seeing_gradients(model)
    assert all(g is None for g in seen[1])
    assert all(p.grad is not None for p in model.parameters())  # the step's own, for SGD


def test_gradients_that_view_a_fusion_bucket_stay_views_and_are_zeroed():
    model = tiny_model()
    buckets = GradientBuckets(model, Compression.none)
    buckets.install_views()
    slots = {id(p): b.slot(i).data_ptr() for b in buckets.buckets for i, p in enumerate(b.params)}
    seen = steps_seeing_gradients(model, steps=3)
    for step in seen[1:]:
        assert all(g is not None and not g.any() for g in step)
    assert all(p.grad.data_ptr() == slots[id(p)] for p in model.parameters())
    assert any(b.flat.any() for b in buckets.buckets)  # the last step's gradient landed there


def test_a_parameter_without_a_gradient_moves_as_with_a_zero_one():
    """SGD skips a parameter whose .grad is None; with momentum a zero gradient still moves
    it, as it did when gradients were zeroed in place, so dropping them changes no update."""
    model = tiny_model()
    x, y = batch()
    last = list(model.parameters())[-1]
    with make_strategy("sequential", StrategyOptions()) as strategy:
        strategy.setup(model)
        optimizer = make_optimizer(model.parameters(), 0.01, 0.9)
        optimizer_step(strategy, optimizer, x, y)
        momentum = optimizer.state[last]["momentum_buffer"].clone()
        before = last.detach().clone()

        def all_but_the_last(strategy, x, y):
            stats = host_gradients(strategy, x, y)
            last.grad = None
            return stats

        optimizer_step(strategy, optimizer, x, y, gradients=all_but_the_last)
    assert torch.allclose(last.detach(), before - 0.01 * 0.9 * momentum)
    assert not torch.equal(last.detach(), before)


def test_an_empty_share_still_steps():
    model = tiny_model()
    with make_strategy("sequential", StrategyOptions()) as strategy:
        strategy.setup(model)
        optimizer = make_optimizer(model.parameters(), 0.01, 0.9)
        stats = optimizer_step(strategy, optimizer, torch.empty(0, 3, 2, 2),
                               torch.empty(0, dtype=torch.int64))
    assert stats == StepStats(0, 0.0)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_local_parameters_are_finished_and_updated_before_the_averaging_waits():
    """What no host averages (the hybrid scheme's classifier slices, returned with the
    gradients as a LocalUpdate) is finished and updated while the averaged gradients still
    cross the wire: when `average` is called, those parameters have moved and the others
    have not; three steps end bit for bit where three plain steps do (each tensor's update
    is its own), momentum included."""
    x, y = batch()
    plain = tiny_model()
    with make_strategy("sequential", StrategyOptions()) as strategy:
        strategy.setup(plain)
        plain_optimizer = make_optimizer(plain.parameters(), 0.01, 0.9)
        for _ in range(3):
            optimizer_step(strategy, plain_optimizer, x, y)

    model = tiny_model()
    last_layer = model[3]
    pending, finished, moved_at_average = {}, [], []

    def finish():  # the scheme's work left for the wait (hybrid: a weight gradient)
        finished.append(True)
        last_layer.weight.grad = pending.pop("weight")

    local = LocalUpdate(frozenset(id(p) for p in last_layer.parameters()), finish)

    def gradients(strategy, x, y):
        stats = host_gradients(strategy, x, y)
        pending["weight"], last_layer.weight.grad = last_layer.weight.grad, None
        stats.local = local
        return stats
    with make_strategy("sequential", StrategyOptions()) as strategy:
        strategy.setup(model)
        optimizer = make_optimizer(model.parameters(), 0.01, 0.9)
        for _ in range(3):
            before = [p.detach().clone() for p in model.parameters()]

            def average(stats):
                moved_at_average.append([not torch.equal(p.detach(), b)
                                         for p, b in zip(model.parameters(), before)])
            optimizer_step(strategy, optimizer, x, y, average, gradients)
    assert finished == [True] * 3
    # Linear(12, 5)'s weight and bias not yet moved, Linear(5, 3)'s moved, at every step.
    assert moved_at_average == [[False, False, True, True]] * 3
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine.detach(), theirs.detach())
        assert torch.equal(optimizer.state[mine]["momentum_buffer"],
                           plain_optimizer.state[theirs]["momentum_buffer"])
    assert all(len(group["params"]) == 4 for group in optimizer.param_groups)  # restored

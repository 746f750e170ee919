"""The layer-wise strategy trains exactly the model sequential SGD trains, on every model
with a features/classifier cut, and refuses the others in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybriddl.tuning.benchmark import StepTiming
from hybriddl.errors import UsageError
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.strategies.layerwise import AccumulatingLinear, split_at_classifier
from hybriddl.usecases import build_model
from test_strategies import (assert_matches_sequential, assert_same_parameters, batches,
                             local_threads, slim_model)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_layerwise_matches_sequential(workers):
    options = StrategyOptions(workers=workers, oversubscribe=True)
    assert_matches_sequential("layerwise", options, "alexnet")


@pytest.mark.slow
def test_layerwise_matches_sequential_on_vgg16():
    assert_matches_sequential("layerwise", StrategyOptions(workers=2, oversubscribe=True), "vgg16")


def trained(strategy: str, workers: int, model: nn.Module, steps, keys=None
            ) -> list[torch.Tensor]:
    """The parameters after `steps` ((x, y) batches) under `strategy`; `keys(step)` the
    dropout keys of each step's samples (None: torch's RNG draws the masks)."""
    from hybriddl.dropout import dropout_keys

    threads = torch.get_num_threads()
    try:
        with make_strategy(strategy, StrategyOptions(workers=workers, oversubscribe=True)) as local:
            local.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            torch.manual_seed(5)
            for step, (x, y) in enumerate(steps):
                optimizer.zero_grad(set_to_none=False)
                with dropout_keys(keys(step) if keys else None):
                    local.compute_gradients(x, y)
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return [p.detach().clone() for p in model.parameters()]


def train_with_dropout(strategy: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("alexnet", 3, dropout=0.5)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, 64)
    model.classifier[4] = nn.Linear(64, 64)
    model.classifier[6] = nn.Linear(64, 3)
    return trained(strategy, 2, model, batches("alexnet"))


def test_layerwise_matches_sequential_with_classifier_dropout():
    """The classifier runs once over the whole batch, drawing its dropout masks from the
    same random stream as sequential: equal even with AlexNet's dropout 0.5."""
    assert_same_parameters(train_with_dropout("layerwise"), train_with_dropout("sequential"))


@pytest.mark.parametrize("name", ["resnet18", "densenet121"])
def test_layerwise_refuses_a_model_without_the_cut(name):
    model = build_model(name, 3)
    threads = torch.get_num_threads()
    try:
        with make_strategy("layerwise", StrategyOptions(workers=2, oversubscribe=True)) as local:
            with pytest.raises(UsageError, match="features -> avgpool -> flatten -> classifier"):
                local.setup(model)
                local.compute_gradients(torch.randn(2, 3, 64, 64), torch.tensor([0, 1]))
    finally:
        torch.set_num_threads(threads)
    assert local_threads() == []


def test_layerwise_cut_keeps_every_parameter():
    model = slim_model("vgg16")
    convolutions, classifier = split_at_classifier(model)
    cut = {id(p) for part in (convolutions, classifier) for p in part.parameters()}
    assert cut == {id(p) for p in model.parameters()}


def test_tuner_tries_layerwise_only_on_models_with_the_cut(monkeypatch):
    from hybriddl.tuning import tuner
    from hybriddl.tuning.profiles import Settings
    from test_tuner import tiny_images

    tried = []

    def measure(name, *args, **kwargs):
        tried.append(name)
        return StepTiming({"name": name}, 2, 1.0, [1.0], 1)

    monkeypatch.setattr(tuner, "measure_strategy", measure)
    for model in ("resnet18", "vgg16"):
        tried.clear()
        tuner.tune_host(Settings("ComplexSmall", model, 32, 2), tiny_images(), budget=600,
                        steps=1, host=tuner.HostResources(cores=2))
        assert ("layerwise" in tried) == (model == "vgg16")


class WideClassifier(nn.Module):
    """features -> avgpool -> classifier, with one 32 MiB classifier weight."""

    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(3, 8, 3, padding=1)
        self.avgpool = nn.AdaptiveAvgPool2d(16)  # 8 * 16 * 16 = 2048 features
        self.classifier = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 3))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def largest_backward_allocation(strategy: str, options: StrategyOptions) -> int:
    """Bytes of the largest block allocated by one op during a steady step (the second:
    .grad exists and is accumulated into, as the trainer zeroes it without freeing it)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = WideClassifier()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(3, (8,))
    with make_strategy(strategy, options) as local:
        local.setup(model)
        local.compute_gradients(x, y)
        for p in model.parameters():
            p.grad.zero_()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            local.compute_gradients(x, y)
        return max(event.cpu_memory_usage for event in prof.events())


def test_layerwise_classifier_adds_weight_gradients_in_place():
    """No temporary of the weight's size: sequential's backward allocates one (32 MiB for
    the 4096 x 2048 weight), layerwise's classifier adds straight into .grad."""
    weight_bytes = 4096 * 2048 * 4
    assert largest_backward_allocation("sequential", StrategyOptions()) >= weight_bytes
    layerwise = StrategyOptions(workers=2, oversubscribe=True)
    assert largest_backward_allocation("layerwise", layerwise) < weight_bytes / 4


def test_layerwise_gives_the_model_back_as_it_came():
    model = slim_model("alexnet")
    with make_strategy("layerwise", StrategyOptions(workers=2, oversubscribe=True)) as local:
        local.setup(model)
        assert {type(m).__name__ for m in model.classifier} >= {"AccumulatingLinear"}
    assert all(type(m) is not AccumulatingLinear for m in model.modules())
    # bf16 leaves autocast's linear layers alone.
    with make_strategy("layerwise", StrategyOptions(workers=2, oversubscribe=True,
                                                    precision="bf16")) as local:
        local.setup(model)
        assert all(type(m) is not AccumulatingLinear for m in model.modules())


def train_with_stochastic_depth(strategy: str, workers: int) -> list[torch.Tensor]:
    """EfficientNet-B0 (its BatchNorms made identities: sub-batches would change their
    statistics) with stochastic depth at 0.5, keyed per sample."""
    from hybriddl.dropout import KeyedStochasticDepth, sample_keys

    torch.manual_seed(0)
    model = build_model("efficientnet_b0", 3)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, name, nn.Identity())
            elif isinstance(child, KeyedStochasticDepth):
                child.p = 0.5
    generator = torch.Generator().manual_seed(1)
    steps = [(torch.randn(5, 3, 32, 32, generator=generator),
              torch.randint(3, (5,), generator=generator)) for _ in range(2)]
    return trained(strategy, workers, model, steps,
                   keys=lambda step: sample_keys(0, step, torch.arange(5)))


def test_layerwise_matches_sequential_with_stochastic_depth_in_the_convolutions():
    """Its workers' sub-batches ran the convolutions without their samples' keys: the
    master's thread held the whole batch's (a RuntimeError, 5 keys for 3 samples) and the
    pool's none (torch's global RNG)."""
    sequential = train_with_stochastic_depth("sequential", 1)
    assert_same_parameters(train_with_stochastic_depth("layerwise", 2), sequential)

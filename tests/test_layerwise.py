"""The layer-wise strategy trains exactly the model sequential SGD trains, on every model
with a features/classifier cut, and refuses the others in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybriddl.tuning.benchmark import StepTiming
from hybriddl.errors import UsageError
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.strategies.layerwise import split_at_classifier
from hybriddl.usecases import build_model
from test_strategies import (assert_matches_sequential, assert_same_parameters, batches,
                             local_threads, slim_model)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_layerwise_matches_sequential(workers):
    options = StrategyOptions(workers=workers, oversubscribe=True)
    assert_matches_sequential("layerwise", options, "alexnet")


def test_layerwise_matches_sequential_on_vgg16():
    assert_matches_sequential("layerwise", StrategyOptions(workers=2, oversubscribe=True), "vgg16")


def train_with_dropout(strategy: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("alexnet", 3, dropout=0.5)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, 64)
    model.classifier[4] = nn.Linear(64, 64)
    model.classifier[6] = nn.Linear(64, 3)
    threads = torch.get_num_threads()
    try:
        with make_strategy(strategy, StrategyOptions(workers=2, oversubscribe=True)) as local:
            local.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            torch.manual_seed(5)
            for x, y in batches("alexnet"):
                optimizer.zero_grad(set_to_none=False)
                local.compute_gradients(x, y)
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return [p.detach().clone() for p in model.parameters()]


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

"""Precision and memory format: channels_last trains sequential's model (within the
tolerance of another convolution algorithm), bf16 trains a bfloat16 model that every
strategy agrees on loosely, and strategies that cannot honour them refuse them."""

from __future__ import annotations

import functools

import pytest
import torch

from hybriddl.errors import UsageError
import dataclasses

from hybriddl.strategies import (STRATEGIES, HostResources, StrategyOptions, StrategySpec,
                                 cpu_strategies, make_strategy)
from hybriddl.tuning.tuner import enumerate_candidates
from test_strategies import sequential_parameters, train

# channels_last runs oneDNN's NHWC convolution kernels, which may sum in another order:
# 3 SGD steps differed from sequential by 2.2e-7 (processes and layerwise, AlexNet), so
# the equivalence tests' own 1e-5 holds.
CHANNELS_LAST_TOLERANCE = 1e-5
# bfloat16 keeps 8 bits of mantissa (~2-3 significant digits): strategies that sum the
# same products in another order (sub-batches, another thread count) agree to a few %.
BF16_TOLERANCE = 5e-2


def largest_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(((a - e).abs().max() / e.abs().max()).item() for a, e in zip(actual, expected))


@functools.cache
def sequential_bf16(model_name: str) -> list[torch.Tensor]:
    return train("sequential", StrategyOptions(precision="bf16"), model_name)


# The registry's CPU strategies that run the model in other numerics when asked, and those
# that refuse to.
HONOURING = [name for name in cpu_strategies() if STRATEGIES[name].honours_numerics]
WITH_WORKERS = [name for name in HONOURING if STRATEGIES[name].example_options.workers]
REFUSING = [name for name, cls in STRATEGIES.items() if not cls.honours_numerics]


@pytest.mark.parametrize("strategy", HONOURING)
def test_channels_last_matches_sequential(strategy):
    options = dataclasses.replace(STRATEGIES[strategy].example_options, channels_last=True)
    difference = largest_difference(train(strategy, options, "alexnet"),
                                    sequential_parameters("alexnet"))
    assert difference <= CHANNELS_LAST_TOLERANCE, difference


@pytest.mark.slow
def test_layerwise_channels_last_matches_sequential_on_vgg16():
    """In float64 (test_strategies.DTYPE: a float32 ReLU flip at VGG16's 2x2 maps is no
    float tolerance): the layout's logic, where AlexNet's tests check oneDNN's kernels."""
    options = StrategyOptions(workers=2, oversubscribe=True, channels_last=True)
    difference = largest_difference(train("layerwise", options, "vgg16"),
                                    sequential_parameters("vgg16"))
    assert difference <= CHANNELS_LAST_TOLERANCE, difference


def test_bf16_really_trains_in_reduced_precision():
    """bf16 moves the parameters away from float32 training by far more than any float32
    tolerance: autocast is in effect, not silently ignored."""
    difference = largest_difference(sequential_bf16("alexnet"), sequential_parameters("alexnet"))
    assert difference > 1e-3, difference


@pytest.mark.parametrize("strategy, channels_last", [
    *[(name, False) for name in WITH_WORKERS], ("layerwise", True)])
def test_bf16_strategies_match_sequential_bf16_loosely(strategy, channels_last):
    options = dataclasses.replace(STRATEGIES[strategy].example_options, precision="bf16",
                                  channels_last=channels_last)
    actual = train(strategy, options, "alexnet")
    # Closer to bf16 sequential than bf16 is to float32: the same computation, summed
    # in another order.
    difference = largest_difference(actual, sequential_bf16("alexnet"))
    assert difference <= BF16_TOLERANCE, difference
    assert all(p.dtype == torch.float32 for p in actual)  # master weights stay float32


@pytest.mark.parametrize("numerics", [{"precision": "bf16"}, {"channels_last": True}])
@pytest.mark.parametrize("strategy", REFUSING)
def test_strategies_that_run_the_model_in_pieces_refuse_other_numerics(strategy, numerics):
    options = dataclasses.replace(STRATEGIES[strategy].example_options, **numerics)
    with pytest.raises(UsageError, match="float32"):
        make_strategy(strategy, options)


def test_precision_auto_needs_the_tuner():
    with pytest.raises(UsageError, match="--strategy auto"):
        make_strategy("threads", StrategyOptions(precision="auto"))


def test_tuner_tries_bf16_only_when_allowed():
    fp32 = enumerate_candidates(HostResources(cores=2), 16)
    auto = enumerate_candidates(HostResources(cores=2), 16, precision="auto")
    assert all(c.precision == "fp32" for c in fp32)
    assert StrategySpec("layerwise", workers=2) in fp32
    assert StrategySpec("layerwise", workers=2, channels_last=True) in fp32  # fp32 NHWC too
    bf16 = [c for c in auto if c.precision == "bf16"]
    assert [c.label for c in bf16] == [
        "intraop K=2 bf16 channels_last", "threads K=2 bf16 channels_last",
        "processes K=2 bf16 channels_last", "layerwise K=2 bf16 channels_last"]
    assert set(auto) - set(bf16) == set(fp32)  # the baseline stays sequential in float32


def test_default_numerics_are_left_out_of_profiles_so_old_profiles_read_the_same():
    old = {"name": "threads", "workers": 2, "micro_batches": None, "devices": []}
    assert StrategySpec.from_dict(old) == StrategySpec("threads", workers=2)
    assert StrategySpec("threads", workers=2).to_dict() == old


def test_bf16_choice_round_trips_and_gives_its_options():
    choice = StrategySpec("layerwise", workers=2, precision="bf16", channels_last=True)
    assert StrategySpec.from_dict(choice.to_dict()) == choice
    options = choice.options()
    assert (options.precision, options.channels_last) == ("bf16", True)

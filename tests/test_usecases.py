"""The paper's use cases as data, and the torchvision models they name."""

import pytest
import torch
from torch import nn

from hybriddl.errors import UsageError
from hybriddl.usecases import (RGB_MEAN, RGB_STD, USECASES, build_model, check_image_size,
                               get_usecase)


def test_complexsmall_is_vgg16_on_the_small_dataset_with_three_classes():
    case = get_usecase("ComplexSmall")
    assert (case.model, case.dataset, case.num_classes) == ("vgg16", "small", 3)


def test_simplebig_is_alexnet_on_the_big_dataset_with_three_classes():
    case = get_usecase("SimpleBig")
    assert (case.model, case.dataset, case.num_classes) == ("alexnet", "big", 3)


def test_only_the_papers_two_use_cases_exist():
    assert set(USECASES) == {"ComplexSmall", "SimpleBig"}


@pytest.mark.parametrize("name", ["ComplexSmall", "SimpleBig"])
def test_use_cases_train_with_the_papers_sgd_at_224_px(name):
    case = get_usecase(name)
    assert case.lr == 0.001
    assert case.momentum == 0.9
    assert case.image_size == 224
    assert case.batch_size >= 1 and case.epochs >= 1


def test_preprocessing_normalises_with_the_imagenet_statistics():
    assert RGB_MEAN == (0.485, 0.456, 0.406)
    assert RGB_STD == (0.229, 0.224, 0.225)


def test_unknown_use_case_is_a_usage_error_naming_the_known_ones():
    with pytest.raises(UsageError, match="ComplexSmall, SimpleBig"):
        get_usecase("ComplexBig")


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "squeezenet1_1",
                                  "googlenet", "shufflenet_v2_x0_5"])
def test_build_model_gives_any_torchvision_classifier_with_the_requested_classes(name):
    model = build_model(name, num_classes=3)
    model.train()
    logits = model(torch.rand(2, 3, 64, 64))
    # A plain tensor in training mode too: auxiliary heads would break the loss.
    assert isinstance(logits, torch.Tensor)
    assert logits.shape == (2, 3)


def test_build_model_starts_from_the_seed_not_from_pretrained_weights():
    torch.manual_seed(7)
    first = build_model("squeezenet1_1", num_classes=3).state_dict()
    torch.manual_seed(7)
    second = build_model("squeezenet1_1", num_classes=3).state_dict()
    torch.manual_seed(8)
    third = build_model("squeezenet1_1", num_classes=3).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["features.0.weight"], third["features.0.weight"])


@pytest.mark.parametrize("name", ["alexnet", "vgg16"])
def test_dropout_zero_turns_off_every_dropout_layer(name):
    model = build_model(name, num_classes=3, dropout=0.0)
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts, "the paper's models have dropout in their classifier"
    assert [m.p for m in dropouts] == [0.0] * len(dropouts)


def test_dropout_value_reaches_torchvisions_model():
    model = build_model("alexnet", num_classes=3, dropout=0.25)
    assert {m.p for m in model.modules() if isinstance(m, nn.Dropout)} == {0.25}


def test_default_dropout_is_torchvisions():
    model = build_model("alexnet", num_classes=3)
    assert {m.p for m in model.modules() if isinstance(m, nn.Dropout)} == {0.5}


def test_dropout_on_a_model_without_that_option_is_a_usage_error():
    with pytest.raises(UsageError, match="resnet18.*no dropout option"):
        build_model("resnet18", num_classes=3, dropout=0.0)


@pytest.mark.parametrize("dropout", [-0.1, 1.0])
def test_dropout_outside_zero_to_one_is_a_usage_error(dropout):
    with pytest.raises(UsageError, match="--dropout"):
        build_model("alexnet", num_classes=3, dropout=dropout)


def test_unknown_model_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown model 'vgg17'"):
        build_model("vgg17", num_classes=3)


def test_image_size_too_small_for_alexnet_is_a_usage_error():
    with pytest.raises(UsageError, match="--image-size 32"):
        check_image_size(build_model("alexnet", num_classes=3), 32, 3)


def test_small_sizes_the_tests_use_are_accepted():
    check_image_size(build_model("alexnet", num_classes=3), 64, 3)
    check_image_size(build_model("resnet18", num_classes=3), 32, 3)


def test_image_size_check_leaves_the_model_in_training_mode():
    model = build_model("resnet18", num_classes=3)
    model.train()
    check_image_size(model, 32, 3)
    assert model.training


class FixedSizeModel(nn.Module):
    """Like torchvision's vit_*: asserts one input size instead of failing in a layer."""

    def forward(self, x):
        torch._assert(x.shape[-1] == 224, f"Wrong image height! Expected 224 but got {x.shape[-1]}!")
        return torch.zeros(len(x), 3)


def test_model_that_asserts_another_image_size_is_a_usage_error():
    with pytest.raises(UsageError, match="--image-size 64 .*Expected 224"):
        check_image_size(FixedSizeModel(), 64, 3)

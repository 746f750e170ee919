"""The paper's use cases as data, and the torchvision models they name.

The use cases are read by every command, emulate and launch too, which only start processes:
torch and torchvision are imported where a model is built or run, not above."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybriddl.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

# ImageNet statistics, as in the paper's preprocessing.
RGB_MEAN = (0.485, 0.456, 0.406)
RGB_STD = (0.229, 0.224, 0.225)
# The paper's optimizer: mini-batch SGD at this learning rate and momentum.
SGD_LR = 0.001
SGD_MOMENTUM = 0.9


@dataclass(frozen=True)
class UseCase:
    name: str
    model: str
    dataset: str  # embedded dataset variant: "small" or "big"
    num_classes: int = 3
    image_size: int = 224
    batch_size: int = 16
    epochs: int = 3
    lr: float = SGD_LR
    momentum: float = SGD_MOMENTUM


USECASES = {
    "ComplexSmall": UseCase("ComplexSmall", model="vgg16", dataset="small", batch_size=16),
    "SimpleBig": UseCase("SimpleBig", model="alexnet", dataset="big", batch_size=32),
}

# Where the two-stage pipeline cuts each model: after the 4th convolution for
# AlexNet and after the 8th for VGG16 (the paper's split), each convolution kept
# with its ReLU. Index = position of the first module of stage 2 in `model.features`:
# AlexNet features[8] is its 4th Conv2d, features[9] its ReLU; VGG16 features[17]
# is its 8th Conv2d, features[18] its ReLU.
PIPELINE_SPLITS = {"alexnet": 10, "vgg16": 19}

# torchvision classifiers that return extra auxiliary logits in training mode; the
# use cases' loss is plain cross-entropy on the main head, so those heads are left out.
AUXILIARY_HEAD_MODELS = {"googlenet", "inception_v3"}


DEFAULT_USECASE = "ComplexSmall"  # what train, tune and compare run when --usecase is left out


def get_usecase(name: str) -> UseCase:
    try:
        return USECASES[name]
    except KeyError:
        known = ", ".join(USECASES)
        raise UsageError(f"unknown use case {name!r}: choose one of {known}") from None


class NamesAUseCase:
    """Settings that name their use case (`usecase`: the name, as files and command lines
    carry it) give the UseCase itself as `case`, so no user of them looks it up again."""

    @property
    def case(self) -> UseCase:
        return get_usecase(self.usecase)


def use_case_workload(usecase: str, model: str | None, image_size: int | None,
                      batch_size: int | None) -> tuple[str, int, int]:
    """The model, image size and batch, the use case's where left out, checked: what
    train, tune and compare all start from."""
    case = get_usecase(usecase)
    model = model or case.model
    image_size = image_size if image_size is not None else case.image_size
    batch_size = batch_size if batch_size is not None else case.batch_size
    for flag, value in (("--batch-size", batch_size), ("--image-size", image_size)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give at least 1")
    return model, image_size, batch_size


def classifier_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, num_classes: int, dropout: float | None = None) -> nn.Module:
    """A freshly initialised torchvision classifier (no pretrained weights: no network)."""
    import torchvision

    from hybriddl.dropout import key_dropout

    if name not in classifier_names():
        raise UsageError(
            f"unknown model {name!r}: use a torchvision classifier name such as vgg16, "
            "alexnet or resnet50 (see torchvision.models.list_models())"
        )
    kwargs = {"weights": None, "num_classes": num_classes}
    if name in AUXILIARY_HEAD_MODELS:
        kwargs["aux_logits"] = False
    if dropout is not None:
        if not 0.0 <= dropout < 1.0:
            raise UsageError(f"--dropout {dropout} is out of range: give a value in [0, 1)")
        kwargs["dropout"] = dropout
    try:
        # Keyed dropout: each sample's masks depend on the sample, not on who computes it.
        return key_dropout(torchvision.models.get_model(name, **kwargs))
    except TypeError as exc:
        if "dropout" in str(exc) and dropout is not None:
            raise UsageError(f"model {name!r} has no dropout option: leave --dropout out") from None
        raise


def check_image_size(model: nn.Module, image_size: int, num_classes: int) -> None:
    """Fail early, with advice, when the model cannot take images this small."""
    if image_size < 1:
        raise UsageError(f"--image-size {image_size} must be a positive number of pixels")
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, 3, image_size, image_size))
    # Too-small inputs fail in a pooling or convolution (RuntimeError/ValueError);
    # fixed-size models such as vit_* assert their size (AssertionError).
    except (RuntimeError, ValueError, AssertionError) as exc:
        # A size too large for memory (torch's OutOfMemoryError on a GPU, the allocator's
        # RuntimeError on a CPU) is no size the model refuses.
        if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc):
            raise UsageError(f"--image-size {image_size}: one image of that size does not fit "
                             "this host's memory in this model; give a smaller size") from None
        raise UsageError(
            f"--image-size {image_size} does not work with this model ({_first_line(exc)}): "
            "give a size it accepts, e.g. at least 64 for alexnet, 32 for vgg16"
        ) from None
    finally:
        model.train(was_training)
    if out.shape[-1] != num_classes:
        raise UsageError(f"the model gives {out.shape[-1]} outputs for {num_classes} classes")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__

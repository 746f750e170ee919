"""Keyed dropout: a sample's masks depend on (seed, epoch, sample index, layer) only."""

import torch
from torch import nn

from hybriddl.dropout import KeyedDropout, dropout_keys, key_dropout, sample_keys
from hybriddl.usecases import build_model


def test_a_samples_mask_does_not_depend_on_its_batch():
    layer = KeyedDropout(0.5, layer=0).train()
    x = torch.ones(6, 40)
    keys = sample_keys(3, 1, torch.tensor([9, 2, 5, 11, 4, 0]))
    with dropout_keys(keys):
        whole = layer(x)
    with dropout_keys(keys[2:5].flip(0)):
        part = layer(x[2:5])
    assert torch.equal(part, whole[2:5].flip(0))
    assert set(whole.unique().tolist()) == {0.0, 2.0}


def test_masks_differ_between_samples_epochs_seeds_and_layers():
    x = torch.ones(1, 4000)
    index = torch.tensor([5])

    def drawn(seed, epoch, i, layer):
        with dropout_keys(sample_keys(seed, epoch, i)):
            return KeyedDropout(0.5, layer).train()(x)

    reference = drawn(0, 0, index, 0)
    for other in (drawn(1, 0, index, 0), drawn(0, 1, index, 0), drawn(0, 0, index + 1, 0),
                  drawn(0, 0, index, 1)):
        assert not torch.equal(other, reference)
    dropped = (reference == 0).float().mean().item()
    assert 0.45 < dropped < 0.55


def test_eval_mode_and_missing_keys():
    layer = KeyedDropout(0.5).eval()
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), x)
    layer.train()
    torch.manual_seed(0)
    plain = layer(x)  # no keys (tuner timing runs): torch's own dropout
    torch.manual_seed(0)
    assert torch.equal(plain, nn.functional.dropout(x, 0.5, True))


def test_models_get_keyed_dropout_numbered_in_order():
    model = build_model("alexnet", 3)
    layers = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert [type(m) for m in layers] == [KeyedDropout, KeyedDropout]
    assert [m.layer for m in layers] == [0, 1]
    assert key_dropout(model) is model and [m.layer for m in model.modules()
                                            if isinstance(m, KeyedDropout)] == [0, 1]

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


def _reference_keep(key: int, layer: int, element: int, p: float) -> bool:
    """SplitMix64 in Python's unbounded integers, masked to 64 bits at every step: what
    the int64 tensor ops must reproduce on any device. Pair j = e // 2 is hashed; element
    2j takes its high 32 bits, 2j + 1 its low."""
    mask64 = 2 ** 64 - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
        return z ^ (z >> 31)

    base = mix(((key << 6) + layer) & mask64)
    state = mix((base + (element // 2 + 1) * 0x9E3779B97F4A7C15) & mask64)
    draw = state >> 32 if element % 2 == 0 else state & (2 ** 32 - 1)
    return draw >= round(p * 2 ** 32)


def test_masks_are_splitmix64_of_key_layer_and_element_bit_for_bit():
    keys = sample_keys(7, 2, torch.tensor([0, 1, 123456, 2 ** 31]))
    layer = KeyedDropout(0.5, layer=3).train()
    with dropout_keys(keys):
        kept = layer(torch.ones(4, 3, 5, 7)) != 0
    expected = torch.tensor([[_reference_keep(k, 3, e, 0.5) for e in range(3 * 5 * 7)]
                             for k in keys.tolist()]).view(4, 3, 5, 7)
    assert torch.equal(kept, expected)


def test_masks_are_computed_on_the_tensors_device_without_a_host_generator(monkeypatch):
    """No generator drawn from on the host (the old masks came from an mt19937 per sample,
    in a Python loop, copied to the device): with torch's generators and rand refused, a
    batch on the meta device (shapes, no data, no host copy possible) gets its mask there."""
    def refused(*args, **kwargs):
        raise AssertionError("a host-side random generator was used")

    monkeypatch.setattr(torch, "Generator", refused)
    monkeypatch.setattr(torch, "rand", refused)
    layer = KeyedDropout(0.5, layer=0).train()
    with dropout_keys(sample_keys(0, 0, torch.arange(64))):
        y = layer(torch.ones(64, 4096, device="meta"))
        assert 0.49 < (layer(torch.ones(64, 4096)) == 0).float().mean().item() < 0.51
    assert y.device.type == "meta" and y.shape == (64, 4096)


def test_a_hosts_columns_draw_the_whole_rows_mask():
    from hybriddl.hybrid.classifier import SlicedDropout

    keys = sample_keys(1, 0, torch.arange(5))
    whole, sliced = KeyedDropout(0.5, layer=1).train(), SlicedDropout(nn.Dropout(0.5), 40, 13, 28)
    sliced.layer = 1
    sliced.train()
    with dropout_keys(keys):
        assert torch.equal(sliced(torch.ones(5, 15)), whole(torch.ones(5, 40))[:, 13:28])

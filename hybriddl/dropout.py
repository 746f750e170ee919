"""Dropout whose masks depend on the sample, never on who computes it.

torch's dropout draws from the RNG of whichever thread or process runs the forward, so
the same sample gets another mask under another strategy, host count, or after a resume.
Here each sample's mask comes from its own generator, seeded by its key (seed, epoch,
sample index) and the dropout layer's position in the model. Whoever runs a forward
pass says which samples it holds with `dropout_keys(keys)`; the strategies pass the
slice of the keys that matches each sub-batch, micro-batch or host share they cut.
Checkpoints therefore need no RNG state for dropout: a resumed step draws what the
uninterrupted one drew.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

_context = threading.local()
_INDEX_BITS = 32  # room for 4 G samples per epoch
_KEY_MODULUS = 2 ** 56  # keys stay exact in int64, even after the layer is mixed in
_LAYER_BITS = 6
_MASK64 = 2 ** 64 - 1


def sample_keys(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """The dropout key of each sample (int64), a function of (seed, epoch, index) only."""
    base = ((seed * 1_000_003 + epoch) << _INDEX_BITS) % _KEY_MODULUS
    return indices.to(torch.int64) + base


@contextmanager
def dropout_keys(keys: torch.Tensor | None) -> Iterator[None]:
    """Forward passes in this thread draw the masks of the samples with these keys."""
    previous = getattr(_context, "keys", None)
    _context.keys = keys
    try:
        yield
    finally:
        _context.keys = previous


def current_keys(start: int | None = None, stop: int | None = None) -> torch.Tensor | None:
    """This thread's keys (or their [start, stop) slice); None when none are set."""
    keys = getattr(_context, "keys", None)
    return keys if keys is None or start is None else keys[start:stop]


class KeyedDropout(nn.Dropout):
    """nn.Dropout with per-sample masks from the keys set by `dropout_keys`.

    Without keys (the tuner's timing runs, a DDP contender) it is plain nn.Dropout.
    """

    def __init__(self, p: float = 0.5, layer: int = 0):
        super().__init__(p)
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keys = current_keys()
        if keys is None:
            return F.dropout(x, self.p, True)
        if len(keys) != len(x):
            raise RuntimeError(f"dropout got {len(x)} samples but {len(keys)} sample keys: "
                               "slice the keys like the batch")
        uniform = torch.empty(x.shape, dtype=torch.float32)
        generator = torch.Generator()
        for row, key in zip(uniform, keys.tolist()):
            # mt19937 on the CPU: the same draws on every machine, thread and device.
            generator.manual_seed(_seed32((key << _LAYER_BITS) + self.layer))
            torch.rand(row.shape, generator=generator, out=row)
        scale = (uniform >= self.p).to(device=x.device, dtype=x.dtype).mul_(1.0 / (1.0 - self.p))
        return x * scale

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


def _seed32(key: int) -> int:
    """32 well-mixed bits of a 64-bit key (splitmix64's finaliser): torch's CPU generator
    keeps only the low 32 bits of its seed, where seed and epoch would not reach."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


def key_dropout(model: nn.Module) -> nn.Module:
    """Replace the model's nn.Dropout modules, in place, by KeyedDropout (numbered in order)."""
    layer = 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Dropout:
                setattr(parent, name, KeyedDropout(child.p, layer % 2 ** _LAYER_BITS))
                layer += 1
    return model

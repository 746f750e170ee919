"""Dropout whose masks depend on the sample, never on who computes it.

torch's dropout draws from the RNG of whichever thread or process runs the forward, so
the same sample gets another mask under another strategy, host count, or after a resume.
Here each sample's mask is a pure function of its key (seed, epoch, sample index), the
dropout layer's position in the model and the element's index: a counter-based generator
computed on the tensor's own device (the same bits on CPU and CUDA, no per-sample loop,
no mask copied from the host). Whoever runs a forward
pass says which samples it holds with `dropout_keys(keys)`; the strategies pass the
slice of the keys that matches each sub-batch, micro-batch or host share they cut.
Checkpoints therefore need no RNG state for dropout: a resumed step draws what the
uninterrupted one drew.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

# The generator behind the masks, recorded in metrics.json: a run resumed from a checkpoint
# of an older generator (none recorded: mt19937 seeded per sample, before 2026-11) draws
# other masks after the resume than its uninterrupted run would have.
MASKS = "splitmix64-pairs"

_context = threading.local()
_INDEX_BITS = 32  # room for 4 G samples per epoch
_KEY_MODULUS = 2 ** 56  # keys stay exact in int64, even after the layer is mixed in
_LAYER_BITS = 6


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
        return keyed_dropout(x, keys, self.layer, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


# SplitMix64 (Steele, Lea & Flood 2014) as a counter-based generator: the state of pair
# j of a sample's mask is base + (j + 1) * golden, finalised by the mixer below; its high
# and low 32 bits are the draws of elements 2j and 2j + 1. A mask is therefore a pure
# function of (key, layer, element) (Salmon et al. 2011; Triton's low-memory dropout),
# computed by whole-tensor int64 ops on the tensor's own device. torch's int64 arithmetic
# wraps modulo 2**64 on CPU and CUDA alike, and its >> is arithmetic, so the logical
# shifts mask off the copied sign bits: the same bits on every device. In-place ops and
# two draws per hash: int64 multiplies are not vectorised without AVX-512, and the first
# version (one draw per hash, a new tensor per op) cost 4x the per-sample mt19937 loop it
# replaced on one CPU core (256 x 4096 elements: 22 ms against 5.6 ms); this one 6.2-7.5 ms.
_GOLDEN = 0x9E3779B97F4A7C15 - 2 ** 64
_MIX1 = 0xBF58476D1CE4E5B9 - 2 ** 64
_MIX2 = 0x94D049BB133111EB - 2 ** 64
_LOW32 = 2 ** 32 - 1


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place (logical shifts: the sign bits masked off)."""
    for shift, multiplier in ((30, _MIX1), (27, _MIX2)):
        z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1)).mul_(multiplier)
    return z.bitwise_xor_((z >> 31).bitwise_and_((1 << 33) - 1))


def keep_mask(keys: torch.Tensor, layer: int, start: int, stop: int, p: float,
              device: torch.device) -> torch.Tensor:
    """(samples, stop - start) booleans on `device`: True where dropout at rate `p` keeps
    element e in [start, stop) of the sample with key k in layer `layer`; a pure function of
    (k, layer, e), so a slice of the elements (a host's columns) draws what the whole row
    would."""
    keys = keys.to(device, non_blocking=True)
    base = _mix_((keys << _LAYER_BITS) + layer)
    first = start // 2
    pairs = torch.arange(first + 1, (stop + 1) // 2 + 1, device=device, dtype=torch.int64)
    state = _mix_(base[:, None] + pairs[None, :] * _GOLDEN)
    # The [high, low] 32 bits of each pair, interleaved: element 2j is high, 2j + 1 low.
    draws = torch.stack(((state >> 32).bitwise_and_(_LOW32), state.bitwise_and_(_LOW32)), 2)
    offset = start - 2 * first
    return draws.view(len(keys), -1)[:, offset:offset + stop - start] >= round(p * 2 ** 32)


def keyed_dropout(x: torch.Tensor, keys: torch.Tensor, layer: int, p: float,
                  start: int = 0) -> torch.Tensor:
    """Dropout at rate `p` of x's rows (one per key; each row elements [start, start +
    row size) of the layer's whole row): x times the keep mask, scaled by 1 / (1 - p);
    on a CUDA device one kernel each way (see COMPILED_DEVICES)."""
    keys = keys.to(x.device, non_blocking=True)
    return _KeyedDropoutFunction.apply(x, keys, layer, p, start)


def _forward(x: torch.Tensor, keys: torch.Tensor, layer: int, p: float,
             start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x dropped out, and what backward needs: the keep mask as booleans (a quarter of the
    bytes of x's float32), which the compiled backward scales in the same kernel."""
    keep = keep_mask(keys, layer, start, start + x[0].numel(), p, x.device).view(x.shape)
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p)), keep


def _backward(grad: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    return grad * keep.to(grad.dtype).mul_(1.0 / (1.0 - p))


def _forward_eager(x, keys, layer, p, start):
    """Eager ops keep the scaled mask instead: backward is then one multiply, not three."""
    keep = keep_mask(keys, layer, start, start + x[0].numel(), p, x.device).view(x.shape)
    scaled = keep.to(x.dtype).mul_(1.0 / (1.0 - p))
    return x * scaled, scaled


def _backward_eager(grad, scaled, p):
    return grad * scaled


class _KeyedDropoutFunction(torch.autograd.Function):
    # Its own backward, so that the fused kernels never meet autograd: torch.compile then
    # compiles two plain functions, forward and backward, with nothing compiled lazily in
    # autograd's device threads. Backward runs the kernels forward ran: they chose what
    # was saved.
    @staticmethod
    def forward(ctx, x, keys, layer, p, start):
        ctx.kernels = _kernels(x.device)
        y, saved = ctx.kernels.forward(x, keys, layer, p, start)
        ctx.save_for_backward(saved)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        return ctx.kernels.backward(grad, saved, ctx.p), None, None, None, None


# The mask is about 35 elementwise ops (the hash of every pair, the split into draws, the
# compare, the scale): on a GPU each is a kernel launch and a pass over int64 memory, where
# nn.Dropout is one kernel. torch.compile fuses forward and backward into one kernel each,
# with the same int64 arithmetic, so the same bits (tests/test_dropout.py checks the
# compiled functions against the pure-Python reference on the CPU; tests/test_gpu.py CUDA
# against the CPU). Only on CUDA devices: on the CPU, compiling took 27 s on 2 cores and
# the compiled kernels ran slower than the eager ops (forward and backward of AlexNet's two
# dropout layers, batch 64, one thread: 12.5-13 ms against 4.0-4.2 ms a step,
# scripts/bench_dropout.py --compiled; probably as the fused kernel hashes each pair for
# both its elements where the eager ops hash it once: spare arithmetic on a GPU, not here).
# On CUDA the same two kernels are written by hand in Triton (hybriddl/dropout_triton.py)
# and run first: torch.compile's cost about 0.9 ms of host time per AlexNet step on an H200
# in Dynamo's guards and Inductor's wrappers, and a GPU step of AlexNet is bound by its
# host's launches. torch.compile's are the fallback where the Triton kernels fail their
# check against the eager ops; HYBRIDDL_COMPILE_DROPOUT=0 keeps the eager ops on CUDA too.
COMPILED_DEVICES = frozenset({"cuda"})


class _Kernels:
    """The forward and backward functions of keyed dropout: eager or compiled."""

    def __init__(self, forward: Callable, backward: Callable, compiled: bool,
                 locked: bool = True):
        self.compiled = compiled
        # Whether a call takes _COMPILE_LOCK: torch.compile's functions do; Triton's
        # kernels, built and checked once, are plain launches that need none (one lock
        # fewer per dropout layer each way, on a step bound by the host's launches).
        self.locked = locked
        self._forward, self._backward = forward, backward
        self.fallback: str | None = None  # why compiling failed, once it did

    def forward(self, *args):
        return self._run("_forward", args)

    def backward(self, *args):
        return self._run("_backward", args)

    def _run(self, name: str, args):
        if not self.compiled:
            return getattr(self, name)(*args)
        try:
            if not self.locked:
                return getattr(self, name)(*args)
            # torch.compile is not thread-safe (pytorch/pytorch#118260): pipeline stages and
            # gpu-threads replicas call it from their own threads, and autograd runs a
            # backward in its device's thread. The calls only queue kernels: taking turns
            # costs microseconds.
            with _COMPILE_LOCK:
                return getattr(self, name)(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - no compiler here: the eager ops, same bits
            # The uncompiled functions themselves: they save what the compiled ones save.
            self.compiled, self.fallback = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
            self._forward, self._backward = _forward, _backward
            return getattr(self, name)(*args)


_COMPILE_LOCK = threading.Lock()
_EAGER = _Kernels(_forward_eager, _backward_eager, compiled=False)
_compiled: _Kernels | None = None


def compiled_kernels() -> _Kernels:
    """The compiled forward and backward (compiled at their first call), made once."""
    global _compiled
    with _COMPILE_LOCK:
        if _compiled is None:
            _compiled = _Kernels(torch.compile(_forward, dynamic=True),
                                 torch.compile(_backward, dynamic=True), compiled=True)
    return _compiled


_triton: _Kernels | None = None


def triton_kernels() -> _Kernels:
    """The hand-written Triton kernels (hybriddl.dropout_triton), made once: checked against
    the eager ops on the current CUDA device before their first use. Where Triton is
    missing or a bit differs, `compiled` is False and `fallback` says why."""
    global _triton
    with _COMPILE_LOCK:
        if _triton is None:
            try:
                from hybriddl import dropout_triton
                kernels = _Kernels(dropout_triton.forward, dropout_triton.backward,
                                   compiled=True, locked=False)
                _check_against_eager(kernels, torch.device("cuda", torch.cuda.current_device()))
                _triton = kernels
            except Exception as exc:  # noqa: BLE001 - recorded; torch.compile's then
                _triton = _Kernels(_forward, _backward, compiled=False)
                _triton.fallback = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _triton


def _check_against_eager(kernels: _Kernels, device: torch.device) -> None:
    """Raise unless `kernels` draw the eager ops' bits, forward and backward, for keys
    past 2**31, an odd start and row size, p = 0.3 and 0.5, float32 and bfloat16."""
    keys = sample_keys(7, 2, torch.tensor([0, 1, 123456, 2 ** 31])).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    for dtype, start, p in ((torch.float32, 0, 0.5), (torch.float32, 13, 0.3),
                            (torch.bfloat16, 5, 0.3)):
        x = torch.randn(4, 3, 37, generator=generator, device=device).to(dtype)
        y, keep = kernels._forward(x, keys, 3, p, start)
        want_y, want_keep = _forward(x, keys, 3, p, start)
        grad = torch.randn(4, 3, 37, generator=generator, device=device).to(dtype)
        if not (torch.equal(keep, want_keep) and torch.equal(y, want_y)
                and torch.equal(kernels._backward(grad, keep, p), _backward(grad, keep, p))):
            raise RuntimeError(f"its bits differ from the eager ops' ({dtype}, start {start}, "
                               f"p {p})")


def _kernels(device: torch.device) -> _Kernels:
    """What keyed dropout runs on `device`: on CUDA the Triton kernels, else torch.compile's
    (each where it works), else the eager ops; HYBRIDDL_COMPILE_DROPOUT=0 keeps the eager
    ops everywhere."""
    if device.type not in COMPILED_DEVICES or os.environ.get("HYBRIDDL_COMPILE_DROPOUT") == "0":
        return _EAGER
    if device.type == "cuda":
        # Made and checked once; each step's dropout calls take no lock to find them.
        kernels = _triton or triton_kernels()
        if kernels.compiled:
            return kernels
    kernels = compiled_kernels()
    return kernels if kernels.compiled else _EAGER


class KeyedStochasticDepth(nn.Module):
    """torchvision's StochasticDepth in "row" mode (EfficientNet, ConvNeXt, Swin, MaxViT:
    a residual branch dropped per sample) with each sample's keep from its key, as
    KeyedDropout's masks: torchvision's draws from the global RNG, which a checkpoint
    restores as rank 0's on every host and which threads and worker processes share or
    do not. Without keys it is torchvision's."""

    def __init__(self, p: float, layer: int = 0):
        super().__init__()
        self.p, self.mode, self.layer = p, "row", layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keys = current_keys()
        if keys is None:
            from torchvision.ops import stochastic_depth

            return stochastic_depth(x, self.p, self.mode, True)
        if len(keys) != len(x):
            raise RuntimeError(f"stochastic depth got {len(x)} samples but {len(keys)} sample "
                               "keys: slice the keys like the batch")
        keep = keep_mask(keys, self.layer, 0, 1, self.p, x.device).to(x.dtype)
        if self.p < 1.0:
            keep = keep / (1.0 - self.p)
        return x * keep.view(len(x), *[1] * (x.dim() - 1))

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}, layer={self.layer}"


def key_dropout(model: nn.Module) -> nn.Module:
    """Replace the model's nn.Dropout modules, and torchvision's row-wise StochasticDepth,
    in place, by KeyedDropout and KeyedStochasticDepth (numbered in order)."""
    from torchvision.ops import StochasticDepth

    layer = 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Dropout:
                setattr(parent, name, KeyedDropout(child.p, layer % 2 ** _LAYER_BITS))
            elif type(child) is StochasticDepth and child.mode == "row":
                setattr(parent, name, KeyedStochasticDepth(child.p, layer % 2 ** _LAYER_BITS))
            else:
                continue
            layer += 1
    return model

"""Keyed dropout: a sample's masks depend on (seed, epoch, sample index, layer) only."""

import contextlib
import os

import pytest
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


def test_backward_scales_the_gradient_by_the_same_mask():
    keys = sample_keys(2, 0, torch.arange(3))
    x = torch.randn(3, 50, requires_grad=True)
    layer = KeyedDropout(0.25, layer=2).train()
    with dropout_keys(keys):
        y = layer(x)
    y.backward(torch.ones_like(y))
    kept = y != 0
    assert torch.equal(x.grad, kept.float() / 0.75)
    assert torch.allclose(y[kept], x.detach()[kept] / 0.75)


def test_cpu_steps_run_the_eager_ops_and_cuda_the_compiled_unless_switched_off(monkeypatch):
    from hybriddl import dropout

    assert dropout._kernels(torch.device("cpu")) is dropout._EAGER
    monkeypatch.setenv("HYBRIDDL_COMPILE_DROPOUT", "0")
    assert dropout._kernels(torch.device("cuda", 0)) is dropout._EAGER


TRITON_BITS = """
import torch
from hybriddl import dropout, dropout_triton
from tests.test_dropout import _reference_mask
keys = dropout.sample_keys(7, 2, torch.tensor([0, 1, 123456, 2 ** 31]))
generator = torch.Generator().manual_seed(0)
for dtype, start, p in ((torch.float32, 0, 0.5), (torch.float32, 13, 0.3),
                        (torch.bfloat16, 5, 0.3)):
    x = torch.randn(4, 3, 37, generator=generator).to(dtype)
    y, keep = dropout_triton.forward(x, keys, 3, p, start)
    assert torch.equal(keep, _reference_mask(keys, 3, 3 * 37, start, p).view(4, 3, 37)), dtype
    if dtype == torch.float32:  # the interpreter rounds bfloat16 toward zero, a GPU to nearest
        grad = torch.randn(4, 3, 37, generator=generator)
        assert torch.equal(y, dropout._forward(x, keys, 3, p, start)[0])
        assert torch.equal(dropout_triton.backward(grad, keep, p),
                           dropout._backward(grad, keep, p))
print("same bits")
"""


def test_the_triton_kernels_draw_the_reference_bits_in_tritons_interpreter():
    """What a CUDA device runs, hybriddl/dropout_triton.py, run by Triton's interpreter on
    the CPU: the masks against the pure-Python reference, float32 values against the eager
    ops (a GPU checks bfloat16 too, before the kernels' first use: tests/test_gpu.py)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="Triton comes with torch's CUDA builds; this torch "
                        "has none, so CUDA devices would run torch.compile's kernels")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", TRITON_BITS], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1",
                                          "PYTHONPATH": str(repo)}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "same bits", done.stderr[-2000:]


TRITON_DEVICE = """
import contextlib
import torch
from hybriddl import dropout, dropout_triton
made_current = []
def recorded(tensor):
    made_current.append(tensor.device)
    return contextlib.nullcontext()
dropout_triton._on_its_device = recorded
keys = dropout.sample_keys(7, 2, torch.arange(4))
y, keep = dropout_triton.forward(torch.randn(4, 9), keys, 1, 0.5, 0)
dropout_triton.backward(torch.randn(4, 9), keep, 0.5)
assert made_current == [torch.device("cpu")] * 2, made_current
print("each launch on its tensors' device")
"""


def test_each_triton_launch_is_made_on_its_tensors_device():
    """Triton launches on the calling thread's current CUDA device and stream: gpu-threads'
    pool threads (replicas on cuda:1 and up) and `--devices cuda:1` still had cuda:0's, so
    the kernels ran against another device's memory, unordered with its stream. Here, in
    Triton's interpreter, each launch is seen to go through the guard that makes the
    tensors' device current (a second GPU would be needed to see the race itself)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="Triton comes with torch's CUDA builds; this torch "
                        "has none, so CUDA devices would run torch.compile's kernels")
    from hybriddl import dropout_triton

    assert isinstance(dropout_triton._on_its_device(torch.ones(1)), contextlib.nullcontext)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", TRITON_DEVICE], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1",
                                          "PYTHONPATH": str(repo)}, timeout=120)
    assert done.returncode == 0 and "on its tensors' device" in done.stdout, done.stderr[-2000:]


def test_cuda_falls_back_to_torch_compile_where_the_triton_kernels_fail_their_check(
        monkeypatch):
    from hybriddl import dropout

    from hybriddl import dropout_triton

    def differs(kernels, device):
        raise RuntimeError("its bits differ from the eager ops'")

    monkeypatch.setattr(dropout, "_triton", None)
    monkeypatch.setattr(dropout, "_check_against_eager", differs)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernels = dropout._kernels(torch.device("cuda", 0))
    assert kernels is dropout.compiled_kernels() and kernels.compiled
    assert dropout._triton.fallback == "RuntimeError: its bits differ from the eager ops'"
    # Checked and found equal, the Triton kernels run.
    monkeypatch.setattr(dropout, "_triton", None)
    monkeypatch.setattr(dropout, "_check_against_eager", lambda kernels, device: None)
    kernels = dropout._kernels(torch.device("cuda", 0))
    assert kernels._forward is dropout_triton.forward and kernels.fallback is None


def test_the_triton_kernels_run_without_the_compilers_lock(monkeypatch):
    """Once built and checked, Triton's kernels are launched with no lock taken (another
    thread holding torch.compile's lock does not hold them up); torch.compile's functions
    still take turns under it."""
    import threading

    from hybriddl import dropout

    monkeypatch.setattr(dropout, "_triton", None)
    monkeypatch.setattr(dropout, "_check_against_eager", lambda kernels, device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    triton = dropout.triton_kernels()
    entered = {name: threading.Event() for name in ("triton", "compiled")}
    triton._forward = lambda *args: entered["triton"].set()
    compiled = dropout._Kernels(lambda *args: entered["compiled"].set(), None, compiled=True)
    with dropout._COMPILE_LOCK:
        for kernels in (triton, compiled):
            threading.Thread(target=kernels.forward, daemon=True).start()
        assert entered["triton"].wait(30)
        assert not entered["compiled"].is_set()
    assert entered["compiled"].wait(30)


def test_a_compiler_that_fails_leaves_the_eager_ops_with_the_same_bits(monkeypatch):
    from hybriddl import dropout

    def broken(*args, **kwargs):
        raise RuntimeError("no working C++ compiler\nsecond line")

    monkeypatch.setattr(dropout, "COMPILED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(dropout, "_compiled", dropout._Kernels(broken, broken, compiled=True))
    keys = sample_keys(7, 2, torch.tensor([0, 1, 123456, 2 ** 31]))
    x = torch.ones(4, 3, 5, 7, requires_grad=True)
    with dropout_keys(keys):
        y = KeyedDropout(0.5, layer=3).train()(x)
    y.sum().backward()
    kept = y != 0
    assert torch.equal(kept, _reference_mask(keys, 3, 3 * 5 * 7).view(4, 3, 5, 7))
    assert torch.equal(x.grad, kept * 2.0)
    assert dropout._compiled.fallback == "RuntimeError: no working C++ compiler"
    assert dropout._kernels(torch.device("cpu")) is dropout._EAGER


def _reference_mask(keys, layer, elements, start=0, p=0.5):
    return torch.tensor([[_reference_keep(k, layer, e, p) for e in range(start, start + elements)]
                         for k in keys.tolist()])


@pytest.mark.slow
def test_the_compiled_kernels_draw_the_reference_bits_on_the_cpu():
    """What CUDA devices run (torch.compile of forward and backward), compiled here for the
    CPU: bit for bit the pure-Python SplitMix64, for two shapes, an odd column offset (a
    host's slice) and the gradient. 15-30 s of compiling on 2 cores."""
    from hybriddl.dropout import compiled_kernels

    kernels = compiled_kernels()
    keys = sample_keys(7, 2, torch.tensor([0, 1, 123456, 2 ** 31]))
    x = torch.randn(4, 3, 5, 7)
    y, keep = kernels.forward(x, keys, 3, 0.5, 0)
    assert torch.equal(keep, _reference_mask(keys, 3, 105).view(4, 3, 5, 7))
    assert torch.equal(y, x * keep * 2.0)
    y, keep = kernels.forward(torch.ones(3, 15), keys[:3], 1, 0.3, 13)
    assert torch.equal(keep, _reference_mask(keys[:3], 1, 15, start=13, p=0.3))
    grad = torch.randn(3, 15)
    assert torch.equal(kernels.backward(grad, keep, 0.3), grad * keep.float().mul_(1 / 0.7))
    assert kernels.compiled and kernels.fallback is None  # not the eager fallback's bits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host: the "
                    "compiled kernels' bits on a GPU need one")
def test_keyed_dropout_forward_and_backward_are_the_same_on_cpu_and_cuda(monkeypatch):
    from hybriddl import dropout, dropout_triton

    keys = sample_keys(3, 2, torch.arange(64))
    layer = KeyedDropout(0.5, layer=1).train()
    x = torch.randn(64, 4096)

    def gradient(device):
        inputs = x.to(device, copy=True).requires_grad_()  # a leaf of its own on each device
        with dropout_keys(keys):
            layer(inputs).backward(torch.ones(64, 4096, device=device))
        return inputs.grad.cpu()

    on_cpu = gradient("cpu")
    # The Triton kernels, checked against the eager ops (bfloat16 too) before first use.
    assert dropout._kernels(torch.device("cuda"))._forward is dropout_triton.forward, \
        dropout.triton_kernels().fallback
    assert torch.equal(gradient("cuda"), on_cpu)
    # torch.compile's kernels, what a CUDA device runs where Triton's fail their check.
    monkeypatch.setattr(dropout, "_triton", dropout._Kernels(None, None, compiled=False))
    assert dropout._kernels(torch.device("cuda")) is dropout.compiled_kernels()
    assert torch.equal(gradient("cuda"), on_cpu)
    assert dropout.compiled_kernels().compiled, dropout.compiled_kernels().fallback

def test_stochastic_depth_is_keyed_per_sample_like_dropout():
    """EfficientNet's (and ConvNeXt's, Swin's, MaxViT's) stochastic depth drops a residual
    branch per sample from the global RNG: a checkpoint restores rank 0's RNG on every
    host, and threads or worker processes draw in their own order. Keyed, a sample's drop
    is the same whatever batch, host or RNG state it is computed in."""
    from torchvision.ops import StochasticDepth

    from hybriddl.dropout import KeyedStochasticDepth

    model = build_model("efficientnet_b0", 10)
    assert not [m for m in model.modules() if type(m) is StochasticDepth]
    depth = [m for m in model.modules() if isinstance(m, KeyedStochasticDepth)]
    assert len(depth) == 16 and len({m.layer for m in depth}) == 16
    assert [m.layer for m in model.modules() if isinstance(m, KeyedDropout)] == [16]
    layer = KeyedStochasticDepth(0.3, layer=5).train()
    keys = sample_keys(1, 0, torch.arange(4000))
    x = torch.ones(4000, 2, 3, 3)
    torch.manual_seed(0)
    with dropout_keys(keys):
        whole = layer(x)
    torch.manual_seed(1)  # another RNG state: the same drops
    with dropout_keys(keys[:1000]):
        first = layer(x[:1000])
    with dropout_keys(keys[1000:]):
        rest = layer(x[1000:])
    assert torch.equal(torch.cat([first, rest]), whole)
    rows = whole.flatten(1)
    assert torch.equal(rows.amin(1), rows.amax(1))  # a whole sample is kept or dropped
    kept = (rows[:, 0] > 0).float().mean().item()
    assert abs(kept - 0.7) < 0.03 and torch.allclose(rows[rows > 0], torch.tensor(1 / 0.7))
    assert torch.equal(layer.eval()(x), x)

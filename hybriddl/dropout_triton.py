"""Keyed dropout on a CUDA device as one hand-written Triton kernel each way.

The mask is hybriddl.dropout's: SplitMix64 over (key, layer, element), the same uint64
arithmetic, so the same bits as the CPU's eager ops. What it saves over torch.compile of
the same functions is time on the host, not on the GPU: measured on an H200 (AlexNet b32,
scripts/bench_gpu.py), the compiled functions cost about 0.9 ms of host time per step in
Dynamo's guards and Inductor's wrappers for two dropout layers, and a GPU step of AlexNet
is bound by the host's launches (2.7 ms without dropout, 4.2 ms with it). One launch here
is one Python call into Triton's launcher.

Imported only where a CUDA device runs keyed dropout; `kernels()` checks its bits against
the eager ops once per process before it is used (hybriddl.dropout falls back otherwise).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _mix(z):
    """SplitMix64's finaliser on uint64 (logical shifts, products modulo 2**64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _keep(keys_ptr, row, columns, start, layer, threshold):
    """Whether dropout keeps element `start + column` of the sample in `row`."""
    key = tl.load(keys_ptr + row).to(tl.uint64)
    base = _mix((key << 6) + layer)  # hybriddl.dropout._LAYER_BITS
    element = (start + columns).to(tl.uint64)
    state = _mix(base + (element // 2 + 1) * 0x9E3779B97F4A7C15)
    draw = tl.where(element % 2 == 0, state >> 32, state & 0xFFFFFFFF)
    return draw >= threshold


@triton.jit
def _forward_kernel(x_ptr, keys_ptr, y_ptr, keep_ptr, row_size, start, layer, threshold,
                    scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < row_size
    keep = _keep(keys_ptr, row, columns, start, layer, threshold)
    offsets = row * row_size + columns
    x = tl.load(x_ptr + offsets, mask=inside)
    # x times the scaled mask, as the eager ops compute it (0 * nan stays nan).
    y = x.to(tl.float32) * tl.where(keep, scale, 0.0)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=inside)  # rounded to nearest
    tl.store(keep_ptr + offsets, keep, mask=inside)


@triton.jit
def _backward_kernel(grad_ptr, keep_ptr, out_ptr, size, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < size
    keep = tl.load(keep_ptr + offsets, mask=inside, other=0) != 0
    grad = tl.load(grad_ptr + offsets, mask=inside)
    out = grad.to(tl.float32) * tl.where(keep, scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


_scales: dict[tuple[float, torch.dtype], float] = {}


def _scale(p: float, dtype: torch.dtype) -> float:
    """1 / (1 - p) rounded to `dtype`, as the eager ops' `keep.to(dtype).mul_(scale)`."""
    scale = _scales.get((p, dtype))
    if scale is None:
        scale = _scales[(p, dtype)] = torch.tensor(1.0 / (1.0 - p), dtype=dtype).item()
    return scale


def _on_its_device(tensor: torch.Tensor):
    """The tensor's CUDA device made current for a launch (nothing for Triton's interpreter,
    which runs CPU tensors)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def forward(x: torch.Tensor, keys: torch.Tensor, layer: int, p: float,
            start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x dropped out and the keep mask (booleans), as hybriddl.dropout._forward."""
    x = x.contiguous()
    rows, row_size = len(x), x[0].numel()
    y = torch.empty_like(x)
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    if x.numel():
        grid = (rows, triton.cdiv(row_size, BLOCK))
        # Triton launches on the calling thread's current device and its stream: a thread
        # that runs a replica on cuda:1 (gpu-threads, --devices cuda:1) still has cuda:0's.
        with _on_its_device(x):
            _forward_kernel[grid](x, keys, y, keep, row_size, start, layer,
                                  round(p * 2 ** 32), _scale(p, x.dtype), BLOCK=BLOCK)
    return y, keep


def backward(grad: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    grad = grad.contiguous()
    out = torch.empty_like(grad)
    if grad.numel():
        with _on_its_device(grad):  # the tensors' device, whatever the thread's
            _backward_kernel[(triton.cdiv(grad.numel(), BLOCK),)](grad, keep, out, grad.numel(),
                                                                  _scale(p, grad.dtype),
                                                                  BLOCK=BLOCK)
    return out

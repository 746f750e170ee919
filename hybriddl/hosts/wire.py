"""2-byte floats summed by MPI: the split's features' gradients in bfloat16 or float16
(--feature-dtype), reduce-scattered in that precision.

Neither type has a standard MPI datatype (and Open MPI's own float16 loop is slow: 10 s
per VGG16 step, see hosts/compression.py), so the wire is a 2-byte datatype and each
addition is torch's add in that dtype (computed in float32, rounded once) through a
user-defined operation. A ring adds one host's contribution at a time, so a sum of H
values is rounded H times: within about H * 2**-8 (bfloat16; float16: 2**-11) of the
magnitudes summed.
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
_OPERATIONS: dict[torch.dtype, tuple] = {}  # MPI objects live as long as the process


def half_sum(MPI, dtype: torch.dtype) -> tuple:
    """(datatype, op) with which MPI sums buffers of `dtype` (float16 or bfloat16)."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"no 2-byte float sum for {dtype}")
    if dtype not in _OPERATIONS:
        def add(incoming, inout, datatype) -> None:
            if len(incoming):
                torch.frombuffer(inout, dtype=dtype).add_(torch.frombuffer(incoming, dtype=dtype))

        _OPERATIONS[dtype] = (MPI.BYTE.Create_contiguous(2).Commit(),
                              MPI.Op.Create(add, commute=True))
    return _OPERATIONS[dtype]


def as_bits(tensor: torch.Tensor):
    """A contiguous CPU tensor of 2-byte floats as the int16 array MPI reads or writes in
    place (numpy has no bfloat16)."""
    return tensor.view(torch.int16).numpy()

"""2-byte floats on the wire: the split's features and their gradients in bfloat16 or
float16 (--feature-dtype), reduce-scattered in that precision.

Neither type has a standard MPI datatype, so MPI moves them as 16-bit integers, bit for
bit. The reduce-scatter's sum is not MPI's: each host receives every host's copy of its
own rows and adds them in rank order with torch's add in their dtype (computed in float32,
rounded once; hosts/mpi.py, `MPIHosts.reduce_scatter_rows`), so a sum of H values is
rounded H - 1 times: within about H * 2**-8 (bfloat16; float16: 2**-11) of the magnitudes
summed.
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def as_bits(tensor: torch.Tensor):
    """A contiguous CPU tensor of 2-byte floats as the int16 array MPI reads or writes in
    place (numpy has no bfloat16)."""
    return tensor.view(torch.int16).numpy()

"""What gradients look like on the wire between hosts (Horovod's `Compression` idea).

A compression is a small object, chosen once per run, that turns a fused gradient
buffer into the buffer handed to MPI and back. The averaging code never branches on
which one it holds.
"""

from __future__ import annotations

import torch


class NoCompression:
    """Gradients travel in their own precision; the fusion buffer is sent in place."""

    name = "none"
    # MPI sums the wire buffers itself (one allreduce).
    sum_dtype = None

    def wire_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def compress(self, flat: torch.Tensor, wire: torch.Tensor) -> None:
        """`wire` is `flat`: nothing to do."""

    def decompress(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        """`flat` already holds the sum."""


class FP16Compression:
    """Half-precision gradients on the wire: half the bytes, ~3 significant digits.

    Hosts contribute n_h/N * g_h (already the share of the mean), so the summed
    values stay in gradient range and far from float16's 65504 ceiling.

    The sum is taken in float32, not by MPI: Open MPI adds float16 in a software loop
    (10 s per VGG16 step here), so each host receives every host's float16 copy of its
    1/H slice, adds them in float32 with torch, and hands back its slice in float16
    (a reduce-scatter and an allgather, as a ring allreduce does). Each element is rounded
    to float16 twice: once per host contribution, once after the sum, so the average is
    within about 2**-10 * sum_h |n_h/N * g_h| of float32's.
    """

    name = "fp16"
    sum_dtype = torch.float32

    def wire_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=torch.float16)

    def compress(self, flat: torch.Tensor, wire: torch.Tensor) -> None:
        wire.copy_(flat)

    def decompress(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        flat.copy_(wire)


class Compression:
    """The choices, as Horovod spells them: `connect(compression=Compression.fp16)`."""

    none = NoCompression()
    fp16 = FP16Compression()

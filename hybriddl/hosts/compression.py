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
    """

    name = "fp16"

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

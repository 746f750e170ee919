"""Tensor fusion: a model's gradients laid out in a few large contiguous buffers.

One allreduce of 64 MiB costs far less than hundreds of small ones (Horovod's tensor
fusion). Where it is safe, each parameter's `.grad` *is* a view into its bucket
(like DDP's gradient_as_bucket_view), laid out as its parameter (a channels_last weight's
slot takes its strides where every host lays it out alike), so gradients land in the
buffer that MPI sends and nothing is copied; elsewhere (a strategy that owns `.grad`, parameters on a GPU)
gradients are gathered into the bucket before sending and scattered back after. For
parameters on a GPU the buckets are pinned host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    bounds: list[tuple[int, int]]  # each parameter's [start, stop) in `flat`
    flat: torch.Tensor  # on the CPU, where MPI reads it
    wire: torch.Tensor  # what is handed to MPI: `flat` itself or its compressed copy
    viewed: list[bool] = field(default_factory=list)  # .grad is a view into `flat`
    # Each parameter's strides in `flat` where its slot takes its own layout (a
    # channels_last weight), None where the slot is contiguous.
    layouts: list[tuple[int, ...] | None] = field(default_factory=list)

    def slot(self, i: int) -> torch.Tensor:
        start, stop = self.bounds[i]
        if self.layouts and self.layouts[i] is not None:
            return self.flat[start:stop].as_strided(self.params[i].shape, self.layouts[i])
        return self.flat[start:stop].view(self.params[i].shape)


class GradientBuckets:
    """The fusion plan of one model: which parameters share which buffer."""

    def __init__(self, model: nn.Module, compression, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 follow_layout: bool = True):
        """`follow_layout`: a channels_last weight's slot takes its strides, so that its
        gradient is laid out as it is (autograd writes it without a copy, and torch's fused
        SGD, which pairs elements in memory order, may update it); every host must then lay
        out alike (`layouts`), else the slots stay contiguous."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        # Reverse registration order approximates the order in which backward produces
        # gradients, so with overlap the first bucket is the first one complete.
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            fits = groups and groups[-1][0].dtype == p.dtype and size + nbytes <= bucket_bytes
            if fits:
                groups[-1].append(p)
                size += nbytes
            else:
                groups.append([p])
                size = nbytes
        self.buckets: list[Bucket] = []
        for index, group in enumerate(groups):
            bounds, start = [], 0
            for p in group:
                bounds.append((start, start + p.numel()))
                start += p.numel()
            # Gradients on a GPU leave through pinned memory (the Open MPI wheel is not
            # CUDA-aware): the device copies into it by DMA, at full PCIe speed, where a
            # pageable buffer takes a staging copy more.
            on_gpu = any(p.device.type == "cuda" for p in group)
            flat = torch.zeros(start, dtype=group[0].dtype, pin_memory=on_gpu)
            self.buckets.append(Bucket(index, group, bounds, flat, compression.wire_buffer(flat),
                                       [False] * len(group),
                                       [_layout(p) if follow_layout else None for p in group]))
        self.bucket_of = {id(p): b.index for b in self.buckets for p in b.params}

    @property
    def wire_bytes(self) -> int:
        """Bytes one gradient exchange hands to MPI."""
        return sum(b.wire.nbytes for b in self.buckets)

    def layouts(self) -> list:
        """Every parameter's strides in its bucket (None: contiguous), what hosts compare
        before they sum buffers laid out by them."""
        return [layout for bucket in self.buckets for layout in bucket.layouts]

    def signature(self) -> list[tuple[int, str]]:
        """What every host must agree on before buffers are summed element by element."""
        return [(b.flat.numel(), str(b.wire.dtype)) for b in self.buckets]

    def install_views(self) -> None:
        """Make `.grad` a view into the bucket wherever no strategy has claimed it yet."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if p.grad is None and p.device.type == "cpu":
                    p.grad = bucket.slot(i)
                    bucket.viewed[i] = True

    def _still_viewed(self, bucket: Bucket, i: int) -> bool:
        grad = bucket.params[i].grad
        return bucket.viewed[i] and grad is not None and grad.data_ptr() == bucket.slot(i).data_ptr()

    def gather(self, bucket: Bucket) -> None:
        """Bring every gradient of the bucket into its buffer (absent ones count as zero)."""
        for i, p in enumerate(bucket.params):
            if self._still_viewed(bucket, i):
                continue
            bucket.viewed[i] = False
            if p.grad is None:
                bucket.slot(i).zero_()
            else:
                bucket.slot(i).copy_(p.grad)

    def scatter(self, bucket: Bucket) -> None:
        """Put the buffer's (averaged) values back into gradients that are not views."""
        for i, p in enumerate(bucket.params):
            if bucket.viewed[i]:
                continue
            if p.grad is None:
                p.grad = bucket.slot(i).to(p.device, copy=True)
            else:
                p.grad.copy_(bucket.slot(i))


def _layout(p: nn.Parameter) -> tuple[int, ...] | None:
    """A channels_last weight's strides on the CPU (dense, so its slot fills its span), else
    None (contiguous)."""
    if p.device.type == "cpu" and p.dim() == 4 and not p.is_contiguous() \
            and p.is_contiguous(memory_format=torch.channels_last):
        return tuple(p.stride())
    return None

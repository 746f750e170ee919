"""PyTorch DDP as a PyTorch user would run it: one gloo process group, a model wrapped in
DistributedDataParallel. The one DDP implementation behind `hybriddl compare`'s ddp
contender and the DDP peer of `scripts/bench_local.py` (`local_peers.measure_ddp`)."""

# No `from __future__ import annotations`: DDP checks the comm hook's annotation
# against dist.GradBucket itself, not a string.

import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hybriddl.machine.cpu_threads import set_torch_threads

# Buffers are not synchronised each step: the MPI contenders average gradients only,
# and so must this one. (Newer torch renamed the switch.)
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                  else {"broadcast_buffers": False})


@dataclass
class CountingAllreduce:
    """DDP comm-hook state: the process group and the bytes handed to it so far."""

    group: dist.ProcessGroup | None
    world: int
    fp16: bool = False
    bytes_sent: int = 0


def counting_allreduce_hook(state: CountingAllreduce, bucket: dist.GradBucket):
    """DDP's default averaging allreduce (optionally in float16), counting what it sends."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.float16) if state.fp16 else buffer
    sent.div_(state.world)
    state.bytes_sent += sent.numel() * sent.element_size()
    future = dist.all_reduce(sent, group=state.group, async_op=True).get_future()

    def unpack(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(unpack)


@contextmanager
def gloo_group(rank: int, world: int, address: str, port: int, interface: str):
    """This process as rank `rank` of a gloo group over `interface`, one CPU thread."""
    set_torch_threads(1)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=interface)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, world: int,
         fp16: bool = False) -> tuple[DistributedDataParallel, CountingAllreduce]:
    """`model` under DDP, its gradients averaged by a counting allreduce."""
    ddp = DistributedDataParallel(model, **NO_BUFFER_SYNC)
    state = CountingAllreduce(None, world, fp16=fp16)
    ddp.register_comm_hook(state, counting_allreduce_hook)
    return ddp, state

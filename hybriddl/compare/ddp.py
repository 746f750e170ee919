"""The PyTorch DDP contender of `hybriddl compare`: what a PyTorch user would pick instead.
Its command line is hybriddl.cli.compare_ddp:

    python -m hybriddl.cli.compare_ddp --processes P [--hosts H --host-index I --master-addr A] ... --result-dir D

Started once on each of H hosts, it is the first of the P/H processes there (ranks I*P/H,
...) and spawns the others, one CPU thread each, gloo over the host's NIC
(`--interface`); each takes its 1/P of every global batch (the same batches, flips and
model as the other contenders) and writes what it measured to D/rank<R>.json. A DDP communication hook counts the bytes
handed to gloo, as the MPI layer's counter does for MPI: DDP's own allreduce, torch's
fp16_compress_hook (`--fp16-allreduce`) or powerSGD_hook (`--powersgd-rank R`, one bucket,
see ddp_peer.wrap).
"""

import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp

from hybriddl.compare.settings import MeasureSettings
from hybriddl.compare.ddp_peer import CommHook, gloo_group, wrap
from hybriddl.data import BatchTransform, epoch_batches
from hybriddl.data.loading import load_data
from hybriddl.data.sharding import split_bounds
from hybriddl.monitoring.monitor import Monitor
from hybriddl.compare.stepmeter import StepMeter, gradient_bytes, write_rank_result
from hybriddl.compare.theory import powersgd_elements
from hybriddl.strategies import Sequential, criterion
from hybriddl.usecases import build_model

# Each emulated host has its own network namespace, so a fixed port is free on host 0.
PORT = 29500


def peer(local_rank: int, first_rank: int, world: int, address: str, interface: str,
         settings: MeasureSettings, result_dir: str, hook: CommHook = CommHook()) -> None:
    """One DDP process: join the group, run the steps, write rank<rank>.json."""
    rank = first_rank + local_rank
    # The same pidstat/sar-style files the MPI contenders' runs leave, in D/run.
    monitor_dir = Path(result_dir) / "run"
    monitor_dir.mkdir(parents=True, exist_ok=True)
    with gloo_group(rank, world, address, PORT, interface):
        with Monitor(monitor_dir, rank) as monitor:
            record = measure_ddp(rank, world, settings, interface, hook)
            record["monitor"] = monitor.stop()
        write_rank_result(result_dir, rank, record)


def measure_ddp(rank: int, world: int, settings: MeasureSettings, interface: str,
                hook: CommHook = CommHook()) -> dict:
    config = settings.train_config(Sequential.name).resolved()
    split = load_data(config.data, variant=config.case.dataset, image_size=config.image_size)
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(split.classes), config.dropout)
    hook = CommHook("fp16") if settings.fp16_allreduce and hook.name == "allreduce" else hook
    ddp, state = wrap(model, world, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
    transform = BatchTransform(config.image_size)
    warmup = max(settings.warmup, hook.untimed_steps)
    # A DDP process is one rank of one thread: its own memory only (the host's first
    # process is the parent of the others, which measure themselves).
    meter = StepMeter(warmup, settings.steps, comm_bytes=lambda: state.bytes_sent,
                      interface=interface, rss_bytes=lambda: psutil.Process().memory_info().rss)
    epoch = 0
    while meter.remaining:
        batches = epoch_batches(len(split.train), config.batch_size, config.seed, epoch)
        for batch in batches[: meter.remaining]:
            start, stop = split_bounds(len(batch.indices), [1] * world)[rank]
            mine = batch.part(start, stop)
            x = transform(split.train.images[mine.indices], mine.flips)
            y = split.train.labels[mine.indices]
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            loss = criterion(ddp(x), y)
            loss.backward()
            optimizer.step()
            meter.on_step(epoch, batch.step, len(batch.indices), time.perf_counter() - started,
                          loss.item())
        epoch += 1
    return {**meter.result(), "strategy": {"name": "ddp", "backend": "gloo", "processes": world,
                                            "threads_per_process": 1},
            "gradient_bytes": gradient_bytes(model), "warmup": warmup,
            "comm_hook": hook.describe(gradient_bytes(model)),
            "payload_bytes": payload_bytes(model, hook)}


def payload_bytes(model: torch.nn.Module, hook: CommHook) -> float:
    """What one rank hands to gloo per step, in theory: the gradient in float32 or float16,
    or PowerSGD's factors and uncompressed tensors."""
    if hook.name == "powersgd":
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        return powersgd_elements(shapes, hook.rank) * 4
    return gradient_bytes(model) / (2 if hook.name == "fp16" else 1)


def run_host(settings: MeasureSettings, processes: int, hosts: int, host_index: int,
             master_addr: str, interface: str, result_dir: str,
             hook: CommHook = CommHook()) -> None:
    """This host's processes, of `processes` over `hosts`; each writes its rank<R>.json.
    This process is the host's first; only the others are spawned (each spawned process
    adds an interpreter's start and torch's import, seconds, before the group forms)."""
    here = processes // hosts
    args = (host_index * here, processes, master_addr, interface, settings, result_dir, hook)
    others = (mp.start_processes(spawned_peer, args=args, nprocs=here - 1, join=False,
                                 start_method="spawn") if here > 1 else None)
    try:
        peer(0, *args)
    except BaseException:
        if others is not None:
            for process in others.processes:
                process.terminate()
        raise
    # join raises if a spawned process failed, after stopping the others.
    while others is not None and not others.join():
        pass


def spawned_peer(index: int, *args) -> None:
    """A spawned process of a host: its local rank is one after the launcher's."""
    peer(index + 1, *args)

"""The PyTorch DDP contender of `hybriddl compare`: what a PyTorch user would pick instead.
Its command line is hybriddl.cli.compare_ddp:

    python -m hybriddl.cli.compare_ddp --processes P [--hosts H --host-index I --master-addr A] ... --result-dir D

Started once on each of H hosts, it spawns P/H processes there (ranks I*P/H, ...), one
CPU thread each, gloo over the host's NIC (`--interface`); each takes its 1/P of every
global batch (the same batches, flips and model as the other contenders) and writes
what it measured to D/rank<R>.json. A DDP communication hook counts the bytes
handed to gloo, as the MPI layer's counter does for MPI.
"""

import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hybriddl.compare.settings import MeasureSettings
from hybriddl.compare.ddp_peer import gloo_group, wrap
from hybriddl.data import BatchTransform, epoch_batches
from hybriddl.data.loading import load_data
from hybriddl.data.sharding import split_bounds
from hybriddl.monitoring.monitor import Monitor
from hybriddl.compare.stepmeter import StepMeter, gradient_bytes, write_rank_result
from hybriddl.strategies import Sequential, criterion
from hybriddl.usecases import build_model

# Each emulated host has its own network namespace, so a fixed port is free on host 0.
PORT = 29500


def peer(local_rank: int, first_rank: int, world: int, address: str, interface: str,
         settings: MeasureSettings, result_dir: str) -> None:
    """One DDP process: join the group, run the steps, write rank<rank>.json."""
    rank = first_rank + local_rank
    # The same pidstat/sar-style files the MPI contenders' runs leave, in D/run.
    monitor_dir = Path(result_dir) / "run"
    monitor_dir.mkdir(parents=True, exist_ok=True)
    with gloo_group(rank, world, address, PORT, interface):
        with Monitor(monitor_dir, rank) as monitor:
            record = measure_ddp(rank, world, settings, interface)
            record["monitor"] = monitor.stop()
        write_rank_result(result_dir, rank, record)


def measure_ddp(rank: int, world: int, settings: MeasureSettings, interface: str) -> dict:
    config = settings.train_config(Sequential.name).resolved()
    split = load_data(config.data, variant=config.case.dataset, image_size=config.image_size)
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(split.classes), config.dropout)
    ddp, state = wrap(model, world, fp16=settings.fp16_allreduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
    transform = BatchTransform(config.image_size)
    meter = StepMeter(settings.warmup, settings.steps, comm_bytes=lambda: state.bytes_sent,
                      interface=interface)
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
            "gradient_bytes": gradient_bytes(model)}


def run_host(settings: MeasureSettings, processes: int, hosts: int, host_index: int,
             master_addr: str, interface: str, result_dir: str) -> None:
    """This host's processes, of `processes` over `hosts`; each writes its rank<R>.json."""
    # start_processes joins them all and, if one fails, stops the others and raises.
    here = processes // hosts
    mp.start_processes(peer, args=(host_index * here, processes, master_addr, interface,
                                   settings, result_dir),
                       nprocs=here, start_method="spawn")

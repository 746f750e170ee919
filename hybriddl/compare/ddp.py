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
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybriddl.compare.settings import FP16, POWERSGD, MeasureSettings
from hybriddl.compare.ddp_peer import CommHook, gloo_group, wrap
from hybriddl.data import BatchTransform, epoch_batches
from hybriddl.data.loading import load_data
from hybriddl.data.sharding import split_bounds
from hybriddl.monitoring.monitor import Monitor
from hybriddl.compare.stepmeter import StepMeter, gradient_bytes, write_rank_result
from hybriddl.compare.theory import powersgd_elements
from hybriddl.run.target import AccuracyTarget
from hybriddl.strategies import Sequential, criterion
from hybriddl.usecases import build_model

# Each emulated host has its own network namespace, so a fixed port is free on host 0.
PORT = 29500


@dataclass(frozen=True)
class TrainingGoal:
    """`--epochs N`: the DDP peer trains to a target accuracy (scripts/time_to_accuracy.py)
    instead of timing steps: N epochs at most, validated every `eval_every` steps and at
    each epoch's end, timed as `train --target-accuracy` times itself (run/target.py)."""

    epochs: int
    lr: float | None = None  # None: the use case's
    eval_every: int | None = None
    target_accuracy: float | None = None
    stop_at_target: bool = False


def peer(local_rank: int, first_rank: int, world: int, address: str, interface: str,
         settings: MeasureSettings, result_dir: str, hook: CommHook = CommHook(),
         goal: TrainingGoal | None = None) -> None:
    """One DDP process: join the group, run the steps (or train to `goal`), write
    rank<rank>.json."""
    rank = first_rank + local_rank
    # The same pidstat/sar-style files the MPI contenders' runs leave, in D/run.
    monitor_dir = Path(result_dir) / "run"
    monitor_dir.mkdir(parents=True, exist_ok=True)
    with gloo_group(rank, world, address, PORT, interface):
        with Monitor(monitor_dir, rank) as monitor:
            record = (measure_ddp(rank, world, settings, interface, hook) if goal is None
                      else train_ddp(rank, world, settings, hook, goal))
            record["monitor"] = monitor.stop()
        write_rank_result(result_dir, rank, record)


def measure_ddp(rank: int, world: int, settings: MeasureSettings, interface: str,
                hook: CommHook = CommHook()) -> dict:
    config = settings.train_config(Sequential.name)
    split = load_data(config.data, variant=config.case.dataset, image_size=config.image_size)
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(split.classes), config.dropout)
    hook = CommHook(FP16) if settings.fp16_allreduce and hook.name == "allreduce" else hook
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


def train_ddp(rank: int, world: int, settings: MeasureSettings, hook: CommHook,
              goal: TrainingGoal) -> dict:
    """DDP trained as a PyTorch user trains it (torch's own dropout, the comm hook's
    averaging) on the same batches, flips, initial model and validation images as hybriddl
    train, to `goal`; each rank validates its share of the images."""
    config = settings.train_config(Sequential.name)
    split = load_data(config.data, variant=config.case.dataset, image_size=config.image_size)
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(split.classes), config.dropout)
    ddp, _ = wrap(model, world, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=goal.lr or config.lr,
                                momentum=config.momentum)
    transform = BatchTransform(config.image_size)
    target = AccuracyTarget(goal.target_accuracy, goal.eval_every, goal.stop_at_target)
    target.start()
    steps_done, epochs = 0, []
    for epoch in range(goal.epochs):
        batches = epoch_batches(len(split.train), config.batch_size, config.seed, epoch)
        losses, started = [], time.perf_counter()
        for index, batch in enumerate(batches):
            start, stop = split_bounds(len(batch.indices), [1] * world)[rank]
            mine = batch.part(start, stop)
            optimizer.zero_grad(set_to_none=False)
            loss = criterion(ddp(transform(split.train.images[mine.indices], mine.flips)),
                             split.train.labels[mine.indices])
            loss.backward()
            optimizer.step()
            steps_done += 1
            losses.append(loss.item())
            if target.due(steps_done) or index == len(batches) - 1:
                accuracy = validate_share(model, split.val, transform, rank, world,
                                          2 * config.batch_size)
                if target.evaluated(accuracy, epoch + 1, steps_done,
                                    epoch + (index + 1) / len(batches)):
                    break
        epochs.append({"epoch": epoch + 1, "steps": len(losses),
                       "seconds": time.perf_counter() - started,
                       "train_loss": sum(losses) / len(losses),
                       "val_accuracy": target.record["evaluations"][-1]["accuracy"]})
        if target.should_stop():
            break
    target.tick()
    return {"strategy": {"name": "ddp", "backend": "gloo", "processes": world,
                         "threads_per_process": 1},
            "comm_hook": hook.describe(gradient_bytes(model)), "config": {
                "model": config.model, "global_batch": config.batch_size,
                "lr": goal.lr or config.lr, "momentum": config.momentum, "seed": config.seed},
            "epochs": epochs, "target": target.record}


def validate_share(model: torch.nn.Module, images, transform, rank: int, world: int,
                   batch_size: int) -> float:
    """Validation accuracy of `model` (the module DDP wraps: no hook runs), this rank's
    share of the images, the correct counts summed over the group."""
    first, last = split_bounds(len(images), [1] * world)[rank]
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(first, last, batch_size):
            stop = min(start + batch_size, last)
            logits = model(transform(images.images[start:stop]))
            correct += int((logits.argmax(1) == images.labels[start:stop]).sum())
    model.train()
    total = torch.tensor([correct], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total) / len(images)


def payload_bytes(model: torch.nn.Module, hook: CommHook) -> float:
    """What one rank hands to gloo per step, in theory: the gradient in float32 or float16,
    or PowerSGD's factors and uncompressed tensors."""
    if hook.name == POWERSGD:
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        return powersgd_elements(shapes, hook.rank, hook.min_rate) * 4
    return gradient_bytes(model) / (2 if hook.name == FP16 else 1)


def run_host(settings: MeasureSettings, processes: int, hosts: int, host_index: int,
             master_addr: str, interface: str, result_dir: str,
             hook: CommHook = CommHook(), goal: TrainingGoal | None = None) -> None:
    """This host's processes, of `processes` over `hosts`; each writes its rank<R>.json.
    This process is the host's first; only the others are spawned (each spawned process
    adds an interpreter's start and torch's import, seconds, before the group forms)."""
    here = processes // hosts
    args = (host_index * here, processes, master_addr, interface, settings, result_dir, hook,
            goal)
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

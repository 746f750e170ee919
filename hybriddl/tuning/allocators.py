"""`--allocator auto` measured: a few optimizer steps on each installed allocator, each in a
child process started with that library preloaded, in interleaved rounds.

The probe is one fixed workload, not the command's: the choice is made once per host (kept
by machine/allocator.py) before any command knows its model. It is SimpleBig's AlexNet,
batch 32, at 128 px, with PyTorch's intra-op threads on every usable core: its classifier
allocates and frees the same 218 MB of gradients every step as at 224 px, the pattern where
allocators differ (machine/allocator.py), in about a third of the 224 px step. Each child
times steps as the tuner times a candidate (tuning/benchmark.py), so glibc's row keeps freed
memory as every strategy does. The host's other tenants drift slowly (bench_local.py):
rounds are interleaved (A B C A B C ...) and each allocator's figure is its median round.
"""

from __future__ import annotations

import json
import subprocess
import sys

from hybriddl.machine.allocator import loaded_allocator, preload_environment
from hybriddl.machine.hostinfo import usable_cores
from hybriddl.strategies import IntraOp

PROBE_MODEL, PROBE_BATCH, PROBE_IMAGE_SIZE, PROBE_STRATEGY = "alexnet", 32, 128, IntraOp.name
PROBE_ROUNDS, PROBE_WARMUP, PROBE_STEPS = 3, 1, 3
CHILD_TIMEOUT_SECONDS = 600
_CHILD = ("import json, sys; from hybriddl.tuning.allocators import probe_step; "
          "print(json.dumps(probe_step(*json.loads(sys.argv[1]))))")


def describe_probe() -> str:
    return (f"{PROBE_MODEL} {PROBE_IMAGE_SIZE} px, batch {PROBE_BATCH}, {PROBE_STRATEGY}, "
            f"{PROBE_ROUNDS} rounds of {PROBE_STEPS} steps")


def time_allocators(names: list[str], *, rounds: int = PROBE_ROUNDS,
                    image_size: int = PROBE_IMAGE_SIZE, batch_size: int = PROBE_BATCH,
                    steps: int = PROBE_STEPS) -> dict[str, list[float]]:
    """Each allocator's median step per round. One that fails to run, or runs on another
    allocator than it was started with (a preload that did not take), is left out."""
    seconds: dict[str, list[float]] = {name: [] for name in names}
    failed: set[str] = set()
    for _ in range(rounds):
        for name in names:
            if name in failed:
                continue
            timed = _probe_in_child(name, image_size, batch_size, steps)
            if timed is None:
                failed.add(name)
                seconds.pop(name)
            else:
                seconds[name].append(timed)
    return seconds


def _probe_in_child(name: str, image_size: int, batch_size: int, steps: int) -> float | None:
    argv = [sys.executable, "-c", _CHILD, json.dumps([image_size, batch_size, steps])]
    try:
        done = subprocess.run(argv, env=preload_environment(name), capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_SECONDS)
        record = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if done.returncode != 0 or record.get("allocator") != name:
        return None
    return float(record["seconds_per_step"])


def probe_step(image_size: int, batch_size: int, steps: int) -> dict:
    """In the child: the probe's median step, and the allocator it really ran on."""
    import torch

    from hybriddl.data import SYNTHETIC_CLASSES, ImageSet, render_synthetic
    from hybriddl.strategies import StrategyOptions
    from hybriddl.tuning.benchmark import measure_strategy, sample_batch

    classes = len(SYNTHETIC_CLASSES)
    images = torch.stack([torch.from_numpy(render_synthetic(i % classes, i, 64))
                          for i in range(batch_size)])
    x, y = sample_batch(ImageSet(images, torch.arange(batch_size) % classes,
                                 list(SYNTHETIC_CLASSES)), batch_size, image_size)
    timing = measure_strategy(PROBE_STRATEGY, StrategyOptions(workers=usable_cores()),
                              PROBE_MODEL, classes, x, y, warmup=PROBE_WARMUP, steps=steps)
    return {"allocator": loaded_allocator(), "seconds_per_step": timing.seconds_per_step}

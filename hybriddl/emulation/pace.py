"""A wire scheme's own compute at the speed of the hosts emulated ones stand for.

Under `hybriddl emulate --speedup S`, every second of a host's compute here counts as 1/(S·D)
emulated second: PowerSGD's products too, as if the emulated host ran them on its CPU S
times faster. On a GPU host they run on the GPU, at a speed of their own (measured:
results/powersgd_cost-gpu.json). `emulate --compression-seconds G` puts that figure in:
each step that compresses, the scheme's compute here is timed and then padded to G·S·D
wall seconds (G emulated), on hybriddl's hosts (hosts/averaging.py) and in DDP's
powerSGD_hook (compare/ddp_peer.py) alike. Where the compute here already takes longer,
nothing is padded and the step says so once (the emulation then overstates it).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext

from hybriddl.emulation.hosts import COMPRESSION_SECONDS_VARIABLE, time_scale

# How a host's warning begins where its compute here outlasts the pace (benchmarks grep it).
OUTLASTED = "hybriddl: warning: the wire scheme's compute here took"


class Pace:
    """One host's pacing: the compute timed over a step (`timing`, `add`), then padded at
    its end (`end_step`) to `seconds` emulated, `seconds` x `scale` wall."""

    def __init__(self, seconds: float, scale: float):
        self.seconds = seconds
        self.wall = seconds * scale
        self.spent = 0.0
        self.short_steps = 0  # steps whose compute here outlasted `wall`: nothing padded

    @contextmanager
    def timing(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.spent += time.perf_counter() - started

    def add(self, seconds: float) -> None:
        self.spent += seconds

    def forget(self) -> None:
        """A step that did not compress (an exact one before PowerSGD's `start`): the
        hosts emulated would not have computed it either, so nothing is padded."""
        self.spent = 0.0

    def end_step(self) -> float:
        """Sleep what the step's compute here fell short of `wall` by: it stands for the
        compute of the hosts emulated (no synchronisation waits on it). Returns that
        pad, negative where the compute here took longer."""
        pad, self.spent = self.wall - self.spent, 0.0
        if pad > 0:
            time.sleep(pad)
        else:
            self.short_steps += 1
            if self.short_steps == 1:
                sys.stderr.write(
                    f"{OUTLASTED} {self.wall - pad:.3g} s wall, more than --compression-seconds "
                    f"{self.seconds:g} x time scale ({self.wall:.3g} s): its steps are "
                    "emulated slower than the hosts measured\n")
                sys.stderr.flush()
        return pad


def compression_seconds() -> float | None:
    """`emulate --compression-seconds`'s G on an emulated host; None elsewhere."""
    value = os.environ.get(COMPRESSION_SECONDS_VARIABLE)
    try:
        return float(value) if value else None
    except ValueError:
        return None


def timed(paced: Pace | None):
    """Where a scheme computes: timed for `paced`, untimed where nothing is paced."""
    return paced.timing() if paced else nullcontext()


def step_done(paced: Pace | None, compressed: bool) -> None:
    """A step's end: padded where it compressed, its timing dropped where it did not."""
    if paced:
        paced.end_step() if compressed else paced.forget()


def pace() -> Pace | None:
    """This host's Pace where `emulate --compression-seconds` started it; None elsewhere
    (nothing is timed or padded)."""
    seconds = compression_seconds()
    return None if seconds is None else Pace(seconds, time_scale())

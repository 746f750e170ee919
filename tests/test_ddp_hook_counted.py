"""torch's powerSGD_hook as the DDP peer runs it (hybriddl.compare.ddp_peer), counted in a
gloo group of this process. On its own module: a test that runs alone would make
tests/test_compare.py's module of emulated runs wait for it (tests/two_at_once.py)."""

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import hybriddl_env


def in_a_child(check, **env: str) -> None:
    """Run `check`, a function of this module, in a child Python, which leaves with
    os._exit once its assertions passed. A gloo group and DDP's reducer in a pytest worker
    aborted it, twice: "terminate called after throwing an instance of 'std::system_error'
    what(): Resource deadlock avoided" (a C++ thread joining itself as it is destroyed),
    SIGABRT in a native thread during the next test, and the second time (2026-11-30, AMD
    EPYC) pytest-xdist's run waited for ever for the dead worker's tests. In a child such an
    end cannot reach the worker, and os._exit skips the destructors."""
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); "
            f"import {Path(__file__).stem} as tests; tests.{check.__name__}(); "
            "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, env=hybriddl_env(**env))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# Each holds a gloo group on a loopback port: alone (tests/two_at_once.py), in a child.
@pytest.mark.alone
def test_ddp_powersgd_runs_in_one_bucket_and_compresses_from_its_third_step():
    in_a_child(counted_powersgd)


def counted_powersgd():
    """torch's powerSGD_hook, counted: two vanilla allreduces of the whole gradient (the least
    start_powerSGD_iter torch allows), then its factors and small tensors only; a
    min_compression_rate given reaches the hook (at 6 the convolution, whose rank-2 factors
    are 5x smaller, goes dense), and the theory counts what it sends."""
    from hybriddl.compare.ddp import payload_bytes
    from hybriddl.compare.ddp_peer import CommHook, gloo_group, one_bucket_mb, wrap
    from hybriddl.compare.local_peers import _free_loopback_port
    from hybriddl.compare.stepmeter import gradient_bytes
    from hybriddl.machine.cpu_threads import torch_threads

    hook = CommHook("powersgd", rank=2, min_rate=6)
    assert hook.untimed_steps == 3 and CommHook("fp16").untimed_steps == 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 64),
                          nn.ReLU(), nn.Linear(64, 3))
    # gloo_group sets one torch thread, as a DDP process has: the test's process gets its
    # own count back after.
    with torch_threads(), gloo_group(0, 1, "127.0.0.1", _free_loopback_port(), "lo"):
        ddp, counter = wrap(model, 1, hook)
        assert ddp.bucket_bytes_cap >= gradient_bytes(model)  # one bucket, first included
        assert ddp.bucket_bytes_cap // 2**20 == one_bucket_mb(gradient_bytes(model))
        assert counter.state.start_powerSGD_iter == 2
        assert counter.state.matrix_approximation_rank == 2
        assert counter.state.min_compression_rate == 6
        sent = []
        for _ in range(hook.untimed_steps + 1):
            before = counter.bytes_sent
            ddp(torch.randn(4, 3, 8, 8)).sum().backward()
            sent.append(counter.bytes_sent - before)
        # DDP's reducer and the hook's state hold the group: freed here, before the group is
        # destroyed, not by a later test's garbage collection after it.
        del ddp, counter
        gc.collect()
    whole = gradient_bytes(model)
    assert sent[:2] == [whole, whole]
    assert sent[2] == sent[3] == payload_bytes(model, hook) < whole / 4
    # torch's default rate compresses the convolution too: fewer bytes than at 6.
    conv = model[0].weight
    assert payload_bytes(model, CommHook("powersgd", rank=2)) == (
        payload_bytes(model, hook) - 4 * conv.numel() + 4 * 2 * (16 + 27))


@pytest.mark.alone
def test_ddp_powersgd_is_paced_like_hybriddls_under_compression_seconds():
    from hybriddl.emulation.hosts import COMPRESSION_SECONDS_VARIABLE, TIME_SCALE_VARIABLE

    # At time scale 1, whatever the environment of the tests says.
    in_a_child(paced_powersgd, **{COMPRESSION_SECONDS_VARIABLE: "0.25", TIME_SCALE_VARIABLE: "1"})


def paced_powersgd():
    """As `emulate --compression-seconds 0.25` tells a DDP host (emulation/pace.py): each
    step the hook compresses ends 0.25 s (time scale 1) after it started, its CPU time here
    counted in; its two vanilla allreduces first are not padded."""
    import time

    from hybriddl.compare.ddp_peer import CommHook, gloo_group, wrap
    from hybriddl.compare.local_peers import _free_loopback_port
    from hybriddl.machine.cpu_threads import torch_threads

    hook = CommHook("powersgd", rank=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 3))
    with torch_threads(), gloo_group(0, 1, "127.0.0.1", _free_loopback_port(), "lo"):
        ddp, counter = wrap(model, 1, hook)
        seconds = []
        for _ in range(hook.untimed_steps + 1):
            started = time.perf_counter()
            ddp(torch.randn(4, 3, 8, 8)).sum().backward()
            seconds.append(time.perf_counter() - started)
        short = counter.pace.short_steps
        del ddp, counter
        gc.collect()
    assert max(seconds[:2]) < 0.15  # vanilla allreduces of a small model: milliseconds
    assert min(seconds[2:]) >= 0.25 and short == 0


def test_the_local_ddp_peer_reads_its_ranks_reports_while_it_joins_them():
    """A rank's report of thousands of steps fills the queue's pipe (64 KiB) and the rank
    waits for it to be read before it ends: joining first, then reading, waited for ever."""
    from hybriddl.compare.local_peers import measure_ddp, reports_while_joining

    class Queue:
        def __init__(self, items):
            self.items = list(items)

        def empty(self):
            return not self.items

        def get(self):
            return self.items.pop(0)

    class Ranks:  # ended only once their reports were read, as ranks blocked in put()
        def __init__(self, queue):
            self.queue, self.joins = queue, 0

        def join(self, timeout=None):
            assert timeout is not None, "a join without a timeout waits on a full pipe"
            self.joins += 1
            return self.queue.empty()

    queue = Queue([(1, [0.1] * 10_000), (0, [0.2] * 10_000)])
    ranks = Ranks(queue)
    assert sorted(reports_while_joining(ranks, queue))[0][0] == 0 and ranks.joins == 1
    # And the peer itself, two spawned gloo ranks on a small model.
    timing = measure_ddp(2, "squeezenet1_1", 3, torch.randn(4, 3, 32, 32),
                         torch.randint(3, (4,)), warmup=0, steps=2)
    assert timing.batch_size == 4 and len(timing.step_seconds) == 2

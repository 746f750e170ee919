"""torch's powerSGD_hook as the DDP peer runs it (hybriddl.compare.ddp_peer), counted in a
gloo group of this process. On its own module: a test that runs alone would make
tests/test_compare.py's module of emulated runs wait for it (tests/two_at_once.py)."""

import gc

import pytest
import torch
from torch import nn


# A gloo group in this process on a loopback port: on two workers (tests/two_at_once.py) the
# worker that had just run it aborted once (SIGABRT in a native thread, no Python frame, in
# the next test's teardown; DDP's reducer, still alive then, is the suspect), so it runs with
# no other test beside it there, and frees what holds the group before destroying it.
@pytest.mark.alone
def test_ddp_powersgd_runs_in_one_bucket_and_compresses_from_its_third_step():
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
def test_ddp_powersgd_is_paced_like_hybriddls_under_compression_seconds(monkeypatch):
    """As `emulate --compression-seconds 0.25` tells a DDP host (emulation/pace.py): each
    step the hook compresses ends 0.25 s (time scale 1) after it started, its CPU time here
    counted in; its two vanilla allreduces first are not padded."""
    import time

    from hybriddl.compare.ddp_peer import CommHook, gloo_group, wrap
    from hybriddl.compare.local_peers import _free_loopback_port
    from hybriddl.emulation.hosts import COMPRESSION_SECONDS_VARIABLE, TIME_SCALE_VARIABLE
    from hybriddl.machine.cpu_threads import torch_threads

    monkeypatch.setenv(COMPRESSION_SECONDS_VARIABLE, "0.25")
    monkeypatch.delenv(TIME_SCALE_VARIABLE, raising=False)
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

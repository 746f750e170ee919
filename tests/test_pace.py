"""`hybriddl emulate --compression-seconds G` (emulation/pace.py): a wire scheme's compute at
the speed of the hosts emulated ones stand for, padded to G x S x D wall seconds a step, on
hybriddl's hosts and in DDP's powerSGD_hook (tests/test_ddp_hook_counted.py) alike."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybriddl.emulation.hosts import COMPRESSION_SECONDS_VARIABLE, TIME_SCALE_VARIABLE
from hybriddl.emulation.pace import Pace, pace


def test_a_step_is_padded_to_the_hosts_seconds_times_the_time_scale(capsys):
    paced = Pace(0.05, 2.0)  # 0.1 s of wall time a step
    paced.add(0.03)  # the compute timed here
    started = time.perf_counter()
    assert paced.end_step() == pytest.approx(0.07)
    assert time.perf_counter() - started >= 0.07
    assert paced.spent == 0 and paced.short_steps == 0
    # A compute here longer than the hosts': nothing padded, said once.
    for _ in range(2):
        paced.add(0.25)
        assert paced.end_step() == pytest.approx(-0.15)
    assert paced.short_steps == 2
    assert capsys.readouterr().err.count("took 0.25 s wall, more than --compression-seconds "
                                         "0.05 x time scale (0.1 s)") == 1


def test_the_pace_comes_from_emulate_and_is_absent_elsewhere(monkeypatch):
    monkeypatch.delenv(COMPRESSION_SECONDS_VARIABLE, raising=False)
    assert pace() is None
    monkeypatch.setenv(COMPRESSION_SECONDS_VARIABLE, "0.013")
    monkeypatch.setenv(TIME_SCALE_VARIABLE, "127")
    assert pace().wall == pytest.approx(0.013 * 127)


def test_one_host_paces_its_powersgd_steps_and_not_the_exact_ones_before_start(monkeypatch):
    """The host alone runs PowerSGD as hosts would: its compressed steps take G (x the time
    scale, 1 here) however fast this CPU computes them; its exact steps before `start` are
    not padded (the hosts emulated compute nothing there)."""
    from hybriddl.hosts.cluster import SingleHost
    from hybriddl.hosts.powersgd import PowerSGD

    monkeypatch.setenv(COMPRESSION_SECONDS_VARIABLE, "0.3")
    monkeypatch.delenv(TIME_SCALE_VARIABLE, raising=False)
    model = nn.Linear(16, 8)
    hosts = SingleHost(compression=PowerSGD(2, start=1))
    hosts.attach(model)
    seconds = []
    for _ in range(3):
        model.weight.grad, model.bias.grad = torch.randn(8, 16), torch.randn(8)
        started = time.perf_counter()
        with hosts.averaging(SimpleNamespace(samples=4, global_samples=4)) as average:
            average(4)
        seconds.append(time.perf_counter() - started)
    assert seconds[0] < 0.15  # exact: a 16 x 8 matrix's sum, milliseconds
    assert min(seconds[1:]) >= 0.3
    assert hosts._pace.short_steps == 0


def test_compression_seconds_must_be_a_positive_duration(cli_here):
    for value, says in (("0ms", "--compression-seconds '0ms'"), ("soon", "'soon'")):
        done = cli_here("emulate", "--hosts", "2", "--compression-seconds", value, "--", "true")
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert says in done.stderr and "Traceback" not in done.stderr


def test_emulated_hosts_are_told_the_seconds_by_mpirun(tmp_path):
    from hybriddl.emulation.hosts import EmulatedHosts

    cluster = EmulatedHosts(hosts=2, cores_per_host=1, speedup=4, compression_seconds=0.013)
    cluster.folder = tmp_path  # where the hostfile goes; nothing is created
    argv = cluster.mpirun_options()
    assert argv[argv.index(f"{COMPRESSION_SECONDS_VARIABLE}=0.013") - 1] == "-x"
    cluster = EmulatedHosts(hosts=2, cores_per_host=1, speedup=4)
    cluster.folder = tmp_path
    assert not any(COMPRESSION_SECONDS_VARIABLE in word for word in cluster.mpirun_options())

"""Hosts without MPI: shares of a global batch, fusion buckets, wire compression."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from torch import nn

from hybriddl.hosts.base import host_weights
from hybriddl.hosts.cluster import LAUNCHER_VARIABLES, SingleHost, connect
from hybriddl.hosts.compression import Compression, FP16Compression, NoCompression
from hybriddl.data import epoch_batches
from hybriddl.errors import UsageError
from hybriddl.hosts.fusion import GradientBuckets


def test_connect_without_mpirun_gives_a_single_host_and_leaves_mpi_alone(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    hosts = connect(overlap=True, compression=Compression.fp16)
    assert isinstance(hosts, SingleHost)
    assert (hosts.rank, hosts.size) == (0, 1)
    if "mpi4py.MPI" in sys.modules:
        assert not sys.modules["mpi4py.MPI"].Is_initialized()


def test_single_host_takes_every_sample_and_records_steps():
    hosts = SingleHost()
    batch = epoch_batches(10, 4, seed=0, epoch=0)[0]
    share = hosts.share(batch)
    assert torch.equal(share.part.indices, batch.indices)
    hosts.traffic.begin_epoch()
    for _ in range(3):
        with hosts.averaging(share) as average_over_hosts:
            average_over_hosts(len(batch.indices))
    record = hosts.traffic.epoch_record(hosts.allgather)
    assert record["mpi_bytes_sent"] == 0
    assert len(record["per_step"]["compute_seconds"]) == 3
    assert record["by_rank"][0]["mpi_bytes_sent"] == 0


def test_throughput_shares_are_the_default_when_hosts_differ():
    assert host_weights(None, [30.0, 10.0]) == ([30.0, 10.0], "throughput", None)
    assert host_weights(None, [20.0, 20.0])[:2] == ([1.0, 1.0], "even")
    assert host_weights(None, [30.0, None])[:2] == ([1.0, 1.0], "even")
    assert host_weights("even", [30.0, 10.0])[:2] == ([1.0, 1.0], "even")


def test_throughput_balance_fills_unknown_hosts_with_the_mean():
    weights, policy, note = host_weights("throughput", [30.0, None, 10.0])
    assert (weights, policy) == ([30.0, 20.0, 10.0], "throughput")
    assert "ranks [1]" in note
    weights, policy, note = host_weights("throughput", [None, None])
    assert (weights, policy) == ([1.0, 1.0], "even") and "no host knows" in note


@pytest.mark.parametrize("balance, figures", [("fastest", [1.0]), ("throughput", [0.0, 2.0])])
def test_bad_balance_settings_are_usage_errors(balance, figures):
    with pytest.raises(UsageError):
        host_weights(balance, figures)


def test_hosts_split_each_global_batch_by_weight():
    class Rank(SingleHost):
        size = 2

        def __init__(self, rank):
            super().__init__()
            self.rank = rank
            self.weights = [3.0, 1.0]

    batch = epoch_batches(8, 8, seed=0, epoch=0)[0]
    parts = [Rank(r).share(batch).part.indices for r in (0, 1)]
    assert [len(p) for p in parts] == [6, 2]
    assert torch.equal(torch.cat(parts), batch.indices)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_buckets_hold_every_gradient_in_backward_order_within_the_size_limit():
    model = small_model()
    buckets = GradientBuckets(model, NoCompression(), bucket_bytes=16 * 8 * 4)
    params = list(model.parameters())
    laid_out = [p for b in buckets.buckets for p in b.params]
    assert laid_out == params[::-1]
    # 16 + 256 + 64 bytes fit in 512; the 512-byte first weight needs a bucket of its own.
    assert [len(b.params) for b in buckets.buckets] == [3, 1]
    assert all(b.flat.nbytes <= 16 * 8 * 4 for b in buckets.buckets)
    assert buckets.wire_bytes == 4 * sum(p.numel() for p in params)


def test_gradients_land_in_the_fusion_buffer_without_copies():
    model = small_model()
    buckets = GradientBuckets(model, NoCompression(), bucket_bytes=1 << 20)
    buckets.install_views()
    model(torch.randn(5, 8)).sum().backward()
    (bucket,) = buckets.buckets
    for i, p in enumerate(bucket.params):
        assert torch.equal(bucket.slot(i), p.grad)
    bucket.flat.mul_(2)  # what MPI does to the buffer is what the optimizer sees
    assert torch.equal(bucket.slot(0), bucket.params[0].grad)


def test_gradients_a_strategy_owns_are_copied_in_and_out():
    model = small_model()
    owned = [torch.zeros_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), owned):
        p.grad = g
    buckets = GradientBuckets(model, FP16Compression(), bucket_bytes=1 << 20)
    buckets.install_views()
    model(torch.randn(5, 8)).sum().backward()
    (bucket,) = buckets.buckets
    assert bucket.wire.dtype == torch.float16 and bucket.wire.nbytes * 2 == bucket.flat.nbytes
    buckets.gather(bucket)
    assert torch.equal(bucket.slot(0), bucket.params[0].grad)
    bucket.flat.fill_(0.5)
    buckets.scatter(bucket)
    assert all(p.grad is g for p, g in zip(model.parameters(), owned))
    assert all(bool((g == 0.5).all()) for g in owned)


def test_a_steps_interface_bytes_run_from_the_previous_steps_end():
    """Bytes that leave between two steps (a message's tail still queued in the kernel when
    the averaging returned) count in the next step, not nowhere; an epoch starts afresh."""
    from hybriddl.hosts.traffic import TrafficMeter

    meter = TrafficMeter()
    meter.begin_epoch()
    counter = 1000
    for sent_inside, sent_after in ((10, 4), (10, 0), (10, 7)):
        start = meter.nic_step_start(counter)
        counter += sent_inside
        meter.step_done(bytes_at_start=0, compute_seconds=0.0, comm_seconds=0.0,
                        nic_at_start=start, nic_at_end=counter)
        counter += sent_after
    assert meter.epoch_figures()["nic_bytes_sent"] == 10 + 14 + 10
    meter.begin_epoch()  # validation's bytes, between the epochs, are no step's
    start = meter.nic_step_start(counter + 50)
    meter.step_done(bytes_at_start=0, compute_seconds=0.0, comm_seconds=0.0,
                    nic_at_start=start, nic_at_end=counter + 60)
    assert meter.epoch_figures()["nic_bytes_sent"] == 10


def test_an_aborting_rank_waits_until_its_pipes_are_read():
    from hybriddl.hosts.mpi import _unread_bytes, let_mpirun_read_output

    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"rank 0 on h0: rank 1 on host h1 failed while averaging\n")
        assert _unread_bytes(write_end) > 0
        reader = threading.Thread(target=os.read, args=(read_end, 4096))
        started = time.monotonic()
        reader.start()
        let_mpirun_read_output((write_end,), seconds=30)
        assert time.monotonic() - started < 10  # it returned on the read, not the allowance
        assert _unread_bytes(write_end) == 0
        reader.join()
    finally:
        os.close(read_end)
        os.close(write_end)


def test_an_aborting_rank_gives_up_on_a_pipe_nobody_reads():
    from hybriddl.hosts.mpi import _unread_bytes, let_mpirun_read_output

    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"unread\n")
        started = time.monotonic()
        let_mpirun_read_output((write_end,), seconds=0.3)
        assert 0.3 <= time.monotonic() - started < 5
        assert _unread_bytes(write_end) == 7
        assert _unread_bytes(99999) == 0  # a closed descriptor: nothing to wait for
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_progress_deadline_grows_on_a_link_too_slow_for_its_parts():
    """--progress-timeout bounds an exchange every host is inside with no part completing;
    on a link that needs longer to carry PROGRESS_PARTS parts, the parts' time bounds it."""
    from hybriddl.hosts.mpi import MPIHosts, PIECE_BYTES, PROGRESS_PARTS

    hosts = MPIHosts.__new__(MPIHosts)  # no MPI started: only the arithmetic
    hosts.progress_timeout, hosts.link_bytes_per_second, hosts.time_scale = 60.0, None, 1.0
    assert hosts.progress_deadline() == 60.0  # not measured: the flag's
    hosts.link_bytes_per_second = 125e6  # 1 Gbit/s: parts take a fraction of a second
    assert hosts.progress_deadline() == 60.0
    hosts.link_bytes_per_second = 125e3  # 1 Mbit/s
    assert hosts.progress_deadline() == pytest.approx(PROGRESS_PARTS * PIECE_BYTES / 125e3)
    assert hosts.progress_deadline() > 250
    # Emulated hosts slowed S x D = 4 times: the flag's seconds and the rate measured (in
    # emulated time) both stand for 4 times the wall seconds.
    hosts.progress_timeout, hosts.time_scale = 60.0 * 4, 4.0
    assert hosts.progress_deadline() == pytest.approx(4 * PROGRESS_PARTS * PIECE_BYTES / 125e3)


def test_an_exchange_sent_as_one_large_request_has_its_time_on_a_slow_link():
    """The classifier's exchanges and a compressed run's sum go as one request each, not in
    8 MiB pieces: VGG16's classifier inputs, hybrid, 4 hosts, batch 512, are one 38 MB
    gather, 61 s at 5 Mbit/s, with no part completing before its end. Its deadline is that
    request's time, not a piece's."""
    from hybriddl.hosts.mpi import MPIHosts, PIECE_BYTES
    from hybriddl.hosts.traffic import TrafficMeter

    hosts = MPIHosts.__new__(MPIHosts)  # no MPI started: the arithmetic and what is waited
    hosts.progress_timeout, hosts.link_bytes_per_second, hosts.time_scale = 60.0, 625e3, 1.0
    gathered = 38 * 10**6
    assert hosts.progress_deadline() < gathered / 625e3  # a piece's: it would be named stuck
    assert hosts.progress_deadline(gathered) > 2 * gathered / 625e3

    waited = {}

    def wait(requests, what, continues=False, largest=PIECE_BYTES):
        waited[what] = largest

    class Comm:
        def Iallgatherv(self, *arrays, root=None):
            return "request"

        Iallreduce = Igatherv = Iallgatherv

    hosts.wait, hosts.comm, hosts.traffic = wait, Comm(), TrafficMeter()
    hosts.rank, hosts.size, hosts.MPI = 0, 4, type("MPI", (), {"SUM": None})
    rows = torch.zeros(3 * 2**20 // 4, 4)  # 12 MiB of rows from each of 4 hosts
    hosts.allgather_rows(rows, [len(rows)] * 4)
    hosts.allreduce_sum(rows)
    hosts.gather_rows(rows, [len(rows)] * 4)
    assert sorted(waited.values()) == [rows.nbytes, 4 * rows.nbytes, 4 * rows.nbytes]
    assert min(waited.values()) > PIECE_BYTES


def test_an_mpi_error_the_progress_thread_meets_is_raised_by_the_wait_not_lost():
    """The progress thread's Testall may be the call that meets an exchange's error; MPI
    then frees the requests, and the waiting thread's Testsome finds them done. The wait
    must raise the error (one line naming what failed), not return with half-summed
    buffers."""
    from hybriddl.hosts.mpi import HostFailure, MPIHosts, ProgressThread

    class FakeMPI:
        class Exception(Exception):
            def Get_error_string(self):
                return "MPI_ERR_PROC_FAILED: process failure"

        class Request:
            @staticmethod
            def Testall(requests):
                raise FakeMPI.Exception()

            @staticmethod
            def Testsome(requests):
                return None  # every request freed: nothing left to wait for

    thread = ProgressThread(FakeMPI)
    try:
        thread.track(["a request"])
        thread.wake()
        deadline = time.monotonic() + 30
        while thread.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(thread.failure, FakeMPI.Exception)
        hosts = MPIHosts.__new__(MPIHosts)  # no MPI started: only the wait
        hosts.MPI, hosts.comm, hosts.heartbeat, hosts._progress = FakeMPI, object(), None, thread
        hosts._exchanges, hosts._deadline_armed, hosts.timeout = 0, False, 60.0
        with pytest.raises(HostFailure, match="failed while averaging gradients .*process failure"):
            hosts.wait(["a request"], "averaging gradients")
    finally:
        thread.close()


def test_an_mpi_error_as_an_exchange_starts_is_one_line_naming_what_failed():
    """Open MPI may refuse to start a collective with a process it knows failed: the error
    came from the call that starts it, outside the wait, and reached the user as a
    traceback. Each exchange's method names it as the wait does."""
    from hybriddl.hosts.mpi import HostFailure, MPIHosts
    from hybriddl.hosts.traffic import TrafficMeter

    class FakeMPI:
        SUM = MAX = IN_PLACE = None

        class Exception(Exception):
            def Get_error_string(self):
                return "MPI_ERR_PROC_FAILED: process failure"

    class Comm:
        def refuse(self, *args, **kwargs):
            raise FakeMPI.Exception()

        Iallgather = Iallgatherv = Ibcast = Ibarrier = Iallreduce = Igatherv = refuse

        def Get_failed(self):
            raise NotImplementedError  # no ULFM: the heartbeat would name the host

        def Get_size(self):
            return 2

    hosts = MPIHosts.__new__(MPIHosts)  # no MPI started: the calls that start exchanges
    hosts.MPI, hosts.comm, hosts.heartbeat, hosts.traffic = FakeMPI, Comm(), None, TrafficMeter()
    hosts.rank, hosts.size = 0, 2
    rows = torch.zeros(4, 3)
    for call, what in ((lambda: hosts.allgather(1), "exchanging settings"),
                       (lambda: hosts.broadcast_object(1), "receiving rank 0's settings"),
                       (hosts.barrier, "waiting for every host"),
                       (lambda: hosts.any_true(False), "agreeing whether to stop"),
                       (lambda: hosts.mean_over_hosts(1.0, 2), "averaging the loss"),
                       (lambda: hosts.broadcast_tensors([rows], "receiving a tensor"),
                        "receiving a tensor"),
                       (lambda: hosts.allgather_rows(rows, [4, 4]), "exchanging classifier"),
                       (lambda: hosts.allreduce_sum(rows, "summing statistics"),
                        "summing statistics"),
                       (lambda: hosts.gather_rows(rows, [4, 4]), "gathering the classifier")):
        with pytest.raises(HostFailure, match=f"communication between hosts failed while "
                                              f"{what}.*process failure"):
            call()


def test_a_heartbeat_that_stopped_on_a_fault_of_its_own_is_named_by_the_deadline():
    """A rank's heartbeat thread that met an error of its own (too many open files) stops,
    and the waits go on without it: the deadline's line named a hung host or network, and
    the cause was never shown."""
    from hybriddl.hosts.mpi import HostFailure, MPIHosts

    class FakeMPI:
        class Exception(Exception):
            pass

        class Request:
            @staticmethod
            def Testsome(requests):
                return []  # nothing completes

    class StoppedHeartbeat:
        running = False
        fault = "the heartbeat stopped ([Errno 24] Too many open files)"

    hosts = MPIHosts.__new__(MPIHosts)  # no MPI started: only the wait
    hosts.MPI, hosts.comm, hosts.heartbeat, hosts._progress = FakeMPI, object(), \
        StoppedHeartbeat(), None
    hosts._exchanges, hosts._deadline_armed, hosts.timeout = 0, True, 0.2
    with pytest.raises(HostFailure, match=r"no answer from the other hosts for 0 s while "
                                          r"averaging gradients; .*this rank's heartbeat had "
                                          r"stopped earlier: .*Too many open files"):
        hosts.wait(["a request"], "averaging gradients")


@pytest.mark.parametrize("key, mine, theirs", [("eval_every", 1, 2),
                                                ("checkpoint_every", None, 5),
                                                ("stop_at_target", True, False),
                                                ("check_every", 10, 20),
                                                ("target_accuracy", 0.9, 0.8)])
def test_hosts_given_other_collective_gates_are_refused_before_training(key, mine, theirs):
    """--eval-every, --checkpoint-every, --check-every and the target decide when every host
    enters a collective (a validation, a checkpoint, a replica check, a stop): hosts given
    other values started and hung at the first step one entered alone."""
    from dataclasses import replace
    from types import SimpleNamespace

    from hybriddl.run.settings import TrainConfig
    from hybriddl.run.trainer import settings_hosts_share

    class TwoHosts(SingleHost):
        rank, size = 0, 2
        other: dict = {}

        def allgather(self, value):
            return [value, {**value, **self.other} if isinstance(value, dict) else value]

    config = replace(TrainConfig(usecase="SimpleBig").resolved(), **{key: mine})
    prepared = SimpleNamespace(config=config, split=SimpleNamespace(train=[0] * 8))
    settings = settings_hosts_share(prepared)
    hosts = TwoHosts()
    hosts.agree(settings, "even", None)  # the same everywhere: agreed
    hosts.other = {key: theirs}
    with pytest.raises(UsageError, match=f"hosts disagree on {key} \\(rank 0 has {mine!r}, "
                                         f"rank 1 has {theirs!r}\\)"):
        hosts.agree(settings, "even", None)


def test_an_fp16_sum_that_overflows_stops_the_step_in_one_line():
    """Each host's n_h/N share fits float16, their sum does not: the infinite gradient was
    applied to every replica, and the loss read later blamed --lr. Exact float32 buckets
    are not checked (nothing to pay)."""
    from types import SimpleNamespace

    from hybriddl.errors import TrainingError
    from hybriddl.hosts.averaging import BucketedAverager

    class TwoHostsSummed:
        progress = None
        traffic = SimpleNamespace(sent=lambda nbytes: None)

        def iallreduce(self, wire, received):
            received.copy_(wire.float() * 2)  # the other host sent the same
            return []

        def wait(self, requests, what):
            pass

    def averaged(compression, gradient: float):
        model = small_model()
        buckets = GradientBuckets(model, compression, bucket_bytes=1 << 20)
        buckets.install_views()
        for p in model.parameters():
            p.grad.fill_(gradient)
        averager = BucketedAverager(TwoHostsSummed(), compression, buckets)
        averager.arm(0.5)
        averager.average()
        return [p.grad for p in model.parameters()]

    assert all(bool((g == 1.0).all()) for g in averaged(FP16Compression(), 1.0))
    with pytest.raises(TrainingError, match="the gradients summed on the fp16 wire are not "
                                            "finite .* resume with --compression none"):
        averaged(FP16Compression(), 1e5)  # 5e4 a host, 1e5 summed: beyond 65504
    assert all(bool((g == 1e5).all()) for g in averaged(NoCompression(), 1e5))

"""GPU strategies on a CUDA device, and the GPU code paths that run on CPU devices in CI.

On a GPU the equivalence is checked against the plain loop on the same device (`gpu`,
sequential SGD there) within 1e-5, with TF32 off and cuDNN deterministic for that
comparison, and against the CPU baseline within GPU_VS_CPU: GPU kernels sum in another
order than the CPU (on an H100 the first conv weight of AlexNet differed by 1.8e-6
after 3 steps, 3.5e-6 of its largest value). Without CUDA each such test says why it skips.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import hybriddl_env
from test_strategies import assert_same_parameters, sequential_parameters, slim_model, train
from hybriddl.dropout import KeyedDropout, dropout_keys, sample_keys
from hybriddl.rundir import MODEL
from hybriddl.strategies import StrategyOptions, make_strategy

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this host: GPU figures and "
                                                 "GPU equivalence need one")
GPUS = torch.cuda.device_count() if CUDA else 0
GPU_VS_CPU = 1e-4  # of each parameter tensor's largest value, after 3 SGD steps


@pytest.fixture
def exact_cuda():
    """float32 as the CPU computes it: no TF32, deterministic cuDNN kernels."""
    if not CUDA:
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


@functools.cache
def gpu_parameters(model_name: str) -> list[torch.Tensor]:
    return train("gpu", StrategyOptions(devices=("cuda:0",)), model_name)


def assert_close(actual, expected, tolerance: float) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        error = ((a - e).abs().max() / e.abs().max()).item()
        assert error <= tolerance, f"parameter {i}: {error:.2e} of its largest value"


# --------------------------------------------------------------------------- on CPU devices

class Elsewhere(torch.Tensor):
    """CPU data that says it lives on another device (`meta`): what a CUDA tensor is to code
    that must not hand it to numpy or MPI. Every operation runs on the data and stays
    "elsewhere"; only a copy into a CPU tensor brings the data back."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        made = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype,
                                                   device="meta", strides=data.stride())
        made.data_here = data
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(value):
            return value.data_here if isinstance(value, Elsewhere) else value

        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                and kwargs["device"].type == "cpu":
            return unwrap(args[0]).clone()
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func is torch.ops.aten.copy_.default:
            return args[0]
        return tree_map(lambda v: Elsewhere(v) if isinstance(v, torch.Tensor) else v, out)


class OneRankComm:
    """MPI's collectives for one rank, on numpy arrays only (what mpi4py reads)."""

    def __init__(self):
        self.buffers = []

    def _seen(self, *arrays):
        import numpy as np

        for array in arrays:
            assert isinstance(array, np.ndarray), f"MPI was handed {type(array).__name__}"
            self.buffers.append(array)

    def Iallgatherv(self, send, receive):
        self._seen(send, receive[0])
        receive[0].reshape(-1)[:send.size] = send.reshape(-1)

    def Ialltoallv(self, send, receive):  # one rank: it sends itself nothing
        self._seen(send[0], receive[0])
        assert send[1][0] == [0] and receive[1][0] == [0]  # (counts, displacements)

    def Iallreduce(self, send, receive, op):
        self._seen(send, receive)
        receive[...] = send

    def Igatherv(self, send, receive, root):
        self._seen(send, receive[0])
        receive[0].reshape(-1)[:send.size] = send.reshape(-1)

    def Ibcast(self, buffer, root):  # rank 0's parameters: sevens
        self._seen(buffer)
        buffer[...] = 7


def one_rank_mpi_hosts():
    """An MPIHosts of one rank whose MPI is OneRankComm (no MPI runtime started)."""
    from hybriddl.hosts.mpi import MPIHosts
    from hybriddl.hosts.traffic import TrafficMeter

    hosts = MPIHosts.__new__(MPIHosts)
    hosts.comm, hosts.MPI = OneRankComm(), SimpleNamespace(SUM="sum")
    hosts.rank, hosts.size, hosts.traffic = 0, 1, TrafficMeter()
    hosts.wait = lambda requests, what, **how: None  # continues, largest
    hosts.barrier = lambda: None
    return hosts


def test_every_mpi_entry_point_stages_a_tensor_of_another_device_through_host_memory():
    """The classifier split across hosts hands device tensors to the hosts' collectives
    (issue 39: `.numpy()` of a CUDA tensor crashed two hosts with --strategy gpu): each is
    copied to host memory for MPI, and the result comes back on the tensor's device."""
    hosts = one_rank_mpi_hosts()
    rows = torch.arange(12.0).view(4, 3)
    for call in (lambda t: hosts.allgather_rows(t, [4]), lambda t: hosts.reduce_scatter_rows(t, [4]),
                 hosts.allreduce_sum, lambda t: hosts.gather_rows(t, [4])):
        out = call(Elsewhere(rows))
        assert isinstance(out, Elsewhere) and torch.equal(out.data_here, rows)
    weight = Elsewhere(torch.zeros(2, 3))
    hosts.broadcast_parameters(SimpleNamespace(parameters=lambda: [weight], buffers=lambda: []))
    assert torch.equal(weight.data_here, torch.full((2, 3), 7.0))


def test_mpi_refuses_a_tensor_of_another_device_and_reads_a_cpu_one_in_place():
    from hybriddl.hosts.mpi import _as_mpi

    with pytest.raises(RuntimeError, match="MPI reads host memory only"):
        _as_mpi(Elsewhere(torch.zeros(3)))
    hosts = one_rank_mpi_hosts()
    rows = torch.arange(6.0).view(2, 3)
    assert torch.equal(hosts.allreduce_sum(rows), rows)
    assert hosts.comm.buffers[0].ctypes.data == rows.data_ptr()  # no copy on the CPU path


def test_the_gpu_step_leaves_its_loss_on_the_device():
    """No read-back inside the step: the loss is a tensor of the strategy's device (the
    trainer reads it for progress), here the CPU standing in for a GPU."""
    x, y = torch.randn(4, 3, 64, 64), torch.randint(3, (4,))
    with make_strategy("gpu", StrategyOptions(devices=("cpu",))) as gpu:
        gpu.setup(slim_model("alexnet"))
        assert gpu.stage_batch(x) is x  # nothing to copy on the CPU
        rows, flips = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8), torch.tensor([1, 0, 1, 0]).bool()
        from hybriddl.data import BatchTransform

        assert torch.equal(gpu.prepare_batch(rows, flips, BatchTransform(64)),
                           BatchTransform(64)(rows, flips))
        with dropout_keys(sample_keys(0, 0, torch.arange(4))):
            stats = gpu.compute_gradients(x, y)
    assert isinstance(stats.loss_sum, torch.Tensor) and stats.loss_sum.device == gpu.device
    assert stats.loss > 0


def test_a_checkpoint_of_a_device_is_staged_in_host_memory_and_its_buffers_reused():
    """The model and momentum of a GPU are copied to (pinned) host buffers for the writer,
    not to a second copy on the GPU; buffers are reused from one checkpoint to the next."""
    from hybriddl.run.checkpointer import blank, stage

    weights = torch.arange(6.0).view(2, 3)
    state = {"model": {"w": Elsewhere(weights)}, "optimizer": {"state": {0: {
        "momentum_buffer": Elsewhere(-weights)}}, "param_groups": [{"lr": 0.1}]}}
    buffers = blank({"model": {"w": torch.empty(2, 3, device="meta")}})
    assert buffers["model"]["w"].device.type == "cpu"
    staged = stage(buffers, state)
    w, m = staged["model"]["w"], staged["optimizer"]["state"][0]["momentum_buffer"]
    assert type(w) is torch.Tensor and w.device.type == "cpu" and torch.equal(w, weights)
    assert w is buffers["model"]["w"]
    assert type(m) is torch.Tensor and m.device.type == "cpu" and torch.equal(m, -weights)
    again = stage(staged, state)
    assert again["optimizer"]["state"][0]["momentum_buffer"] is m  # reused, not reallocated


def epoch_on_a_queueing_device(run_dir, queued: float, **flags) -> tuple[dict, list[float]]:
    """Two steps of the gpu strategy on a stand-in device that has `queued` seconds of work
    left whenever it is asked to finish (`synchronize`): the epoch's record and the steps'
    seconds as the observer saw them."""
    from hybriddl.run import trainer
    from hybriddl.run.settings import TrainConfig

    config = TrainConfig(strategy="gpu", strategy_options=StrategyOptions(devices=("cpu",)),
                         model="resnet18", image_size=32, batch_size=8, max_steps=2,
                         run_dir=str(run_dir), **flags)
    prepared = trainer.prepare(config.resolved())
    prepared.strategy.synchronize = lambda: time.sleep(queued)
    steps = []

    class Steps(trainer.TrainingObserver):
        def on_step(self, epoch, step, samples, seconds, loss):
            steps.append(seconds)

    return trainer.run(prepared, Steps())["epochs"][0], steps


def test_an_epochs_images_per_second_waits_for_the_work_its_steps_queued(tmp_path):
    """A GPU step returns once its kernels are queued: the epoch's seconds end when the
    device has run them (`synchronize`), not when the last step was queued."""
    queued = 0.5
    epoch, steps = epoch_on_a_queueing_device(tmp_path / "run", queued)
    assert len(steps) == 2 and epoch["seconds"] >= sum(steps) + queued
    assert epoch["images_per_second"] <= 16 / queued


def test_a_validation_inside_an_epoch_does_not_take_the_work_its_steps_queued(tmp_path):
    """--eval-every inside an epoch: validation's first read-back waited for the steps'
    queued work, and the clock restarted after validation, so that work was in no one's
    seconds (images/s too high)."""
    queued = 0.5
    epoch, steps = epoch_on_a_queueing_device(tmp_path / "run", queued, eval_every=1)
    # Before each of the two validations, and at the epoch's end.
    assert len(steps) == 2 and epoch["seconds"] >= sum(steps) + 3 * queued


@pytest.mark.parametrize("name, devices", [("gpu", ("cpu",)), ("pipeline", ("cpu", "cpu")),
                                           ("gpu-threads", ("cpu", "cpu"))])
def test_no_gpu_strategy_reads_its_loss_back_inside_the_step(name, devices, monkeypatch):
    """Issue 39: gpu-threads read each part's loss with .item() (the host waited for the
    device twice a step). Every GPU strategy leaves the loss on its device, and makes its
    batch from uint8 rows as the CPU transform does."""
    from hybriddl.data import BatchTransform

    rows = torch.randint(0, 256, (6, 3, 64, 64), dtype=torch.uint8)
    flips = torch.tensor([True, False] * 3)
    y = torch.randint(3, (6,))
    with make_strategy(name, StrategyOptions(micro_batches=2, devices=devices)) as strategy:
        strategy.setup(slim_model("alexnet"))
        x = strategy.prepare_batch(strategy.batch_rows(rows, torch.arange(6)), flips,
                                   BatchTransform(64))
        assert torch.equal(x, BatchTransform(64)(rows, flips))

        def read_back(tensor):
            raise AssertionError("a loss was read back inside the step")

        monkeypatch.setattr(torch.Tensor, "item", read_back)
        with dropout_keys(sample_keys(0, 0, torch.arange(6))):
            stats = strategy.compute_gradients(x, y)
        monkeypatch.undo()
    assert isinstance(stats.loss_sum, torch.Tensor) and stats.loss_sum.device == strategy.device
    assert stats.loss > 0


def test_the_prefetcher_gathers_images_and_labels_through_the_strategys_rows():
    """So that a GPU strategy gathers them straight into pinned memory (issue 39: the rows
    were indexed, then copied again to pin them)."""
    from hybriddl import data

    images = data.ImageSet(torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8),
                           torch.arange(10) % 3, ["a", "b", "c"])
    gathered = []

    def rows(source, indices):
        gathered.append(source.dtype)
        return source[indices]

    batches = data.epoch_batches(10, 5, seed=0, epoch=0)
    with data.BatchPrefetcher(images, batches, data.BatchTransform(4), rows=rows) as prefetch:
        got = list(prefetch)
    assert gathered == [torch.uint8, torch.int64] * 2
    assert all(torch.equal(y, images.labels[share.part.indices]) for share, _, y in got)


def test_the_normalisation_is_copied_to_a_device_once():
    """Issue 39: mean and std were copied to the device, blocking, for every batch."""
    from hybriddl.data import BatchTransform

    transform = BatchTransform(8)
    mean, std = transform.normalisation(torch.device("meta"))
    assert mean.device.type == "meta" and std.shape == (1, 3, 1, 1)
    again = transform.normalisation(torch.device("meta"))
    assert again[0] is mean and again[1] is std


def test_the_pipelines_timeline_has_each_stage_of_each_micro_batch():
    x, y = torch.randn(8, 3, 64, 64), torch.randint(3, (8,))
    with make_strategy("pipeline", StrategyOptions(micro_batches=4, devices=("cpu", "cpu"))) as pipe:
        pipe.setup(slim_model("alexnet"))
        pipe.record_timeline = True
        pipe.compute_gradients(x, y)
        timeline = pipe.timeline()
    # Stage 1's forward and backward of each micro-batch, stage 2's forward+backward.
    assert sorted((r["stage"], r["micro_batch"]) for r in timeline) == sorted(
        [(1, m) for m in range(4)] * 2 + [(2, m) for m in range(4)])
    assert all(r["end_ms"] >= r["start_ms"] >= 0 for r in timeline)


class FakeCuda:
    """torch.cuda's streams and events as the pipeline uses them, for stages whose data stay
    on the CPU: an event is timed only against an event of its own device, as CUDA does."""

    class Stream:
        def __init__(self, device):
            self.device = torch.device(device)

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

    class Event:
        def __init__(self, enable_timing=False):
            self.device, self.at = None, None

        def record(self, stream=None):
            self.device, self.at = stream.device, time.perf_counter()

        def elapsed_time(self, end) -> float:
            if end.device != self.device:
                raise RuntimeError("CUDA cannot time events of two devices against each other")
            return (end.at - self.at) * 1e3

    @classmethod
    def install(cls, monkeypatch):
        import contextlib

        monkeypatch.setattr(torch.cuda, "Event", cls.Event)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cls.Stream(device))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)


def test_the_timeline_of_a_pipeline_over_two_gpus_times_each_stage_on_its_own_device(monkeypatch):
    """Issue 39: timeline() timed stage 2's events (cuda:1) against stage 1's first (cuda:0),
    which CUDA refuses. Here the stages' streams are fake streams of cuda:0 and cuda:1."""
    x, y = torch.randn(8, 3, 64, 64), torch.randint(3, (8,))
    with make_strategy("pipeline", StrategyOptions(micro_batches=2, devices=("cpu", "cpu"))) as pipe:
        pipe.setup(slim_model("alexnet"))
        FakeCuda.install(monkeypatch)
        pipe.streams = (FakeCuda.Stream("cuda:0"), FakeCuda.Stream("cuda:1"))
        pipe.record_timeline = True
        pipe.compute_gradients(x, y)
        timeline = pipe.timeline()
    assert sorted((r["stage"], r["micro_batch"]) for r in timeline) == sorted(
        [(1, m) for m in range(2)] * 2 + [(2, m) for m in range(2)])
    assert min(r["start_ms"] for r in timeline) == 0
    assert all(r["end_ms"] >= r["start_ms"] >= 0 for r in timeline)
    stage_2 = [r for r in timeline if r["stage"] == 2]
    assert stage_2 and all(r["start_ms"] > 0 for r in stage_2)  # after stage 1's first


# --------------------------------------------------------------------------- on a GPU

@needs_cuda
@pytest.mark.gpu
def test_keyed_dropout_masks_are_the_same_on_cpu_and_cuda():
    keys = sample_keys(3, 2, torch.arange(64))
    layer = KeyedDropout(0.5, layer=1).train()
    with dropout_keys(keys):
        on_cpu = layer(torch.ones(64, 4096))
        on_cuda = layer(torch.ones(64, 4096, device="cuda"))
    assert torch.equal(on_cpu, on_cuda.cpu())


@needs_cuda
@pytest.mark.gpu
def test_augmentation_on_the_gpu_makes_the_cpus_batch():
    """uint8 rows scaled, flipped and normalised on the device, against the CPU."""
    from hybriddl.data import BatchTransform

    rows = torch.randint(0, 256, (8, 3, 80, 80), dtype=torch.uint8)
    flips = torch.tensor([True, False] * 4)
    with make_strategy("gpu", StrategyOptions(devices=("cuda:0",))) as gpu:
        gpu.setup(slim_model("alexnet"))
        for size in (80, 64):  # as stored, and scaled
            transform = BatchTransform(size)
            on_gpu = gpu.prepare_batch(rows, flips, transform)
            torch.cuda.synchronize()
            assert on_gpu.is_cuda
            assert torch.allclose(on_gpu.cpu(), transform(rows, flips), atol=1e-5 if size == 80 else 2e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name, devices", [("gpu", ("cuda:0",)), ("pipeline", ("cuda:0", "cuda:0")),
                                           ("gpu-threads", ("cuda:0", "cuda:0"))])
def test_a_gpu_strategy_gathers_rows_into_pinned_memory_and_augments_them_on_the_device(name,
                                                                                       devices):
    from hybriddl.data import BatchTransform

    images = torch.randint(0, 256, (12, 3, 64, 64), dtype=torch.uint8)
    labels, indices = torch.arange(12) % 3, torch.tensor([5, 1, 7, 3])
    flips = torch.tensor([True, False, False, True])
    with make_strategy(name, StrategyOptions(micro_batches=2, devices=devices)) as strategy:
        strategy.setup(slim_model("alexnet"))
        rows, y = strategy.batch_rows(images, indices), strategy.batch_rows(labels, indices)
        assert rows.is_pinned() and y.is_pinned()
        assert torch.equal(rows, images[indices]) and torch.equal(y, labels[indices])
        x = strategy.prepare_batch(rows, flips, BatchTransform(64))
        assert x.is_cuda
        with dropout_keys(sample_keys(0, 0, indices)):
            stats = strategy.compute_gradients(x, y)
        strategy.synchronize()
    assert torch.allclose(x.cpu(), BatchTransform(64)(images[indices], flips), atol=1e-5)
    assert stats.loss_sum.is_cuda and torch.isfinite(stats.loss_sum)


@needs_cuda
@pytest.mark.gpu
def test_gpu_matches_the_cpu_baseline_within_float_tolerance(exact_cuda):
    assert_close(gpu_parameters("alexnet"), sequential_parameters("alexnet"), GPU_VS_CPU)


@needs_cuda
@pytest.mark.gpu
def test_a_staged_batch_trains_what_a_copied_one_does(exact_cuda):
    """The prefetch thread's copy on the side stream, against the step's own copy."""
    model_a, model_b = slim_model("alexnet"), slim_model("alexnet")
    x, y = torch.randn(6, 3, 64, 64), torch.randint(3, (6,))
    grads = []
    for model, staged in ((model_a, False), (model_b, True)):
        with make_strategy("gpu", StrategyOptions(devices=("cuda:0",))) as gpu:
            gpu.setup(model)
            images = gpu.stage_batch(x) if staged else x
            assert images.is_cuda == staged
            with dropout_keys(sample_keys(0, 0, torch.arange(6))):
                gpu.compute_gradients(images, y)
            grads.append([p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_pipeline_on_one_gpu_matches_gpu(micro_batches, exact_cuda):
    options = StrategyOptions(micro_batches=micro_batches, devices=("cuda:0", "cuda:0"))
    assert_same_parameters(train("pipeline", options, "alexnet"), gpu_parameters("alexnet"))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"{GPUS} CUDA device(s): the two-GPU pipeline needs two")
def test_pipeline_on_two_gpus_matches_gpu(exact_cuda):
    options = StrategyOptions(micro_batches=4, devices=("cuda:0", "cuda:1"))
    assert_same_parameters(train("pipeline", options, "alexnet"), gpu_parameters("alexnet"))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"{GPUS} CUDA device(s): the two-GPU pipeline needs two")
def test_the_two_gpu_pipelines_loss_is_the_gpu_steps(exact_cuda):
    """Issue 39: the micro-batches' losses were summed on cuda:1's default stream, which
    never waited for stage 2's stream: the step's loss could be read before it was made."""
    x, y = torch.randn(16, 3, 64, 64), torch.randint(3, (16,))
    losses = []
    for name, options in (("gpu", StrategyOptions(devices=("cuda:0",))),
                          ("pipeline", StrategyOptions(micro_batches=4,
                                                       devices=("cuda:0", "cuda:1")))):
        with make_strategy(name, options) as strategy:
            strategy.setup(slim_model("alexnet"))
            with dropout_keys(sample_keys(0, 0, torch.arange(16))):
                for _ in range(3):  # later steps queue behind the earlier ones' kernels
                    stats = strategy.compute_gradients(strategy.stage_batch(x), y)
            losses.append(float(stats.loss_sum))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@needs_cuda
@pytest.mark.gpu
def test_gpu_threads_on_one_gpu_matches_gpu(exact_cuda):
    options = StrategyOptions(devices=("cuda:0", "cuda:0"))
    assert_same_parameters(train("gpu-threads", options, "alexnet"), gpu_parameters("alexnet"))


@needs_cuda
@pytest.mark.gpu
def test_the_pipelines_stages_overlap_on_one_gpu():
    """Each stage on its own stream: some of stage 1's work on micro-batch m + 1 runs while
    stage 2 works on m (VGG16, whose stages are of similar cost)."""
    x, y = torch.randn(16, 3, 224, 224), torch.randint(3, (16,))
    with make_strategy("pipeline", StrategyOptions(micro_batches=4,
                                                   devices=("cuda:0", "cuda:0"))) as pipe:
        from hybriddl.usecases import build_model

        pipe.setup(build_model("vgg16", 3))
        for _ in range(3):
            pipe.compute_gradients(x, y)
        pipe.record_timeline = True
        pipe.compute_gradients(x, y)
        timeline = pipe.timeline()
    first = [(r["start_ms"], r["end_ms"]) for r in timeline if r["stage"] == 1]
    second = [(r["start_ms"], r["end_ms"]) for r in timeline if r["stage"] == 2]
    overlap = sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in first for a2, b2 in second)
    assert overlap > 0, timeline


def gpu_mpirun() -> Path:
    beside = Path(sys.executable).parent / "mpirun"  # the venv's (pip's Open MPI), else PATH's
    found = beside if beside.exists() else shutil.which("mpirun")
    if found is None:
        pytest.skip(f"no mpirun at {beside} or on PATH")
    return Path(found)


def two_ranks(mpirun: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(mpirun), "--oversubscribe", "--mca", "btl", "tcp,self", "--mca",
                           "btl_tcp_if_include", "lo", "-np", "2", sys.executable, "-m",
                           "hybriddl", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("host_parallel", ["auto", "hybrid"])
def test_two_ranks_sharing_one_gpu_train_what_one_process_does(tmp_path, host_parallel):
    mpirun = gpu_mpirun()
    train_args = ["train", "--model", "alexnet", "--image-size", "64", "--batch-size", "8",
                  "--max-steps", "3", "--epochs", "1", "--strategy", "gpu", "--devices", "cuda:0"]
    env = {**hybriddl_env(), "NVIDIA_TF32_OVERRIDE": "0"}
    one = subprocess.run([sys.executable, "-m", "hybriddl", *train_args, "--run-dir",
                          str(tmp_path / "one")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert one.returncode == 0, one.stderr
    two = two_ranks(mpirun, [*train_args, "--host-parallel", host_parallel,
                             "--run-dir", str(tmp_path / "two")], env)
    assert two.returncode == 0, two.stdout + two.stderr
    got, want = torch.load(tmp_path / "two" / MODEL), torch.load(tmp_path / "one" / MODEL)
    # model.pt holds CPU tensors whichever device trained it and however many hosts did.
    assert {str(t.device) for t in [*got.values(), *want.values()]} == {"cpu"}
    assert_close([got[k] for k in want], list(want.values()), GPU_VS_CPU)
    config = json.loads((tmp_path / "two" / "metrics.json").read_text())["config"]
    assert config["host_parallel"]["asked"] == host_parallel, config["host_parallel"]
    if host_parallel == "hybrid":
        assert config["host_parallel"]["scheme"] == "hybrid", config["host_parallel"]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.slow
def test_two_ranks_on_cuda_with_powersgd_resumed_end_as_uninterrupted(tmp_path):
    """Two ranks sharing the GPU, `--compression powersgd:2`: stopped after 4 steps and
    resumed to 6, they end where 6 uninterrupted steps end (the checkpoint keeps the
    factors and each host's errors, apart, on the CPU)."""
    mpirun = gpu_mpirun()
    env = {**hybriddl_env(), "NVIDIA_TF32_OVERRIDE": "0"}
    args = ["train", "--model", "alexnet", "--image-size", "64", "--batch-size", "8",
            "--epochs", "2", "--strategy", "gpu", "--devices", "cuda:0",
            "--compression", "powersgd:2"]
    straight = two_ranks(mpirun, [*args, "--max-steps", "6", "--run-dir",
                                  str(tmp_path / "straight")], env)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    cut = two_ranks(mpirun, [*args, "--max-steps", "4", "--run-dir", str(tmp_path / "cut")],
                    env)
    assert cut.returncode == 0, cut.stdout + cut.stderr
    resumed = two_ranks(mpirun, ["train", "--resume", str(tmp_path / "cut"), "--max-steps",
                                 "6"], env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    got = torch.load(tmp_path / "cut" / MODEL)
    want = torch.load(tmp_path / "straight" / MODEL)
    assert_close([got[k] for k in want], list(want.values()), GPU_VS_CPU)
    metrics = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert metrics["config"]["compression"] == "powersgd:2"
    assert len(metrics["resumes"]) == 1, metrics["resumes"]


@needs_cuda
@pytest.mark.gpu
def test_powersgd_on_cuda_applies_what_it_applies_on_the_cpu(exact_cuda):
    """PowerSGD's state on the GPU (batched products there, row chunks on the CPU): the
    same approximations to float rounding, step after step, error feedback included."""
    from hybriddl.hosts.powersgd import PowerSGD

    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 3, 11, 11), (64,), (512, 1024), (3, 512), (3,)]
    cpu, cuda = PowerSGD(2), PowerSGD(2)
    for step in range(6):
        gradients = [torch.randn(shape, generator=generator) for shape in shapes]
        on_cpu = cpu.aggregate(gradients, lambda wire: wire)
        on_cuda = cuda.aggregate([g.to("cuda:0") for g in gradients], lambda wire: wire)
        assert all(g.device.type == "cuda" for g in on_cuda)
        for a, b in zip(on_cpu, on_cuda):
            assert torch.allclose(a, b.cpu(), rtol=1e-4, atol=1e-5), step

"""Every local strategy trains exactly the model that sequential SGD trains, and leaves
no worker behind.

The models are the real torchvision feature extractors (so the pipeline cuts them at
the paper's split) with a slim classifier, at small image sizes: a few seconds per test.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import threading
import types

import psutil
import pytest
import torch
from torch import nn

from conftest import hybriddl_env
from hybriddl.errors import TrainingError, UsageError
from hybriddl import strategies
from hybriddl.strategies import (STRATEGIES, HostResources, LocalStrategy, StrategyOptions,
                                 StrategySpec, cpu_strategies, make_strategy)
from hybriddl.step import make_optimizer
from hybriddl.strategies.base import host_gradients, plain_step
from hybriddl.strategies.pipeline import split_stages
from hybriddl.dropout import dropout_keys, key_dropout, sample_keys
from hybriddl.tuning.tuner import enumerate_candidates
from hybriddl.usecases import PIPELINE_SPLITS, build_model

IMAGE_SIZE = {"alexnet": 64, "vgg16": 32}
# VGG16's 13 convolutions at 32 px end on 2x2 maps, where a pre-activation may lie within
# float32 rounding of zero (2.3e-8 before conv 13's ReLU in this seed). Summing a batch in
# other chunks, or a CPU whose oneDNN kernels round otherwise, flips that ReLU: a discrete
# difference no float tolerance bounds (measured on an AMD EPYC Zen 3: every strategy
# 7e-3 from sequential at conv 12's bias, all of them bitwise alike). These tests check the
# strategies' logic, so VGG16 trains in float64, where no ReLU flips (the loss stays
# float32, run_forward's contract: 7e-8 apart at most, within the same 1e-5); AlexNet keeps
# float32 and the oneDNN kernels users run.
DTYPE = {"alexnet": torch.float32, "vgg16": torch.float64}
BATCHES = (5, 2, 7)  # 5 and 7 split unevenly over 2 or 3 workers, 2 leaves a worker idle
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this host")


def slim_model(name: str) -> nn.Module:
    """The torchvision model with its features intact and a small classifier, with the
    models' default dropout (keyed by sample, so every strategy draws the same masks)."""
    torch.manual_seed(0)
    model = build_model(name, 3)
    channels = model.features[-3].out_channels
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(channels, 32),
                                     nn.ReLU(inplace=True), nn.Linear(32, 3))
    return key_dropout(model).to(DTYPE[name])


def batches(model_name: str):
    generator = torch.Generator().manual_seed(1)
    size = IMAGE_SIZE[model_name]
    return [(torch.randn(n, 3, size, size, generator=generator).to(DTYPE[model_name]),
             torch.randint(3, (n,), generator=generator)) for n in BATCHES]


def train(strategy: str, options: StrategyOptions, model_name: str) -> list[torch.Tensor]:
    """Parameters after len(BATCHES) SGD steps (lr 0.01 so that they move measurably)."""
    threads = torch.get_num_threads()
    model = slim_model(model_name)
    try:
        with make_strategy(strategy, options) as local:
            local.setup(model)
            optimizer = make_optimizer(model.parameters(), 0.01, 0.9)
            first = 0
            for x, y in batches(model_name):
                optimizer.zero_grad(set_to_none=False)
                with dropout_keys(sample_keys(7, 0, torch.arange(first, first + len(y)))):
                    stats = host_gradients(local, x, y)
                first += len(y)
                assert stats.samples == len(y)
                optimizer.step()
                local.after_step()
    finally:
        torch.set_num_threads(threads)
    return [p.detach().cpu().clone() for p in model.parameters()]


@functools.cache
def sequential_parameters(model_name: str) -> list[torch.Tensor]:
    return train("sequential", StrategyOptions(), model_name)


def assert_matches_sequential(strategy: str, options: StrategyOptions, model_name: str) -> None:
    assert_same_parameters(train(strategy, options, model_name), sequential_parameters(model_name))


def assert_same_parameters(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        scale = e.abs().max().item()
        assert (a - e).abs().max().item() <= 1e-5 * scale, f"parameter {i} differs"


def test_training_moves_the_parameters():
    """Every parameter tensor moves by 10x the tolerance of the equivalence tests or more,
    so they could not pass by comparing two barely trained models."""
    before = [p.detach().clone() for p in slim_model("alexnet").parameters()]
    after = sequential_parameters("alexnet")
    moved = min(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(after, before))
    assert moved > 1e-4


# The registry's strategies with K local workers on CPU cores.
CPU_WORKERS = [name for name in cpu_strategies() if STRATEGIES[name].example_options.workers]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("strategy", CPU_WORKERS)
def test_cpu_strategy_matches_sequential(strategy, workers):
    options = StrategyOptions(workers=workers, oversubscribe=True)
    assert_matches_sequential(strategy, options, "alexnet")


@pytest.mark.slow
def test_threads_matches_sequential_on_vgg16():
    options = StrategyOptions(workers=2, oversubscribe=True)
    assert_matches_sequential("threads", options, "vgg16")


@pytest.mark.slow
def test_processes_matches_sequential_on_vgg16():
    options = StrategyOptions(workers=2, oversubscribe=True)
    assert_matches_sequential("processes", options, "vgg16")


@pytest.mark.parametrize("model_name", ["alexnet", pytest.param("vgg16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_pipeline_matches_sequential_on_cpu(model_name, micro_batches):
    options = StrategyOptions(micro_batches=micro_batches, devices=("cpu", "cpu"))
    assert_matches_sequential("pipeline", options, model_name)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu"), ("cpu", "cpu", "cpu")])
def test_gpu_threads_matches_sequential_on_cpu(devices):
    options = StrategyOptions(devices=devices)
    assert_matches_sequential("gpu-threads", options, "alexnet")


# The GPU equivalence tests (the same device within 1e-5, the CPU baseline within a
# stated tolerance): tests/test_gpu.py.


@pytest.mark.parametrize(("name", "convolutions"), [("alexnet", 4), ("vgg16", 8)])
def test_pipeline_cuts_after_the_papers_convolution(name, convolutions):
    model = build_model(name, 3)
    cut = PIPELINE_SPLITS[name]
    convs = [i for i, m in enumerate(model.features) if isinstance(m, nn.Conv2d)]
    assert convs[convolutions - 1] == cut - 2
    assert isinstance(model.features[cut - 1], nn.ReLU)
    first, second = split_stages(model)
    assert sum(isinstance(m, nn.Conv2d) for m in first.modules()) == convolutions
    staged = {id(p) for stage in (first, second) for p in stage.parameters()}
    assert staged == {id(p) for p in model.parameters()}


def test_pipeline_refuses_models_without_a_split():
    with make_strategy("pipeline", StrategyOptions(devices=("cpu", "cpu"))) as local:
        with pytest.raises(UsageError, match="alexnet and vgg16"):
            local.setup(build_model("resnet18", 3))


@pytest.mark.parametrize(("strategy", "options", "message"), [
    ("threads", StrategyOptions(workers=0), "at least 1"),
    ("processes", StrategyOptions(workers=os.cpu_count() + 1), "--oversubscribe"),
    ("intraop", StrategyOptions(workers=-2), "at least 1"),
    ("pipeline", StrategyOptions(devices=("cpu",)), "two devices"),
    ("pipeline", StrategyOptions(devices=("cpu", "cpu"), micro_batches=0), "--micro-batches"),
    ("gpu-threads", StrategyOptions(devices=("tpu:0",)), "unknown device"),
])
def test_infeasible_strategies_are_refused_before_starting(strategy, options, message):
    with pytest.raises(UsageError, match=message):
        make_strategy(strategy, options)


@pytest.mark.skipif(CUDA, reason="this host has CUDA")
@pytest.mark.parametrize("strategy", [name for name, cls in STRATEGIES.items() if cls.needs_gpu])
def test_gpu_strategies_need_cuda(strategy):
    with pytest.raises(UsageError, match="no CUDA device"):
        make_strategy(strategy, StrategyOptions())


def local_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hybriddl-")]


def child_pids() -> set[int]:
    """This process's children, but multiprocessing's resource tracker: the first worker
    process started in a test session starts it, and it stays for the session."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in command_line(p)}


@pytest.mark.parametrize("strategy, options", [
    ("threads", StrategyOptions(workers=3, oversubscribe=True)),
    ("processes", StrategyOptions(workers=3, oversubscribe=True)),
    ("pipeline", StrategyOptions(devices=("cpu", "cpu"), micro_batches=2)),
    ("gpu-threads", StrategyOptions(devices=("cpu", "cpu"))),
])
@pytest.mark.parametrize("failing", [False, True])
def test_no_local_worker_outlives_close(strategy, options, failing):
    """Neither after a normal end nor after an error inside a step (a label out of range
    in the last sample, which a local worker computes)."""
    before = child_pids()
    model = slim_model("alexnet")
    x, y = batches("alexnet")[2]
    if failing:
        y = y.clone()
        y[-1] = 99
    threads = torch.get_num_threads()
    try:
        with make_strategy(strategy, options) as local:
            local.setup(model)
            if failing:
                with pytest.raises((TrainingError, IndexError, RuntimeError)):
                    local.compute_gradients(x, y)
            else:
                local.compute_gradients(x, y)
            assert local_threads() or child_pids() - before  # there were workers to stop
    finally:
        torch.set_num_threads(threads)
    assert local_threads() == []
    assert child_pids() == before


def command_line(process: psutil.Process) -> str:
    """A child's command line; "" for one that ended (or is a zombie) while we looked."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def start_cli_training(tmp_path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A `train --strategy processes` child, once its two local workers are running. The
    model is small: what is tested is the workers' end, and a stop's checkpoint of VGG16
    (1 GB with its momentum) only made the master take longer to get there."""
    command = [sys.executable, "-m", "hybriddl", "train", "--strategy", "processes",
               "--workers", "3", "--oversubscribe", "--usecase", "ComplexSmall",
               "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "6",
               # Epochs enough that the signal finds it training: the small model's
               # default 3 epochs can end before the workers are even counted.
               "--epochs", "1000", "--run-dir", str(tmp_path / "run")]
    master = subprocess.Popen(command, env=hybriddl_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(master.pid)
    for _ in range(600):  # waits for a condition, at most a minute; no timing is asserted
        workers = [p for p in parent.children(recursive=True)
                   if "multiprocessing" in command_line(p)
                   and "resource_tracker" not in command_line(p)]  # workers only
        if len(workers) == 2 or master.poll() is not None:
            break
        psutil.wait_procs([parent], timeout=0.1)
    assert len(workers) == 2, master.communicate()[1]
    return master, workers


@pytest.mark.slow
def test_ctrl_c_of_a_cli_run_leaves_no_worker(tmp_path):
    master, workers = start_cli_training(tmp_path)
    master.send_signal(signal.SIGINT)
    _, stderr = master.communicate(timeout=120)
    assert master.returncode != 0
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == [], stderr


@pytest.mark.slow
def test_workers_die_with_a_killed_master(tmp_path):
    master, workers = start_cli_training(tmp_path)
    master.kill()
    master.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=60)
    assert alive == []


@pytest.mark.parametrize("flags", [
    ("--strategy", "threads", "--workers", "0"),
    ("--strategy", "processes", "--workers", str(os.cpu_count() + 1)),
    ("--strategy", "pipeline", "--devices", "cpu,quantum:3"),
])
def test_infeasible_strategy_is_one_line_and_exit_2(cli_here, tmp_path, flags):
    done = cli_here("train", "--image-size", "32", "--run-dir", str(tmp_path / "run"), *flags)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()


def registered_cases(**numerics) -> list:
    """(name, options) for every registered strategy at its example options (with
    `numerics` replaced): what each strategy's equivalence test runs at."""
    return [pytest.param(name, dataclasses.replace(cls.example_options, **numerics), id=name)
            for name, cls in STRATEGIES.items()]


def assert_matches_sequential_here(name: str, options: StrategyOptions) -> None:
    reason = STRATEGIES[name].unavailable_here(options)
    if reason:
        pytest.skip(f"{name} cannot run on this host: {reason}")
    assert_matches_sequential(name, options, "alexnet")


@pytest.mark.parametrize(("name", "options"), registered_cases())
def test_every_registered_strategy_matches_sequential(name, options):
    assert_matches_sequential_here(name, options)


@pytest.mark.parametrize(("name", "options"), [
    *registered_cases(accumulate=2),
    pytest.param("sequential", StrategyOptions(accumulate=3), id="sequential-3"),  # chunks 2,2,1 and 3,2,2
    pytest.param("threads", StrategyOptions(workers=2, oversubscribe=True, accumulate=3),
                 id="threads-3"),
])
def test_accumulated_gradients_match_sequential(name, options):
    """Gradient accumulation computes the same step, uneven chunks and dropout included."""
    assert_matches_sequential_here(name, options)


class Toy(LocalStrategy):
    """A strategy a newcomer might add: the plain loop under another name."""

    name = "toy"
    summary = "the plain loop, registered by a test"

    @classmethod
    def tuning_candidates(cls, host, batch_size):
        return [StrategySpec(cls.name)]

    def compute_gradients(self, x, y):
        return plain_step(self.model, x, y, self.options)


@pytest.fixture
def registry():
    """The registry as it was, back after the test."""
    saved = dict(STRATEGIES)
    yield STRATEGIES
    STRATEGIES.clear()
    STRATEGIES.update(saved)


def test_a_registered_strategy_is_enumerated_everywhere(registry):
    """Registering is all it takes: the equivalence cases, the command line's list and the
    tuner's candidates pick a new strategy up, and it trains as sequential SGD does."""
    strategies.register(Toy)
    assert "toy" in [case.values[0] for case in registered_cases()]
    assert ("toy", Toy.summary) in strategies.strategy_summaries()
    assert "toy" in strategies.cpu_strategies()
    assert StrategySpec("toy") in enumerate_candidates(HostResources(cores=2), 4)
    assert StrategySpec("toy").infeasibility() is None
    assert_matches_sequential_here("toy", Toy.example_options)


def test_the_command_line_lists_every_strategy_in_one_line_each():
    summaries = strategies.strategy_summaries()
    assert [name for name, _ in summaries] == list(STRATEGIES)
    assert all(summary and "\n" not in summary and len(summary) < 90 for _, summary in summaries)


def test_a_strategy_without_a_summary_is_not_registered(registry):
    with pytest.raises(ValueError, match="one-line summary"):
        strategies.register(type("Unsaid", (Toy,), {"summary": ""}))


def test_registering_a_second_strategy_under_a_taken_name_is_refused(registry):
    taken = type("Impostor", (Toy,), {"name": "sequential"})
    with pytest.raises(ValueError, match="registered already"):
        strategies.register(taken)


def test_accumulation_runs_the_model_on_chunks():
    """The memory it saves is real: no forward pass sees more than a chunk of the batch."""
    seen = []
    model = slim_model("alexnet")
    model.features.register_forward_hook(lambda module, args, out: seen.append(len(args[0])))
    with make_strategy("sequential", StrategyOptions(accumulate=3)) as local:
        local.setup(model)
        x, y = batches("alexnet")[2]  # 7 samples
        stats = host_gradients(local, x, y)
    assert seen == [3, 2, 2]
    assert stats.samples == 7 and stats.extra["chunks"] == 3
    assert local.writes_gradients_once is False  # .grad is final only after the last chunk
    assert local.describe()["accumulate"] == 3


def test_accumulate_below_one_is_refused():
    with pytest.raises(UsageError, match="--accumulate 0: give at least 1"):
        make_strategy("sequential", StrategyOptions(accumulate=0))


def test_every_strategy_module_registers_its_strategy():
    """A strategy class defined in strategies/ but left out of the registry is a mistake."""
    defined = set()
    for module in pkgutil.iter_modules(strategies.__path__):
        loaded = importlib.import_module(f"hybriddl.strategies.{module.name}")
        defined |= {cls for cls in vars(loaded).values()
                    if isinstance(cls, type) and issubclass(cls, LocalStrategy)
                    and cls.__module__ == loaded.__name__ and cls.name}
    assert defined and defined == set(STRATEGIES.values())


def test_processes_refuse_a_too_small_shared_memory(monkeypatch, tmp_path):
    from hybriddl.strategies import processes

    one_mib_free = types.SimpleNamespace(total=2**20, used=0, free=2**20)
    monkeypatch.setattr(processes.shutil, "disk_usage", lambda path: one_mib_free)
    before = child_pids()
    with make_strategy("processes", StrategyOptions(workers=2, oversubscribe=True)) as local:
        with pytest.raises(UsageError, match="shared memory"):
            local.setup(slim_model("alexnet"))
    assert child_pids() == before


def test_processes_workers_outlast_a_schedulers_sigterm_and_name_their_failures(tmp_path):
    """scancel and a SLURM time limit signal the whole process group: the master stops at
    the step's end and ends its workers, which must live that long. A worker's failure
    is one line; a worker killed between steps is named, not a broken pipe."""
    model = slim_model("alexnet")
    x, y = batches("alexnet")[0]
    def keys():
        return dropout_keys(sample_keys(7, 0, torch.arange(len(y))))
    with make_strategy("processes", StrategyOptions(workers=3, oversubscribe=True)) as local:
        local.setup(model)
        first, second = local.processes
        os.kill(first.pid, signal.SIGTERM)
        first.join(timeout=2)  # it is not to end: a dead worker ends at once
        assert first.is_alive()
        with keys():
            assert local.compute_gradients(x, y).samples == len(y)
        local.connections[0].send(("step", 0, 1, 1, ["not a key"]))  # its own error
        failure = local._reply(1, "done")
        assert isinstance(failure, TrainingError) and "\n" not in str(failure)
        assert str(failure).startswith("local worker process 1 failed: ValueError: "), failure
        second.kill()
        second.join(timeout=30)
        with keys(), pytest.raises(TrainingError,
                                 match=r"local worker process 2 died \(exit code -9\)"):
            local.compute_gradients(x, y)

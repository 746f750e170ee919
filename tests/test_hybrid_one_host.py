"""The classifier split across hosts (--host-parallel hybrid) on one host: how the classifier
is split, which models and local strategies can run it, and, in a child process, that it
trains exactly what sequential SGD on the global batch trains with every local strategy that
can run the convolutions alone (with keyed dropout and --accumulate); the planner's
prediction and probes. Across hosts: tests/test_hybrid.py (these run beside other tests,
before any test alone begins, in a module that holds no hosts)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import hybriddl_env
from sample_data import write_saturated_classes
from hybriddl.hosts.cluster import SingleHost
from hybriddl.hybrid.classifier import NotSplittable, plan, split_classifier
from hybriddl.hybrid.parallel import DataParallel, HybridParallel, choose, traffic_bytes
from hybriddl.rundir import METRICS, MODEL
from hybriddl.strategies import STRATEGIES, StrategyOptions, make_strategy
from hybriddl.errors import UsageError
from hybriddl.usecases import build_model

# AlexNet: the smallest torchvision model made of features -> avgpool -> classifier without
# batch normalisation (whose statistics would differ with the host's share), with the
# default dropout of its classifier.
TRAIN = ["train", "--model", "alexnet", "--image-size", "64", "--batch-size", "8",
         "--epochs", "1", "--monitor-interval", "0"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """3 classes x 8 images: batches of 8, 8 and a short last one."""
    return write_saturated_classes(tmp_path_factory.mktemp("images"), seed=2)


def train(run_dir: Path, *args: str, images: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybriddl", *TRAIN, "--data", str(images),
                           "--run-dir", str(run_dir), *args], capture_output=True, text=True,
                          timeout=300, env=hybriddl_env())


@pytest.fixture(scope="module")
def sequential(images, tmp_path_factory) -> Path:
    """The sequential run every hybrid run must equal. On pytest-xdist's workers it is
    trained once for the whole test run, by the first module to ask (the workers' folders
    share a parent), so that tests/test_hybrid.py's tests, which run alone, find it made by
    this module's, which run beside others; `images` are the same bytes on every worker."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "hybrid-sequential"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("sequential")
    run_dir = folder / "run"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run_dir / MODEL).exists():
            done = train(run_dir, "--strategy", "sequential", "--host-parallel", "data",
                         images=images)
            assert done.returncode == 0, done.stderr
    return run_dir


def assert_same_model(run_dir: Path, reference: Path, rtol: float = 1e-5) -> None:
    got, want = torch.load(run_dir / MODEL), torch.load(reference / MODEL)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        scale = want[name].abs().max().clamp_min(1e-12)
        error = float((got[name] - want[name]).abs().max() / scale)
        assert error <= rtol, f"{name}: relative difference {error:.2e}"


def metrics_of(run_dir: Path) -> dict:
    return json.loads((run_dir / METRICS).read_text())


# --------------------------------------------------------------------------- the split

def test_alexnet_and_vgg16_classifiers_split_column_then_row_then_replicated():
    for name in ("alexnet", "vgg16"):
        with torch.device("meta"):
            model = build_model(name, 3)
        assert [s.kind for s in plan(model.classifier)] == ["column", "row", "replicated"]


def test_a_split_host_holds_its_slice_of_the_classifier():
    model = build_model("alexnet", 3)
    whole = {k: v.clone() for k, v in model.state_dict().items()}

    class ThirdHost(SingleHost):
        rank, size = 2, 3
    split = split_classifier(model, ThirdHost())
    held = model.state_dict()
    # 4096 outputs over 3 hosts: 1366, 1365, 1365; the third holds [2731, 4096).
    assert held["classifier.1.weight"].shape == (1365, 9216)
    assert torch.equal(held["classifier.1.weight"], whole["classifier.1.weight"][2731:])
    assert torch.equal(held["classifier.4.weight"], whole["classifier.4.weight"][:, 2731:])
    assert torch.equal(held["classifier.4.bias"], whole["classifier.4.bias"])
    assert torch.equal(held["classifier.6.weight"], whole["classifier.6.weight"])
    assert split.parameter_slices(model)["classifier.1.weight"] == (0, 4096, 2731, 4096)
    linear = sum(whole[k].numel() for k in whole if k.startswith("classifier."))
    kept = sum(held[k].numel() for k in held if k.startswith("classifier."))
    # Memory: a third of the split layers, the replicated 4096 x 3 layer and bias whole.
    assert kept < linear / 3 + 4096 * 4 + 4


@pytest.mark.parametrize("rate, shared", [(1e12, True), (1e3, False)])
def test_split_hosts_share_validation_only_where_the_convolutions_outlast_the_features(rate,
                                                                                     shared):
    """A sample's convolutions (AlexNet at 64 px: 0.35 ms on one core here) against its
    9216 x 4 bytes of features on the link: 37 ns at 1 TB/s, 37 s at 1 kB/s. Settled once,
    at the first validation, the same on every host (the slowest host's time)."""
    class SecondHost(SingleHost):
        rank, size, time_scale = 1, 2, 1.0

        def allgather(self, value):
            return [value, value]
    model, strategy, hosts = build_model("alexnet", 3), make_strategy("sequential"), SecondHost()
    scheme = HybridParallel()
    scheme.setup(model, strategy, hosts)
    scheme.plan = {"inputs": {"link_bytes_per_second": rate}}
    timed = []

    def sample():
        timed.append(1)
        return torch.randn(4, 3, 64, 64)
    assert (scheme.validation_logits(strategy, sample) is not None) is shared
    assert (scheme.validation_logits(strategy, sample) is not None) is shared
    assert timed == [1] and scheme.validation_shared is shared
    # Without a measured link (one host's plan), nothing is shared and nothing timed.
    alone = HybridParallel()
    alone.setup(build_model("alexnet", 3), make_strategy("sequential"), SecondHost())
    assert alone.validation_logits(strategy, sample) is None and timed == [1]


def test_models_without_a_splittable_classifier_get_data_with_the_reason():
    model = build_model("squeezenet1_1", 3)
    scheme = choose("hybrid", model, make_strategy("sequential"), SingleHost(), 8, 32, None)
    assert isinstance(scheme, DataParallel) and not isinstance(scheme, HybridParallel)
    assert "hybrid cannot split SqueezeNet" in scheme.reason
    with pytest.raises(NotSplittable):
        plan(torch.nn.Sequential(torch.nn.Linear(4, 3)))


def test_a_strategy_that_cannot_run_the_convolutions_alone_is_refused_for_hybrid():
    model = build_model("alexnet", 3)
    strategy = make_strategy("threads", StrategyOptions(workers=1))
    with pytest.raises(UsageError, match="cannot run the convolutions apart"):
        choose("hybrid", model, strategy, SingleHost(), 8, 64, None)
    # auto falls back to data with the reason instead.
    assert choose("auto", model, strategy, SingleHost(), 8, 64, None).name == "data"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_split_layer_s_weight_gradient_computed_after_its_input_s_is_autograd_s(kind,
                                                                                 precision):
    """Hybrid's step returns the features' gradient before the split linear layers' weight
    gradients are computed (that crosses the wire meanwhile, and the last chunk's wait for
    the convolutions' gradients): the same bits as one backward. The first layer is
    column-split (weight and bias deferred), the second row-split (its weight deferred; its
    replicated bias, added after the sum over hosts, autograd's)."""
    from hybriddl.hybrid.classifier import ColumnLinear, GatherRows, ReturnedGradient, RowLinear
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 10)
    if kind == "column":
        once, deferred = ColumnLinear(linear, 2, 8), ColumnLinear(linear, 2, 8)
        width, out_width = 24, 6
    else:
        once, deferred = RowLinear(linear, 2, 8, SingleHost()), RowLinear(linear, 2, 8,
                                                                           SingleHost())
        width, out_width = 6, 10
    rows, tags, upstream = torch.randn(5, width), torch.zeros(5, 2, dtype=torch.int64), \
        torch.randn(5, out_width)
    bf16 = precision == "bf16"
    grads = []
    for layer, returned in ((once, None), (deferred, ReturnedGradient())):
        local = rows.clone().requires_grad_()
        whole, _ = GatherRows.apply(local, SingleHost(), [5], tags, None, returned)
        if returned is not None:
            layer.defer_weight_gradients()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = layer(whole)
        (out.float() * upstream).sum().backward()
        if returned is None:
            grads.append(local.grad)
            continue
        assert layer.weight.grad is None and local.grad is None  # nothing yet: deferred
        layer.weight_gradients()
        grads.append(returned.result())
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(once.weight.grad, deferred.weight.grad)
    assert torch.equal(once.bias.grad, deferred.bias.grad)  # the row layer's: not doubled
    assert deferred.deferred is None  # the next backward computes them itself again


def test_traffic_theory_is_design_md_s():
    with torch.device("meta"):
        alexnet, vgg16 = build_model("alexnet", 3), build_model("vgg16", 3)
    for model, convolutions, features in ((alexnet, 9.9e6, 9216), (vgg16, 58.9e6, 25088)):
        bytes_ = traffic_bytes(model, hosts=2, global_batch=64)
        # 2(H-1)/H = 1 at H = 2: the convolutions' gradient once, the features there and back.
        assert bytes_["hybrid_convolutions"] == pytest.approx(convolutions, rel=0.02)
        assert bytes_["hybrid_activations"] == 64 * (features + 4096) * 4
        assert bytes_["hybrid"] < bytes_["data"] / 5


# --------------------------------------------------------------------------- one host

CAN_RUN_ALONE = [name for name, cls in STRATEGIES.items() if cls.runs_convolutions_alone]


def feasible(name: str) -> bool:
    return why_not(name) is None


def why_not(name: str) -> str | None:
    try:
        STRATEGIES[name].check_feasible(StrategyOptions(workers=2, oversubscribe=True))
        return None
    except UsageError as exc:
        return str(exc)


@pytest.mark.parametrize("name", CAN_RUN_ALONE)
@pytest.mark.slow
def test_hybrid_on_one_host_matches_sequential_for_every_strategy_that_can_run_it(
        name, images, sequential, tmp_path):
    if not feasible(name):
        pytest.skip(f"strategy {name!r} cannot run on this host: {why_not(name)}")
    workers = STRATEGIES[name].example_options.workers
    options = ["--workers", str(workers), "--oversubscribe"] if workers else []
    done = train(tmp_path / "run", "--strategy", name, *options, "--host-parallel", "hybrid",
                 "--accumulate", "2", images=images)
    assert done.returncode == 0, done.stderr
    assert_same_model(tmp_path / "run", sequential)
    assert metrics_of(tmp_path / "run")["config"]["host_parallel"]["scheme"] == "hybrid"


def test_hybrid_with_a_strategy_that_cannot_is_one_line_exit_2(images, tmp_path):
    done = train(tmp_path / "run", "--strategy", "threads", "--workers", "2", "--oversubscribe",
                 "--host-parallel", "hybrid", images=images)
    assert done.returncode == 2
    assert "cannot run the convolutions apart from the classifier" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


def test_auto_predicts_compute_plus_bytes_over_the_link():
    """AlexNet's bytes at 2 hosts, a 1 s step: the hybrid's fewer bytes win at 1 Gbit/s;
    the reason gives the predicted step and its parts (the planner's: tests/test_planner.py)."""
    from hybriddl.hybrid.planner import Link, ModelShapes, make_plan
    with torch.device("meta"):
        shapes = ModelShapes.of(build_model("alexnet", 3))
    plan = make_plan(shapes, 2, 32, 1.0, Link(1e9 / 8))
    assert plan.chosen.host_parallel == "hybrid" and plan.chosen.exact
    # 1.000 + 0.093 of wire, 0.084 of it (the convolutions' gradients and the features'
    # gradient, 10.5 MB) beside the compute.
    assert "predicted step 1.009 s (compute 1.000 + wire 0.093" in plan.reason
    steps = {row.scheme.label: row.step_seconds for row in plan.rows}
    assert steps["data"] == pytest.approx(1.0 + 228_064_524 / (1e9 / 8))


def test_the_compute_probe_leaves_the_model_as_it_was():
    from hybriddl.hybrid.parallel import probe_compute
    from hybriddl.usecases import build_model
    torch.manual_seed(0)
    model = build_model("alexnet", 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    random_state = torch.get_rng_state()
    assert probe_compute(model, 2, 64) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), random_state)


def test_the_convolutions_go_in_one_bucket_where_backward_hides_little_of_the_wire():
    """About a layer a bucket where backward hides a good part of the exchange (S = 1 at
    1 Gbit/s: 58 % of the wire); one bucket where it hides almost none (hosts far faster
    than their link), as each bucket is an allreduce of its own."""
    from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES
    from hybriddl.hybrid.parallel import CONVOLUTION_BUCKET_BYTES, convolution_bucket_bytes

    def plan(hidden, wire):
        row = {"scheme": "hybrid", "wire_seconds": wire, "overlap_seconds": hidden}
        return {"rows": [{**row, "scheme": "data", "overlap_seconds": 0.0}, row],
                "chosen": {"scheme": "hybrid"}}

    assert convolution_bucket_bytes(plan(0.058, 0.100)) == CONVOLUTION_BUCKET_BYTES
    assert convolution_bucket_bytes(plan(0.0003, 0.101)) == DEFAULT_BUCKET_BYTES
    # No plan (one host, or a scheme made outside `choose`): the buckets of about a layer.
    assert convolution_bucket_bytes(None) == CONVOLUTION_BUCKET_BYTES
    assert convolution_bucket_bytes({"rows": [], "chosen": {"scheme": "data"}}) == \
        CONVOLUTION_BUCKET_BYTES


def test_the_replica_check_covers_the_classifier_tensors_no_host_slices():
    """The replicated last layer and a row split's bias are whole on every host and updated
    there from every host's features, never averaged: hosts whose arithmetic rounds
    differently drift there, and the check looked at the convolutions only."""
    class SecondHost(SingleHost):
        rank, size = 1, 2

    model = build_model("alexnet", 3)
    scheme = HybridParallel()
    scheme.setup(model, make_strategy("sequential"), SecondHost())
    names = [name for name, _ in scheme.replicated(model)]
    assert "features.0.weight" in names
    assert {"classifier.4.bias", "classifier.6.weight", "classifier.6.bias"} <= set(names)
    assert not {"classifier.1.weight", "classifier.1.bias", "classifier.4.weight"} & set(names)
    # Checked, not averaged: each host updates them itself, after its own gradient.
    classifier = {id(p) for p in model.classifier.parameters()}
    assert classifier <= scheme.local.parameters


def test_batchnorm_running_statistics_are_averaged_before_validation_not_named_drift():
    """Each host updates BatchNorm's running statistics from its own rows: the replica
    check named the hosts as differing at every check (and a strict run stopped at its
    first) on any BatchNorm model across hosts. They are each host's own between
    validations, and averaged over the hosts before each."""
    from hybriddl.hybrid.parallel import running_statistics

    class TwoHosts(SingleHost):
        rank, size = 0, 2

        def allreduce_sum(self, tensor, what=""):  # the other host's statistics are 3 more
            self.what = what
            return tensor + (tensor + 3)

    model = build_model("resnet18", 3)
    names = [name for name, _ in DataParallel().replicated(model)]
    assert "bn1.weight" in names and "bn1.num_batches_tracked" in names
    assert not [name for name in names if "running_" in name]
    statistics = running_statistics(model)
    assert len(statistics) == 2 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    before = [t.clone() for t in statistics]
    hosts = TwoHosts()
    DataParallel().average_statistics(model, hosts)
    assert all(torch.allclose(t, b + 1.5) for t, b in zip(statistics, before))
    assert hosts.what == "averaging the hosts' running statistics"
    DataParallel().average_statistics(model, SingleHost())  # one host: nothing to average
    assert all(torch.allclose(t, b + 1.5) for t, b in zip(statistics, before))


def test_where_every_host_validates_every_row_rank_0s_count_decides_for_all():
    """The hybrid scheme where sharing validation does not pay: every host takes every row
    and kept its own count, so under --stop-at-target a host whose replicated last layer
    differed by an ulp could stop alone while the others trained on (a hang)."""
    from hybriddl.data import ImageSet
    from hybriddl.run.trainer import evaluate

    class SecondOfTwo(SingleHost):
        rank, size = 1, 2

        def allgather(self, value):
            self.gathered = value
            return [3, value]  # rank 0 counted 3 of the 4 right

    class NotShared(DataParallel):
        def validation_logits(self, strategy, sample):
            return None

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
    with make_strategy("sequential") as strategy:
        strategy.setup(model)
        images = ImageSet(torch.zeros(4, 3, 2, 2, dtype=torch.uint8),
                          torch.tensor([0, 1, 0, 1]), ["a", "b"])
        hosts = SecondOfTwo()
        accuracy, shared_by = evaluate(strategy, images, lambda x: x.float(), 2, hosts,
                                       NotShared())
    assert (accuracy, shared_by) == (0.75, 1) and hosts.gathered == 2  # its own: half right

"""How hosts divide the work of a step (`--host-parallel`): the two schemes and the choice.

- `DataParallel` ("data"): every host holds the whole model, computes the gradient of its
  share with its local strategy, and the hosts average the whole gradient (the paper's
  design, Horovod's model).
- `HybridParallel` ("hybrid"): the convolutions stay data-parallel, and only their
  gradients are averaged; the classifier's linear layers are split across hosts
  (hybriddl.hybrid.classifier), so each host holds and updates 1/H of them.

Both leave every host with what sequential SGD on the global batch has: the same update
of the same (whole, or sliced) parameters. Checkpoints and model.pt stay the whole
torchvision state_dict in both (`model_state`, `optimizer_state`), so a run resumes on
another host count and in the other scheme.

`choose` settles "auto" (--host-parallel, --compression, --feature-dtype) from each scheme's
predicted step (hybrid/planner.py): the profile's compute (or, without a profile, a forward
and backward timed once on a copy of the model), the bytes each scheme sends over the link
rate, and the latency rounds, that the hosts measured at start.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from hybriddl.data.sharding import split_bounds, split_counts
from hybriddl.dropout import current_keys, dropout_keys
from hybriddl.errors import UsageError
from hybriddl.hosts.compression import AUTO, EXACT
from hybriddl.hosts.fusion import DEFAULT_BUCKET_BYTES
from hybriddl.hybrid.classifier import (DeferredWeightGradients, GatherRows, NotSplittable,
                                        ReturnedGradient, SplitClassifier, plan, slice_counts,
                                        split_classifier)
from hybriddl.machine.cpu_threads import torch_threads
from hybriddl.hybrid.planner import (EXACT_FEATURES, FEATURE_DTYPES, HostCosts, Link,
                                     ModelShapes, make_plan, one_host_plan)
from hybriddl.strategies import LocalStrategy, StepStats
from hybriddl.strategies.base import LocalUpdate, cut_computes_model, host_gradients, run_forward, \
    split_at_classifier

HOST_PARALLEL = ("auto", "data", "hybrid")
# Hybrid's convolution buckets: about one layer each (AlexNet's are 0.1-3.5 MB, VGG16's up
# to 9.4 MB), so a layer's gradient leaves as soon as its backward has written it and only
# the first layers' (AlexNet: 1.3 MB) remain when backward ends; the small first layers
# share one bucket.
CONVOLUTION_BUCKET_BYTES = 2**20
# Where the plan credits backward with hiding less than this share of the step's wire time
# (hosts far faster than their link), the convolutions' gradient goes in one bucket: each
# bucket is an allreduce of its own, and small ones then only add messages. Measured at
# S = 200 (AlexNet, 2 emulated hosts x 1 core, 1 Gbit/s; scripts/planner_check.py): 0.1205 s
# a step with the 1 MiB buckets (steps 0.115-0.124), 0.1139 s with one (0.113-0.115); at
# S = 1 the plan credits 58 % of the wire and the buckets stay.
ONE_BUCKET_BELOW_HIDDEN_SHARE = 0.1


def running_statistics(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running means and variances, which each host updates from its own rows."""
    return [buffer for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
            for buffer in (module.running_mean, module.running_var) if buffer is not None]


class DataParallel:
    """The whole model on every host; the whole gradient averaged."""

    name = "data"
    # Settled by `choose` with the planner (hybrid/planner.py): its record, the gradients'
    # compression and (hybrid) the features' wire dtype.
    plan: dict | None = None
    compression = EXACT
    feature_dtype = EXACT_FEATURES
    # A compressed run resumed on fewer hosts goes on as the logical ranks it started on
    # (each host computes its ranks' rows in turn, run/trainer.py `logical_gradients`).
    runs_logical_ranks = True

    def __init__(self, reason: str = ""):
        self.reason = reason

    def setup(self, model: nn.Module, strategy: LocalStrategy, hosts,
              built_from_seed: bool = False) -> None:
        """`built_from_seed`: every host built the model from the run's seed (see
        Hosts.broadcast_parameters)."""
        strategy.setup(model)
        hosts.broadcast_parameters(model, built_from_seed)
        hosts.attach(model, gradient_hooks=strategy.writes_gradients_once)

    def gradients(self, strategy: LocalStrategy, x, y, share) -> StepStats:
        # A host whose share of a short batch is empty contributes a zero gradient.
        return host_gradients(strategy, x, y) if len(y) else StepStats(0, 0.0)

    def model_state(self, model: nn.Module, hosts) -> dict | None:
        """The whole model's state_dict on rank 0 (None elsewhere); collective."""
        return model.state_dict() if hosts.rank == 0 else None

    def optimizer_state(self, optimizer, model: nn.Module, hosts) -> dict | None:
        return optimizer.state_dict() if hosts.rank == 0 else None

    def local_optimizer_state(self, state: dict, model: nn.Module) -> dict:
        """This host's part of a whole optimizer state_dict (a checkpoint's)."""
        return state

    def replicated(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what every host holds the same of the model: all of it but the
        running statistics (`average_statistics`)."""
        own = {id(t) for t in running_statistics(model)}
        return [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]
                if id(t) not in own]

    def average_statistics(self, model: nn.Module, hosts) -> None:
        """Every host's BatchNorm running statistics (each from its own rows of every batch,
        so never the same across hosts) averaged over the hosts (collective, where the model
        has any): before each validation, so that every host validates the same model and
        rank 0 keeps it. As DDP's broadcast_buffers, but from every host's rows."""
        statistics = running_statistics(model)
        if not statistics or hosts.size == 1:
            return
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in statistics])
        mean = hosts.allreduce_sum(flat, "averaging the hosts' running statistics") / hosts.size
        offset = 0
        with torch.no_grad():
            for t in statistics:
                t.copy_(mean[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def validation_logits(self, strategy: LocalStrategy, sample: Callable[[], torch.Tensor]):
        """How a host takes its rows of each validation batch (run/trainer.py `evaluate`):
        `logits(x, counts)` gives the logits of `x`, this host's rows, where every host
        takes its `counts` share; None: every host takes every row. With the whole model on
        every host, its rows through it."""
        def logits(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
            return strategy.evaluate(x) if len(x) else torch.zeros((0, 1))
        return logits

    def describe(self, model: nn.Module | None = None) -> dict:
        return {"scheme": self.name, "reason": self.reason, "compression": self.compression}


class HybridParallel(DataParallel):
    """Convolutions data-parallel, the classifier's linear layers split across hosts."""

    name = "hybrid"
    # The classifier's slices follow the hosts there are, not the ranks the run started on:
    # resumed on another host count, rank 0 takes the hosts' errors summed
    # (resumption.compression_for_host), as a data run that cannot run logical ranks.
    runs_logical_ranks = False

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.split: SplitClassifier | None = None
        self.hosts = None
        self.features_width = 0
        self.validation_shared: bool | None = None  # settled at the first validation

    @staticmethod
    def check(model: nn.Module, strategy: LocalStrategy) -> None:
        """NotSplittable or UsageError, before anything starts, when this cannot run."""
        plan(getattr(model, "classifier", None) or nn.Identity())
        split_at_classifier(model, "--host-parallel hybrid", "use --host-parallel data")
        if not strategy.runs_convolutions_alone:
            from hybriddl.strategies import STRATEGIES
            able = ", ".join(name for name, cls in STRATEGIES.items()
                             if cls.runs_convolutions_alone)
            raise UsageError(f"--host-parallel hybrid: strategy {strategy.name!r} cannot run the "
                             f"convolutions apart from the classifier; use one of {able}, or "
                             "--host-parallel data")

    def setup(self, model: nn.Module, strategy: LocalStrategy, hosts,
              built_from_seed: bool = False) -> None:
        hosts.broadcast_parameters(model, built_from_seed)  # the whole model, before it is cut
        self.hosts = hosts
        self.split = split_classifier(model, hosts)
        self.features_width = next(s.in_features for s in self.split.splits)
        strategy.setup(model)
        convolutions = split_at_classifier(model)[0]
        # The convolutions' gradients leave while their backward still runs, by default
        # where that changes no bit (an exact compression): in buckets small enough that the
        # last layers' leave while the first layers' backward computes. One 9.9 MB bucket
        # (AlexNet's convolutions) left only once backward was done, its 80 ms at 1 Gbit/s
        # all exposed.
        exact = getattr(getattr(hosts, "compression", None), "exact", True)
        self.bucket_bytes = convolution_bucket_bytes(getattr(self, "plan", None))
        hosts.attach(convolutions, gradient_hooks=strategy.writes_gradients_once,
                     overlap=True if exact else None, bucket_bytes=self.bucket_bytes)
        self.classifier = model.classifier
        # The split linear layers, whose weight gradients wait (see `gradients`).
        self.deferring = [layer for layer in self.classifier
                          if isinstance(layer, DeferredWeightGradients)]
        # The classifier's parameters, which no host averages (each holds its own slices;
        # the replicated last layers' gradients are the global mean already): the split
        # layers' last weight gradients, then their update, while the convolutions'
        # gradients cross the wire (step.py `optimizer_step`).
        averaged = {id(tensor) for _, tensor in self._convolutions(model)}
        self.local = LocalUpdate(frozenset(id(p) for p in model.parameters()
                                           if id(p) not in averaged), self.weight_gradients)

    def replicated(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What every host holds the same: the convolutions (averaged) and the classifier's
        tensors no host slices (its replicated last layer, a row split's bias), whose
        gradients each host computes from every host's features, unaveraged: hosts whose
        arithmetic rounds differently (other thread counts, a GPU beside CPUs) drift there."""
        sliced = self.split.parameter_slices(model)
        return [*self._convolutions(model),
                *((name, p) for name, p in model.named_parameters()
                  if name.startswith("classifier.") and name not in sliced)]

    @staticmethod
    def _convolutions(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        convolutions = split_at_classifier(model)[0]
        names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        own = {id(t) for t in running_statistics(model)}
        return [(names.get(id(t), "?"), t)
                for t in [*convolutions.parameters(), *convolutions.buffers()] if id(t) not in own]

    def validation_logits(self, strategy: LocalStrategy, sample: Callable[[], torch.Tensor]):
        """Each host's rows of a validation batch through the convolutions, and every host's
        features through the classifier's slices (collective), where that is faster than
        every host running every row: where a sample's convolutions, timed once on `sample()`
        (the slowest host's), take longer than its features on the link (the plan's measured
        rate). On one core of this project's AMD EPYC, at 10 Gbit/s emulated (395 MB/s
        measured): AlexNet at 64 px 0.35 ms against 37 kB in 0.09 ms; VGG16 at 32 px 2.8 ms
        against 100 kB in 0.25 ms. Hosts 20x faster over 1 Gbit/s would not share."""
        if self.validation_shared is None:
            self.validation_shared = self._sharing_pays(strategy, sample)
        if not self.validation_shared:
            return None
        convolutions, hosts = split_at_classifier(strategy.model)[0], self.hosts

        def logits(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
            with torch.no_grad():
                features = (run_forward(convolutions, x.to(strategy.device), strategy.options)
                            if len(x) else torch.zeros((0, self.features_width)))
                whole = hosts.allgather_rows(to_host(features.float()), counts)
                everyone = run_forward(self.classifier, whole.to(strategy.device),
                                       strategy.options).cpu()
            first = sum(counts[:hosts.rank])
            return everyone[first:first + counts[hosts.rank]]
        return logits

    def _sharing_pays(self, strategy: LocalStrategy, sample: Callable[[], torch.Tensor]) -> bool:
        rate = ((self.plan or {}).get("inputs") or {}).get("link_bytes_per_second")
        if not rate or self.hosts.size == 1:
            return False
        convolutions, sample = split_at_classifier(strategy.model)[0], sample()
        with torch.no_grad():
            strategy.synchronize()
            started = time.perf_counter()
            run_forward(convolutions, sample.to(strategy.device), strategy.options)
            strategy.synchronize()
        # In the time the link's rate is in (emulated hosts: wall seconds / D,
        # emulation/hosts.py).
        seconds = (time.perf_counter() - started) / max(len(sample), 1) \
            / getattr(self.hosts, "time_scale", 1.0)
        return max(self.hosts.allgather(seconds)) > self.features_width * 4 / rate

    def gradients(self, strategy: LocalStrategy, x, y, share) -> StepStats:
        """The step's gradients: the convolutions' host mean (averaged after, as in data)
        and this host's slices of the classifier's global mean, over `accumulate` chunks
        (every host goes through the same number of chunks, empty ones included). The last
        chunk's split-layer weight gradients are left to `self.local`'s `finish`."""
        started = time.perf_counter()
        hosts = self.hosts
        total, mine = share.global_samples, share.samples
        rows = split_counts(total, hosts.weights)
        if rows[hosts.rank] != mine:
            raise RuntimeError(f"host share {mine} is not the split's {rows[hosts.rank]}")
        chunks = strategy.options.accumulate
        bounds = [split_bounds(count, [1.0] * chunks) for count in rows]
        keys = current_keys()
        loss_sum = 0.0
        last = max((k for k in range(chunks) if any(b > a for a, b in (h[k] for h in bounds))),
                   default=-1)
        for k in range(chunks):
            counts = [host_bounds[k][1] - host_bounds[k][0] for host_bounds in bounds]
            if not sum(counts):
                continue
            a, b = bounds[hosts.rank][k]
            if b > a:
                with dropout_keys(keys[a:b] if keys is not None else None):
                    features = strategy.convolutions_forward(x[a:b])
            else:
                features = torch.zeros((0, self.features_width))
            local = to_host(features.float()).requires_grad_()
            # Every sample's label and dropout key travel with its features.
            chunk_keys = keys[a:b] if keys is not None else torch.full((b - a,), -1)
            tags = torch.stack([y[a:b].to(torch.int64), chunk_keys.to(torch.int64)], 1)
            returned = ReturnedGradient()
            whole, everyone = GatherRows.apply(local, hosts, counts, tags, self.wire_dtype,
                                               returned)
            global_keys = everyone[:, 1] if keys is not None else None
            for layer in self.deferring:
                layer.defer_weight_gradients()
            with dropout_keys(global_keys):
                logits = run_forward(self.classifier, whole.to(strategy.device), strategy.options)
            losses = F.cross_entropy(logits, everyone[:, 0].to(logits.device), reduction="none")
            # Backward stops at the features' gradient, whose return it starts, having
            # computed only the split layers' input gradients; their weight gradients are
            # computed while that crosses the wire, but the last chunk's wait for the
            # convolutions' gradients, a longer exchange: they and the classifier's update
            # then run while those cross (`self.local`). Measured, 2 hosts of 1 core side
            # by side, 1 Gbit/s, 2 interleaved rounds (AMD EPYC): the first layer's moved
            # so, a step 14 % shorter for AlexNet (64 px, b32), 7.5 % for VGG16 (32 px,
            # b16); the second's too, AlexNet's 4.7 % shorter again, VGG16's the same; at
            # 10 Gbit/s the same within noise; every loss bit for bit.
            (losses.sum() / total).backward()
            if k != last:
                self.weight_gradients()
            features_grad = returned.result()
            first = sum(counts[:hosts.rank])
            loss_sum += float(losses.detach()[first:first + b - a].sum())
            if b > a:
                # The features' gradient is of the global mean loss; scaled to this host's
                # mean, so the averaging weighs it by mine / total as in data parallelism.
                strategy.convolutions_backward(features_grad * (total / mine))
        return StepStats(mine, loss_sum, time.perf_counter() - started,
                         {"host_parallel": self.name}, local=self.local)

    def weight_gradients(self) -> None:
        """The split layers' deferred weight gradients, into their .grad."""
        for layer in self.deferring:
            layer.weight_gradients()

    # ------------------------------------------------------------------ whole state
    def model_state(self, model: nn.Module, hosts) -> dict | None:
        slices = self.split.parameter_slices(model)
        state = {}
        for name, tensor in model.state_dict().items():
            state[name] = self._gather(tensor, slices[name]) if name in slices else tensor
        return state if hosts.rank == 0 else None

    def optimizer_state(self, optimizer, model: nn.Module, hosts) -> dict | None:
        whole = optimizer.state_dict()
        slices = self.split.parameter_slices(model)
        names = [name for name, _ in model.named_parameters()]
        state = {}
        for index, entry in sorted(whole["state"].items()):
            cut = slices.get(names[index])
            state[index] = {key: self._gather(value, cut)
                            if cut is not None and isinstance(value, torch.Tensor) and value.dim()
                            else value for key, value in entry.items()}
        return {**whole, "state": state} if hosts.rank == 0 else None

    def local_optimizer_state(self, state: dict, model: nn.Module) -> dict:
        slices = self.split.parameter_slices(model)
        names = [name for name, _ in model.named_parameters()]
        local = {}
        for index, entry in state["state"].items():
            cut = slices.get(names[int(index)])
            local[index] = {key: _slice(value, cut)
                            if cut is not None and isinstance(value, torch.Tensor) and value.dim()
                            else value for key, value in entry.items()}
        return {**state, "state": local}

    def _gather(self, tensor: torch.Tensor, cut: tuple[int, int, int, int]) -> torch.Tensor | None:
        dim, width = cut[:2]
        counts = slice_counts(width, self.hosts.size)
        rows = tensor.detach().cpu()
        rows = rows.t().contiguous() if dim == 1 else rows.contiguous()
        whole = self.hosts.gather_rows(rows, counts)
        if whole is None:
            return None
        return whole.t().contiguous() if dim == 1 else whole

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The features' dtype on the wire (--feature-dtype); None: their own, bit for bit."""
        return None if self.feature_dtype == EXACT_FEATURES else FEATURE_DTYPES[self.feature_dtype]

    def describe(self, model: nn.Module | None = None) -> dict:
        record = {"scheme": self.name, "reason": self.reason, "compression": self.compression,
                  "feature_dtype": self.feature_dtype,
                  "convolution_bucket_bytes": getattr(self, "bucket_bytes", None)}
        if self.split is not None:
            record["classifier"] = [{"layer": s.index, "split": s.kind,
                                     "in": s.in_features, "out": s.out_features}
                                    for s in self.split.splits]
        if model is not None:
            record["held_parameter_bytes"] = held_bytes(model)
        return record


def convolution_bucket_bytes(plan: dict | None) -> int:
    """The hybrid's convolution buckets for `plan` (metrics.json's config.plan): about a layer
    each (CONVOLUTION_BUCKET_BYTES), so that they leave during backward; one bucket where the
    plan's chosen row hides less than ONE_BUCKET_BELOW_HIDDEN_SHARE of its wire time."""
    rows = (plan or {}).get("rows") or []
    chosen = (plan or {}).get("chosen", {}).get("scheme")
    row = next((r for r in rows if r["scheme"] == chosen), None)
    if row and row["wire_seconds"] > 0 and \
            row["overlap_seconds"] < ONE_BUCKET_BELOW_HIDDEN_SHARE * row["wire_seconds"]:
        return DEFAULT_BUCKET_BYTES
    return CONVOLUTION_BUCKET_BYTES


def _slice(tensor: torch.Tensor, cut: tuple[int, int, int, int]) -> torch.Tensor:
    dim, width, start, stop = cut
    if tensor.shape[dim] != width:
        raise UsageError(f"a checkpoint's optimizer state has {tensor.shape[dim]} where the "
                         f"classifier layer has {width}: it is of another model")
    return tensor.narrow(dim, start, stop - start).clone()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this host holds: parameters, and with `optimizer` its state (SGD's momentum),
    each as the classifier's (the head: `classifier`, or `fc` for a resnet; none for a
    model with neither) and the rest's. Counted from the tensors themselves, so a
    split classifier shows its 1/H."""
    head = getattr(model, "classifier", None) or getattr(model, "fc", None)  # resnet: fc
    head_parameters = list(head.parameters()) if isinstance(head, nn.Module) else []
    mine = {id(p) for p in head_parameters}
    held = {"classifier": sum(p.numel() * p.element_size() for p in head_parameters),
            "other": sum(p.numel() * p.element_size() for p in model.parameters()
                         if id(p) not in mine)}
    if optimizer is None:
        return held
    state = {"classifier": 0, "other": 0}
    for parameter, entry in optimizer.state.items():
        size = sum(v.numel() * v.element_size() for v in entry.values()
                   if isinstance(v, torch.Tensor))
        state["classifier" if id(parameter) in mine else "other"] += size
    return {"parameters": held, "optimizer_state": state}


# --------------------------------------------------------------------------- the choice

def traffic_bytes(model: nn.Module, hosts: int, global_batch: int) -> dict[str, float]:
    """Bytes each host's link sends per step, in theory, for each scheme (ring collectives):
    averaging S bytes sends 2(H-1)/H S; gathering B rows of F floats sends (H-1)/H B F 4,
    and the reduce-scatter of their gradient as much again; the row-parallel layer's sum
    of B x hidden floats is an allreduce."""
    ring = (hosts - 1) / hosts
    whole = sum(p.numel() for p in model.parameters()) * 4
    try:
        splits = plan(model.classifier)
    except (NotSplittable, AttributeError):
        return {"data": 2 * ring * whole}
    linear = sum(p.numel() for m in model.classifier.modules() if isinstance(m, nn.Linear)
                 for p in m.parameters()) * 4
    features = next(s.in_features for s in splits)
    sums = sum(s.out_features for s in splits if s.kind == "row")
    exchange = 2 * ring * global_batch * features * 4 + 2 * ring * global_batch * sums * 4
    return {"data": 2 * ring * whole, "hybrid": 2 * ring * (whole - linear) + exchange,
            "hybrid_convolutions": 2 * ring * (whole - linear), "hybrid_activations": exchange}


def choose(asked: str, model: nn.Module, strategy: LocalStrategy, hosts, global_batch: int,
           image_size: int, compute_seconds: float | None, compression: str = EXACT,
           feature_dtype: str | None = None, accumulate: int = 1) -> DataParallel:
    """The scheme for `--host-parallel asked --compression compression [--feature-dtype]`,
    the same on every host (rank 0 plans, hybrid/planner.py): every scheme's step predicted
    from the compute (the profile's, or timed once), the link's rate and latency measured
    now and the model's shapes; "auto" and a feature dtype left out settled from it. The
    scheme carries the plan (`plan`), the gradients' compression and the features' dtype."""
    if asked not in HOST_PARALLEL:
        raise UsageError(f"--host-parallel {asked}: choose one of {', '.join(HOST_PARALLEL)}")
    if feature_dtype is not None and feature_dtype not in FEATURE_DTYPES:
        raise UsageError(f"--feature-dtype {feature_dtype}: choose one of "
                         f"{', '.join(FEATURE_DTYPES)}")
    cannot_split = None
    try:
        HybridParallel.check(model, strategy)
        if not cut_computes_model(model, torch.zeros(1, 3, image_size, image_size)):
            raise NotSplittable("its forward does more than features -> avgpool -> classifier")
    except NotSplittable as exc:
        cannot_split = (f"hybrid cannot split {type(model).__name__}: {exc}; averaging the "
                        "whole gradient instead")
    except UsageError as exc:
        if asked == "hybrid":
            raise
        cannot_split = f"{exc}"
    if hosts.size == 1:
        if asked == "hybrid" and cannot_split is None:
            scheme = HybridParallel("asked for (--host-parallel hybrid)")
        elif asked == "hybrid" or (asked == "auto" and cannot_split is not None):
            scheme = DataParallel(cannot_split)
        else:
            scheme = DataParallel("asked for (--host-parallel data)" if asked == "data"
                                  else "one host: nothing to split or average")
        # Alone nothing crosses a wire: auto is none; a named compression still applies
        # (PowerSGD trains the same steps on one host as on H).
        return _settled(scheme, one_host_plan().record(),
                        EXACT if compression == AUTO else compression,
                        feature_dtype or EXACT_FEATURES)
    rate, latency = hosts.link_rate(), hosts.link_latency() or 0.0
    # Every time the plan weighs is in the time the link's rate is in: on emulated hosts
    # slowed down or sped up by D (S·D under --speedup), wall seconds / D. The profile's
    # compute was measured in wall seconds on this machine, as the probe's is.
    scale = getattr(hosts, "time_scale", 1.0)
    source = "the profile" if compute_seconds is not None else "timed once on a copy of the model"
    # On this rank's cores only, as its strategy will compute: before the strategy is set
    # up, torch's thread count is the machine's, which ranks sharing it oversubscribe.
    cores = len(getattr(hosts, "cores", None) or []) or None
    time_alone = None  # one host's whole global batch, where the plan needs it
    if compute_seconds is None:  # no profile: time this host's share once (wall seconds)
        share = max(1, hosts.samples_of(global_batch))  # its weight's (--balance)
        compute_seconds = probe_in_threads(model, share, image_size, cores, 1.0)
        time_alone = functools.partial(probe_in_threads, model, global_batch, image_size,
                                       cores, scale)
    compute = max(hosts.allgather(compute_seconds / scale))
    record = None
    if hosts.rank == 0:
        shapes = ModelShapes.of(model, splittable=cannot_split is None)
        gradients = [p.detach() for p in model.parameters() if p.requires_grad]
        averaged = {id(p) for p in split_at_classifier(model)[0].parameters()} \
            if cannot_split is None else set()
        in_hybrid = [g for g in gradients if id(g) in averaged] if averaged else gradients

        def measure(scope: str, compression) -> float:
            return compression.measure_seconds(gradients if scope == "data" else in_hybrid) / scale

        record = make_plan(shapes, hosts.size, global_batch, compute, Link(rate, latency),
                           HostCosts.measure().scaled(1 / scale), host_parallel=asked,
                           compression=compression,
                           feature_dtype=feature_dtype, chunks=accumulate,
                           compute_source=f"this host's share, {source}; the slowest host's",
                           measure=measure, overlap=bool(getattr(hosts, "overlap", False)),
                           time_alone=time_alone).record()
    record = hosts.broadcast_object(record)
    chosen = record["chosen"]
    if chosen["host_parallel"] == "hybrid":
        scheme = HybridParallel("asked for (--host-parallel hybrid); " + record["reason"]
                                if asked == "hybrid" else record["reason"])
    else:
        scheme = DataParallel(cannot_split + "; " + record["reason"] if asked != "data"
                              and cannot_split else
                              "asked for (--host-parallel data); " + record["reason"]
                              if asked == "data" else record["reason"])
    return _settled(scheme, record, chosen["compression"], chosen["feature_dtype"])


def _settled(scheme: DataParallel, plan: dict, compression: str,
             feature_dtype: str) -> DataParallel:
    scheme.plan, scheme.compression = plan, compression
    scheme.feature_dtype = feature_dtype if scheme.name == "hybrid" else EXACT_FEATURES
    return scheme


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `tensor` for MPI (the Open MPI wheel is not CUDA-aware): from a GPU
    through pinned memory, which the device fills by DMA without a staging copy."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)


def probe_in_threads(model: nn.Module, batch: int, image_size: int, cores: int | None,
                     scale: float) -> float:
    """`probe_compute` on `cores` threads, in the link's time (wall seconds / `scale`)."""
    with torch_threads(cores):
        return probe_compute(model, batch, image_size) / scale


def probe_compute(model: nn.Module, batch: int, image_size: int) -> float:
    """Seconds of a forward and backward of `batch` images on a copy of `model` (the
    model itself, its buffers and every random stream untouched), the second of two
    (the first pays for allocations): a step's compute where no profile gives it."""
    probe = copy.deepcopy(model).eval()  # eval: no dropout keys needed, no BN update
    x = torch.zeros(batch, 3, image_size, image_size)
    seconds = 0.0
    for _ in range(2):
        probe.zero_grad(set_to_none=True)  # a step writes its gradients, adds to none
        started = time.perf_counter()
        probe(x).float().sum().backward()
        seconds = time.perf_counter() - started
    return seconds

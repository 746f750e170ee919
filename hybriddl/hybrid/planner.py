"""The exchange planned per link: each scheme's step predicted from measured inputs.

At start the hosts know this host's compute per step (the profile's, or timed once), the
link's rate and latency (measured by `Hosts.link_rate` and `Hosts.link_latency`), the host
count and the model's shapes. From them alone, with no MPI here, `predict` gives each
scheme's step:

    step = compute
         + bytes each host's link sends / rate      (a ring: 2(H-1)/H of an allreduce's payload,
                                                     (H-1)/H of an allgather's or reduce-scatter's)
         + latency x rounds of the exchanges a step waits for one after another
                                                    (a ring allreduce 2(H-1) rounds,
                                                     an allgather H-1, the split's
                                                     reduce-scatter, an alltoallv, 1)
         + compression's own compute (casts, 2-byte sums, PowerSGD's products), this host's,
           as the compression object answers it (`compute_seconds`)
         - overlap: hybrid's, and with --overlap what the compression sends during backward
           (`early_wire_bytes`: PowerSGD's first phase, the classifier's factors), at most
           OVERLAP_SHARE of the compute.

The planner names no compression: it weighs the variants each registered one plans
(hosts/compression.py, `planned_compressions`) and predicts from what the objects answer.

Data is credited no overlap: on 2-core hosts at 1 Gbit/s its step was the compute plus all
of its exchange (AlexNet 3.12 s = 1.03 + 2.09; VGG16 17.9 s = 12.1 + 5.8), and a credit of
two thirds of the compute picked data for VGG16 where hybrid was 1.27x faster (see
`hybrid.parallel`). The hybrid step sends its convolutions' gradients while their backward
runs (exact compression only) and returns the features' gradient beside the first linear
layer's weight gradient (hybrid/parallel.py): those exchanges are credited up to
OVERLAP_SHARE of the compute, what measured runs hid and no more (`OVERLAP_SHARE`).

The fusion buckets of one gradient exchange are all in flight at once, so they pay one
allreduce's latency; a compression's exchanges that wait for one another are its
`allreduces_per_step`.

`settle` picks: exact schemes unless `--compression auto`; with auto the fastest, but an
inexact one only where it is predicted faster than the best exact one by more than the
predictions' error (`PREDICTION_ERROR`), so the plan never takes a scheme slower than dense
averaging (on fast links it says "none"). Where an inexact scheme is predicted at least
`ADVICE_FACTOR` times faster than the exact one a run uses, the plan carries one line naming
it and its flags.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from hybriddl.errors import UsageError
from hybriddl.hosts.compression import AUTO, EXACT, parse_compression, planned_compressions
from hybriddl.hybrid.classifier import NotSplittable, plan

# The split's features and their gradients on the wire (--feature-dtype): float32 is exact;
# bfloat16 halves the bytes and keeps float32's exponent range, which the gradients of the
# global mean loss (a 1/B factor in every element) need and float16's would cut off.
FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXACT_FEATURES = "float32"
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16"}
# Predictions were within this of measured steps (docs/multi-host.md): an inexact scheme
# must win by more than it.
PREDICTION_ERROR = 0.15
# How much faster an inexact scheme must be predicted for a run on an exact one to say so.
ADVICE_FACTOR = 2.0
# Bytes of the tags (label, dropout key: two int64) every feature row carries.
TAG_BYTES = 16
# The most of a hybrid step's compute its overlapped exchanges are credited with. Measured
# (AlexNet 224 px, global batch 32, 2 emulated 1-core hosts at 1 Gbit/s): 0.096 s of 0.098 s
# of wire hidden beside 0.51 s of compute, 19 %; taken lower, so a prediction errs long.
OVERLAP_SHARE = 0.15


@dataclass(frozen=True)
class Scheme:
    """One way hosts may exchange a step: how they divide it (`data`, `hybrid`), what the
    averaged gradients look like on the wire, and (hybrid) the features' wire dtype."""

    host_parallel: str
    compression: str = EXACT
    feature_dtype: str = EXACT_FEATURES

    @property
    def exact(self) -> bool:
        return compression_object(self.compression).exact and \
            self.feature_dtype == EXACT_FEATURES

    @property
    def label(self) -> str:
        parts = [self.host_parallel]
        if self.compression != EXACT:
            parts.append(self.compression)
        if self.feature_dtype != EXACT_FEATURES:
            parts.append(f"{SHORT_NAMES[self.feature_dtype]} features")
        return " + ".join(parts)

    @property
    def flags(self) -> str:
        """The command line that asks for this scheme."""
        line = f"--host-parallel {self.host_parallel} --compression {self.compression}"
        if self.host_parallel == "hybrid" and self.feature_dtype != EXACT_FEATURES:
            line += f" --feature-dtype {self.feature_dtype}"
        return line


def candidate_schemes(splittable: bool) -> list[Scheme]:
    """The schemes weighed: data with each compression; hybrid exact, with 2-byte features,
    and with each compression of its convolutions' gradients (features in bfloat16 there:
    once a run is inexact, float32 features only cost bytes)."""
    compressions = planned_compressions()
    schemes = [Scheme("data", c) for c in compressions]
    if splittable:
        schemes += [Scheme("hybrid"), Scheme("hybrid", EXACT, "bfloat16")]
        schemes += [Scheme("hybrid", c, "bfloat16") for c in compressions if c != EXACT]
    return schemes


@dataclass(frozen=True)
class ModelShapes:
    """What the planner needs of a model: its parameters' shapes, those the hybrid scheme
    still averages (all but the classifier's linear layers), the width of the split's
    features and the outputs of its row-parallel layers (each one allreduce of B rows)."""

    parameters: tuple[tuple[int, ...], ...]
    averaged_in_hybrid: tuple[tuple[int, ...], ...]
    features: int | None = None  # None: the classifier cannot be split
    row_outputs: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, splittable: bool = True) -> ModelShapes:
        """`model`'s shapes (any device, the meta device too); `splittable` False where the
        hybrid scheme cannot run it whatever its classifier."""
        every = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
        classifier = getattr(model, "classifier", None)
        try:
            splits = plan(classifier) if splittable and classifier is not None else None
        except NotSplittable:
            splits = None
        if not splits:
            return cls(every, every)
        linear = {id(p) for m in classifier.modules() if isinstance(m, nn.Linear)
                  for p in m.parameters()}
        rest = tuple(tuple(p.shape) for p in model.parameters()
                     if p.requires_grad and id(p) not in linear)
        return cls(every, rest, splits[0].in_features,
                   tuple(s.out_features for s in splits if s.kind == "row"))

    @property
    def splittable(self) -> bool:
        return self.features is not None


@dataclass(frozen=True)
class Link:
    """The slowest host's link as measured at start: bytes per second through a ring, and
    one hop's latency for a small message."""

    bytes_per_second: float
    latency_seconds: float = 0.0


# --------------------------------------------------------------------------- bytes

@functools.lru_cache(maxsize=None)
def compression_object(name: str):
    """The compression `name` names (hosts/compression.py), which the planner only asks:
    one object per name, read and never stepped."""
    compression = parse_compression(name)
    if compression == AUTO:
        raise UsageError(f"--compression {AUTO} is the planner's to settle, not a scheme to "
                         "predict: name a scheme")
    return compression


@dataclass(frozen=True)
class GradientExchange:
    """What one compression hands to the allreduce per step: payload bytes (before the
    ring's 2(H-1)/H), exchanges that wait for one another, and whether it is exact."""

    name: str
    payload_bytes: float
    allreduces_per_step: int
    exact: bool
    # Of the payload, what leaves during backward with --overlap (PowerSGD's first phase:
    # the trailing gradients' factors, hosts/mpi.py); 0 where the exchange waits for the end.
    early_bytes: float = 0.0


def gradient_exchange(name: str, shapes) -> GradientExchange:
    """`name`'s exchange of gradients of `shapes`, as the compression object answers it."""
    shapes = list(shapes)
    compression = compression_object(name)
    return GradientExchange(name, float(compression.wire_bytes(shapes)),
                            int(compression.allreduces_per_step), bool(compression.exact),
                            float(compression.early_wire_bytes(shapes)))


# --------------------------------------------------------------------------- compute

@dataclass(frozen=True)
class HostCosts:
    """This host's seconds for the work compression adds to a step, measured once
    (`measure`): per element, a float32 <-> 2-byte float cast, a 2-byte float addition as
    MPI's reduction does it (torch's add), a float32 element-wise pass, and a gradient
    matrix's skinny product with rank-1 factors (scaled by R). `measured` holds seconds
    per step measured with a compression object itself, keyed as it says (its
    `measured_key`: PowerSGD's "data:R" / "hybrid:R"); without them the object estimates
    its cost from the per-element figures."""

    cast: float
    half_add: float
    elementwise: float
    matmul: float
    measured: dict = field(default_factory=dict)

    @classmethod
    def measure(cls, elements: int = 1 << 21) -> HostCosts:
        """Each figure the best of three (the first pays for allocations)."""
        x = torch.ones(elements)
        half = torch.empty(elements, dtype=torch.float16)
        other = torch.ones(elements, dtype=torch.float16)
        y = torch.empty_like(x)
        matrix = torch.ones(1024, elements // 1024)
        factor = torch.ones(elements // 1024, 4)
        return cls(cast=_best(lambda: half.copy_(x)) / elements,
                   half_add=_best(lambda: half.add_(other)) / elements,
                   elementwise=_best(lambda: torch.add(x, x, out=y)) / elements,
                   matmul=_best(lambda: matrix @ factor) / (elements * 4))

    def scaled(self, factor: float) -> HostCosts:
        """These costs `factor` times as long (on emulated hosts, 1/D: emulated time)."""
        return HostCosts(self.cast * factor, self.half_add * factor, self.elementwise * factor,
                         self.matmul * factor,
                         {key: seconds * factor for key, seconds in self.measured.items()})


def _best(work, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-12)


# --------------------------------------------------------------------------- predictions

@dataclass(frozen=True)
class Prediction:
    """One scheme's predicted step and its parts, in seconds."""

    scheme: Scheme
    nic_bytes: float  # what each host's link sends per step
    compute_seconds: float
    wire_seconds: float
    latency_seconds: float
    compression_seconds: float
    step_seconds: float
    images_per_second: float
    estimated: bool  # compression's own compute estimated, not measured
    overlap_seconds: float = 0.0  # credited to exchanges that run beside compute

    def record(self) -> dict:
        return {"scheme": self.scheme.label, "host_parallel": self.scheme.host_parallel,
                "compression": self.scheme.compression,
                "feature_dtype": self.scheme.feature_dtype, "exact": self.scheme.exact,
                "flags": self.scheme.flags, "nic_bytes_per_step": round(self.nic_bytes),
                **{key: round(value, 6) for key, value in (
                    ("compute_seconds", self.compute_seconds),
                    ("wire_seconds", self.wire_seconds),
                    ("latency_seconds", self.latency_seconds),
                    ("compression_seconds", self.compression_seconds),
                    ("overlap_seconds", self.overlap_seconds),
                    ("step_seconds", self.step_seconds),
                    ("images_per_second", self.images_per_second))},
                "compression_cost": "estimated" if self.estimated else "measured"}


def predict(scheme: Scheme, shapes: ModelShapes, hosts: int, global_batch: int,
            compute_seconds: float, link: Link, costs: HostCosts | None = None,
            chunks: int = 1, overlap: bool = False) -> Prediction:
    """`scheme`'s step on `hosts` hosts (see the module's docstring for the model);
    `chunks`: --accumulate, each chunk one gather, row sums and reduce-scatter; `overlap`:
    --overlap, under which PowerSGD's first phase leaves during backward."""
    if hosts < 2:
        raise ValueError("one host exchanges nothing: there is nothing to predict")
    ring = (hosts - 1) / hosts
    averaged = shapes.parameters if scheme.host_parallel == "data" else shapes.averaged_in_hybrid
    gradients = gradient_exchange(scheme.compression, averaged)
    nic = nic_gradients = 2 * ring * gradients.payload_bytes
    rounds = gradients.allreduces_per_step * 2 * (hosts - 1)
    extra, estimated, overlappable = 0.0, False, 0.0
    if costs is not None:
        extra, estimated = compression_object(scheme.compression).compute_seconds(
            costs, scheme.host_parallel, averaged, hosts)
    if overlap and gradients.early_bytes:
        # The first phase's factors leave beside backward (its allreduce's rounds too; the
        # second phase's are the step's one allreduce's).
        overlappable = 2 * ring * gradients.early_bytes
    if scheme.host_parallel == "hybrid":
        if not shapes.splittable:
            raise ValueError("the hybrid scheme needs a classifier it can split")
        size = FEATURE_DTYPES[scheme.feature_dtype].itemsize
        rows = global_batch * shapes.features
        nic += ring * global_batch * (shapes.features * size + TAG_BYTES)  # allgather
        nic += ring * rows * size  # the features' gradient, reduce-scattered
        # Beside compute: the features' gradient on its way back, and the convolutions'
        # gradients where they leave during backward (an exact compression).
        overlappable = ring * rows * size + (nic_gradients if gradients.exact else overlappable)
        nic += sum(2 * ring * global_batch * out * 4 for out in shapes.row_outputs)
        # Per chunk: the gather (H-1 rounds), the reduce-scatter (one alltoallv) and each
        # row-parallel layer's allreduce (2(H-1)).
        rounds += chunks * ((hosts - 1) + 1 + 2 * (hosts - 1) * len(shapes.row_outputs))
        if costs is not None and size < 4:
            # Each host's rows and the gradient's part cast down, the whole batch's cast
            # back up (both ways), and the reduce-scatter's additions in 2 bytes.
            extra += (2 + 2 / hosts) * rows * costs.cast + ring * rows * costs.half_add
    wire = nic / link.bytes_per_second
    latency = rounds * link.latency_seconds
    hidden = min(overlappable / link.bytes_per_second, OVERLAP_SHARE * compute_seconds)
    step = compute_seconds + wire + latency + extra - hidden
    return Prediction(scheme, nic, compute_seconds, wire, latency, extra, step,
                      global_batch / step, estimated, hidden)


@dataclass
class Plan:
    """Every scheme's prediction, the one settled and why, the advice line (or None), and
    the line that says one host alone is predicted faster (or None)."""

    hosts: int
    rows: list[Prediction]
    chosen: Scheme
    reason: str
    advice: str | None = None
    inputs: dict = field(default_factory=dict)
    alone: str | None = None

    def record(self) -> dict:
        """The plan as metrics.json's config keeps it."""
        return {"hosts": self.hosts, "inputs": self.inputs,
                "rows": [row.record() for row in self.rows],
                "chosen": {**asdict(self.chosen), "scheme": self.chosen.label,
                           "exact": self.chosen.exact, "flags": self.chosen.flags},
                "reason": self.reason, "advice": self.advice, "alone": self.alone,
                "overlap": f"hybrid's, and PowerSGD's first phase with --overlap, at most "
                           f"{OVERLAP_SHARE:.0%} of the compute (hybriddl/hybrid/planner.py)"}


def one_host_plan() -> Plan:
    """Alone, a host exchanges nothing: data parallelism over itself, nothing compressed."""
    return Plan(1, [], Scheme("data"), f"one host: no exchange, nothing to compress ({EXACT})")


def make_plan(shapes: ModelShapes, hosts: int, global_batch: int, compute_seconds: float,
              link: Link, costs: HostCosts | None = None, *, host_parallel: str = "auto",
              compression: str = EXACT, feature_dtype: str | None = None,
              chunks: int = 1, compute_source: str = "", measure=None,
              overlap: bool = False, time_alone=None) -> Plan:
    """Predict every candidate scheme and settle the asked ones (see `settle`); `overlap`:
    the run's --overlap. `time_alone()`: seconds of one host's compute of the whole global
    batch, timed where the alone line needs it (see `alone_line`).

    `measure(scope, compression)`: seconds of a compression object's own compute per step
    in `scope`, measured on this host (its `measure_seconds`). Measuring every variant takes
    seconds (PowerSGD's ranks), so it is asked only for the rows that decide (the one
    settled, the one advised) while their cost is estimated, and the plan made again: an
    estimate never decides."""
    if hosts < 2:
        return one_host_plan()
    schemes = candidate_schemes(shapes.splittable)
    # A scheme asked for outside the candidates (powersgd:8) is predicted too.
    extra = _asked_scheme(host_parallel, compression, feature_dtype, shapes.splittable)
    schemes += [s for s in extra if s not in schemes]
    while True:
        rows = [predict(s, shapes, hosts, global_batch, compute_seconds, link, costs, chunks,
                        overlap)
                for s in schemes]
        rows.sort(key=lambda row: row.step_seconds)
        chosen, reason = settle(rows, host_parallel, compression, feature_dtype)
        advised = advise(rows, chosen, compression)
        deciding = [chosen] + ([advised[0]] if advised else [])
        estimated = [r.scheme for r in deciding if r.estimated]
        if not estimated or measure is None or costs is None:
            break
        for scheme in estimated:
            measured = compression_object(scheme.compression)
            costs.measured[measured.measured_key(scheme.host_parallel)] = \
                measure(scheme.host_parallel, measured)
    reason += (f"; measured link {link.bytes_per_second * 8 / 1e9:.3f} Gbit/s, latency "
               f"{link.latency_seconds * 1e3:.3f} ms")
    inputs = {"compute_seconds": compute_seconds, "compute_source": compute_source,
              "link_bytes_per_second": link.bytes_per_second,
              "latency_seconds": link.latency_seconds, "global_batch": global_batch,
              "accumulate": chunks, "overlap": overlap,
              "compression_costs": None if costs is None else
              {"cast": costs.cast, "half_add": costs.half_add,
               "elementwise": costs.elementwise, "matmul": costs.matmul,
               # metrics.json's name for it since PowerSGD was the one scheme measured
               "powersgd_measured": dict(costs.measured)}}
    line, inputs["alone_seconds"] = alone_line(chosen, hosts, compute_seconds, time_alone)
    return Plan(hosts, rows, chosen.scheme, reason, advice_line(*advised) if advised else None,
                inputs, line)


def alone_line(chosen: Prediction, hosts: int, compute_seconds: float,
               time_alone=None) -> tuple[str | None, float | None]:
    """Where the settled scheme's step is predicted slower than one of the hosts computing
    the whole global batch alone (no exchange), the line that says so (else None), and
    that host's time where it was timed (else None).

    Its share's compute times the host count is that time at most where a larger batch is
    no less efficient per image; where the step is under it but over half of it, one
    host's global batch is timed (`time_alone()`). Measured (AMD EPYC): AlexNet at 64 px,
    2 hosts of one core over 1 Gbit/s, 0.212 s a step predicted (0.206 s measured), against
    0.172 s timed for the 32 images on one core, where the estimate gave 2 x 0.127 s.
    Measured where it fired on the estimate: AlexNet at 64 px on hosts of a 10 ms step over
    1 Gbit/s, auto's pick then (data + powersgd:1:rounds=2) took 2.3x one host's time an
    epoch (results/time_to_accuracy-mnist-SimpleBig-1gbit-10ms.json)."""
    alone, how = compute_seconds * hosts, f"its share's compute x {hosts}"
    timed = None
    if chosen.step_seconds <= alone:
        if time_alone is None or chosen.step_seconds <= alone / 2:
            return None, None
        alone = timed = time_alone()
        how = "timed"
        if chosen.step_seconds <= alone:
            return None, timed
    return (f"{hosts} hosts are predicted slower than one of them alone: "
            f"{chosen.step_seconds:.3f} s a step with {chosen.scheme.label} against "
            f"{alone:.3f} s for the global batch on one host ({how}); "
            "the exchange costs more than the compute it shares out: fewer hosts, a faster "
            "link, or a larger batch per host"), timed


def _asked_scheme(host_parallel, compression, feature_dtype, splittable) -> list[Scheme]:
    """The schemes a run asked for by name, where they are none of the candidates (a
    variant no compression plans, powersgd:8; under auto, the compressions with the feature
    dtype given)."""
    if compression == AUTO:
        if feature_dtype is None or not splittable or host_parallel == "data":
            return []
        return [Scheme("hybrid", c, feature_dtype) for c in planned_compressions()]
    parallels = ["data", "hybrid"] if host_parallel == "auto" else [host_parallel]
    if not splittable:
        parallels = [p for p in parallels if p == "data"]
    return [Scheme(p, compression, (feature_dtype or EXACT_FEATURES) if p == "hybrid"
                   else EXACT_FEATURES) for p in parallels]


def settle(rows: list[Prediction], host_parallel: str = "auto", compression: str = EXACT,
           feature_dtype: str | None = None) -> tuple[Prediction, str]:
    """The scheme a run takes among `rows`, and why. Named choices are kept; "auto" and a
    feature dtype left out are the planner's. With --compression auto the fastest, but an
    inexact scheme only where it is predicted faster than the best exact one by more than
    PREDICTION_ERROR: never a scheme slower than dense averaging."""
    def allowed(row: Prediction) -> bool:
        s = row.scheme
        dtype = feature_dtype or (None if compression == "auto" else EXACT_FEATURES)
        return (host_parallel in ("auto", s.host_parallel)
                and compression in ("auto", s.compression)
                and (s.host_parallel == "data" or dtype in (None, s.feature_dtype)))

    options = [row for row in rows if allowed(row) and not (
        compression == "auto" and compression_object(row.scheme.compression).misses_target)]
    if not options:
        raise UsageError(f"no scheme fits --host-parallel {host_parallel} --compression "
                         f"{compression}" + (f" --feature-dtype {feature_dtype}" if feature_dtype
                                             else "") + ": the classifier cannot be split; use "
                         "--host-parallel data")
    best = min(options, key=lambda row: row.step_seconds)
    exact = [row for row in options if row.scheme.exact]
    best_exact = min(exact, key=lambda row: row.step_seconds) if exact else None
    parts = f"predicted step {best.step_seconds:.3f} s ({_parts(best)})"
    if compression != "auto":
        return best, f"{best.scheme.label}: {parts}"
    if best.scheme.exact or best_exact is None:
        return best, f"auto: {best.scheme.label}, the fastest predicted; {parts}"
    gain = best_exact.step_seconds / best.step_seconds
    if gain > 1 + PREDICTION_ERROR:
        return best, (f"auto: {best.scheme.label} (not exact), predicted {gain:.2f}x faster "
                      f"than {best_exact.scheme.label}; {parts}")
    return best_exact, (f"auto: {EXACT}, {best_exact.scheme.label} (exact): the fastest inexact "
                        f"scheme, {best.scheme.label}, is predicted only {gain:.2f}x faster, "
                        f"within the predictions' {PREDICTION_ERROR:.0%}; predicted step "
                        f"{best_exact.step_seconds:.3f} s ({_parts(best_exact)})")


def advise(rows: list[Prediction], chosen: Prediction,
           compression: str) -> tuple[Prediction, Prediction] | None:
    """(the fastest inexact row, the best exact row) where a run on an exact scheme could
    go ADVICE_FACTOR times faster inexact; None elsewhere, and under --compression auto."""
    if compression == "auto" or not chosen.scheme.exact:
        return None
    exact = min((r for r in rows if r.scheme.exact), key=lambda r: r.step_seconds)
    # Never a scheme the time-to-accuracy tables show missing the target (`misses_target`).
    inexact = [r for r in rows if not r.scheme.exact
               and not compression_object(r.scheme.compression).misses_target]
    if not inexact:
        return None
    fastest = min(inexact, key=lambda r: r.step_seconds)
    return (fastest, exact) if exact.step_seconds >= ADVICE_FACTOR * fastest.step_seconds \
        else None


def advice_line(fastest: Prediction, exact: Prediction) -> str:
    """The one line that names a scheme predicted ADVICE_FACTOR times faster, and its flags."""
    return (f"{fastest.scheme.label} is predicted {exact.step_seconds / fastest.step_seconds:.1f}x "
            f"faster than {exact.scheme.label} ({fastest.step_seconds:.3f} s against "
            f"{exact.step_seconds:.3f} s per step) but is not exact: to use it, run with "
            f"{fastest.scheme.flags} (or --compression auto)")


def _parts(row: Prediction) -> str:
    return (f"compute {row.compute_seconds:.3f} + wire {row.wire_seconds:.3f} + latency "
            f"{row.latency_seconds:.3f} + compression {row.compression_seconds:.3f} - overlap "
            f"{row.overlap_seconds:.3f} s, "
            f"{row.nic_bytes / 1e6:.1f} MB per host")


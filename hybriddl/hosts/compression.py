"""What gradients look like on the wire between hosts (Horovod's `Compression` idea): the
schemes, and their registry.

A scheme is one object (hosts/scheme.py's `WireScheme`), chosen once per run
(`parse_compression`, the text of `--compression`). `none` and `fp16` turn each fused
gradient buffer into the buffer handed to MPI and name how MPI sums it; `powersgd:R`
(hosts/powersgd.py) compresses the step's whole gradient at once, its allreduce passed in.
Every one says, for the planner, what it sends and computes: `name`, `exact`,
`wire_bytes(model or shapes)` (bytes one host hands to the allreduce per step, before the
ring's 2(H-1)/H), `allreduces_per_step` (exchanges that wait for one another in a step: the
fusion buckets of `none` and `fp16` are all in flight at once, so one) and
`compute_seconds`; for the averaging, its `kind`.

Adding a scheme = its class (here, or a module of its own in hosts/) and one line in
`register(...)` below: the command line's list, the parser, the planner's candidates and
the averaging enumerate REGISTRY.
"""

from __future__ import annotations

import torch

from hybriddl.errors import TrainingError, UsageError
from hybriddl.hosts.powersgd import PowerSGD
from hybriddl.hosts.scheme import (AUTO, BUCKETED, EXACT, WHOLE_GRADIENT, WireScheme,
                                   gradient_elements)

# Every scheme --compression can name, by its word, in the order the command line lists them
# and the planner weighs them.
REGISTRY: dict[str, type[WireScheme]] = {}


class NoCompression(WireScheme):
    """Gradients travel in their own precision: the fusion buffer itself is sent."""

    name = syntax = EXACT
    help = "none is exact (default)"
    exact = True
    itemsize = 4  # float32 gradients

    def wire_bytes(self, model_or_shapes) -> int:
        return gradient_elements(model_or_shapes) * self.itemsize

    def wire_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def compress(self, flat: torch.Tensor, wire: torch.Tensor) -> None:
        """`wire` is `flat`: nothing to do."""

    def mpi_sum(self, MPI):
        """(datatype, op) that MPI sums the wire with; datatype None: MPI reads the
        buffer's own type (float32)."""
        return None, MPI.SUM


class HalfWire(WireScheme):
    """Gradients cast to a 2-byte float (`wire_dtype`) on the wire, summed in it.

    Hosts contribute n_h/N * g_h (already the share of the mean), so the summed values stay
    in gradient range. 2-byte floats have no standard MPI datatype, so the wire is a 2-byte
    datatype and each addition is torch's add in `wire_dtype` (computed in float32, rounded
    once), through a user-defined operation. A ring adds one host's contribution at a time,
    so each element is rounded H times (each contribution once, then each partial sum)."""

    wire_dtype = torch.float16
    itemsize = 2

    def wire_bytes(self, model_or_shapes) -> int:
        return gradient_elements(model_or_shapes) * self.itemsize

    def wire_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=self.wire_dtype)

    def compress(self, flat: torch.Tensor, wire: torch.Tensor) -> None:
        wire.copy_(flat)

    def check_sum(self, summed: torch.Tensor) -> None:
        # One pass over half the gradient's bytes: an overflow applied would make every
        # replica's weights infinite, and the loss read later would blame --lr.
        if not bool(torch.isfinite(summed).all()):
            raise TrainingError(
                f"the gradients summed on the {self.name} wire are not finite (a value beyond "
                f"{torch.finfo(self.wire_dtype).max:g} once weighted by each host's share, or "
                "a NaN gradient); the step was not applied and the last checkpoint is kept: "
                "resume with --compression none, or a lower --lr")

    def mpi_sum(self, MPI):
        if not hasattr(self, "_mpi"):  # MPI objects live as long as the process
            half = MPI.BYTE.Create_contiguous(self.itemsize).Commit()
            self._mpi = half, MPI.Op.Create(_adder(self.wire_dtype), commute=True)
        return self._mpi

    def compute_seconds(self, costs, scope, model_or_shapes, hosts):
        # Cast to 2 bytes and back, and the ring's (H-1)/H additions in 2 bytes.
        elements = gradient_elements(model_or_shapes)
        ring = (hosts - 1) / hosts
        return 2 * elements * costs.cast + ring * elements * costs.half_add, False


class FP16Compression(HalfWire):
    """Half-precision gradients on the wire: half the bytes, ~3 significant digits. A sum
    beyond float16's 65504 stops the run (`check_sum`); at the other end, weighted values
    below 2**-14 lose digits in float16's subnormals and those below 2**-25 are sent as 0,
    a bias no error feedback carries over (as Horovod's Compression.fp16).

    Open MPI's own float16 loop is slow (10 s per VGG16 step here), hence torch's add.
    Measured on emulated hosts, 64 MiB: 2 hosts without a limit 0.068 s against float32's
    0.091 s; 8 hosts at 1 Gbit/s 0.853 s against 1.214 s. Above float16's subnormals the
    average is within about H * 2**-11 * sum_h |n_h/N * g_h| of float32's.
    """

    name = syntax = "fp16"
    help = "fp16 halves the bytes"


def _adder(dtype: torch.dtype):
    """MPI's reduction callback for a 2-byte float wire: inout += incoming."""
    def add(incoming, inout, datatype) -> None:
        if len(incoming):
            torch.frombuffer(inout, dtype=dtype).add_(torch.frombuffer(incoming, dtype=dtype))
    return add


def register(*classes: type[WireScheme]) -> None:
    """Add schemes to REGISTRY under their words, in the order given."""
    for cls in classes:
        if not cls.name or not cls.syntax or not cls.help:
            raise ValueError(f"{cls.__name__} needs a name, a syntax and its help to be registered")
        if cls.kind not in (BUCKETED, WHOLE_GRADIENT):
            raise ValueError(f"{cls.__name__}: kind is {BUCKETED!r} or {WHOLE_GRADIENT!r}")
        if REGISTRY.get(cls.name, cls) is not cls:
            raise ValueError(f"scheme {cls.name!r} is registered already "
                             f"({REGISTRY[cls.name].__name__})")
        REGISTRY[cls.name] = cls


register(
    NoCompression,
    FP16Compression,
    PowerSGD,
)


class Compression:
    """The choices, as Horovod spells them: `connect(compression=Compression.fp16)`."""

    none = NoCompression.shared()
    fp16 = FP16Compression.shared()


def schemes() -> tuple[str, ...]:
    """What --compression accepts, as its help and errors list it."""
    return (*(cls.syntax for cls in REGISTRY.values()), AUTO)


def compression_help() -> str:
    """--compression's help: each registered scheme's part, then auto."""
    return (f"what gradients look like on the wire, one of {', '.join(schemes())}: "
            + "; ".join(cls.help for cls in REGISTRY.values())
            + "; auto takes the fastest the planner predicts")


def planned_compressions() -> list[str]:
    """The gradient exchanges the planner weighs beside each other, in the registry's order."""
    return [scheme.name for cls in REGISTRY.values() for scheme in cls.planned()]


def held_state_bytes(text: str, model_or_shapes) -> int:
    """Bytes of state the compression `text` holds on each host from step to step (auto:
    the most that any scheme the planner weighs holds)."""
    scheme = parse_compression(text)
    schemes = ([parse_compression(name) for name in planned_compressions()]
               if scheme == AUTO else [scheme])
    return max(s.held_bytes(model_or_shapes) for s in schemes)


def parse_compression(text: str):
    """The compression `--compression TEXT` names, or AUTO (the planner settles it);
    UsageError, one line, for anything else."""
    text = (text or "").strip()
    if text == AUTO:
        return AUTO
    for cls in REGISTRY.values():
        scheme = cls.parse(text)
        if scheme is not None:
            return scheme
    notes = "; ".join(cls.syntax_note for cls in REGISTRY.values() if cls.syntax_note)
    raise UsageError(f"--compression {text}: choose one of {', '.join(schemes())}"
                     + (f" ({notes})" if notes else ""))

"""What every wire scheme answers: the one interface the planner, the averaging and the
settings ask, so that none of them names a scheme (hosts/compression.py registers them).

A scheme averages in one of two ways, which it declares (`kind`): BUCKETED, each fusion
bucket turned into its wire (`wire_buffer`, `compress`) and summed by MPI as the scheme says
(`mpi_sum`), buckets leaving during backward with --overlap; or WHOLE_GRADIENT, the step's
whole gradient at once (`setup`, `aggregate`, or `begin_step` / `local_wire` / `finish_step`
where hosts run it in phases), which applies on one host too.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

# Torch-free, so that the display and the command line may name these words without it.
# "auto" is the planner's to settle; EXACT, the default, sends the gradients as they are.
AUTO = "auto"
EXACT = "none"
BUCKETED = "bucketed"
WHOLE_GRADIENT = "whole_gradient"


def gradient_shapes(model_or_shapes) -> list[tuple[int, ...]]:
    """The shapes of a model's trainable parameters (its gradients), or the shapes given."""
    if hasattr(model_or_shapes, "parameters"):  # an nn.Module
        return [tuple(p.shape) for p in model_or_shapes.parameters() if p.requires_grad]
    return [tuple(shape) for shape in model_or_shapes]


def gradient_elements(model_or_shapes) -> int:
    return sum(math.prod(s) for s in gradient_shapes(model_or_shapes))


class WireScheme(ABC):
    """One way gradients look on the wire. A subclass sets the class attributes and, where
    its text has parameters (`powersgd:R`), overrides `parse` and `planned`."""

    # The word --compression starts with (an instance's `name` is its whole text).
    name = ""
    # How --compression's list and its errors show it ("powersgd:R"), its part of the
    # flag's help, and (optional) a line on its parameters for an error to end with.
    syntax = ""
    help = ""
    syntax_note = ""
    exact = False
    kind = BUCKETED
    # Exchanges that wait for one another in a step (a bucketed scheme's buckets are all in
    # flight at once: one).
    allreduces_per_step = 1
    # (WHOLE_GRADIENT) whether --overlap may send the trailing gradients' part of its step
    # during backward (`early_positions`, `split_phases`).
    in_phases = False
    # Why --compression auto never picks it: the time-to-accuracy table (results/) that shows
    # it missing the target more often than exact; None where none does.
    misses_target: str | None = None

    @property
    def compressing(self) -> bool:
        """Whether the step under way sends the scheme's own wire (not so where it averages
        exactly for a while, as PowerSGD before `start`): what `emulate
        --compression-seconds` paces (emulation/pace.py)."""
        return not self.exact

    @classmethod
    def parse(cls, text: str) -> WireScheme | None:
        """The scheme `text` names, None where it names another; UsageError, one line, for
        this scheme's word with parameters it cannot take."""
        return cls.shared() if text == cls.name else None

    @classmethod
    def shared(cls) -> WireScheme:
        """The one instance of a scheme without parameters or state: the MPI objects it
        makes (`mpi_sum`) live as long as the process, made once."""
        if "_shared" not in cls.__dict__:
            cls._shared = cls()
        return cls._shared

    @classmethod
    def planned(cls) -> list[WireScheme]:
        """The variants the planner weighs beside the other schemes'."""
        return [cls.shared()]

    @abstractmethod
    def wire_bytes(self, model_or_shapes) -> int:
        """Bytes one host hands to the allreduce per step, before the ring's 2(H-1)/H:
        every scheme answers it (a class that does not cannot be made)."""

    def early_wire_bytes(self, model_or_shapes) -> int:
        """Of `wire_bytes`, what leaves during backward with --overlap where the exchange
        otherwise waits for the step's end (a bucketed scheme's buckets are credited as
        the hybrid scheme credits them, not here)."""
        return 0

    def compute_seconds(self, costs, scope: str, model_or_shapes, hosts: int) -> tuple[float, bool]:
        """(seconds per step, estimated?) of this scheme's own compute on `hosts` hosts,
        from `costs` (hybrid/planner.py's HostCosts); `scope` "data" or "hybrid"."""
        return 0.0, False

    def measured_key(self, scope: str) -> str | None:
        """The key of its compute per step in `costs.measured` where the planner may measure
        it (`measure_seconds`); None where its figures are never estimated."""
        return None

    def measure_seconds(self, gradients) -> float:
        """Seconds of one step of its own compute on `gradients` as stand-ins; asked only
        where `measured_key` gives a key (a scheme with compute of its own to time)."""
        raise TypeError(f"{type(self).__name__} has no compute of its own to measure: its "
                        "measured_key is None, so the planner never asks")

    def held_bytes(self, model_or_shapes) -> int:
        """Bytes of state each host holds from step to step, which its checkpoints keep
        (a stateless scheme: none)."""
        return 0

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of it, this host's (no exchange): a stateless scheme's
        name."""
        return {"name": self.name}

    def load_checkpoint_state(self, state: dict, holds_error: bool = True) -> None:
        """A stateless scheme continues from its name alone."""

    # ---------------------------------------------- WHOLE_GRADIENT: what a one-round,
    # stateless scheme need not write (PowerSGD overrides each).
    def next_round(self, totals) -> object | None:
        """After the step's allreduces so far (`totals`, summed over hosts), this host's wire
        for one more round that depends on them, or None: one round is all it needs."""
        return None

    def use_parts(self, count: int) -> None:
        """This host runs `count` logical ranks (a run resumed on fewer hosts), each with
        state of its own: a stateless scheme holds none."""

    def load_part_errors(self, part: int, errors) -> None:
        """The checkpointed state of this host's logical rank `part` (see `use_parts`): a
        stateless scheme holds none."""

    def check_sum(self, summed) -> None:
        """A bucket's sum over the hosts as it came off the wire (the same on every host):
        raise a TrainingError where it cannot be applied. Float32 cannot overflow there."""

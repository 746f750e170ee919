"""PowerSGD: each gradient matrix sent as rank-R factors (Vogels, Karimireddy & Jaggi,
NeurIPS 2019), in one allreduce per step (`powersgd:R`) or, as the paper's Algorithm 1,
epfml/powersgd and torch's powerSGD_hook compute it, in two (`powersgd:R:rounds=2`).

Two rounds: P_h = M Q (Q: last step's, the warm start), summed and orthogonalised; then
Q_h = M^T P, summed; the approximation is P Q^T, its subspace taken from this step's M.
That learns as torch's hook does (AlexNet on MNIST, results/time_to_accuracy-mnist-*):
one round, below, projects this step's M on last step's factor, which on SGD's noisy
gradients holds little of each step's gradient, and it missed the target there.

One round: a gradient of shape out x in (a convolution's out x in*k*k) is approximated
by P Q^T, P out x R and Q in x R: R*(out+in) floats instead of out*in. It alternates,
one step computing Q = M^T P from last step's P, the next P = M Q from last step's Q
(M: this host's gradient plus its error), so each step sends ONE of the two factors of
every matrix, batched with the dense tensors (biases, small matrices) in one allreduce,
where PyTorch's powerSGD_hook sends both in two allreduces that wait for each other.
The factor of last step is the warm start: one step of power iteration on a gradient
that changes slowly tracks its leading subspace. What the approximation leaves out of
a host's M stays in its error buffer and is added to the next step's gradient (error
feedback), so nothing is lost, only delayed.

Hosts contribute n_h/N * g_h (the averaging's weights for uneven shares) and the
factors are summed, so the approximation is of the mean gradient over the global batch.
Each host's error is the part of its own M outside the shared factor's span; their sum
is the mean's M minus the approximation, so what is applied depends only on the mean
gradient: 1 host and H hosts train the same mathematics (to float rounding), and a
checkpoint keeps each host's errors apart (no exchange; any host count may resume it: fewer
hosts as the logical ranks it started on, each part's errors its own (`use_parts`), the
same bits; more, the errors summed on one host).

Every host computes the approximation from the same summed factor, the same bits: the
factor is orthogonalised in float64 (LAPACK's rounding, which depends on the CPU,
stays far below float32's), and P Q^T is summed outer product by outer product
(elementwise operations round the same on every IEEE machine), so replicas never drift.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from hybriddl.errors import UsageError
from hybriddl.hosts.scheme import WHOLE_GRADIENT, WireScheme, gradient_shapes

# The seed of the first P and Q: the same on every host, whatever the run's --seed.
FACTOR_SEED = 0
# The ranks the planner weighs: those its paper and PyTorch's hook use (1 to 4).
PLANNED_RANKS = (1, 2, 4)
# Per rounds a step, the highest rank measured missing the time-to-accuracy target more
# often than exact; a lower rank is lossier, so it misses too, and one round is lossier than
# two at the same rank (AlexNet on MNIST at 64 px, validation 0.90 within 6 epochs, which one
# host exact reaches in 4 of 5 seeds: results/time_to_accuracy-mnist-SimpleBig-1gbit-s1.json).
# Two rounds, rank 4: neither of 2 seeds reached it (0.872 and 0.772 at the cap; rank 2:
# 0.693 and 0.647, and 0.741 and 0.675 with one epoch exact first), one host trained with
# --compression, the same mathematics as H hosts (time_to_accuracy-mnist-SimpleBig-1core-
# powersgd.json); rank 2 on 2 hosts at a 10 ms host step: neither of 2 (1gbit-10ms.json).
# One round, rank 2: none of 5 seeds reached even 0.45 on 2 hosts, where two rounds reached
# it in 5 of 5 (time_to_accuracy-mnist-SimpleBig-1gbit.json); at rank 4 it is lossier than
# two rounds at rank 4. So --compression auto takes none of the planned ranks (1, 2, 4).
# What slows it is compressing the convolutions: two rounds at rank 2 with every convolution
# dense (min_rate=200 on AlexNet) kept within 3 points of exact at every epoch, but reached
# 0.90 in 2 of 5 seeds on an Intel Xeon (exact 4 of 5) and 4 of 5 on an AMD EPYC (exact 3 of
# 5, DDP + powerSGD_hook at rank 2 0 of 5: ...-1core-vs-ddp.json), 6 of 10 against exact's 7;
# with only the last layer dense (min_rate=10), 0 of 2. Not planned: it misses once more.
# VGG16 at 32 px, target 0.78 (...-ComplexSmall-1core-vs-ddp.json): every convolution dense
# (min_rate=500) 3 of 5 as exact's 3 of 5; rank 2 everywhere 0 of 3, the hook's 0 of 5.
# Rank 16, two rounds, on every matrix but the last layer: 1 of 3 (not planned).
MISSES_TARGET_UP_TO_RANK = {1: 4, 2: 4}
MISSES_TARGET_TABLES = {1: "results/time_to_accuracy-mnist-SimpleBig-1gbit.json; two rounds at "
                           "rank 4: results/time_to_accuracy-mnist-SimpleBig-1core-powersgd.json",
                        2: "results/time_to_accuracy-mnist-SimpleBig-1core-powersgd.json"}


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """A gradient as the matrix PowerSGD approximates: out x (everything else), as
    epfml/powersgd views a convolution; None for vectors and scalars."""
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(shape[1:])


@dataclass
class _Group:
    """The compressed matrices of one shape, batched (epfml/powersgd's idea: one bmm each)."""

    shape: tuple[int, int]
    indices: list[int]  # positions in the gradient list
    p: torch.Tensor  # (k, out, R), the same on every host
    q: torch.Tensor  # (k, in, R), the same on every host
    error: torch.Tensor  # (k, out, in), this host's


class PowerSGD(WireScheme):
    """`powersgd:R`: rank-R factors of every gradient matrix, error feedback, warm start.

    `aggregate(gradients, allreduce)` returns the approximate sum over hosts of the
    gradients (each host's already weighted n_h/N), `allreduce` being the transport:
    tensor -> its sum over hosts (the same bits everywhere). The state (factors, errors,
    which factor is next) is `checkpoint_state` / `load_checkpoint_state`.

    A matrix goes dense, in the same allreduce, where R >= min(out, in) (a rank-R
    approximation would be the matrix) or where R*(out+in) >= out*in (the factors are
    no smaller than the matrix): `setup` returns one line naming them.
    """

    name = "powersgd"  # an instance's: powersgd:R[:start=N]
    syntax = "powersgd:R"
    help = ("powersgd:R sends rank-R factors of each gradient matrix with error feedback, also "
            "on one host (inexact, opt-in), one factor a step; powersgd:R:rounds=2 both, in "
            "two allreduces, as Vogels et al. (learns faster); powersgd:R:start=N after N "
            "steps averaged exactly; powersgd:R:min_rate=K sends dense each matrix that "
            "factors make less than K times smaller")
    syntax_note = ("R: PowerSGD's rank, e.g. powersgd:2; powersgd:2:rounds=2 sends P then Q "
                   "each step; powersgd:2:start=100 averages the first 100 steps exactly")
    exact = False
    kind = WHOLE_GRADIENT
    allreduces_per_step = 1
    in_phases = True
    cpu_chunks = True  # on a CPU, local_factor's row chunks (False: a GPU's batched products)

    def __init__(self, rank: int, seed: int = FACTOR_SEED, start: int = 0, rounds: int = 1,
                 min_rate: int = 1):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise UsageError(f"--compression powersgd:{rank}: give a rank of at least 1, "
                             "e.g. powersgd:2")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise UsageError(f"--compression powersgd:{rank}:start={start}: give the first "
                             "compressed step as a whole number of at least 0, e.g. "
                             f"powersgd:{rank}:start=100")
        if rounds not in (1, 2):
            raise UsageError(f"--compression powersgd:{rank}:rounds={rounds}: give 1 round "
                             f"per step (one factor, alternating) or 2 (P then Q, as "
                             f"Vogels et al. and torch's hook), e.g. powersgd:{rank}:rounds=2")
        if isinstance(min_rate, bool) or not isinstance(min_rate, int) or min_rate < 1:
            raise UsageError(f"--compression powersgd:{rank}:min_rate={min_rate}: give the "
                             "least compression rate a matrix must reach to travel as factors "
                             f"as a whole number of at least 1, e.g. powersgd:{rank}:min_rate=10")
        self.rank = rank
        self.seed = seed
        # A matrix travels as factors only where they are at least `min_rate` times smaller
        # than it (torch's hook: min_compression_rate, 2 by default); the others go dense.
        # A high rate keeps a classifier's last layer dense (AlexNet's 4096 x 10 is 5x
        # smaller as rank-2 factors, its convolutions 27-157x, its hidden layers 1000x+).
        self.min_rate = min_rate
        # 1: one allreduce per step, P one step and Q the next, each projecting this step's
        # M on last step's factor. 2: Vogels et al.'s Algorithm 1, as epfml/powersgd and
        # torch's powerSGD_hook: P = M Q summed, orthogonalised, then Q = M^T P summed, the
        # subspace taken from this step's M, in two allreduces that wait for one another.
        self.rounds = rounds
        self.allreduces_per_step = rounds
        self.in_phases = rounds == 1
        # Steps before `start` are averaged exactly (DDP's start_powerSGD_iter): the first
        # steps' gradients change fast, which a warm-started rank-R factor tracks worst.
        # The default is 0 (none): one epoch exact first (start=125) left AlexNet at 64 px,
        # rank 2, two rounds, short of 0.90 in both seeds as start=0 did (0.741 and 0.675
        # against 0.693 and 0.647 at the 6-epoch cap): a warm-up does not make it reach
        # the target (results/time_to_accuracy-mnist-SimpleBig-1core-powersgd.json).
        self.start = start
        self.name = (f"powersgd:{rank}" + (f":start={start}" if start else "")
                     + (f":rounds={rounds}" if rounds != 1 else "")
                     + (f":min_rate={min_rate}" if min_rate != 1 else ""))
        self.step = 0  # from `start`: even steps compute and send Q, odd ones P
        self._exact_step = start > 0  # the step under way averages exactly (begin_step)
        self._shapes: list[tuple[int, ...]] | None = None
        self._groups: list[_Group] = []
        self._dense: list[int] = []
        self._dense_device = torch.device("cpu")
        self._phase_of: dict = {}  # group id / dense position -> 0 or 1 (split_phases)
        self._group_key: dict[int, int] = {}
        self._local: dict[int, torch.Tensor] = {}
        # Logical ranks this host runs (`use_parts`): each one's errors and step factors; the
        # groups' `error` points at the selected part's (part 0's between steps).
        self._part_errors: list[list[torch.Tensor]] = []
        self._locals: list[dict[int, torch.Tensor]] = [self._local]

    def mpi_sum(self, MPI):
        """(datatype, op) MPI sums the wire with: factors and dense tensors are float32,
        which MPI reads and sums itself."""
        return None, MPI.SUM

    @property
    def misses_target(self) -> str | None:
        highest = MISSES_TARGET_UP_TO_RANK.get(self.rounds, 0)
        if self.rank > highest:
            return None
        rounds = "one round" if self.rounds == 1 else f"{self.rounds} rounds"
        return (f"{rounds} at rank {self.rank} <= {highest} missed the time-to-accuracy "
                f"target more often than exact ({MISSES_TARGET_TABLES[self.rounds]})")

    # ------------------------------------------------------------------ the registry's questions
    @classmethod
    def parse(cls, text: str) -> PowerSGD | None:
        """`powersgd:R`, then any of `:start=N`, `:rounds=2` and `:min_rate=K`."""
        scheme, _, rest = text.partition(":")
        if scheme != cls.name:
            return None
        rank, *options = rest.split(":")
        if not rank.strip().lstrip("-").isdigit():
            raise UsageError(f"--compression {text}: give PowerSGD's rank as a whole number, "
                             "e.g. powersgd:2")
        settings = {"start": 0, "rounds": 1, "min_rate": 1}
        for option in options:
            key, equals, value = option.partition("=")
            if key.strip() not in settings or not equals or not value.strip().lstrip("-").isdigit():
                raise UsageError(f"--compression {text}: after the rank, give only the first "
                                 f"compressed step (powersgd:{rank.strip()}:start=100) or the "
                                 f"rounds per step (powersgd:{rank.strip()}:rounds=2), or the "
                                 f"least compression rate (powersgd:{rank.strip()}:min_rate=10)")
            settings[key.strip()] = int(value)
        return cls(int(rank), start=settings["start"], rounds=settings["rounds"],
                   min_rate=settings["min_rate"])

    @classmethod
    def planned(cls) -> list[PowerSGD]:
        return [cls(rank, rounds=rounds) for rounds in (1, 2) for rank in PLANNED_RANKS]

    def early_wire_bytes(self, model_or_shapes) -> int:
        """The first phase's factors (`first_phase`), which --overlap sends during backward."""
        if not self.in_phases:
            return 0
        shapes = gradient_shapes(model_or_shapes)
        first = self.first_phase(self.early_positions(shapes), shapes) if shapes else []
        return self.wire_bytes(shapes, first) if first else 0

    def compute_seconds(self, costs, scope, model_or_shapes, hosts):
        """Measured (`costs.measured`, keyed by `measured_key`), else estimated from the
        per-element figures; the steps before `start` are not predicted (the planner
        predicts the steps after it)."""
        measured = costs.measured.get(self.measured_key(scope))
        if measured is not None:
            return measured, False
        seconds = 0.0
        for shape in gradient_shapes(model_or_shapes):
            if self.compresses(shape):
                n = math.prod(shape)
                # M Q, M^T P and P Q^T (the error), each R products per element; the error
                # added in and the approximation taken out: two element-wise passes.
                seconds += 3 * self.rank * n * costs.matmul + 2 * n * costs.elementwise
        return seconds, True

    def measured_key(self, scope: str) -> str:
        """One key per work done: the rank, the rounds and which matrices go as factors."""
        return (f"{scope}:{self.rank}" + (f":rounds={self.rounds}" if self.rounds != 1 else "")
                + (f":min_rate={self.min_rate}" if self.min_rate != 1 else ""))

    def measure_seconds(self, gradients: Sequence[torch.Tensor]) -> float:
        """Seconds of one step of `aggregate` with the allreduce left out, on `gradients` as
        stand-ins (their values do not change the work), after its set-up, on a fresh
        object of the same rank; a step sends one factor, the next the other, at the same
        cost."""
        fresh = PowerSGD(self.rank, self.seed, rounds=self.rounds,
                         min_rate=self.min_rate)
        fresh.setup([g.shape for g in gradients])
        started = time.perf_counter()
        fresh.aggregate(gradients, lambda wire: wire)
        return time.perf_counter() - started

    # ------------------------------------------------------------------ planning
    def compresses(self, shape: Sequence[int]) -> bool:
        """Whether a gradient of this shape travels as factors (else dense)."""
        matrix = matrix_shape(shape)
        if matrix is None:
            return False
        rows, cols = matrix
        sent = self.rank * (rows + cols)
        return (self.rank < min(rows, cols) and sent < rows * cols
                and rows * cols >= self.min_rate * sent)

    def held_bytes(self, model_or_shapes) -> int:
        """This host's error buffers: every compressed matrix in float32 (the factors, the
        same on every host, are small beside them)."""
        return 4 * sum(math.prod(shape) for shape in gradient_shapes(model_or_shapes)
                       if self.compresses(shape))

    def wire_bytes(self, model_or_shapes, positions: Iterable[int] | None = None) -> int:
        """Bytes one host hands to the allreduces of a step: the dense tensors plus, for
        each compressed matrix, in one round P (out*R) one step and Q (in*R) the next,
        counted as their mean, in two rounds both; of the gradients at `positions` only,
        where given."""
        floats = 0.0
        shapes = gradient_shapes(model_or_shapes)
        if positions is not None:
            shapes = [shapes[i] for i in positions]
        for shape in shapes:
            if self.compresses(shape):
                rows, cols = matrix_shape(shape)
                floats += self.rank * (rows + cols) * self.rounds / 2
            else:
                floats += math.prod(shape)
        return math.ceil(floats) * 4

    def setup(self, shapes: Sequence[Sequence[int]], names: Sequence[str] | None = None,
              device: torch.device | str = "cpu") -> list[str]:
        """Lay out the state for gradients of these shapes (their order is the order
        `aggregate` receives them in); returns the note to show, at most one line."""
        self._shapes = [tuple(int(d) for d in s) for s in shapes]
        names = list(names) if names is not None else [f"#{i}" for i in range(len(shapes))]
        by_shape: dict[tuple[int, int], list[int]] = {}
        self._dense, dense_matrices = [], []
        for i, shape in enumerate(self._shapes):
            if self.compresses(shape):
                by_shape.setdefault(matrix_shape(shape), []).append(i)
            else:
                self._dense.append(i)
                if matrix_shape(shape) is not None:
                    dense_matrices.append(f"{names[i]} {'x'.join(map(str, matrix_shape(shape)))}")
        generator = torch.Generator().manual_seed(self.seed)
        self._dense_device = torch.device(device)
        self._groups = []
        for (rows, cols), indices in by_shape.items():
            k = len(indices)
            # Drawn on the CPU from the seeded generator: the same bits on every host and device.
            p = torch.randn((k, rows, self.rank), generator=generator)
            q = torch.randn((k, cols, self.rank), generator=generator)
            self._groups.append(_Group((rows, cols), indices, p.to(device), q.to(device),
                                       torch.zeros((k, rows, cols), device=device)))
        self._group_key = {i: id(group) for group in self._groups for i in group.indices}
        self._phase_of = {}
        self._part_errors, self._locals = [], [{}]
        self._select(0)
        self.step = 0
        if not dense_matrices:
            return []
        return [f"--compression {self.name} sends {len(dense_matrices)} gradient "
                f"matri{'x' if len(dense_matrices) == 1 else 'ces'} dense, which rank "
                f"{self.rank} factors would not make "
                + (f"at least {self.min_rate} times " if self.min_rate > 1 else "")
                + "smaller: " + ", ".join(dense_matrices)]

    # ------------------------------------------------------------------ one step
    def aggregate(self, gradients: Sequence[torch.Tensor],
                  allreduce: Callable[[torch.Tensor], torch.Tensor],
                  out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The approximate sum over hosts of `gradients`, one call of `allreduce`.

        Every gradient is read before anything is written, so `out` (where the
        approximations go, each where it can: contiguous float32 on the state's device) may
        be `gradients` themselves, which saves a buffer and a copy the size of the model;
        without it the gradients are only read. Every host must call it at the same step
        with gradients of the same shapes.

        A step in parts, as hosts that send early gradients during backward run it:
        `begin_step`, then `local_wire` per phase (each summed over hosts by the caller),
        then `finish_step`; `aggregate` is the same in one allreduce."""
        if self._shapes is None:
            self.setup([g.shape for g in gradients],
                       device=gradients[0].device if gradients else "cpu")
        self.begin_step([g.shape for g in gradients])
        wires = [self.local_wire(gradients, phase) for phase in range(self.phases)]
        device = self._device()
        total = allreduce(torch.cat(wires) if wires else torch.zeros(0, device=device))
        totals, offset = [], 0
        for wire in wires:
            totals.append(total[offset:offset + wire.numel()])
            offset += wire.numel()
        while (wire := self.next_round(totals)) is not None:
            totals.append(allreduce(wire))
        return self.finish_step(totals, out)

    # ------------------------------------------------------------------ a step in phases
    def split_phases(self, early: Iterable[int]) -> list[int]:
        """Send the gradients at positions `early` (those backward writes first) in a
        first allreduce of their own, the others in a second (see `first_phase`). Returns
        the positions the first phase waits for (all of them ready before it can be
        computed); [] where nothing can go first, and then the step stays one allreduce.
        The state and the mathematics are the same either way."""
        if self._shapes is None:
            raise RuntimeError("setup before split_phases")
        first = set(self.first_phase(early))
        self._phase_of = {}
        if first:
            self._phase_of = {id(g): 0 if set(g.indices) <= first else 1 for g in self._groups}
            self._phase_of.update({i: 0 if i in first else 1 for i in self._dense})
        return sorted(first)

    def first_phase(self, early: Iterable[int], shapes=None) -> list[int]:
        """Of the positions `early`, those a first phase can send: the dense ones, and the
        compressed matrices whose every matrix of the same shape is early (matrices of one
        shape are worked on together); [] where that is nothing or everything. `shapes`:
        the gradients' (those of `setup` if not given)."""
        shapes = self._shapes if shapes is None else [tuple(s) for s in gradient_shapes(shapes)]
        early = set(early)
        by_shape: dict[tuple[int, int], list[int]] = {}
        first = []
        for i, shape in enumerate(shapes):
            if self.compresses(shape):
                by_shape.setdefault(matrix_shape(shape), []).append(i)
            elif i in early:
                first.append(i)
        first += [i for indices in by_shape.values() if set(indices) <= early for i in indices]
        return sorted(first) if 0 < len(first) < len(shapes) else []

    def early_positions(self, shapes=None) -> list[int]:
        """The trailing gradients (backward writes them first) whose share of what a step
        sends is at least half: the first phase where hosts overlap. `shapes`: the
        gradients' (those of `setup` if not given)."""
        shapes = self._shapes if shapes is None else [tuple(s) for s in gradient_shapes(shapes)]
        sizes = [self.rank * sum(matrix_shape(shape)) if self.compresses(shape)
                 else math.prod(shape) for shape in shapes]
        half, taken, early = sum(sizes) / 2, 0, []
        for i in reversed(range(len(sizes))):
            if taken >= half:
                break
            early.append(i)
            taken += sizes[i]
        return sorted(early)

    @property
    def phases(self) -> int:
        return 2 if self._phase_of else 1

    def _in_phase(self, key, phase: int) -> bool:
        return self._phase_of.get(key, 0) == phase

    # ------------------------------------------------------------------ logical ranks
    def use_parts(self, count: int) -> None:
        """Run `count` logical ranks on this host (a run resumed on fewer hosts than it
        started on, hosts/mpi.py `use_logical`): each keeps errors of its own, its wire is
        `local_wire(..., part=j)`, and `next_round` gives every part's wire in turn; part 0
        holds the errors the groups show between steps. After `setup`."""
        if count < 1 or self._shapes is None:
            raise ValueError("use_parts(count >= 1) after setup")
        self._part_errors = [[group.error for group in self._groups]] + [
            [torch.zeros_like(group.error) for group in self._groups] for _ in range(count - 1)]
        self._locals = [{} for _ in range(count)]
        self._select(0)

    @property
    def parts(self) -> int:
        return len(self._locals)

    def _select(self, part: int) -> None:
        """Point the groups' errors and this step's factors at logical part `part`'s."""
        if self._part_errors:
            for group, error in zip(self._groups, self._part_errors[part]):
                group.error = error
        self._local = self._locals[part]

    def part_errors(self, part: int) -> list[torch.Tensor]:
        """Logical part `part`'s errors, on the CPU (its checkpoint file's)."""
        errors = self._part_errors[part] if self._part_errors else [g.error for g in self._groups]
        return [error.cpu().clone() for error in errors]

    def load_part_errors(self, part: int, errors: Sequence[torch.Tensor] | None) -> None:
        """Logical part `part`'s errors from a checkpoint (None: zero)."""
        mine = self._part_errors[part] if self._part_errors else [g.error for g in self._groups]
        if errors is not None and [e.shape for e in errors] != [m.shape for m in mine]:
            raise ValueError("its errors are of other shapes")
        for target, error in zip(mine, errors if errors is not None else [None] * len(mine)):
            target.zero_() if error is None else target.copy_(error)

    def begin_step(self, shapes: Sequence[Sequence[int]]) -> None:
        """Start a step with gradients of these shapes (those `setup` was given): the
        factor it uses orthogonalised."""
        shapes = [tuple(int(d) for d in shape) for shape in shapes]
        if shapes != self._shapes:
            raise ValueError(f"{self.name} was set up for gradients of shapes {self._shapes}, "
                             f"given {shapes}")
        self._exact_step = self.step < self.start
        self._sends_q = (self.step - self.start) % 2 == 0
        self._locals = [{} for _ in range(self.parts)]
        self._select(0)
        self._round = 0
        if self._exact_step or self.rounds == 2:
            return  # two rounds: P = M Q from last step's Q as it was summed
        factors = [group.p if self._sends_q else group.q for group in self._groups]
        for factor, done in zip(factors, self._orthogonalised(factors)):
            factor.copy_(done)

    @property
    def compressing(self) -> bool:
        return not self._exact_step

    def local_wire(self, gradients: Sequence[torch.Tensor], phase: int = 0,
                   part: int = 0) -> torch.Tensor:
        """This host's part of the phase's allreduce: the factors of its matrices (this
        host's error buffers updated) and its dense gradients, as one flat tensor on the
        state's device; every gradient of the phase is read here and not after. `part`:
        the logical rank of this host's whose gradients these are (`use_parts`)."""
        self._select(part)
        device = self._device()
        if self._exact_step:
            parts = [g.reshape(-1).to(device) for i, g in enumerate(gradients)
                     if self._in_phase(self._key(i), phase)]
            return torch.cat(parts) if parts else torch.zeros(0, device=device)
        # On a CPU each matrix is worked through in row chunks that stay in cache: M,
        # this host's factor and its error in one pass over the matrix (sending P) or two
        # (sending Q), with matrix-vector products, where whole-matrix products with R
        # columns take about twice as long (scripts/bench_powersgd.py). A GPU's batched
        # products are the fast way there.
        in_chunks = self._in_chunks(device)
        parts = []
        for group in self._groups:
            if not self._in_phase(id(group), phase):
                continue
            if self.rounds == 2 and in_chunks:
                # M = this step's gradient + what earlier approximations left out; P_h = M Q.
                mine = torch.stack([
                    absorb_and_project(group.error[j],
                                       gradients[i].reshape(group.shape).to(device), group.q[j])
                    for j, i in enumerate(group.indices)])
            elif self.rounds == 2:
                for j, i in enumerate(group.indices):
                    group.error[j].add_(gradients[i].reshape(group.shape).to(device))
                mine = torch.bmm(group.error, group.q)
            elif in_chunks:
                mine = torch.stack([
                    local_factor(group.error[j], gradients[i].reshape(group.shape).to(device),
                                 group.p[j] if self._sends_q else group.q[j], self._sends_q)
                    for j, i in enumerate(group.indices)])
            else:
                # M = this step's gradient + what earlier approximations left out.
                for j, i in enumerate(group.indices):
                    group.error[j].add_(gradients[i].reshape(group.shape).to(device))
                if self._sends_q:
                    # Q_h = M^T P, as (P^T M)^T: bmm reads M in its own layout (8x faster
                    # on a 4096 x 9216 matrix than through M's transpose); this host's
                    # error is the part of its M outside span(P), P orthonormal.
                    mine = torch.bmm(group.p.transpose(1, 2), group.error).transpose(1, 2)
                    group.error.baddbmm_(group.p, mine.transpose(1, 2), alpha=-1)
                else:
                    mine = torch.bmm(group.error, group.q)  # P_h = M Q
                    group.error.baddbmm_(mine, group.q.transpose(1, 2), alpha=-1)
            self._local[id(group)] = mine
            parts.append(mine.reshape(-1))
        parts += [gradients[i].reshape(-1).to(device) for i in self._dense
                  if self._in_phase(i, phase)]
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    def next_round(self, totals: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """After the step's allreduces so far (`totals`, summed over hosts, in order), this
        host's wire for one more that depends on them, or None where the step has all it
        needs (`finish_step`). Two rounds: after P, P orthogonalised and Q_h = M^T P (this
        host's error left as M - P Q_h^T, its part outside span(P))."""
        if self.rounds == 1 or self._exact_step or self._round > 0:
            return None
        self._round = 1
        device = self._device()
        in_chunks = self._in_chunks(device)
        offset, summed = 0, []
        for group in self._groups:
            mine = self._locals[0][id(group)]
            summed.append(totals[0][offset:offset + mine.numel()].view(mine.shape))
            offset += mine.numel()
        for group, done in zip(self._groups, self._orthogonalised(summed)):
            group.p.copy_(done)
        parts = []  # every logical part's wire in turn (one, but on a host of fewer)
        for part in range(self.parts):
            self._select(part)
            for group in self._groups:
                if in_chunks:
                    mine = torch.stack([local_factor(group.error[j], None, group.p[j], True)
                                        for j in range(len(group.indices))])
                else:
                    mine = torch.bmm(group.p.transpose(1, 2), group.error).transpose(1, 2)
                    group.error.baddbmm_(group.p, mine.transpose(1, 2), alpha=-1)
                self._local[id(group)] = mine
                parts.append(mine.reshape(-1))
        self._select(0)
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    def finish_step(self, totals: Sequence[torch.Tensor],
                    out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The approximations from each phase's wire summed over hosts (`totals`, in phase
        order; with two rounds, P's and the dense tensors' then Q's), written into `out`
        where they can be (see `aggregate`)."""
        device = self._device()
        shapes = self._shapes
        outputs: list[torch.Tensor | None] = list(out) if out is not None else [None] * len(shapes)
        offsets = [0] * len(totals)

        def take(phase: int, n: int) -> torch.Tensor:
            piece = totals[phase][offsets[phase]:offsets[phase] + n]
            offsets[phase] += n
            return piece

        if self._exact_step:
            for i in range(len(shapes)):
                summed = take(self._phase_of.get(self._key(i), 0), math.prod(shapes[i]))
                outputs[i] = self._place(outputs[i], summed.view(shapes[i]))
            self.step += 1
            return outputs
        if self.rounds == 2:
            return self._finish_two_rounds(totals, outputs, take)
        in_chunks = self._in_chunks(device)
        for phase in range(len(totals)):
            for group in self._groups:
                if not self._in_phase(id(group), phase):
                    continue
                mine = self._local[id(group)]
                summed = take(phase, mine.numel()).view(mine.shape)
                (group.q if self._sends_q else group.p).copy_(summed)
                for j, i in enumerate(group.indices):
                    target = outputs[i]
                    if not _writable(target, device):
                        target = torch.empty(shapes[i], device=device)
                    outer_products(group.p[j], group.q[j], target.view(group.shape),
                                   in_chunks)
                    outputs[i] = target
            for i in self._dense:
                if self._in_phase(i, phase):
                    summed = take(phase, math.prod(shapes[i])).view(shapes[i])
                    outputs[i] = self._place(outputs[i], summed)
        self._locals = [{} for _ in range(self.parts)]
        self._select(0)
        self.step += 1
        return outputs

    def _finish_two_rounds(self, totals, outputs, take) -> list[torch.Tensor]:
        """P Q^T from the summed Q (the second round), the dense tensors from the first."""
        device = self._device()
        in_chunks = self._in_chunks(device)
        for group in self._groups:
            take(0, group.p.numel())  # the summed P, orthogonalised into group.p already
        for i in self._dense:
            outputs[i] = self._place(outputs[i], take(0, math.prod(self._shapes[i]))
                                     .view(self._shapes[i]))
        for group in self._groups:
            mine = self._local[id(group)]
            group.q.copy_(take(1, mine.numel()).view(mine.shape))
            for j, i in enumerate(group.indices):
                target = outputs[i]
                if not _writable(target, device):
                    target = torch.empty(self._shapes[i], device=device)
                outer_products(group.p[j], group.q[j], target.view(group.shape), in_chunks)
                outputs[i] = target
        self._locals = [{} for _ in range(self.parts)]
        self._select(0)
        self.step += 1
        return outputs

    def _in_chunks(self, device: torch.device) -> bool:
        """Whether this step's products go through row chunks in cache (a CPU's way) or
        whole batched products and whole-matrix operations (a GPU's)."""
        return device.type == "cpu" and self.cpu_chunks

    def _orthogonalised(self, factors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The groups' factors orthogonalised: on a GPU in one batch (`orthogonal_all`: a
        launch per operation for every group at once), on a CPU group by group (no launches
        to save, and a batch padded to VGG16's longest Q took 5.9 ms where the groups alone
        took 1.3)."""
        if self._in_chunks(self._device()):
            return [orthogonal(f) for f in factors]
        return orthogonal_all(factors)

    def _key(self, i: int):
        """Where position i's phase is kept: its group's (a compressed matrix) or its own."""
        return self._group_key.get(i, i)

    @staticmethod
    def _place(target: torch.Tensor | None, summed: torch.Tensor) -> torch.Tensor:
        if target is None:
            return summed
        target.copy_(summed)
        return target

    def _device(self) -> torch.device:
        if self._groups:
            return self._groups[0].error.device
        return self._dense_device

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """The state as a checkpoint keeps it, on the CPU: the factors (the same on every
        host) and this host's errors. No exchange: each host's errors are its own (a
        checkpoint keeps them apart, `run/checkpointer.py`), and since every step is linear
        in them, their sum is what carries on (`load_checkpoint_state`'s `holds_error`)."""
        return {"name": self.name, "step": self.step,
                "shapes": [list(s) for s in (self._shapes or [])],
                "p": [g.p.cpu().clone() for g in self._groups],
                "q": [g.q.cpu().clone() for g in self._groups],
                "error": [g.error.cpu().clone() for g in self._groups]}

    def load_checkpoint_state(self, state: dict, holds_error: bool = True) -> None:
        """Continue from `checkpoint_state`'s record: its errors where `holds_error` (this host's
        own, or, on another host count, every host's summed on one host), zero where not
        (the hosts' sum is what carries on). ValueError when the record is of another
        scheme or of other gradients."""
        if state.get("name") != self.name:
            raise ValueError(f"it is {state.get('name')}'s, not {self.name}'s")
        if not {"shapes", "step", "p", "q", "error"} <= state.keys():
            raise ValueError("it holds no factors")
        shapes = [tuple(s) for s in state["shapes"]]
        if self._shapes is None:
            self.setup(shapes)
        if shapes != self._shapes:
            raise ValueError("it is of other gradients (another model, or the other "
                             "--host-parallel scheme)")
        errors = state["error"] if holds_error else [None] * len(self._groups)
        for group, p, q, error in zip(self._groups, state["p"], state["q"], errors):
            if p.shape != group.p.shape or q.shape != group.q.shape or (
                    error is not None and error.shape != group.error.shape):
                raise ValueError("its factors are of other shapes")
            group.p.copy_(p)
            group.q.copy_(q)
            if error is not None:
                group.error.copy_(error)
            else:
                group.error.zero_()
        self.step = int(state["step"])


# Up to this rank factors are orthogonalised by Gram-Schmidt, above it by QR, as torch's
# powerSGD_hook does up to rank 2. Gram-Schmidt is a few batched elementwise operations and
# reductions per column on any device; QR is a LAPACK call on a CPU, a cuSOLVER one on a GPU,
# per group and step. On an H200, one step of hybriddl's powersgd:2 with QR took 13.3 ms for
# AlexNet and 31.3 ms for VGG16 where the hook's took 4.7 and 4.1 ms
# (results/powersgd_cost-gpu.json); how much of that the QR calls were is for a GPU to
# measure (scripts/powersgd_cost.py times QR's step beside this one), not measured since.
# On a GPU every group's factors are orthogonalised in one batch (`orthogonal_all`).
GRAM_SCHMIDT_MAX_RANK = 4
# A column whose part outside the columns before it is this small against the column is
# taken as dependent on them: it starts again from a fixed direction, as a zero one does.
DEPENDENT = 1e-10


def orthogonal(factors: torch.Tensor, fresh: torch.Tensor | None = None) -> torch.Tensor:
    """Orthonormal columns spanning each matrix's (k, n, R), as epfml/powersgd's
    orthogonalize, in float64 so that every host rounds to the same float32 bits.

    A zero column (a matrix whose summed M was exactly zero, as every layer's is at the
    first step behind a zero-initialised head) would stay zero under power iteration for
    ever, its layer frozen while its error grows: it starts again from a fixed direction
    (`fresh`, float64 of the factors' shape; by default `fresh_direction`'s), the same on
    every host, made orthogonal to the columns before it; so does a column that depends on
    them."""
    wide = factors.double()
    if _by_qr(factors.shape[-1]):
        return torch.linalg.qr(wide).Q.to(factors.dtype)
    if fresh is None:
        fresh = fresh_direction(tuple(wide.shape), wide.device)
    if factors.shape[-1] == 1:
        norms = wide.norm(dim=1, keepdim=True)
        wide = torch.where(norms > 0, wide, fresh)
        # Each matrix's own norm (epfml divides the whole batch by one norm).
        return (wide / wide.norm(dim=1, keepdim=True).clamp_min(1e-30)).to(factors.dtype)
    columns: list[torch.Tensor] = []
    for r in range(wide.shape[-1]):
        column = _outside(wide[:, :, r:r + 1], columns)
        kept = column.norm(dim=1, keepdim=True) > DEPENDENT * wide[:, :, r:r + 1].norm(
            dim=1, keepdim=True)
        column = torch.where(kept, column, _outside(fresh[:, :, r:r + 1], columns))
        columns.append(column / column.norm(dim=1, keepdim=True).clamp_min(1e-30))
    return torch.cat(columns, dim=2).to(factors.dtype)


def _by_qr(rank: int) -> bool:
    """Whether factors of this rank are orthogonalised by QR (Gram-Schmidt up to
    GRAM_SCHMIDT_MAX_RANK; rank 1 is only normalised)."""
    return rank > GRAM_SCHMIDT_MAX_RANK


def orthogonal_all(factors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`orthogonal` of every group's factors (each (k, n, R), of one rank and device) as
    one batch: zero rows pad each to the longest n, which changes no norm and no projection,
    and each group's fresh direction is its own, padded likewise; so each group gets the
    columns it gets alone (to float64 rounding, far below float32's), and the operations
    run once a step rather than once per group. On a GPU each is a kernel launch: a step of
    powersgd:2 in the GPU's code path (torch.profiler's top-level operations, views not
    counted, on the CPU) went from 416 to 180 for AlexNet and from 641 to 303 for VGG16
    (two rounds: 425 to 189, 653 to 315); its time on a GPU is not measured yet. Above
    GRAM_SCHMIDT_MAX_RANK, QR group by group. PowerSGD batches so on a GPU only
    (`PowerSGD._orthogonalised`)."""
    if len(factors) < 2 or _by_qr(factors[0].shape[-1]):
        return [orthogonal(f) for f in factors]
    longest = max(f.shape[1] for f in factors)
    device = factors[0].device
    padded = torch.cat([torch.nn.functional.pad(f, (0, 0, 0, longest - f.shape[1]))
                        for f in factors])
    done = orthogonal(padded, _padded_fresh(tuple(tuple(f.shape) for f in factors), device))
    out, start = [], 0
    for f in factors:
        out.append(done[start:start + len(f), :f.shape[1]])
        start += len(f)
    return out


@functools.lru_cache(maxsize=16)
def _padded_fresh(shapes: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """Each shape's `fresh_direction`, zero-padded to the longest and stacked, made once."""
    longest = max(shape[1] for shape in shapes)
    return torch.cat([torch.nn.functional.pad(fresh_direction(shape, device),
                                              (0, 0, 0, longest - shape[1]))
                      for shape in shapes])


def _outside(column: torch.Tensor, orthonormal: list[torch.Tensor]) -> torch.Tensor:
    """`column` (k, n, 1) less its projections on the orthonormal columns given, twice
    (classical Gram-Schmidt run twice keeps float64 orthogonality at any conditioning)."""
    for _ in range(2):
        for q in orthonormal:
            column = column - q * (q * column).sum(dim=1, keepdim=True)
    return column


@functools.lru_cache(maxsize=64)
def fresh_direction(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A fixed float64 direction of this shape (FACTOR_SEED's), drawn once per shape."""
    generator = torch.Generator().manual_seed(FACTOR_SEED)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device)


# Elements of a matrix worked on at a time: ~1 MB, in cache, where a whole matrix's pass
# goes to memory (and a temporary the size of the matrix costs its fresh pages: 0.4 s a
# step for AlexNet's largest layer).
CHUNK_ELEMENTS = 2**18


# On a GPU: chunks that bound the scratch of P Q^T (64 MB; VGG16's largest layer would need
# 411 MB whole) while each operation stays one large kernel.
DEVICE_CHUNK_ELEMENTS = 2**24


def _chunk_rows(cols: int, elements: int | None = None) -> int:
    return max(1, (elements or CHUNK_ELEMENTS) // max(cols, 1))


def _row_chunks(rows: int, cols: int, step: int | None = None):
    step = step or _chunk_rows(cols)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def absorb_and_project(error: torch.Tensor, gradient: torch.Tensor,
                       q: torch.Tensor) -> torch.Tensor:
    """On a CPU, in row chunks: M = error + gradient, into `error`; returns P_h = M Q
    (out x R), the first round of two (Q as last step summed it, not orthonormal: P is
    orthogonalised once summed)."""
    rows, cols = error.shape
    columns = [q[:, r].contiguous() for r in range(q.shape[1])]
    mine = torch.empty((len(columns), rows), dtype=error.dtype)
    for start, stop in _row_chunks(rows, cols):
        chunk = error[start:stop].add_(gradient[start:stop])
        for r, q_r in enumerate(columns):
            torch.mv(chunk, q_r, out=mine[r, start:stop])
    return mine.T


def local_factor(error: torch.Tensor, gradient: torch.Tensor | None, factor: torch.Tensor,
                 sends_q: bool) -> torch.Tensor:
    """One host's part of one matrix on a CPU, its error buffer updated in place:
    M = error + gradient (the error alone where `gradient` is None: already added);
    sending Q, returns Q_h = M^T P (in x R) and leaves M - P Q_h^T;
    sending P, returns P_h = M Q (out x R) and leaves M - P_h Q^T (P or Q orthonormal)."""
    rows, cols = error.shape
    columns = [factor[:, r].contiguous() for r in range(factor.shape[1])]
    if sends_q:
        mine = torch.zeros((len(columns), cols), dtype=error.dtype)
        for start, stop in _row_chunks(rows, cols):
            chunk = error[start:stop]
            if gradient is not None:
                chunk.add_(gradient[start:stop])
            for r, p_r in enumerate(columns):
                mine[r].addmv_(chunk.T, p_r[start:stop])
        # The error needs the whole Q_h: a second pass.
        for start, stop in _row_chunks(rows, cols):
            chunk = error[start:stop]
            for r, p_r in enumerate(columns):
                chunk.addr_(p_r[start:stop], mine[r], alpha=-1)
        return mine.T
    mine = torch.empty((len(columns), rows), dtype=error.dtype)
    for start, stop in _row_chunks(rows, cols):
        chunk = error[start:stop].add_(gradient[start:stop])
        for r, q_r in enumerate(columns):
            torch.mv(chunk, q_r, out=mine[r, start:stop])
        for r, q_r in enumerate(columns):
            chunk.addr_(mine[r, start:stop], q_r, alpha=-1)
    return mine.T


def outer_products(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                   in_chunks: bool = True) -> torch.Tensor:
    """out = P Q^T (P out x R, Q in x R), a sum of R outer products, each operation
    elementwise: the same bits on every host (a matrix product's may depend on its kernel,
    a fused multiply-add on the CPU). `in_chunks` (a CPU): chunk by chunk in cache, one
    pass over `out`; else (a GPU) in chunks of up to DEVICE_CHUNK_ELEMENTS, one kernel
    per operation each, where row chunks of cache size cost 2R-1 launches a chunk
    (AlexNet's 4096 x 9216 layer: 146 chunks; now 3). Either way each element is the same
    sum in the same order."""
    rows, cols = out.shape
    columns_p = [p[:, r:r + 1].contiguous() for r in range(p.shape[1])]
    columns_q = [q[:, r].unsqueeze(0).contiguous() for r in range(q.shape[1])]
    if len(columns_p) == 1:
        return torch.mul(columns_p[0], columns_q[0], out=out)
    chunk = _chunk_rows(cols, CHUNK_ELEMENTS if in_chunks else DEVICE_CHUNK_ELEMENTS)
    scratch = torch.empty((min(rows, chunk), cols), dtype=out.dtype, device=out.device)
    for start, stop in _row_chunks(rows, cols, chunk):
        part = out[start:stop]
        torch.mul(columns_p[0][start:stop], columns_q[0], out=part)
        extra = scratch[:stop - start]
        for p_r, q_r in zip(columns_p[1:], columns_q[1:]):
            torch.mul(p_r[start:stop], q_r, out=extra)
            part.add_(extra)
    return out


def _writable(tensor: torch.Tensor | None, device: torch.device) -> bool:
    return (tensor is not None and tensor.device == device and tensor.dtype == torch.float32
            and tensor.is_contiguous())

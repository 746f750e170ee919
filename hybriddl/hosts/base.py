"""What the trainer asks of the hosts of a run, whichever they are (see cluster.connect)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hybriddl.data import GlobalBatch, HostShare
from hybriddl.data.sharding import split_bounds, split_counts
from hybriddl.emulation.pace import pace, step_done, timed
from hybriddl.errors import TrainingError, UsageError
from hybriddl.machine.naming import host_name
from hybriddl.hosts.compression import Compression
from hybriddl.hosts.scheme import WHOLE_GRADIENT
from hybriddl.hosts.traffic import TrafficMeter, interface_bytes_sent

BALANCE_POLICIES = ("throughput", "even")
DEFAULT_TIMEOUT_SECONDS = 120.0
# An exchange every host is inside, none of whose requests completes for this long, is
# stuck (hosts/mpi.py MPIHosts.wait): a request is one piece of at most 8 MiB, which takes
# 6.7 s at 10 Mbit/s.
DEFAULT_PROGRESS_SECONDS = 60.0


def host_weights(balance: str | None, throughputs: list[float | None]) -> tuple[list[float], str, str | None]:
    """Each host's weight in the split of a global batch, the policy used, and a note.

    `throughputs` are the hosts' images/s (from their profiles or --throughput), None
    where unknown. Without --balance, hosts whose figures differ get throughput
    shares, so a fast host does not wait for a slow one at every step.
    """
    if balance is not None and balance not in BALANCE_POLICIES:
        raise UsageError(f"--balance {balance}: choose one of {', '.join(BALANCE_POLICIES)}")
    for rank, figure in enumerate(throughputs):
        if figure is not None and not figure > 0:
            raise UsageError(f"--throughput {figure} on rank {rank}: give a positive images/s")
    hosts = len(throughputs)
    known = [t for t in throughputs if t is not None]
    if balance is None:
        balance = "throughput" if len(known) == hosts and len(set(known)) > 1 else "even"
    if balance == "even":
        return [1.0] * hosts, "even", None
    if not known:
        return [1.0] * hosts, "even", ("--balance throughput: no host knows its images/s (no "
                                       "profile, no --throughput), so shares stay even")
    fill = statistics.fmean(known)
    note = None
    if len(known) < hosts:
        missing = [r for r, t in enumerate(throughputs) if t is None]
        note = (f"--balance throughput: ranks {missing} have no images/s figure and count "
                f"as the others' mean ({fill:.1f} images/s)")
    return [fill if t is None else float(t) for t in throughputs], "throughput", note


class Exchange:
    """An exchange between hosts that was started and is waited for by `result()` (once)."""

    def __init__(self, value: torch.Tensor):
        self._value = value

    def result(self) -> torch.Tensor:
        return self._value


class Hosts:
    """What the trainer asks of the hosts; the single-host case does no communication.

    Set-up (`agree`, `describe`, `broadcast_parameters`, `attach`); one step (`share` of
    a global batch, then `averaging` its gradient); small collectives (`allgather`,
    `broadcast_object`, `barrier`, `any_true`, `mean_over_hosts`); the end (`close`,
    `abort`). `traffic` meters what this rank handed to MPI.
    """

    rank = 0
    size = 1

    def __init__(self, traffic: TrafficMeter | None = None, compression=Compression.none) -> None:
        self.traffic = traffic or TrafficMeter()
        # What gradients look like on the wire (hosts/compression.py); `use_compression`
        # before `attach` changes it.
        self.compression = compression
        # With a compression of the whole gradient (PowerSGD): the gradients it averages,
        # in the model's parameter order, the same on every host and host count.
        self._compressed: list[nn.Parameter] = []
        # emulate --compression-seconds: the scheme's compute padded to the hosts' (else None).
        self._pace = pace()
        self.notes: list[str] = []  # things the user should know, for the CLI to show
        # Said while it happens (the CLI shows it): a long wait for a host still preparing.
        self.on_notice: Callable[[str], None] = lambda line: None
        self.weights = [1.0] * self.size
        self.balance = "even"
        # A compressed run resumed on fewer hosts than it started on runs its logical ranks
        # (`use_logical`): (first, stop) of each host's, in rank order; None: a rank each.
        self.logical_blocks: list[tuple[int, int]] | None = None
        # Bytes per second the slowest host's link carried when measured (link_rate);
        # None alone or before: what --host-parallel auto predicts communication with.
        self.link_bytes_per_second: float | None = None

    # ------------------------------------------------------------------ set-up
    def describe(self) -> dict:
        return {"count": self.size, "names": [host_name()], "balance": self.balance,
                "weights": self.weights, "compression": self.compression.name,
                "notes": self.notes}

    def agree(self, settings: dict, balance: str | None, throughput: float | None) -> None:
        """Refuse to start when hosts were given different training settings, then decide,
        identically on every host, how global batches are split between hosts."""
        everyone = self.allgather(settings)
        for key in settings:
            values = [host.get(key) for host in everyone]
            if any(v != values[0] for v in values):
                listed = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values))
                raise UsageError(f"hosts disagree on {key} ({listed}): give every host the "
                                 "same training options")
        figures = self.allgather(throughput)
        policies = set(self.allgather(balance))
        if len(policies) > 1:
            raise UsageError(f"hosts disagree on --balance ({sorted(map(str, policies))}): "
                             "give every host the same --balance")
        self.weights, self.balance, note = host_weights(balance, figures)
        if note:
            self.notes.append(note)

    def use_compression(self, compression) -> None:
        """Send gradients as `compression` (hosts/compression.py); before `attach`."""
        self.compression = compression

    def attach(self, model: nn.Module, gradient_hooks: bool = False,
               overlap: bool | None = None, bucket_bytes: int | None = None) -> None:
        """Prepare gradient averaging for `model` (after the strategy set it up).
        `overlap` (None: --overlap's setting) sends buckets during backward where
        `gradient_hooks` allow; `bucket_bytes` caps the fusion buckets' size below
        --fusion-mib's (hybrid's convolutions: see hybrid/parallel.py).

        Alone, there is nothing to sum, but a compression of the whole gradient still
        applies (PowerSGD's approximation and error feedback), so that one host trains
        what H hosts do; `none` and `fp16` change nothing here."""
        self._compressed = [p for p in model.parameters() if p.requires_grad] \
            if self.compression.kind == WHOLE_GRADIENT else []
        if self._compressed:
            names = {id(p): name for name, p in model.named_parameters()}
            self.notes.extend(self.compression.setup(
                [p.shape for p in self._compressed], [names[id(p)] for p in self._compressed],
                self._compressed[0].device))

    def broadcast_parameters(self, model: nn.Module, built_from_seed: bool = False) -> None:
        """Rank 0's initial parameters everywhere; alone, they already are. With
        `built_from_seed` (every host built the model from the run's seed), hosts compare a
        digest and send the parameters only where they differ."""

    # ------------------------------------------------------------------ logical ranks
    @property
    def logical_count(self) -> int:
        """The ranks the run's sums are over: the host count it started on, where a
        compressed run goes on with fewer (`use_logical`); else this run's host count."""
        return self.logical_blocks[-1][1] if self.logical_blocks else self.size

    @property
    def logical_ranks(self) -> range:
        """The logical ranks this host runs, in order (its own rank alone, but where a
        compressed run goes on with fewer hosts)."""
        return range(*self.logical_blocks[self.rank]) if self.logical_blocks \
            else range(self.rank, self.rank + 1)

    def use_logical(self, count: int) -> bool:
        """Run `count` logical ranks, the host count a compressed run started on, on these
        fewer hosts, each host a block of them in turn, so the run trains as it would have
        on `count` hosts, to the bit. False where these hosts cannot (one host without MPI,
        more hosts than `count`, shares that are not even, or an exact scheme): the run then
        goes on with this host count's sums."""
        return False

    def parts(self, share: HostShare) -> list[tuple[int, int]]:
        """(start, stop) of each logical rank's rows within this host's `share`."""
        if not self.logical_blocks:
            return [(0, share.samples)]
        bounds = split_bounds(share.global_samples, [1.0] * self.logical_count)
        first = bounds[self.logical_ranks[0]][0]
        return [(bounds[r][0] - first, bounds[r][1] - first) for r in self.logical_ranks]

    def part_done(self, part: int, samples: int, global_samples: int) -> None:
        """Logical part `part` of this host's has its gradient of `samples` rows in `.grad`:
        hand it to the averaging, which clears `.grad` for the next part."""
        raise RuntimeError("part_done without use_logical")

    def samples_of(self, global_batch: int) -> int:
        """How many of a global batch of `global_batch` samples this host computes (its
        weight's share, after `agree`): what the planner times and predicts."""
        return split_counts(global_batch, self.weights)[self.rank]

    # ------------------------------------------------------------------ one step
    def share(self, batch: GlobalBatch) -> HostShare:
        """This host's part of a global batch, proportional to its weight (its logical
        ranks' parts, where it runs several: `use_logical`)."""
        if self.logical_blocks:
            bounds = split_bounds(len(batch.indices), [1.0] * self.logical_count)
            first, stop = self.logical_ranks[0], self.logical_ranks[-1]
            return HostShare(batch, batch.part(bounds[first][0], bounds[stop][1]))
        return HostShare.of(batch, self.weights, self.rank)

    @contextlib.contextmanager
    def averaging(self, share: HostShare) -> Iterator[Callable[[int], None]]:
        """One step's averaging: enter just before the local strategy computes the
        gradient of `share`, and call what it gives with the samples computed, just after.

        That call leaves the mean gradient over the global batch in every host's
        parameters; the time before it is computation, the time inside it (exposed)
        communication. Gradients may start leaving during backward (overlap) only
        inside this block.
        """
        started = time.perf_counter()
        bytes_at_start = self.traffic.bytes_sent
        nic_at_start = (self.traffic.nic_step_start(interface_bytes_sent())
                        if self.size > 1 else 0)
        self._arm(share)

        def average(samples: int) -> None:
            if samples != share.samples:
                raise TrainingError(f"the local strategy computed {samples} samples but this "
                                    f"host's part of the batch has {share.samples}")
            entered = time.perf_counter()
            self._average(share)
            self.traffic.step_done(bytes_at_start=bytes_at_start,
                                   compute_seconds=entered - started,
                                   comm_seconds=time.perf_counter() - entered,
                                   nic_at_start=nic_at_start,
                                   nic_at_end=(interface_bytes_sent()
                                               if self.size > 1 else 0))

        try:
            yield average
        finally:
            self._disarm()

    def _arm(self, share: HostShare) -> None:
        """Gradients of `share` may be sent from now on."""

    def _average(self, share: HostShare) -> None:
        """Alone, the host's mean gradient already is the global one (compressed as the
        hosts would, where the compression is of the whole gradient)."""
        if self._compressed:
            self._average_compressed(share, self.allreduce_sum)

    def _average_compressed(self, share: HostShare, allreduce) -> None:
        """The whole gradient through the compression (PowerSGD), `allreduce` its transport:
        each host hands it n_h/N of its mean gradient, on the gradients' own device, and
        the approximation of the global mean comes back into `.grad`."""
        scale = share.samples / share.global_samples if share.global_samples else 0.0
        gradients = []
        for p in self._compressed:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            gradients.append(p.grad.mul_(scale) if scale != 1.0 else p.grad)
        # The approximations are written into the gradients where they can be.
        with timed(self._pace):
            for gradient, approximation in zip(
                    gradients, self.compression.aggregate(gradients, allreduce, out=gradients)):
                if approximation is not gradient:
                    gradient.copy_(approximation)
        step_done(self._pace, self.compression.compressing)

    # ------------------------------------------------------------------ compression state
    def compression_state(self) -> dict:
        """The compression's name and this host's state as a checkpoint keeps them: the
        scheme that ran, whatever settled it (`--compression auto`). No exchange."""
        return self.compression.checkpoint_state() if self._compressed \
            else {"name": self.compression.name}

    def restore_compression(self, saved_name: str, saved: dict | None,
                            holds_error: bool | None = None,
                            more_errors: list | None = None) -> str | None:
        """Continue the compression from a checkpoint: `saved_name`, the scheme it was
        written under, and `saved`, its `compression_state` (after `attach`), with the
        errors this host takes where it `holds_error` (default: rank 0, as checkpoints that
        kept the hosts' errors summed have it), and, on a host that runs several logical
        ranks (`use_logical`), `more_errors`: those of its others, in order (None: zero).
        A line to show when that scheme is not this run's, or its state does not fit (the
        compression then starts afresh); None when the run simply goes on."""
        now = self.compression.name
        if saved:  # the scheme that ran (the config may say auto)
            saved_name = saved.get("name", saved_name)
        if saved_name != now:
            steps = "exact" if self.compression.exact else f"{now}'s"
            return (f"--compression {now} resumes a checkpoint of a --compression {saved_name} "
                    f"run: the steps from here on are {steps}")
        if not self._compressed:
            return None
        try:
            if saved is None:
                raise ValueError("it has none")
            self.compression.load_checkpoint_state(
                saved, holds_error=self.rank == 0 if holds_error is None else holds_error)
            for part, errors in enumerate(more_errors or [], start=1):
                self.compression.load_part_errors(part, errors)
        except ValueError as exc:
            return (f"--compression {now}: the checkpoint's state does not fit this run ({exc}); "
                    "its factors and errors start afresh")
        return None

    def _disarm(self) -> None:
        """The step is over: nothing more leaves until the next one is armed."""

    # ------------------------------------------------------------------ small values
    def broadcast_object(self, value):
        """Rank 0's `value` on every host."""
        return value

    def allgather(self, value) -> list:
        """Every host's `value`, in rank order."""
        return [value]

    def barrier(self) -> None:
        """Return when every host has arrived."""

    def broadcast_tensors(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's values of `tensors` written into every host's (alone: they are)."""

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` is true on any host: how all hosts agree to stop at the same step."""
        return bool(flag)

    def mean_over_hosts(self, total: float, samples: int) -> float:
        return total / max(samples, 1)

    def link_rate(self) -> float | None:
        """Bytes per second each host's link carries (the slowest's), measured now."""
        return None

    def link_latency(self) -> float | None:
        """Seconds one small message takes to the next host (the slowest host's), measured
        now; None alone."""
        return None

    # ------------------------------------------------------------------ tensors
    # The collectives of the classifier split across hosts (hybriddl.hybrid). `counts`
    # are every host's number of rows (samples, or a layer's slice), in rank order.
    # Alone, a host already holds every row and every sum.
    def allgather_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every host's rows of `tensor`, concatenated in rank order."""
        return tensor

    def reduce_scatter_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over hosts of `tensor` (the same shape everywhere), cut into rows by
        `counts`: this host's part."""
        return tensor

    def reduce_scatter_half_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """reduce_scatter_rows of a float16 or bfloat16 tensor, summed in that dtype."""
        return tensor

    def allreduce_sum(self, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """The sum over hosts of `tensor`, the same bits on every host (`what`: what the
        exchange is, as a failure names it)."""
        return tensor

    # The same exchanges left running while this host computes: `result()` waits for it.
    # Every host starts them in the same order, and waits for each.
    def start_reduce_scatter_rows(self, tensor: torch.Tensor, counts: list[int]) -> Exchange:
        """reduce_scatter_rows (or, for a 2-byte float tensor, reduce_scatter_half_rows),
        started now."""
        if tensor.dtype in (torch.float16, torch.bfloat16):
            return Exchange(self.reduce_scatter_half_rows(tensor, counts))
        return Exchange(self.reduce_scatter_rows(tensor, counts))

    def gather_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """Every host's rows concatenated on rank 0 (None elsewhere)."""
        return tensor

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Leave cleanly after a successful run."""

    def abort(self, exit_code: int) -> None:
        """Stop every host now (after a failure on this one)."""
        raise SystemExit(exit_code)

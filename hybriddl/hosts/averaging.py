"""The averaging engine: how one step's gradients become their mean over the hosts, in the
way the wire scheme declares (`kind`, hosts/scheme.py), on a transport that moves bytes.

`BucketedAverager`: the fusion buckets (hosts/fusion.py), each turned into the scheme's wire
(`compress`) and summed by MPI as the scheme says, leaving during backward with --overlap
as backward fills them. `WholeGradientAverager`: the step's whole gradient through the
scheme at once (PowerSGD): its wire in one or two phases (with --overlap the trailing
gradients' part leaves during backward), then the rounds that depend on the sums so far
(`next_round`), then the approximation written into the gradients.

The transport (hosts/mpi.py's `MPIHosts`) answers `iallreduce(wire, received)` (requests
summing a CPU tensor over hosts; the buckets'), `start_logical_sum(wire)` (the whole
gradient's: every logical rank's wire summed in logical-rank order, so a run resumed on
fewer hosts as its logical ranks sums the same bits), `logical_ranks`, `wait(requests,
what)` (every wait, with its heartbeat
and deadline), `traffic` and `progress` (the thread that drives requests while backward
runs, or None). Hosts keep transport and membership; this module keeps the arithmetic of
a step's exchange.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from hybriddl.emulation.pace import pace, step_done, timed
from hybriddl.errors import TrainingError
from hybriddl.hosts.compression import Compression
from hybriddl.hosts.fusion import GradientBuckets
from hybriddl.hosts.scheme import BUCKETED, WHOLE_GRADIENT


def host_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty CPU tensor MPI fills for a tensor of `device`: pinned for a GPU, which
    copies from or into it by DMA, without a staging copy (hybrid/parallel.py's
    `to_host` does the same for the features)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous in host memory, where MPI reads it: itself on the CPU, a copy
    from any other device (the Open MPI wheel is not CUDA-aware), made before MPI starts."""
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    return host_empty(tensor.shape, tensor.dtype, tensor.device).copy_(tensor)


def back_to(host: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """What MPI wrote into `host`, on the device of `given` (the tensor it came for): from a
    GPU, copied on that device's current stream without waiting (the caching host allocator
    keeps the pinned buffer until the copy is done)."""
    if given.device.type == "cpu":
        return host
    return given.new_empty(host.shape).copy_(host, non_blocking=True)


class Averager(ABC):
    """One step's averaging of a model's gradients over the hosts (see the module)."""

    def __init__(self, hosts, compression, buckets: GradientBuckets):
        self.hosts = hosts
        self.compression = compression
        self.buckets = buckets
        self._scale = 1.0
        self._requests: list = []
        self._largest = 0
        self.armed = False
        # The gradients the scheme takes whole (WHOLE_GRADIENT), in parameter order.
        self.parameters: list[nn.Parameter] = []

    # Where a step's gradients are ready to leave during backward: (parameter, callback)
    # pairs for post-accumulate hooks; [] where nothing can leave before the step's end.
    def early_hooks(self) -> list[tuple[nn.Parameter, Callable]]:
        return []

    @property
    def phase_positions(self) -> list[list[int]]:
        """How the exchange is split (every host must split it alike); [] for buckets."""
        return []

    def arm(self, scale: float) -> None:
        """A step begins: each host will send `scale` (n_h/N) of its gradient."""
        self._scale = scale
        self._requests = []
        self._largest = 0  # the largest request's bytes, where one is sent whole
        progress = self.hosts.progress
        if progress:
            progress.track(self._requests)
        self.armed = True

    @abstractmethod
    def average(self) -> None:
        """The step's gradients become their mean over the hosts (in `.grad`)."""

    @abstractmethod
    def wire_bytes(self) -> int:
        """Bytes one gradient exchange hands to MPI."""

    def _send(self, wire: torch.Tensor, received: torch.Tensor) -> None:
        self._requests.extend(self.hosts.iallreduce(wire, received))
        self.hosts.traffic.sent(wire.nbytes)


class BucketedAverager(Averager):
    """Fusion buckets, each the scheme's wire, sent in index order (during backward where
    hooks say a bucket is full), summed by MPI into a receive buffer of their own."""

    def __init__(self, hosts, compression, buckets: GradientBuckets):
        super().__init__(hosts, compression, buckets)
        self._received: dict[int, torch.Tensor] = {}  # bucket index -> its allreduce's result
        self._next_to_post = 0
        self._pending: list[set[int]] = [set() for _ in buckets.buckets]

    def early_hooks(self) -> list[tuple[nn.Parameter, Callable]]:
        return [(p, self._gradient_ready) for bucket in self.buckets.buckets for p in bucket.params]

    def arm(self, scale: float) -> None:
        super().arm(scale)
        self._next_to_post = 0
        self._pending = [{id(p) for p in b.params} for b in self.buckets.buckets]

    def _gradient_ready(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        index = self.buckets.bucket_of[id(param)]
        if id(param) not in self._pending[index]:
            raise TrainingError("a parameter's gradient was written twice in one backward "
                                "pass; this strategy must not offer overlap hooks")
        self._pending[index].discard(id(param))
        progress = self.hosts.progress
        with progress.lock:
            self._post_ready_buckets(progress)

    def _post_ready_buckets(self, progress) -> None:
        # Collectives must start in the same order on every host, whichever strategy it
        # runs and whether it overlaps: buckets leave strictly in index order.
        buckets = self.buckets.buckets
        while self._next_to_post < len(buckets) and not self._pending[self._next_to_post]:
            self._post(buckets[self._next_to_post])
            self._next_to_post += 1
            self.hosts.traffic.buckets_sent_in_backward += 1
            progress.wake()

    def _post(self, bucket) -> None:
        self.buckets.gather(bucket)
        if self._scale != 1.0:
            bucket.flat.mul_(self._scale)
        self.compression.compress(bucket.flat, bucket.wire)
        # Out of place: measured on 4 emulated hosts at 1 Gbit/s, Open MPI's in-place
        # Iallreduce sent 2S from two hosts and S from the others (2.8x slower); with a
        # receive buffer every host sends 2(H-1)/H*S, as a ring allreduce does.
        received = self._received.get(bucket.index)
        if received is None:
            received = self._received[bucket.index] = torch.empty_like(bucket.wire)
        self._send(bucket.wire, received)

    def average(self) -> None:
        progress = self.hosts.progress
        if progress:
            progress.release()
        for bucket in self.buckets.buckets[self._next_to_post:]:
            self._post(bucket)
        self._next_to_post = len(self.buckets.buckets)
        try:
            self.hosts.wait(self._requests, "averaging gradients")
        finally:
            self.armed = False
        for bucket in self.buckets.buckets:
            self.compression.check_sum(self._received[bucket.index])
            bucket.flat.copy_(self._received[bucket.index])  # the sum, back in its own dtype
            self.buckets.scatter(bucket)

    def wire_bytes(self) -> int:
        return self.buckets.wire_bytes


class WholeGradientAverager(Averager):
    """The whole gradient through the scheme (PowerSGD), where it is (`.grad`, a bucket's
    view on the CPU, the device's own on a GPU: only the wire crosses to host memory), in
    the model's parameter order, as SingleHost gives it: the same state whatever the host
    count. With `phases` (--overlap) and a scheme that splits its step, the gradients
    backward writes first (the classifier's) leave in an allreduce of their own while
    backward goes on; the rest after it."""

    def __init__(self, hosts, compression, buckets: GradientBuckets, model: nn.Module,
                 phases: bool, notes: list[str]):
        super().__init__(hosts, compression, buckets)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        names = {id(p): name for name, p in model.named_parameters()}
        notes.extend(compression.setup(
            [p.shape for p in self.parameters], [names[id(p)] for p in self.parameters],
            self.parameters[0].device if self.parameters else "cpu"))
        everything = list(range(len(self.parameters)))
        early = (compression.split_phases(compression.early_positions())
                 if phases and compression.in_phases else [])
        self._phase_positions = ([early, [i for i in everything if i not in set(early)]]
                                 if early else [everything])
        self._early_pending: set[int] = set()
        # Each phase's exchange once sent: (wire, its host copy, every logical rank's wire).
        self._phases_sent: list[tuple] = []
        self._step_begun = False
        # On a host that runs several logical ranks (`take_part`): each phase's wires, one
        # per part, computed as each part's gradient is done.
        self._part_wires: list[list[torch.Tensor]] = []
        # emulate --compression-seconds: the scheme's compute padded to the hosts' (else None).
        self._pace = pace()

    @property
    def phase_positions(self) -> list[list[int]]:
        return self._phase_positions

    def early_hooks(self) -> list[tuple[nn.Parameter, Callable]]:
        if len(self._phase_positions) < 2:
            return []
        return [(self.parameters[i], self._early_gradient_ready) for i in self._phase_positions[0]]

    def arm(self, scale: float) -> None:
        super().arm(scale)
        parts = len(self.hosts.logical_ranks)
        # Several logical ranks: each part's backward ends before its wire is made.
        if len(self._phase_positions) > 1 and parts == 1:
            self._early_pending = {id(self.parameters[i]) for i in self._phase_positions[0]}
        self._phases_sent = []
        self._step_begun = False
        self._part_wires = [[] for _ in self._phase_positions] if parts > 1 else []

    def take_part(self, part: int, scale: float) -> None:
        """Logical part `part` of this host's (hosts/mpi.py `use_logical`) has its gradient in
        `.grad`: its wire for every phase, as that logical rank's own host would make it
        (`scale`: its n_l/N), then its gradients cleared for the next part."""
        with timed(self._pace):
            if not self._step_begun:
                self.compression.begin_step([p.shape for p in self.parameters])
                self._step_begun = True
            for p in self.parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif scale != 1.0:
                    p.grad.mul_(scale)
            gradients = [p.grad for p in self.parameters]
            for phase, wires in enumerate(self._part_wires):
                wires.append(self.compression.local_wire(gradients, phase, part))
            for gradient in gradients:
                gradient.zero_()

    def _early_gradient_ready(self, param: nn.Parameter) -> None:
        """A gradient of the first phase is written; the last one sends the phase."""
        if not self.armed or id(param) not in self._early_pending:
            return
        self._early_pending.discard(id(param))
        if not self._early_pending and not self._phases_sent:
            self._send_phase(0)
            self.hosts.traffic.buckets_sent_in_backward += 1

    def _send_phase(self, phase: int) -> None:
        """This host's part of one phase: its gradients scaled by n_h/N, the scheme's wire
        for them, and that wire's allreduce started (driven by the progress thread while
        backward runs)."""
        with timed(self._pace):
            if not self._step_begun:
                self.compression.begin_step([p.shape for p in self.parameters])
                self._step_begun = True
            for i in self._phase_positions[phase]:
                p = self.parameters[i]
                if p.grad is None:  # a host with no samples this step: a zero gradient
                    p.grad = torch.zeros_like(p)
                if self._scale != 1.0:
                    p.grad.mul_(self._scale)
            wire = self.compression.local_wire([p.grad for p in self.parameters], phase)
        self._post(wire)

    def _post(self, wire: torch.Tensor) -> None:
        progress = self.hosts.progress
        with progress.lock if progress else contextlib.nullcontext():
            self._phases_sent.append(self._start(wire))
            if progress:
                progress.wake()

    def _start(self, wire: torch.Tensor) -> tuple:
        """`wire` (this host's logical ranks' wires in turn) summed over every logical
        rank, in logical-rank order (hosts/mpi.py `LogicalSum`), started from host memory:
        (wire, its host copy, the sum under way), each kept until the sum is taken.

        Not MPI's allreduce, whose order is set by the host count: in logical-rank order
        the sum has the same bits whatever host runs which logical rank, so a compressed
        run resumed on fewer hosts trains as the uninterrupted one, bit for bit (PowerSGD's
        error feedback carries any other rounding into every later step)."""
        host_wire = to_host(wire.detach())
        exchange = self.hosts.start_logical_sum(host_wire)
        self._requests.extend(exchange.requests)
        self._largest = max(self._largest, host_wire.nbytes)
        self.hosts.traffic.sent(host_wire.nbytes)
        return wire, host_wire, exchange

    def _summed(self, started: list[tuple]) -> list[torch.Tensor]:
        """The sums of started exchanges whose first part is done, on their wires' devices:
        each host's slice summed, then gathered."""
        self._requests = [request for _, _, exchange in started
                          for request in exchange.gather()]
        self.hosts.wait(self._requests, "averaging gradients", continues=True,
                        largest=self._largest)
        return [back_to(exchange.total, wire) for wire, _, exchange in started]

    def average(self) -> None:
        try:
            progress = self.hosts.progress
            if progress:
                progress.release()
            if self._part_wires:  # several logical ranks: every part's wire is made
                for wires in self._part_wires:
                    self._post(torch.cat(wires))
            for phase in range(len(self._phases_sent), len(self._phase_positions)):
                self._send_phase(phase)
            self.hosts.wait(self._requests, "averaging gradients", largest=self._largest)
            totals = self._summed(self._phases_sent)
            # A round that depends on the sums so far (PowerSGD's Q after its P).
            while True:
                with timed(self._pace):
                    wire = self.compression.next_round(totals)
                if wire is None:
                    break
                self._requests = []
                sent = self._start(wire)  # kept while MPI reads it
                self.hosts.wait(self._requests, "averaging gradients", largest=self._largest)
                totals += self._summed([sent])
            gradients = [p.grad for p in self.parameters]
            # The approximations are written into the gradients where they can be.
            with timed(self._pace):
                compressed = self.compression.compressing
                for gradient, approximation in zip(
                        gradients, self.compression.finish_step(totals, out=gradients)):
                    if approximation is not gradient:
                        gradient.copy_(approximation)
            step_done(self._pace, compressed)
        finally:
            self.armed = False
            self._phases_sent = []
            self._part_wires = []

    def wire_bytes(self) -> int:
        return self.compression.wire_bytes([p.shape for p in self.parameters])


def averager_for(hosts, compression, model: nn.Module, bucket_bytes: int, phases: bool,
                 notes: list[str], follow_layout: bool = True) -> Averager:
    """The averager of the scheme's declared kind for `model`. The buckets hold the
    gradients themselves (their views), also where the scheme takes the whole gradient;
    `follow_layout`: see GradientBuckets."""
    if compression.kind == BUCKETED:
        return BucketedAverager(hosts, compression,
                                GradientBuckets(model, compression, bucket_bytes, follow_layout))
    if compression.kind == WHOLE_GRADIENT:
        return WholeGradientAverager(
            hosts, compression,
            GradientBuckets(model, Compression.none, bucket_bytes, follow_layout),
            model, phases, notes)
    raise ValueError(f"--compression {compression.name} declares averaging of kind "
                     f"{compression.kind!r}, which hosts/averaging.py does not know")

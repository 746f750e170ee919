"""The same model on every host, checked while training runs, not only at the start.

Every host applies the same update to the same parameters, so the replicas stay equal bit
for bit: that is assumed by the averaging and by every checkpoint (rank 0's). It holds
only while every host computes the same bits: hosts with other CPUs or libraries (a GPU
host beside CPU hosts, PowerSGD's factors orthogonalised by another LAPACK) can drift by
one unit in the last place, then further. `ReplicaCheck` compares a checksum of each
replicated tensor across hosts every `every` steps and at every checkpoint; on a mismatch
it names the hosts and the first tensor that differs with its largest difference, then
resyncs every replicated tensor from rank 0 (or, strict, stops the run).

The checksum is the sum, in int64, of a tensor's bits read as int32 (float32's; bytes for
other dtypes): one unit in the last place anywhere changes it, and it reads memory once
(AlexNet's 61 M parameters: about 0.05 s on one core, against 0.35 s for sha256).
"""

from __future__ import annotations

import hashlib
import math
import time

import torch

from hybriddl.errors import TrainingError

# The share of a step the check may take, when --check-every is left out.
CHECK_SHARE = 0.01


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """One int64 sum of each tensor's bits (int32 words where it has 4-byte elements)."""
    sums = []
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1)
        words = data.view(torch.int32) if data.element_size() == 4 else data.view(torch.uint8)
        sums.append(words.sum(dtype=torch.int64))
    return [int(s) for s in torch.stack(sums).cpu()] if sums else []


class ReplicaCheck:
    """Checks that every host holds the same `named` tensors (name, tensor) of its model."""

    def __init__(self, hosts, named: list[tuple[str, torch.Tensor]], every: int | None,
                 strict: bool = False):
        self.hosts, self.named, self.strict = hosts, named, strict
        self.every = every
        self.enabled = hosts.size > 1 and bool(named)
        self.checks = 0
        self.mismatches: list[str] = []
        self._seconds: list[float] = []
        started = time.perf_counter()
        if self.enabled:
            checksums([t for _, t in named])
        self.seconds = time.perf_counter() - started  # one checksum of the model here

    def settle_every(self, step_seconds: float) -> int | None:
        """--check-every left out: as often as costs CHECK_SHARE of a step (the slowest
        host's figures, the same on every host). Collective."""
        if self.every is None and self.enabled:
            worst = max(self.hosts.allgather((self.seconds, step_seconds)))
            self.every = max(1, math.ceil(worst[0] / (CHECK_SHARE * max(worst[1], 1e-9))))
        return self.every

    def due(self, steps_done: int) -> bool:
        return self.enabled and self.every is not None and steps_done % self.every == 0

    def after_step(self, steps_done: int, seconds: float) -> str | None:
        """After every step on every host: the interval settled after this attempt's
        third step (left out: from the median of its first three), then a check where due."""
        if not self.enabled:
            return None
        self._seconds.append(seconds)
        if self.every is None and len(self._seconds) == 3:
            self.settle_every(sorted(self._seconds)[1])
        return self.check(f"after step {steps_done}") if self.due(steps_done) else None

    def describe(self) -> dict:
        return {"check_every": self.every, "strict": self.strict, "checks": self.checks,
                "checksum_seconds": round(self.seconds, 6), "mismatches": self.mismatches}

    def check(self, where: str) -> str | None:
        """Compare the hosts' tensors (collective); None when equal, else the line that
        says who differs where, after resyncing from rank 0 (strict: TrainingError)."""
        if not self.enabled:
            return None
        self.checks += 1
        tensors = [t for _, t in self.named]
        mine = checksums(tensors)
        # 32 bytes from every host (the same on each, whatever the sums), the sums
        # themselves only where the hosts differ.
        digests = self.hosts.allgather(hashlib.sha256(repr(mine).encode()).digest())
        differ = [r for r, digest in enumerate(digests) if digest != digests[0]]
        if not differ:
            return None
        every = self.hosts.allgather(mine)
        first = next(i for i in range(len(tensors)) if any(s[i] != every[0][i] for s in every))
        reference = tensors[first].detach().clone()
        self.hosts.broadcast_tensors([reference], "receiving rank 0's tensor to compare")
        largest = float((tensors[first].detach().double() - reference.double()).abs().max())
        largest = max(self.hosts.allgather(largest))
        names = getattr(self.hosts, "names", None) or [f"{r}" for r in range(self.hosts.size)]
        who = ", ".join(f"rank {r} on host {names[r]}" for r in differ)
        line = (f"hosts differ {where}: {who} hold other values than rank 0, first in "
                f"{self.named[first][0]} (largest difference {largest:.3g})")
        self.mismatches.append(line)
        if self.strict:
            raise TrainingError(f"{line}; --strict-equal stops the run")
        self.hosts.broadcast_tensors(tensors, "receiving rank 0's parameters")
        return f"{line}; every host now holds rank 0's (--strict-equal would stop)"

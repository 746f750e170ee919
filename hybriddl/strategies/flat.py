"""Horovod's execution model as a strategy: this MPI rank is one sequential worker.

Started as `mpirun -np (hosts x workers)`, every rank is its own "host" to the MPI
layer, so all gradients are fused and allreduced across all ranks by the same code
the hybrid uses (ARCHITECTURE.md, "Layers": comparison). Horovod 0.28.1 itself
does not build against current PyTorch; its execution model is what the comparison
needs, not its C++ background loop.
"""

from __future__ import annotations

from hybriddl.errors import UsageError
from hybriddl.strategies.sequential import Sequential


class Flat(Sequential):
    name = "flat"
    summary = "Horovod's model: one MPI rank per worker, each sequential (for compare)"

    @classmethod
    def tuning_candidates(cls, host, batch_size: int) -> list:
        return []  # a launch model for `compare`, not a way for one host to compute

    @classmethod
    def check_feasible(cls, options) -> None:
        if options.workers not in (None, 1):
            raise UsageError(f"--strategy flat runs one worker per MPI rank, not {options.workers}: "
                             "leave --workers out and start hosts x workers ranks with mpirun -np")

    def describe(self) -> dict:
        return {"name": self.name, "model": "Horovod: one MPI rank per worker, each sequential, "
                                            "gradients allreduced across all ranks"}

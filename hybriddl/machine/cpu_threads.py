"""The one owner of torch's intra-op thread count.

OpenMP thread counts are per process and per calling thread, and a count left behind by
one strategy slows the next (a tuner measures many in one process). Every place hybriddl
decides how many cores torch's operators may use goes through here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def set_torch_threads(count: int) -> None:
    """From now on, in this process (and, under OpenMP, this thread), use `count` threads."""
    torch.set_num_threads(count)


@contextmanager
def torch_threads(count: int | None = None) -> Iterator[int]:
    """Run the body with `count` threads (None: as now); the caller's count comes back after.

    Yields the caller's count.
    """
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield previous
    finally:
        torch.set_num_threads(previous)

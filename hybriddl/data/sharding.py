"""How a batch is cut into parts: hosts' shares of a global batch, workers' sub-batches."""

from __future__ import annotations

from collections.abc import Sequence


def split_counts(n: int, weights: Sequence[float]) -> list[int]:
    """Cut n samples into len(weights) parts proportional to weights, summing to n exactly.

    Largest-remainder rounding, ties to the lower index: deterministic, so every host
    computes the same split of every global batch.
    """
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    total = float(sum(weights))
    exact = [n * w / total for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def split_bounds(n: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """(start, stop) of each part of split_counts, in order."""
    bounds, start = [], 0
    for count in split_counts(n, weights):
        bounds.append((start, start + count))
        start += count
    return bounds

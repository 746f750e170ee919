"""The theory beside every measurement of `hybriddl compare`: the bytes an allreduce sends.

A ring over P ranks sends 2(P-1)/P of the gradient S per rank; with K ranks per host placed
host-contiguously only one ring edge per host crosses a NIC, so each host NIC sends
2(HK-1)/(HK) S; one rank per host (or a hierarchical allreduce, which reduces inside each
host first) 2(H-1)/H S.
"""

from __future__ import annotations


def ring_bytes_per_rank(payload_bytes: float, ranks: int) -> float:
    """What each rank of a ring allreduce over `ranks` sends: 2(P-1)/P of the payload."""
    return 2 * (ranks - 1) / ranks * payload_bytes


def host_nic_theory(algorithm: str, payload_bytes: float, hosts: int, ranks: int) -> float:
    """Bytes each host's NIC sends per allreduce of `payload_bytes`.

    A ring over P ranks placed host-contiguously crosses each host's NIC on one edge, so a
    host sends what one rank sends, 2(P-1)/P S; a hierarchical allreduce (reduce within
    the host, allreduce between hosts, broadcast within) sends what a ring of one rank per
    host does, 2(H-1)/H S.
    """
    if algorithm == "ring":
        return ring_bytes_per_rank(payload_bytes, ranks)
    if algorithm == "hierarchical":
        return ring_bytes_per_rank(payload_bytes, hosts)
    raise ValueError(f"no theory for allreduce {algorithm!r}")


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int,
                      min_compression_rate: float = 2) -> int:
    """Elements one step of PyTorch's powerSGD_hook allreduces, once compressing: each
    tensor is viewed as a matrix of shape[0] rows; one it compresses sends its factors
    P (n x r) and Q (m x r), r = min(n, m, rank), which it does when (n + m) r times
    `min_compression_rate` is below n m (PowerSGDState's default rate, 2); every other
    tensor (biases, small matrices) is sent whole."""
    sent = 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        n = shape[0] if shape else 1
        m = numel // n if n else 0
        r = min(n, m, rank)
        factors = (n + m) * r
        sent += factors if factors * min_compression_rate < numel else numel
    return sent

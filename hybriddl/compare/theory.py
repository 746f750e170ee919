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

"""A rank takes its launcher's cores back and shares them with the ranks of its machine."""

from __future__ import annotations

import pytest

from hybriddl.machine import affinity


@pytest.fixture
def machine(monkeypatch):
    """A 4-core machine where mpirun bound this rank to core 0; what it pins is kept."""
    state = {"cores": {0}, "threads": None}
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: set(state["cores"]))
    monkeypatch.setattr(affinity.os, "sched_setaffinity",
                        lambda pid, cores: state.update(cores=set(cores)))
    monkeypatch.setattr(affinity, "launcher_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(affinity, "set_torch_threads",
                        lambda n: state.update(threads=n))
    return state


def test_a_rank_alone_on_its_host_takes_every_core_back(machine):
    cores, notes = affinity.take_cores(1, 0, lambda usable: [usable], "h0", 0)
    assert cores == [0, 1, 2, 3] and machine["threads"] == 4
    assert notes == ["mpirun had bound rank 0 to cores [0]; alone on its host, it uses all 4 cores"]


def test_ranks_sharing_a_machine_divide_its_cores(machine):
    cores, notes = affinity.take_cores(2, 1, lambda usable: [usable, usable], "h0", 1)
    assert cores == [2, 3] and machine["cores"] == {2, 3} and machine["threads"] == 2
    assert "2 ranks share host h0 (4 cores): 2 core(s) each" in notes[0]


def test_more_ranks_than_cores_are_oversubscribed(machine):
    cores, notes = affinity.take_cores(5, 4, lambda usable: [usable] * 5, "h0", 4)
    assert cores == [0] and "oversubscribed" in notes[0]

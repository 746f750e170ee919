"""scripts/scaling.py: the table is the sum of two measured parts, and says what it could
not measure or measured in parts."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO


def load_scaling():
    spec = importlib.util.spec_from_file_location("scaling", REPO / "scripts" / "scaling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


scaling = load_scaling()


def compute_row(kind, hosts, seconds):
    return {"usecase": "SimpleBig", "model": "alexnet", "kind": kind, "hosts": hosts,
            "seconds": seconds, "seconds_spread": [seconds * 0.9, seconds * 1.1]}


def comm_row(kind, hosts, seconds, parts=1):
    return {"usecase": "SimpleBig", "model": "alexnet", "kind": kind, "hosts": hosts,
            "bandwidth": "1gbit", "parts": parts, "seconds": seconds,
            "seconds_spread": [seconds, seconds], "host_nic_bytes_sent": [1, 1],
            "host_nic_bytes_theory": [1, 1]}


def test_the_table_adds_compute_and_communication_and_marks_parts_and_gaps():
    compute = {"phase": "compute", "image_size": 64, "batch_size": 64, "workers_per_host": 2,
               "strategies": {}, "rows": [compute_row("hybrid", 1, 0.8),
                                          compute_row("hybrid", 2, 0.5),
                                          compute_row("flat", 1, 1.0),
                                          compute_row("flat", 2, 0.6)]}
    comm = {"phase": "communication", "rows": [comm_row("flat", 1, 0.2),
                                               comm_row("hybrid", 2, 0.3, parts=2)],
            "not_measured": [{"usecase": "SimpleBig", "kind": "flat", "hosts": 2,
                              "bandwidth": "1gbit", "reason": "memory"}]}
    table = scaling.combine([compute, comm])
    rows = {(r["kind"], r["hosts"]): r for r in table["rows"]}
    hybrid2 = rows[("hybrid", 2)]
    assert hybrid2["step_seconds"] == pytest.approx(0.8)  # 0.5 compute + 0.3 communication
    assert hybrid2["speedup"] == pytest.approx(1.0) and hybrid2["efficiency"] == pytest.approx(0.5)
    assert hybrid2["communication_parts"] == 2
    assert rows[("hybrid", 1)]["communication_seconds"] == 0.0  # one host sends nothing
    assert rows[("flat", 1)]["images_per_second"] == pytest.approx(64 / 1.2)
    assert rows[("flat", 2)]["measured"] is False
    assert table["not_measured"][0]["reason"] == "memory"
    text = scaling.markdown(table)
    assert "| hybrid | 2 | 0.500 | 0.300 (in 2 parts) | 0.800 |" in text
    assert "| Horovod K=2 | 2 | not measured |" in text


def test_a_gradient_is_split_only_as_far_as_memory_needs():
    gradient = 537_091_340  # VGG16's float32 gradient
    available = 22e9

    assert [scaling.parts_to_fit(r, gradient, 0.6 * available, 8) for r in (2, 4, 8, 16)] \
        == [1, 1, 2, 5]
    assert scaling.parts_to_fit(64, gradient, 0.6 * available, 8) is None
    assert scaling.rank_bytes(228_064_524) == pytest.approx(1.2e9, rel=0.05)  # measured 1.13 GB

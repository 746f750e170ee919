"""Fixtures of the test modules that hold training runs in child processes (held_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from held_run import kill_leftovers
from sample_data import write_tinted_classes


@pytest.fixture(autouse=True)
def no_held_run_left():
    """No held child outlives its test, whether the test passed or not."""
    yield
    kill_leftovers()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """3 tinted classes of 6 images each (the checkpoint tests' data)."""
    return write_tinted_classes(tmp_path_factory.mktemp("images"))

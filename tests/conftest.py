"""Fixtures shared by the test modules."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["two_at_once"]  # which tests may run two at once
# Tests load scripts/ by file (importlib); their shared helper (bench_common) is then
# found as when a script runs, with scripts/ on the path.
sys.path.insert(0, str(REPO / "scripts"))


def hybriddl_env(**extra: str) -> dict:
    """Environment for a child `python -m hybriddl`: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 600, cwd: Path | None = None,
            **env: str) -> subprocess.CompletedProcess:
    """Run `python -m hybriddl ARGS` in a child process; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "hybriddl", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=hybriddl_env(**env))


@pytest.fixture
def cli():
    return run_cli


def run_cli_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`hybriddl ARGS` through the same main() as `python -m hybriddl`, in this process.

    For refusals that happen before anything runs: it saves an interpreter start and a
    torch import per case (seconds each, most of such a test's time). An exception main()
    lets through fails the test, as a traceback would in a child's stderr."""
    from hybriddl.cli import main

    out, err, previous = io.StringIO(), io.StringIO(), Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's refusals and --help
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(["hybriddl", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli_here():
    return run_cli_here


@pytest.fixture(scope="session", autouse=True)
def profile_dir(tmp_path_factory):
    """Where runs with --strategy auto (the default) keep profiles during the tests: a
    temporary folder, so tests never write the checkout's profiles/ and never read a
    profile measured outside them."""
    path = tmp_path_factory.mktemp("profiles")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDDL_PROFILES", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def glibc_allocator():
    """`python -m hybriddl` in the tests runs on glibc's allocator, as a test's figures were
    taken, without measuring the host's fastest first (about a minute);
    tests/test_allocator_choice.py chooses its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDDL_ALLOCATOR", "glibc")
        yield


@pytest.fixture(scope="session", autouse=True)
def data_cache_dir(tmp_path_factory):
    """Where streamed data are cached during the tests (the default cache directory
    follows $XDG_CACHE_HOME): never the user's own ~/.cache."""
    path = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(path))
        yield path / "hybriddl"

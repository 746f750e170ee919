"""A reference run that trains while a test's own runs wait (a host timeout, a deadline, a
launcher's relaunch): started at once, waited for only where its result is compared.
Nothing in it is timed; its result is what the same command run to the end gives."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import hybriddl_env


class ReferenceRun:
    """`argv` started now in a child process (its output kept); `run_dir()` waits for it
    to end, checks it succeeded and returns `run_dir`."""

    def __init__(self, argv: list[str], run_dir: Path, timeout: float = 300):
        self._run_dir, self._timeout = run_dir, timeout
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=hybriddl_env())
        self.output: str | None = None

    def run_dir(self) -> Path:
        if self.output is None:
            self.output, _ = self.process.communicate(timeout=self._timeout)
        assert self.process.returncode == 0, self.output[-3000:]
        return self._run_dir

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

    def __enter__(self) -> ReferenceRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

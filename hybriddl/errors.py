"""Errors the user can fix. The CLI turns them into one line and exit code 2."""

import signal


class UsageError(Exception):
    """Bad input: the message says what is wrong and what to do about it."""


class TrainingError(Exception):
    """Training could not go on (non-finite loss, a failed host, ...)."""


class StorageError(TrainingError):
    """A file of the run could not be written (disk full, read-only, I/O error)."""


class TrainingInterrupted(Exception):
    """A stop was requested (SIGTERM, SIGINT); the run's checkpoint is written, workers stopped.

    The CLI turns it into one line saying how to resume, and exit code 128 + signal number
    (143 for SIGTERM, 130 for SIGINT), as a shell reports a process killed by that signal.
    """

    def __init__(self, run_dir, signum: int, epoch: int, step: int):
        self.run_dir, self.signum, self.epoch, self.step = run_dir, signum, epoch, step
        super().__init__(f"stopped by {signal_name(signum)} at epoch {epoch + 1}, step {step}; "
                         f"checkpoint written; continue with: hybriddl train --resume {run_dir}")

    # A stop before the run's first step (a subclass's): what it ended, as the other hosts
    # say it, and what to do then.
    ended = "prepared the run"
    again = "run the same command again"

    @classmethod
    def on_another_host(cls, signum: int, rank: int):
        """What a host says when rank `rank` was stopped in its own work before the first
        step (every host stops there together)."""
        return cls.saying(signum, f"stopped while rank {rank} {cls.ended}; {cls.again}")

    @classmethod
    def saying(cls, signum: int, message: str):
        """A stop with `message` of its own (a stop before the run's first step: nothing
        to resume, so no checkpoint to name)."""
        stopped = cls.__new__(cls)
        Exception.__init__(stopped, message)
        stopped.signum = signum
        return stopped

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

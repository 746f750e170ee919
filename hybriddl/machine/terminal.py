"""What the MPI ranks a command starts are told about where their output goes.

Open MPI gives every rank a pseudo-terminal for its stdout, whatever mpirun's own stdout is
(`mpirun -np 1 python -c "import sys; print(sys.stdout.isatty())" > log` writes True), so a
rank's rich console drew for an 80-column terminal, colour codes included, into a SLURM
job's log or any file mpirun's output went to. Only the process that starts mpirun knows
where that output goes: where it is not a terminal, the ranks are told so through rich's
own variable, TTY_COMPATIBLE=0 (rich >= 14): no colour codes and no animation, and
display.py's width for a log.

It also says which signals stop a command that supervises others (`stop_signals`).
"""

from __future__ import annotations

import signal
import sys
from typing import TextIO

NOT_A_TERMINAL = "TTY_COMPATIBLE=0"


def rank_output_flags(output: TextIO | None = None, *, logged: bool = False) -> list[str]:
    """mpirun's `-x` flag that tells its ranks their output is not a terminal, where
    `output` (what mpirun's stdout is: this process's by default) is not one, or where
    `logged`: mpirun's output goes to a log file whatever this process's is (compare's
    contenders); else none."""
    if logged:
        return ["-x", NOT_A_TERMINAL]
    stream = sys.stdout if output is None else output
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        terminal = False
    return [] if terminal else ["-x", NOT_A_TERMINAL]


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a command supervising processes in sessions of their own
    (`launch`'s mpirun, `emulate`'s hosts): Ctrl-C, SIGTERM and the terminal's hangup
    (a closed terminal or ssh session), which would otherwise end the supervisor alone and
    leave those processes running; not the hangup where it is ignored (`nohup`)."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)

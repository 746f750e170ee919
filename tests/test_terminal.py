"""What the MPI ranks a command starts are told about their output (machine/terminal.py):
Open MPI hands each rank a terminal of its own even where mpirun writes into a file."""

import io
import os
import subprocess
import sys

from conftest import hybriddl_env
from hybriddl.machine.terminal import NOT_A_TERMINAL, rank_output_flags

DRAW = ("from hybriddl.display import out; out.print('[bold]bold[/bold]'); "
        "print('width', out.width)")


def drawn_on_a_terminal(**extra: str) -> str:
    """What display.py's stdout console writes where stdout is a pseudo-terminal, as a
    rank's is under mpirun (no COLUMNS, a TERM that draws colours)."""
    env = hybriddl_env(TERM="xterm", **extra)
    for name in ("COLUMNS", "FORCE_COLOR", "NO_COLOR", *({"TTY_COMPATIBLE"} - set(extra))):
        env.pop(name, None)
    primary, secondary = os.openpty()
    try:
        done = subprocess.run([sys.executable, "-c", DRAW], stdout=secondary,
                              stderr=subprocess.PIPE, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        os.close(secondary)
        secondary = None
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the terminal's other end is closed: all is read
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(primary)
        if secondary is not None:
            os.close(secondary)


def test_a_terminal_asks_nothing_and_a_file_or_pipe_tells_the_ranks():
    primary, secondary = os.openpty()
    with open(secondary, "w") as terminal:
        assert rank_output_flags(terminal) == []
    os.close(primary)
    assert rank_output_flags(io.StringIO()) == ["-x", NOT_A_TERMINAL]
    closed = io.StringIO()
    closed.close()
    assert rank_output_flags(closed) == ["-x", NOT_A_TERMINAL]
    # Output bound for a log file (compare's contenders'): told so even from a terminal.
    primary, secondary = os.openpty()
    with open(secondary, "w") as terminal:
        assert rank_output_flags(terminal, logged=True) == ["-x", NOT_A_TERMINAL]
    os.close(primary)

def test_a_rank_told_its_terminal_is_not_one_draws_no_colour_at_a_logs_width():
    """Without the variable a rank's console draws colour codes at 80 columns on the
    terminal mpirun gives it; with it, plain text at display.LOG_WIDTH."""
    from hybriddl.display import LOG_WIDTH

    assert "\x1b[1m" in drawn_on_a_terminal()
    name, value = NOT_A_TERMINAL.split("=")
    told = drawn_on_a_terminal(**{name: value})
    assert "\x1b" not in told and "bold" in told
    assert f"width {LOG_WIDTH}" in told


def test_a_closed_terminal_stops_a_supervisor_unless_nohup_ignores_the_hangup():
    """`launch` and `emulate` start processes in sessions of their own: a hangup that ended
    the supervisor alone would leave mpirun training unsupervised, or the emulated hosts'
    namespaces behind. It stops them as SIGTERM does, unless nohup set it ignored."""
    import signal

    from hybriddl.machine.terminal import stop_signals

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, previous)

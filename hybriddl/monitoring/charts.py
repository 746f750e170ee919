"""Charts and tables drawn from plain dicts, so that the report (`hybriddl report`) and the
comparison (`hybriddl compare`) draw theirs with the same functions.

- bar charts across configurations, in the style of the course's epoch-time, images/s and
  speedup charts: `bar_chart`, `epoch_time_chart`, `throughput_chart`, `speedup_chart` take
  rows like {"label": "threads K=2, 1 host", "images_per_second": 41.0};
- a resource timeline of one rank from its monitors' samples (`resource_chart`): CPU %, RSS
  and network rate over time, with epoch boundaries marked;
- `markdown_table`: rows as a GitHub Markdown table.

Every PNG is written whole or not at all (`save_figure`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from hybriddl.files import write_atomically
from hybriddl.monitoring.monitor import MIB

BAR_COLOR = "#4C72B0"
BASELINE_COLOR = "#8C8C8C"


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
    """PNG written whole or not at all (files.write_atomically: a failed write is one
    StorageError naming the file and the free space)."""
    path = Path(path)
    write_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=110))
    return path


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

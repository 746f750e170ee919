"""What `hybriddl compare` leaves and shows: comparison.json, the Markdown table and notes,
the charts, and the table's columns, which the CLI's rich table shares."""

from __future__ import annotations

from pathlib import Path

from hybriddl.files import atomic_write_bytes, atomic_write_json

RESULT = "comparison.json"
REPORT = "comparison.md"

# (key of a display row, header, format): the CLI's rich table and the Markdown share it.
COLUMNS = [
    ("name", "contender", "{}"), ("scheme", "scheme", "{}"), ("local_strategy", "local strategy", "{}"),
    ("compression", "on the wire", "{}"), ("ranks", "ranks", "{:d}"),
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
    workers, steps = config["workers_per_host"], config["steps"]
    lines = [f"{config['usecase']}: {config['model']} at {config['image_size']} px, global batch "
             f"{config['batch_size']}, {hosts} emulated hosts x {workers} "
             f"worker{'s' * (workers != 1)} per host, {steps} timed step{'s' * (steps != 1)} "
             f"after {config['warmup']} warm-up"
             + (", gradients sent as float16" if config["fp16_allreduce"] else ""),
             f"network: each host's own NIC, link rate {comparison['bandwidth'] or 'unlimited'}"
             + (f", latency {comparison['latency']}" if comparison["latency"] else "")
             + "; ranks of one host use shared memory; NIC bytes are those sent by each host "
             "(h0 / h1 ...) over the timed steps",
             "theory per host NIC: ring over P ranks placed host-contiguously 2(P-1)/P S; "
             "one rank per host or hierarchical 2(H-1)/H S (S = what each rank hands to the "
             "allreduce: the gradient, half of it as float16, or PowerSGD's factors and small "
             "tensors)"]
    lines += [f"{c['name']}: {c['note']}" for c in comparison["contenders"] if c.get("note")]
    lines += machine.get("emulation_notes", [])
    if unfinished := comparison.get("unfinished"):
        lines.append(f"unfinished: {unfinished['error']}; the contenders after "
                     f"{unfinished['contender']} did not run")
    if machine["oversubscribed"]:
        lines.append(f"oversubscribed: {machine['workers']} workers on "
                     f"{machine['usable_cores']} cores, so speeds are not those of separate hosts")
    return lines


def markdown(comparison: dict) -> str:
    from hybriddl.monitoring import charts

    return (charts.markdown_table(display_rows(comparison), COLUMNS) + "\n"
            + "".join(f"- {line}\n" for line in notes(comparison)))


def write_outputs(comparison: dict, output: Path) -> list[Path]:
    atomic_write_json(output / RESULT, comparison)
    atomic_write_bytes(output / REPORT, markdown(comparison).encode())
    return [output / RESULT, output / REPORT, *comparison_charts(comparison, output)]


def comparison_charts(comparison: dict, output: Path) -> list[Path]:
    """Speed and bytes per host NIC per contender, the hybrid's bar set apart."""
    from hybriddl.monitoring import charts

    rows = display_rows(comparison)
    common = {"label_key": "name", "xlabel": "contender", "highlight": "hybrid",
              "highlight_label": "hybrid (local-first)"}
    return [
        charts.throughput_chart(rows, output / "images_per_second.png",
                                title="Training speed, side by side", **common),
        charts.bar_chart(rows, "max_nic_mb_per_step", output / "host_nic_bytes_per_step.png",
                         title="Bytes sent per host NIC per step (emulated hosts)",
                         ylabel="MB per step (lower is better)", value_format="{:.1f} MB",
                         **common),
    ]

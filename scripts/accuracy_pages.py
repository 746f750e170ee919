"""The time-to-accuracy pages in docs/benchmarks: how results/time_to_accuracy-*.json
(scripts/time_to_accuracy.py) are written as pages, and what the compressed schemes' speed
pages quote of them (`accuracy_at_equal_epochs`, `accuracy_links`).

They stand apart from scripts/time_to_accuracy.py for now, as each other benchmark's pages
stand beside its runner; they join it once that runner is rewritten.
"""

from __future__ import annotations

import json
from pathlib import Path

from pages import Page, ratio_text

RESULTS = Path(__file__).resolve().parents[1] / "results"


def accuracy_links() -> str:
    """The time-to-accuracy pages that exist, where compressed schemes are judged."""
    pages = sorted(p.stem for p in RESULTS.glob("time_to_accuracy-*.json"))
    if not pages:
        return "no time-to-accuracy table is measured yet"
    return ", ".join(f"[{name}]({name}.md)" for name in pages)


def accuracy_at_equal_epochs() -> str | None:
    """What the compressed schemes cost in accuracy, for the headlines beside their speed:
    the final validation accuracy of each run of the results/time_to_accuracy-digits-*.json
    whose exact run learned most (at least half right on the ten digits), points against
    exact; None where no such file is."""
    learned = []
    for path in RESULTS.glob("time_to_accuracy-digits-*.json"):
        data = json.loads(path.read_text())
        exact = [r["val_accuracy"][-1] for r in data["summary"]
                 if r["compression"] == "none" and r["val_accuracy"]]
        if exact and max(exact) >= 0.5:
            learned.append((max(exact), path.stem, data))
    if not learned:
        return None
    _, stem, data = max(learned, key=lambda item: item[0])
    rows = [r for r in data["summary"] if r["val_accuracy"]]
    parts = [f"{r['host_parallel']}/{r['compression']} {r['val_accuracy'][-1]:.3f}" + (
        f" ({r['points_vs_exact'][-1]:+.1f} points)" if r["compression"] != "none"
        and r.get("points_vs_exact") else "") for r in rows]
    return (f"accuracy after {len(rows[0]['val_accuracy'])} epochs "
            f"({data.get('model') or data['usecase']} on the handwritten digits, "
            f"{rows[0]['hosts']} hosts): " + ", ".join(parts)
            + f" ([table](docs/benchmarks/{stem}.md))")


def time_to_accuracy_table(data: dict) -> str:
    lines = ["| hosts | across hosts | train loss per epoch | validation accuracy per epoch "
             "| emulated s per epoch | emulated s, all epochs | speed-up | same accuracy as 1 host |",
             "|---:|---|---|---|---|---:|---:|---|"]
    runs = {r["hosts"]: r for r in data["runs"] if "failed" not in r}
    for row in data["summary"]:
        run = runs[row["hosts"]]
        accuracy = ", ".join(f"{a:.3f}" for a in row["val_accuracy"])
        spans = ", ".join(f"{e['emulated_seconds']:.0f}" for e in run["epochs"])
        same = {True: "yes", False: "**no**", None: "–"}[row["same_accuracy_as_one_host"]]
        losses = ", ".join(f"{e['train_loss']:.5f}" for e in run["epochs"])
        lines.append(f"| {row['hosts']} | {row['host_parallel']} | {losses} | {accuracy} | {spans} | "
                     f"{row['emulated_seconds_total']:.0f} | {ratio_text(row['speedup'])} | {same} |")
    return "\n".join(lines)


def time_to_accuracy_setting(data: dict) -> str:
    return (f"{data['usecase']}, its global batch on every host count, emulated hosts of "
            f"{data['cores_per_host']} cores each, {data['bandwidth']} links")


def compressed_accuracy_table(data: dict) -> str:
    """Exact against compressed at equal epochs: one row per run (scheme across hosts and
    what crossed the wire), its accuracy per epoch and the points it differs from the exact
    run at the same host count, and the emulated time it took."""
    lines = ["| hosts | across hosts | on the wire | exact? | validation accuracy per epoch "
             "| points vs exact, per epoch | emulated s, all epochs | faster than exact |",
             "|---:|---|---|---|---|---|---:|---:|"]
    for row in data["summary"]:
        accuracy = ", ".join(f"{a:.3f}" for a in row["val_accuracy"])
        points = ("–" if row["points_vs_exact"] is None else
                  ", ".join(f"{p:+.1f}" for p in row["points_vs_exact"]))
        exact = "yes" if row["compression"] == "none" else "**no**"
        lines.append(f"| {row['hosts']} | {row['host_parallel']} | {row['compression']} | "
                     f"{exact} | {accuracy} | {points} | {row['emulated_seconds_total']:.1f} | "
                     f"{ratio_text(row['speedup_vs_exact'])}× |")
    failed = [r for r in data["runs"] if "failed" in r]
    lines += [f"\nNot finished: {r['host_parallel']}/{r['compression']} at {r['hosts']} hosts "
              f"(exit {r['failed']})." for r in failed]
    return "\n".join(lines)


def compressed_accuracy_setting(data: dict) -> str:
    run = next((r for r in data["runs"] if "failed" not in r), {})
    step = run.get("host_step_seconds")
    speed = (f"each host standing for one whose step takes {step * 1e3:g} ms (speedup S = "
             f"{run.get('speedup', 1):.3g}, measured here)" if step else "hosts at their speed here")
    return (f"{data['usecase']} ({data.get('model') or 'its model'}) on `{data['data']}`, "
            f"{data['cores_per_host']} core(s) per host, {data['bandwidth']} links, {speed}")


COMPRESSED_ACCURACY_NOTES = """\
How to read it: every run trains the same steps from the same seed; only what crosses the
wire differs. `none` is exact (hybrid and data give the same model to float rounding), so
the exact row is the reference and a compressed row's points are its accuracy minus the
exact run's, epoch by epoch. Times are the epochs' spans in emulated seconds (wall / S).
A table whose exact run did not learn (accuracy near 1 / classes) judges speed only."""


TIME_TO_ACCURACY_NOTES = """\
How to read it: the same training (same global batch, same steps, same dropout masks) on
1, 2 and 4 emulated hosts: in exact arithmetic the same model, so only the time should
differ. In floating point each host count sums in another order (a host's batch of 16, 8 or
4 images picks other kernels; the hybrid splits the classifier's sums), each step agreeing to
about 1e-5 (the equivalence tests); over the epochs' steps those differences grow, which the
train loss per epoch shows, and can move an image across a decision boundary. Times are the
epochs' spans (their steps; the evaluation after each epoch is not in them) in emulated
seconds, wall time / D."""


PAGES = [
    Page("time_to_accuracy-ComplexSmall-1gbit",
         "Time to accuracy, the main job (VGG16), 1, 2 and 4 hosts, 1 Gbit/s links",
         "results/time_to_accuracy-ComplexSmall-1gbit.json", time_to_accuracy_table,
         time_to_accuracy_setting, TIME_TO_ACCURACY_NOTES),
    Page("time_to_accuracy-digits-*", "Accuracy at equal epochs, exact against compressed",
         "results/time_to_accuracy-digits-*.json", compressed_accuracy_table,
         compressed_accuracy_setting, COMPRESSED_ACCURACY_NOTES,
         none_yet="scripts/time_to_accuracy.py --data DIGITS --runs ... writes them"),
]

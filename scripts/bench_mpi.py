"""The MPI layer measured: co-located ranks, its overhead, fp16 on the wire, overlap.

    python scripts/bench_mpi.py --usecase ComplexSmall --steps 6 \
        --output bench-mpi.json

Every row is a real `hybriddl train` run (with or without mpirun, TCP over loopback),
on the same model, global batch and image size, one after another in one invocation:

- the local strategy alone on K cores, against K co-located ranks of one core each
  (sequential), which is what one-rank-per-core (Horovod's model) gives a host;
- the MPI layer's overhead: the same strategy without mpirun and under `mpirun -np 1`,
  interleaved --repeats times (target: at most 3% slower);
- K ranks with float32 and with --fp16-allreduce gradients on the wire: bytes handed
  to MPI per step, bytes on the wire (lo), final loss and how far the parameters moved;
- K ranks without and with --overlap.

Seconds/step is the median over the steps after the first (warm-up), as the trainer
records them per step in metrics.json; images/s = global batch / seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table

from hybriddl.rundir import METRICS, MODEL
from hybriddl.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]


MPIRUN = Path(sys.executable).parent / "mpirun"
LOOPBACK = ["--oversubscribe", "--bind-to", "none", "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", "lo"]
console = Console(width=None if sys.stdout.isatty() else 150)  # tables stay readable in logs


def parse_args(argv=None) -> argparse.Namespace:
    best = "processes"  # the paper's fastest on CPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="ComplexSmall")
    parser.add_argument("--model", help="torchvision classifier (default: the use case's)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, help="global batch (default: the use case's)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (>= 2)")
    parser.add_argument("--ranks", type=int, default=2,
                        help="co-located ranks = local workers K (default: 2, this machine's cores)")
    parser.add_argument("--local-strategy", default=best,
                        help=f"the strategy of the single-process rows (default: {best})")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved repeats of the overhead pair (default: 3)")
    parser.add_argument("--output", help="write every figure as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    return args


def train_args(args, run_dir: Path, *extra: str) -> list[str]:
    command = ["-m", "hybriddl", "train", "--usecase", args.usecase, "--image-size",
               str(args.image_size), "--max-steps", str(args.steps), "--dropout", "0",
               "--run-dir", str(run_dir), *extra]
    if args.model:
        command += ["--model", args.model]
    if args.batch_size:
        command += ["--batch-size", str(args.batch_size)]
    return command


def strategy_args(name: str, workers: int) -> list[str]:
    return ["--strategy", name] + (["--workers", str(workers)] if name != "sequential" else [])


def run(label: str, args, work: Path, ranks: int | None, *extra: str) -> dict:
    """One training run; ranks None: no mpirun at all."""
    run_dir = work / label.replace(" ", "-").replace("/", "-")
    command = [sys.executable, *train_args(args, run_dir, *extra)]
    if ranks is not None:
        command = [str(MPIRUN), *LOOPBACK, "-np", str(ranks), *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    console.print(f"[dim]running: {label}[/]")
    lo_before = _lo_bytes_sent()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lo_after = _lo_bytes_sent()
    if done.returncode != 0:
        raise SystemExit(f"{label} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    metrics = json.loads((run_dir / METRICS).read_text())
    epoch = metrics["epochs"][0]
    steps = epoch["per_step"]
    timed = slice(1, None)  # the first step warms up allocators and caches
    seconds = statistics.median(steps["seconds"][timed])
    return {
        "label": label, "ranks": ranks, "extra": list(extra),
        "global_batch": metrics["config"]["global_batch"],
        "seconds_per_step": seconds,
        "images_per_second": metrics["config"]["global_batch"] / seconds,
        "comm_seconds_per_step": statistics.median(steps["comm_seconds"][timed]),
        "compute_seconds_per_step": statistics.median(steps["compute_seconds"][timed]),
        "mpi_bytes_per_step": statistics.median(steps["mpi_bytes_sent"][timed]),
        "lo_bytes_per_step_whole_run": (lo_after - lo_before) / epoch["steps"],
        "buckets_sent_in_backward": [r.get("buckets_sent_in_backward") for r in epoch["by_rank"]],
        "train_loss": epoch["train_loss"],
        "model": str(run_dir / MODEL),
    }


def _lo_bytes_sent() -> int:
    counters = psutil.net_io_counters(pernic=True)
    return counters["lo"].bytes_sent if "lo" in counters else 0


def parameter_drift(a: str, b: str) -> float:
    """Largest relative difference between two runs' parameters (per tensor, max-abs)."""
    x, y = torch.load(a), torch.load(b)
    return max(float((x[k] - y[k]).abs().max() / y[k].abs().max().clamp_min(1e-12)) for k in y
               if y[k].is_floating_point())


def main(argv=None) -> int:
    args = parse_args(argv)
    if not MPIRUN.exists():
        raise SystemExit(f"no mpirun at {MPIRUN}")
    k = args.ranks
    local = strategy_args(args.local_strategy, k)
    rows, summary = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-mpi-") as tmp:
        work = Path(tmp)
        alone = run(f"{args.local_strategy} K={k}, no MPI", args, work, None, *local,
                    "--oversubscribe")
        ranks = run(f"{k} ranks x sequential", args, work, k, "--strategy", "sequential")
        rows += [alone, ranks]
        summary["co_located_ranks_vs_local_strategy"] = \
            ranks["images_per_second"] / alone["images_per_second"]

        plain, under_mpi = [], []
        for i in range(args.repeats):
            plain.append(run(f"{args.local_strategy} no MPI #{i + 1}", args, work, None, *local,
                             "--oversubscribe"))
            under_mpi.append(run(f"{args.local_strategy} mpirun -np 1 #{i + 1}", args, work, 1,
                                 *local, "--oversubscribe"))
        rows += plain + under_mpi
        t_plain = statistics.median(r["seconds_per_step"] for r in plain)
        t_mpi = statistics.median(r["seconds_per_step"] for r in under_mpi)
        summary["mpi_layer_overhead_one_rank"] = t_mpi / t_plain - 1

        fp16 = run(f"{k} ranks fp16 on the wire", args, work, k, "--strategy", "sequential",
                   "--fp16-allreduce")
        overlap = run(f"{k} ranks --overlap", args, work, k, "--strategy", "sequential",
                      "--overlap")
        rows += [fp16, overlap]
        summary["fp16_mpi_bytes_per_step_ratio"] = fp16["mpi_bytes_per_step"] / ranks["mpi_bytes_per_step"]
        summary["fp16_lo_bytes_ratio"] = (fp16["lo_bytes_per_step_whole_run"]
                                          / max(ranks["lo_bytes_per_step_whole_run"], 1))
        summary["fp16_train_loss_delta"] = fp16["train_loss"] - ranks["train_loss"]
        summary["fp16_parameter_drift"] = parameter_drift(fp16["model"], ranks["model"])
        summary["overlap_speedup"] = ranks["seconds_per_step"] / overlap["seconds_per_step"]
        summary["overlap_exposed_comm_ratio"] = (overlap["comm_seconds_per_step"]
                                                 / max(ranks["comm_seconds_per_step"], 1e-12))
    show(rows, summary, args)
    if args.output:
        for row in rows:
            row.pop("model")
        atomic_write_json(Path(args.output), {"settings": vars(args), "rows": rows,
                                              "summary": summary})
        console.print(f"written: {args.output}")
    return 0


def show(rows: list[dict], summary: dict, args) -> None:
    table = Table(title=f"MPI layer, {args.usecase} {args.model or ''} {args.image_size} px, "
                        f"{args.steps} steps (median after the first)")
    for column in ("run", "s/step", "images/s", "compute s/step", "comm s/step",
                   "MPI bytes/step", "lo bytes/step*", "train loss"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for r in rows:
        table.add_row(r["label"], f"{r['seconds_per_step']:.4f}", f"{r['images_per_second']:.1f}",
                      f"{r['compute_seconds_per_step']:.4f}", f"{r['comm_seconds_per_step']:.4f}",
                      f"{r['mpi_bytes_per_step']:,.0f}", f"{r['lo_bytes_per_step_whole_run']:,.0f}",
                      f"{r['train_loss']:.5f}")
    console.print(table)
    console.print("* lo bytes over the whole run (start-up, broadcast and validation "
                  "included) divided by its steps; lo is machine-wide, so other programs' "
                  "loopback traffic counts too: measure on a quiet machine")
    verdicts = Table(title="Summary")
    verdicts.add_column("figure")
    verdicts.add_column("value", justify="right")
    overhead = summary["mpi_layer_overhead_one_rank"]
    verdicts.add_row(f"{args.ranks} co-located ranks / {args.local_strategy} alone (images/s)",
                     f"{summary['co_located_ranks_vs_local_strategy']:.3f}")
    verdicts.add_row("MPI layer overhead, mpirun -np 1 vs no MPI (target <= 3%)",
                     f"{100 * overhead:+.1f}% {'ok' if overhead <= 0.03 else 'MISSED'}")
    verdicts.add_row("fp16: MPI bytes per step, fraction of float32",
                     f"{summary['fp16_mpi_bytes_per_step_ratio']:.3f}")
    verdicts.add_row("fp16: lo bytes, fraction of float32", f"{summary['fp16_lo_bytes_ratio']:.3f}")
    verdicts.add_row("fp16: train loss minus float32's", f"{summary['fp16_train_loss_delta']:+.2e}")
    verdicts.add_row("fp16: largest relative parameter difference",
                     f"{summary['fp16_parameter_drift']:.2e}")
    verdicts.add_row("--overlap speedup (s/step without / with)", f"{summary['overlap_speedup']:.3f}")
    verdicts.add_row("--overlap exposed comm, fraction of blocking",
                     f"{summary['overlap_exposed_comm_ratio']:.3f}")
    console.print(verdicts)


if __name__ == "__main__":
    sys.exit(main())

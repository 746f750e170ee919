"""Strong scaling over H hosts: images/s, speedup and efficiency, from measured parts.

    python scripts/scaling.py compute --output results/scaling-compute-64px.json
    sudo python scripts/scaling.py communication --bandwidth 1gbit \
        --output results/scaling-communication-1gbit.json
    python scripts/scaling.py table results/scaling-compute-64px.json \
        results/scaling-communication-*.json --output results/scaling-64px.json

This machine has 2 cores, so H hosts cannot compute side by side here; each part of a
step is measured where it can be measured faithfully, and the step is their sum:

- compute: one host's optimizer step (`step.optimizer_step`, timed by the tuner's
  `measure_strategy`) at its share B/H of the global batch B, with --strategy over the
  host's K cores (the hybrid); and one Horovod worker's step, `sequential` on one core,
  at its share B/(H*K) (Horovod's model, K workers per host). Rounds interleave H.
- communication: the trainer's averaging of that model's gradient (its float32 bytes) on
  H emulated hosts at --bandwidth (`scripts/bench_allreduce.py`'s `measure`): one rank
  per host for the hybrid, K ranks per host (a ring over H*K ranks) for Horovod's model.
  One host alone communicates nothing in the hybrid; Horovod's K workers still average
  over shared memory, measured on one emulated host. Where the ranks' buffers do not fit
  in this machine's memory, each timed averaging is P back-to-back averagings of S/P
  bytes (bench_allreduce --parts; the same bytes cross each NIC), and the table says so.

step(H) = compute(H) + communication(H) (no overlap); images/s = B / step; speedup =
images/s over the hybrid's on one host; efficiency = speedup / H.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


USECASES = ("SimpleBig", "ComplexSmall")
NUM_CLASSES = 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    phases = parser.add_subparsers(dest="phase", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--usecase", nargs="+", choices=USECASES, default=list(USECASES))
    common.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8])
    common.add_argument("--workers-per-host", type=int, default=2,
                        help="K: cores per host, Horovod workers per host (default: 2)")
    common.add_argument("--output", required=True, help="JSON file to write")
    compute = phases.add_parser("compute", parents=[common],
                                help="one host's step at each host's share")
    compute.add_argument("--image-size", type=int, default=64)
    compute.add_argument("--batch-size", type=int, default=64, help="global batch B")
    compute.add_argument("--strategy", default="intraop",
                         help="the hybrid host's local strategy over K workers "
                              "(default: intraop)")
    compute.add_argument("--steps", type=int, default=2, help="timed steps per visit")
    compute.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    comm = phases.add_parser("communication", parents=[common],
                             help="the model's averaging on emulated hosts")
    comm.add_argument("--bandwidth", nargs="+", required=True)
    comm.add_argument("--repeats", type=int, default=2, help="timed averagings per run")
    comm.add_argument("--rounds", type=int, default=1, help="interleaved rounds")
    comm.add_argument("--kind", nargs="+", choices=("hybrid", "flat"),
                      default=["hybrid", "flat"], help="contenders to measure (default: both)")
    comm.add_argument("--memory-fraction", type=float, default=0.6,
                      help="when the ranks' buffers need more than this fraction of the "
                           "available memory, average the gradient in parts (up to "
                           "--max-parts), else skip the run (default: 0.6)")
    comm.add_argument("--max-parts", type=int, default=8,
                      help="most parts a gradient may be averaged in to fit (default: 8)")
    table = phases.add_parser("table", help="combine measured parts into the scaling table")
    table.add_argument("parts", nargs="+", help="compute and communication JSON files")
    table.add_argument("--output", required=True)
    return parser.parse_args(argv)


def gradient_bytes(usecase: str) -> tuple[str, int]:
    from hybriddl.usecases import build_model, get_usecase

    model_name = get_usecase(usecase).model
    model = build_model(model_name, NUM_CLASSES)
    return model_name, 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def measure_compute(args) -> dict:
    import torch

    from hybriddl.strategies import StrategyOptions
    from hybriddl.tuning.benchmark import measure_strategy
    from hybriddl.usecases import get_usecase

    k, b = args.workers_per_host, args.batch_size
    for h in args.hosts:
        if b % (h * k):
            raise SystemExit(f"scaling: --batch-size {b} must divide into {h}x{k} workers")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(b, 3, args.image_size, args.image_size, generator=generator)
    y = torch.randint(NUM_CLASSES, (b,), generator=generator)
    seconds: dict[tuple, list[float]] = {}
    described: dict[str, dict] = {}
    for _ in range(args.rounds):
        for usecase in args.usecase:
            model = get_usecase(usecase).model
            for h in args.hosts:
                for kind, name, options, share in (
                        ("hybrid", args.strategy, StrategyOptions(workers=k), b // h),
                        ("flat", "sequential", StrategyOptions(), b // (h * k))):
                    timing = measure_strategy(name, options, model, NUM_CLASSES, x[:share],
                                              y[:share], warmup=1, steps=args.steps)
                    seconds.setdefault((usecase, kind, h), []).extend(timing.step_seconds)
                    described[kind] = timing.strategy
    rows = [{"usecase": u, "model": get_usecase(u).model, "kind": kind, "hosts": h,
             "samples": b // h if kind == "hybrid" else b // (h * k),
             "seconds": statistics.median(s), "seconds_spread": [min(s), max(s)],
             "seconds_all": s} for (u, kind, h), s in seconds.items()]
    return {"phase": "compute", "image_size": args.image_size, "batch_size": b,
            "workers_per_host": k, "rounds": args.rounds, "steps_per_visit": args.steps,
            "strategies": described, "torch_threads_note": "hybrid: K threads; flat: 1",
            "rows": rows}


def rank_bytes(gradient: float) -> float:
    """One averaging rank's memory for a gradient of `gradient` bytes: the fusion buckets,
    the received copy and MPI's ring buffers (about 3.5x, measured: 1.13 GB resident per
    rank for AlexNet's 228 MB on 8 emulated hosts), plus the interpreter and torch."""
    return 3.5 * gradient + 400 * 2**20


def parts_to_fit(ranks: int, gradient: int, memory: float, most: int) -> int | None:
    """The fewest parts (at most `most`) that let `ranks` ranks average `gradient` bytes
    within `memory` bytes; None when even `most` do not."""
    return next((p for p in range(1, most + 1) if ranks * rank_bytes(gradient / p) <= memory),
                None)


def measure_communication(args) -> dict:
    import psutil

    from bench_allreduce import measure

    k = args.workers_per_host
    plan = []
    for bandwidth in args.bandwidth:
        for usecase in args.usecase:
            model, size = gradient_bytes(usecase)
            for h in args.hosts:
                if h > 1 and "hybrid" in args.kind:
                    plan.append((bandwidth, usecase, model, size, "hybrid", h, 1))
                if "flat" in args.kind:
                    plan.append((bandwidth, usecase, model, size, "flat", h, k))
    runs: dict[tuple, list[dict]] = {}
    skipped = []
    for _ in range(args.rounds):
        for bandwidth, usecase, model, size, kind, h, ranks in plan:
            available = psutil.virtual_memory().available
            parts = parts_to_fit(h * ranks, size, args.memory_fraction * available,
                                 args.max_parts)
            key = (bandwidth, usecase, kind, h)
            if parts is None:
                need = h * ranks * rank_bytes(size / args.max_parts)
                skipped.append({"bandwidth": bandwidth, "usecase": usecase, "kind": kind,
                                "hosts": h, "reason": f"{h * ranks} ranks need about "
                                f"{need / 2**30:.1f} GiB even in {args.max_parts} parts, "
                                f"{available / 2**30:.1f} GiB available on this machine"})
                continue
            try:
                run = measure(h, size, bandwidth=bandwidth, repeats=args.repeats,
                              ranks_per_host=ranks, parts=parts)
            except RuntimeError as exc:  # e.g. a rank killed for memory: the others stand
                print(f"scaling: {usecase} {kind} H={h} at {bandwidth}: {exc}", file=sys.stderr)
                skipped.append({"bandwidth": bandwidth, "usecase": usecase, "kind": kind,
                                "hosts": h, "reason": f"{exc} (in {parts} parts)"})
                continue
            runs.setdefault(key, []).append({**run, "model": model})
    rows = []
    for (bandwidth, usecase, kind, h), done in runs.items():
        s = [x for run in done for x in run["seconds_repeats"]]
        rows.append({"usecase": usecase, "model": done[0]["model"], "kind": kind, "hosts": h,
                     "bandwidth": bandwidth, "ranks_per_host": done[0]["ranks_per_host"],
                     "bytes": done[0]["bytes"], "parts": done[0]["parts"],
                     "seconds": statistics.median(s),
                     "seconds_spread": [min(s), max(s)], "seconds_all": s,
                     "bound_seconds": done[0]["bound_seconds"],
                     "host_nic_bytes_sent": done[0]["host_nic_bytes_sent"],
                     "host_nic_bytes_theory": done[0]["host_nic_bytes_theory"],
                     "machine_cpu_busy_fraction": done[0]["machine_cpu_busy_fraction"]})
    return {"phase": "communication", "workers_per_host": k, "rounds": args.rounds,
            "repeats": args.repeats, "rows": rows, "not_measured": skipped}


def combine(parts: list[dict]) -> dict:
    compute = [p for p in parts if p["phase"] == "compute"]
    if len(compute) != 1:
        raise SystemExit("scaling table: give exactly one compute file")
    compute = compute[0]
    b = compute["batch_size"]
    times = {(r["usecase"], r["kind"], r["hosts"]): r for r in compute["rows"]}
    comms = {(r["usecase"], r["kind"], r["hosts"], r["bandwidth"]): r
             for p in parts if p["phase"] == "communication" for r in p["rows"]}
    bandwidths = sorted({key[3] for key in comms}, key=lambda s: (len(s), s))
    rows = []
    for usecase in dict.fromkeys(r["usecase"] for r in compute["rows"]):
        base = times[(usecase, "hybrid", 1)]["seconds"]
        for bandwidth in bandwidths:
            for kind in ("hybrid", "flat"):
                for h in sorted({r["hosts"] for r in compute["rows"]}):
                    work = times.get((usecase, kind, h))
                    if kind == "hybrid" and h == 1:
                        talk = {"seconds": 0.0, "seconds_spread": [0.0, 0.0]}
                    else:
                        talk = comms.get((usecase, kind, h, bandwidth))
                    if work is None or talk is None:
                        rows.append({"usecase": usecase, "bandwidth": bandwidth, "kind": kind,
                                     "hosts": h, "measured": False})
                        continue
                    step = work["seconds"] + talk["seconds"]
                    speedup = base / step
                    rows.append({
                        "usecase": usecase, "model": work["model"], "bandwidth": bandwidth,
                        "kind": kind, "hosts": h, "measured": True,
                        "compute_seconds": work["seconds"],
                        "compute_spread": work["seconds_spread"],
                        "communication_seconds": talk["seconds"],
                        "communication_spread": talk["seconds_spread"],
                        "communication_parts": talk.get("parts", 1),
                        "step_seconds": step, "images_per_second": b / step,
                        "images_per_second_spread": [
                            b / (work["seconds_spread"][1] + talk["seconds_spread"][1]),
                            b / (work["seconds_spread"][0] + talk["seconds_spread"][0])],
                        "speedup": speedup, "efficiency": speedup / h,
                        "host_nic_bytes_sent": talk.get("host_nic_bytes_sent"),
                        "host_nic_bytes_theory": talk.get("host_nic_bytes_theory")})
    skipped = [s for p in parts for s in p.get("not_measured", [])]
    return {"image_size": compute["image_size"], "batch_size": b,
            "workers_per_host": compute["workers_per_host"],
            "strategies": compute["strategies"],
            "method": "step = compute (one host at its share, measured) + communication "
                      "(the trainer's averaging on emulated hosts, measured); no overlap; "
                      "speedup against the hybrid on one host",
            "rows": rows, "not_measured": skipped}


def markdown(table: dict) -> str:
    lines = []
    for usecase in dict.fromkeys(r["usecase"] for r in table["rows"]):
        for bandwidth in dict.fromkeys(r["bandwidth"] for r in table["rows"]):
            lines += [f"\n{usecase} at {bandwidth}:\n",
                      "| contender | H | compute s | communication s | step s | images/s "
                      "| speedup | efficiency |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for r in table["rows"]:
                if r["usecase"] != usecase or r["bandwidth"] != bandwidth:
                    continue
                kind = "hybrid" if r["kind"] == "hybrid" else \
                    f"Horovod K={table['workers_per_host']}"
                if not r["measured"]:
                    lines.append(f"| {kind} | {r['hosts']} | not measured | | | | | |")
                    continue
                lo, hi = r["images_per_second_spread"]
                parts = r.get("communication_parts", 1)
                talk = f"{r['communication_seconds']:.3f}" + (
                    f" (in {parts} parts)" if parts > 1 else "")
                lines.append(
                    f"| {kind} | {r['hosts']} | {r['compute_seconds']:.3f} "
                    f"| {talk} | {r['step_seconds']:.3f} "
                    f"| {r['images_per_second']:.1f} ({lo:.1f}–{hi:.1f}) "
                    f"| {r['speedup']:.2f}× | {r['efficiency']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from hybriddl.files import atomic_write_json

    if args.phase == "compute":
        result = measure_compute(args)
    elif args.phase == "communication":
        result = measure_communication(args)
    else:
        result = combine([json.loads(Path(p).read_text()) for p in args.parts])
        print(markdown(result))
    result["command"] = "scripts/scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
    atomic_write_json(Path(args.output), result)
    if args.phase != "table":
        print(json.dumps(result["rows"] if args.phase == "compute" else
                         {"rows": [{k: r[k] for k in ("usecase", "kind", "hosts", "bandwidth",
                                                      "seconds")} for r in result["rows"]],
                          "not_measured": result["not_measured"]}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gradient averaging on H emulated hosts: seconds and per-host NIC bytes against the bound.

    sudo python scripts/bench_allreduce.py --hosts 4 --bandwidth 1gbit \
        --mib 64 --output /tmp/allreduce-4.json
    sudo python scripts/bench_allreduce.py --hosts 2 4 8 --bandwidth 1gbit 10gbit \
        --mib 64 --compression none fp16 --rounds 2 --output results/allreduce-1gbit-10gbit.json

Runs the trainer's own averaging (`hybriddl.hosts.cluster.connect()` under mpirun, i.e.
`MPIHosts.averaging` with the trainer's default fusion buckets) on H emulated
hosts, --ranks-per-host ranks each (1: the hybrid; K > 1: Horovod's model, a ring over
H*K ranks placed K per host), every link limited to --bandwidth. The gradient is one
float32 tensor of --mib MiB, averaged once to warm up, then --repeats times, each between
two barriers. With --backward it is 16 equal parameters and each repeat starts with
their backward (which only accumulates a constant into each gradient view, one pass over
the gradient); with --overlap on as well, the trainer's --overlap hooks post each fusion
bucket as soon as backward has filled it, and its progress thread moves the transfers
while backward runs. With --parts P each repeat is P averagings of S/P bytes back to
back (P times less memory per rank, the same bytes). Each rank reads its own host's NIC
(`eth0` in its namespace) before and after the repeats, so the bytes are what crossed
the network for the allreduces alone (TCP/IP headers included; veth carries up to 64 KiB
segments, so they add well under 1 %). With several hosts counts, bandwidths,
compressions or overlap settings, every combination is measured once per round, rounds
interleaved; seconds is the median of all its timed repeats, spread their lowest and
highest. CPU: each rank's CPU seconds over the repeats against their wall time, and the
whole machine's busy fraction meanwhile (every emulated host shares it).

Theory: a ring (or reduce-scatter + allgather) allreduce over P = H*K ranks sends
2(P-1)/P*S from every rank, and with K ranks per host only one ring edge per host crosses
its NIC: 2(HK-1)/(HK)*S per host; no host can finish sooner than that over its link:
bound = bytes*8/rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", required=True,
                        help="emulated hosts (one or several counts)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks on each host (default: 1, the hybrid; 2: Horovod's model "
                             "with K = 2 workers per host)")
    parser.add_argument("--bandwidth", nargs="+", default=[None],
                        help="every link's rate, e.g. 1gbit, or none for no limit (several: "
                             "each is measured; default: none, which has no bound)")
    parser.add_argument("--latency", help="one-way delay added per link, e.g. 0.1ms")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--mib", type=float, help="gradient size in MiB")
    size.add_argument("--bytes", type=int, help="gradient size in bytes (a multiple of 4)")
    parser.add_argument("--compression", choices=("none", "fp16"), nargs="+", default=["none"],
                        help="what travels: float32 (none) or float16 (the trainer's "
                             "--fp16-allreduce); several: each is measured; default none")
    parser.add_argument("--parts", type=int, default=1,
                        help="average the gradient as P back-to-back averagings of S/P bytes "
                             "each, timed together, so that P times less memory is held "
                             "(default: 1, the whole gradient at once)")
    parser.add_argument("--backward", action="store_true",
                        help="the gradient is 16 parameters, produced by a backward pass at "
                             "the start of each timed averaging (implied by --overlap on)")
    parser.add_argument("--overlap", choices=("off", "on"), nargs="+", default=["off"],
                        help="on: the trainer's --overlap, backward's hooks post each fusion "
                             "bucket as soon as it is full; several: each is measured; "
                             "default off")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed allreduces per round (default: 5)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds over every combination (default: 1)")
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set when run under mpirun
    args = parser.parse_args(argv)
    args.bandwidth = [None if b in (None, "none") else b for b in args.bandwidth]
    args.size = args.bytes if args.bytes is not None else int(args.mib * 2**20) // 4 * 4
    return args


# With a backward the gradient is this many equal parameters (AlexNet has 16, VGG16 32).
BACKWARD_TENSORS = 16


def worker(args: argparse.Namespace) -> None:
    """One rank: the trainer's averaging on a model of one tensor (16 with a backward);
    rank 0 writes --worker."""
    import psutil
    import torch
    from torch import nn

    from hybriddl.data import epoch_batches
    from hybriddl.hosts.cluster import connect
    from hybriddl.hosts.compression import Compression
    from hybriddl.emulation.hosts import NIC

    overlap = args.overlap[0] == "on"
    backward = overlap or args.backward
    hosts = connect(overlap=overlap, compression=getattr(Compression, args.compression[0]))
    model = nn.ParameterList()
    elements = args.size // args.parts // 4
    tensors = BACKWARD_TENSORS if backward else 1
    cuts = [i * elements // tensors for i in range(tensors + 1)]
    for a, b in zip(cuts, cuts[1:]):
        # The parameters' values are never read: one stored zero keeps memory to the
        # buckets (a VGG16-sized gradient on 8 ranks of one machine).
        model.append(nn.Parameter(torch.zeros(1).expand(b - a)))
    hosts.attach(model, gradient_hooks=overlap)  # .grad: views into the fusion buckets
    gradients = [p.grad for p in model]
    mine = torch.tensor(float(hosts.rank + 1))
    # Each host holds one sample of a global batch of H: it sends 1/H of its gradient.
    share = hosts.share(epoch_batches(hosts.size, hosts.size, seed=0, epoch=0)[0])

    def average_one_part() -> None:
        with hosts.averaging(share) as average_over_hosts:
            if backward:
                # Backward accumulates `mine` into every (zeroed) gradient view, one
                # parameter after another; with --overlap its hooks post each bucket as
                # soon as it is full.
                torch.autograd.backward(list(model), [mine.expand(p.shape) for p in model])
            average_over_hosts(1)

    def average() -> float:
        for gradient in gradients:
            gradient.zero_() if backward else gradient.fill_(mine)
        hosts.barrier()
        started = time.perf_counter()
        for part in range(args.parts):
            if part and backward:
                for gradient in gradients:
                    gradient.zero_()
            average_one_part()
        hosts.barrier()
        return time.perf_counter() - started

    average()
    expected = (hosts.size + 1) / 2
    # float16 rounds each contribution and each partial sum of the ring: H times 2**-11.
    tolerance = hosts.size * 2**-11 if args.compression[0] == "fp16" else 1e-5
    if not all(torch.allclose(p.grad, torch.full_like(p.grad, expected), rtol=tolerance)
               for p in model):
        raise SystemExit(f"rank {hosts.rank}: the average is wrong")
    if overlap and hosts.traffic.buckets_sent_in_backward == 0:
        raise SystemExit(f"rank {hosts.rank}: --overlap sent no bucket during backward")
    me = psutil.Process()
    before = psutil.net_io_counters(pernic=True)[NIC].bytes_sent
    cpu, machine, wall = sum(me.cpu_times()[:2]), psutil.cpu_times(), time.perf_counter()
    seconds = [average() for _ in range(args.repeats)]
    cpu, wall = sum(me.cpu_times()[:2]) - cpu, time.perf_counter() - wall
    machine_after = psutil.cpu_times()
    ticks = sum(machine_after) - sum(machine)  # 0 when the repeats took under one clock tick
    busy = 1 - (machine_after.idle - machine.idle) / ticks if ticks > 0 else None
    sent = (psutil.net_io_counters(pernic=True)[NIC].bytes_sent - before) / args.repeats
    everyone = hosts.allgather((seconds, sent, cpu / wall))
    if hosts.rank == 0:
        Path(args.worker).write_text(json.dumps({
            # A repeat ends when the slowest host has its result.
            "seconds": [max(s[i] for s, _, _ in everyone) for i in range(args.repeats)],
            "rank_nic_bytes_sent": [round(b) for _, b, _ in everyone],
            "rank_cpu_fraction": [round(c, 3) for _, _, c in everyone],
            "machine_cpu_busy_fraction": None if busy is None else round(busy, 3)}))
    hosts.close()


def measure(hosts: int, size: int, *, bandwidth: str | None = None, compression: str = "none",
            repeats: int = 5, ranks_per_host: int = 1, latency: str | None = None,
            parts: int = 1, overlap: bool = False, backward: bool = False) -> dict:
    """One run of the trainer's averaging of `size` bytes on `hosts` emulated hosts.

    With `parts` P > 1 each timed repeat averages P gradients of size/P bytes back to back
    (P times less memory per rank; the same bytes cross the network)."""
    from hybriddl.compare.theory import host_nic_theory
    from hybriddl.emulation import EmulatedHosts

    with EmulatedHosts(hosts=hosts, bandwidth=bandwidth, latency=latency) as cluster:
        figures = Path(cluster.folder) / "figures.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        worker_args = ["--hosts", str(hosts), "--bytes", str(size), "--compression",
                       compression, "--repeats", str(repeats), "--parts", str(parts),
                       "--overlap", "on" if overlap else "off",
                       *(["--backward"] if backward else []),
                       "--output", os.devnull,
                       "--worker", str(figures)]
        run = cluster.run([sys.executable, str(Path(__file__).resolve()), *worker_args],
                          ranks_per_host=ranks_per_host, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"the averaging run on {hosts} hosts failed "
                               f"(exit {run.returncode})")
        measured = json.loads(figures.read_text())
        rate, notes = cluster.rate, cluster.notes
    size = size // parts // 4 * 4 * parts  # what the parts add up to
    wire = size // 2 if compression == "fp16" else size
    # float32 and float16 alike go through one ring allreduce of the wire buffer; on one
    # host nothing leaves it.
    theory = host_nic_theory("ring", wire, hosts, hosts * ranks_per_host) if hosts > 1 else 0.0
    # Rank r runs on host r // K; its K ranks read the same NIC.
    per_host = measured["rank_nic_bytes_sent"][::ranks_per_host]
    return {"hosts": hosts, "ranks_per_host": ranks_per_host,
            "bandwidth_bits_per_second": rate, "bytes": size, "parts": parts,
            "compression": compression, "overlap": overlap, "backward": backward or overlap,
            "wire_bytes": wire, "seconds_repeats": measured["seconds"],
            "bound_seconds": theory * 8 / rate if rate and theory else None,
            "host_nic_bytes_sent": per_host, "host_nic_bytes_theory": [round(theory)] * hosts,
            "latency": latency, "rank_cpu_fraction": measured["rank_cpu_fraction"],
            "machine_cpu_busy_fraction": measured["machine_cpu_busy_fraction"],
            "emulation_notes": notes}


def merge(runs: list[dict]) -> dict:
    """One combination's rounds as one result: median and spread of all timed repeats."""
    seconds = [s for run in runs for s in run["seconds_repeats"]]
    first = runs[0]
    result = {key: first[key] for key in ("hosts", "ranks_per_host", "bandwidth_bits_per_second",
                                          "bytes", "parts", "compression", "overlap",
                                          "backward", "wire_bytes")}
    result["seconds"] = statistics.median(seconds)
    result["seconds_spread"] = [min(seconds), max(seconds)]
    result["bound_seconds"] = first["bound_seconds"]
    result["ratio_to_bound"] = (result["seconds"] / first["bound_seconds"]
                                if first["bound_seconds"] else None)
    result["host_nic_bytes_sent"] = [round(statistics.mean(b)) for b in
                                     zip(*(run["host_nic_bytes_sent"] for run in runs))]
    result["host_nic_bytes_theory"] = first["host_nic_bytes_theory"]
    result["rank_cpu_fraction"] = [round(statistics.median(c), 3) for c in
                                   zip(*(run["rank_cpu_fraction"] for run in runs))]
    busy = [run["machine_cpu_busy_fraction"] for run in runs
            if run["machine_cpu_busy_fraction"] is not None]
    result["machine_cpu_busy_fraction"] = statistics.median(busy) if busy else None
    result.update(latency=first["latency"], seconds_repeats=seconds,
                  rounds=len(runs), emulation_notes=first["emulation_notes"])
    return result


def table_row(r: dict) -> str:
    """One Markdown row; the README's table is these rows."""
    rate = r["bandwidth_bits_per_second"]
    link = f"{rate / 1e9:g} Gbit/s" if rate else "none"
    sent = [b / 2**20 for b in r["host_nic_bytes_sent"]]
    sent_text = (f"{min(sent):.1f}–{max(sent):.1f} ({len(sent)} hosts)" if len(sent) > 2
                 else " / ".join(f"{b:.1f}" for b in sent))
    bound = f"{r['bound_seconds']:.3f}" if r["bound_seconds"] else "—"
    ratio = f"{r['ratio_to_bound']:.2f}×" if r["ratio_to_bound"] else "—"
    low, high = r["seconds_spread"]
    payload = "float16" if r["compression"] == "fp16" else "float32"
    if r.get("overlap"):
        payload += ", backward, --overlap"
    elif r.get("backward"):
        payload += ", backward"
    busy = r["machine_cpu_busy_fraction"]
    busy = "—" if busy is None else f"{busy:.0%}"
    return (f"| {r['hosts']} | {r['ranks_per_host']} | {link} | {payload} | {r['seconds']:.3f} "
            f"| {low:.3f}–{high:.3f} | {bound} | {ratio} | {sent_text} "
            f"| {r['host_nic_bytes_theory'][0] / 2**20:.1f} "
            f"| {busy} |")


TABLE_HEADER = ("| H | ranks per host | link | payload | seconds | spread | bound | × bound "
                "| MiB sent per host NIC | theory MiB | machine CPU busy |\n"
                "|---:|---:|---|---|---:|---|---:|---:|---|---:|---:|")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from hybriddl.errors import UsageError
    from hybriddl.files import atomic_write_json

    if args.size < 4 or args.size % 4:
        print(f"bench_allreduce: --bytes {args.size}: give a positive multiple of 4",
              file=sys.stderr)
        return 2
    if args.parts < 1 or args.size // args.parts < 4:
        print(f"bench_allreduce: --parts {args.parts}: give 1 or more, at most the gradient's "
              "size in float32 elements", file=sys.stderr)
        return 2
    combinations = [(h, b, c, o) for b in args.bandwidth for h in args.hosts
                    for c in args.compression for o in args.overlap]
    runs: dict[tuple, list[dict]] = {combo: [] for combo in combinations}
    try:
        for _ in range(args.rounds):
            for hosts, bandwidth, compression, overlap in combinations:
                runs[(hosts, bandwidth, compression, overlap)].append(measure(
                    hosts, args.size, bandwidth=bandwidth, compression=compression,
                    repeats=args.repeats, ranks_per_host=args.ranks_per_host,
                    latency=args.latency, parts=args.parts, overlap=overlap == "on",
                    backward=args.backward))
    except UsageError as exc:
        print(f"bench_allreduce: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"bench_allreduce: {exc}", file=sys.stderr)
        return 1
    results = [merge(runs[combo]) for combo in combinations]
    atomic_write_json(Path(args.output), {
        "command": "scripts/bench_allreduce.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "repeats_per_round": args.repeats, "results": results})
    print(TABLE_HEADER)
    for result in results:
        print(table_row(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

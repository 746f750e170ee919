"""The split's features' gradient on H emulated hosts: Open MPI's reduce-scatter against
hybriddl's, side by side.

    python scripts/bench_rows_exchange.py --hosts 2 4 --speedup 74 --bandwidth 1gbit \\
        --output results/bench_rows_exchange.json

With `--host-parallel hybrid` every host computes the classifier on the whole global batch,
and backward hands each host the gradient of every sample's features: a reduce-scatter of
rows gives each host the sum over hosts of its own samples' rows. Two ways, timed on the
same tensor (--rows-per-host rows of --width values from each host: AlexNet's and VGG16's
9216 features at 32 images a host by default), float32 and bfloat16, in interleaved rounds:

- `libnbc`: Open MPI's `Ireduce_scatter` (libnbc's: a reduce to one host along a tree, then
  a scatter from it), what the hosts ran before; bfloat16 summed by a user-defined operation
  of torch's add, as they did;
- `hybriddl`: `MPIHosts.reduce_scatter_rows` (an alltoallv of each host's rows, then each
  host's own sum in rank order).

A repeat ends when the slowest host has its part (between two barriers); seconds are
emulated (wall / dilation S x D). The bound is what each host must send, (H-1)/H of the
tensor, over the link rate. Both ways' results are checked against each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench_common import REPO, results_header, spread
from pages import Page

WAYS = ("libnbc", "hybriddl")
DTYPES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--speedup", type=float, nargs="+", default=[1.0, 74.0],
                        help="emulated hosts' speedup S (hybriddl emulate --speedup)")
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--rows-per-host", type=int, default=32)
    parser.add_argument("--width", type=int, default=9216)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each way once")
    parser.add_argument("--output", required=True)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one rank: where rank 0 writes
    args = parser.parse_args(argv)
    if min(args.hosts) < 2 or min(args.speedup) < 1 or args.rounds < 1 \
            or args.rows_per_host < 1 or args.width < 1:
        parser.error("--hosts at least 2, --speedup at least 1, --rounds, --rows-per-host "
                     "and --width at least 1")
    return args


def worker(args: argparse.Namespace) -> None:
    """One rank: both ways, every dtype, interleaved rounds; rank 0 writes --worker."""
    import torch

    from hybriddl.hosts.cluster import connect
    from hybriddl.emulation.hosts import time_scale
    from hybriddl.hosts.wire import as_bits

    hosts = connect()
    comm, MPI = hosts.comm, hosts.MPI
    counts = [args.rows_per_host] * hosts.size
    sizes = [c * args.width for c in counts]
    dilation = time_scale()

    def half_sum(dtype):
        """What the hosts summed bfloat16 with before: torch's add as an MPI operation."""
        def add(incoming, inout, datatype) -> None:
            if len(incoming):
                torch.frombuffer(inout, dtype=dtype).add_(torch.frombuffer(incoming, dtype=dtype))
        return MPI.BYTE.Create_contiguous(2).Commit(), MPI.Op.Create(add, commute=True)

    figures = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        tensor = torch.randn(sum(counts), args.width,
                             generator=torch.Generator().manual_seed(hosts.rank)).to(dtype)
        operation = half_sum(dtype) if dtype != torch.float32 else None

        def libnbc():
            out = torch.empty(counts[hosts.rank], args.width, dtype=dtype)
            if operation is None:
                comm.Ireduce_scatter(tensor.numpy(), out.numpy(), sizes, MPI.SUM).Wait()
            else:
                datatype, op = operation
                comm.Ireduce_scatter([as_bits(tensor), datatype], [as_bits(out), datatype],
                                     sizes, op).Wait()
            return out

        def ours():
            return hosts.reduce_scatter_rows(tensor, counts)

        tolerance = 1e-5 if dtype == torch.float32 else hosts.size * 2**-8
        if not torch.allclose(libnbc().float(), ours().float(), rtol=tolerance,
                              atol=tolerance * hosts.size):
            raise SystemExit(f"rank {hosts.rank}: the two reduce-scatters of {name} differ")
        seconds = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way, run in zip(WAYS, (libnbc, ours)):
                hosts.barrier()
                started = time.perf_counter()
                run()
                elapsed = time.perf_counter() - started
                seconds[way].append(max(hosts.allgather(elapsed)) / dilation)
        figures[name] = seconds
        if operation is not None:
            operation[1].Free()
    if hosts.rank == 0:
        Path(args.worker).write_text(json.dumps(figures))
    hosts.close()


def measure(hosts: int, speedup: float, args: argparse.Namespace) -> list[dict]:
    """Both ways on `hosts` emulated hosts of one core at `speedup`: one row per dtype."""
    from hybriddl.emulation import EmulatedHosts
    from hybriddl.emulation.hosts import bits_per_second

    with EmulatedHosts(hosts=hosts, cores_per_host=1, bandwidth=args.bandwidth,
                       speedup=speedup) as cluster:
        out = Path(cluster.folder) / "figures.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        run = cluster.run([sys.executable, str(Path(__file__).resolve()),
                           "--rows-per-host", str(args.rows_per_host), "--width", str(args.width),
                           "--rounds", str(args.rounds), "--output", os.devnull,
                           "--worker", str(out)], env=env)
        if run.returncode != 0:
            raise SystemExit(f"bench_rows_exchange: the run on {hosts} hosts at S = {speedup:g} "
                             f"failed (exit {run.returncode})")
        figures = json.loads(out.read_text())
        time_scale = cluster.time_scale
    rows = []
    for name, seconds in figures.items():
        size = 2 if name == "bfloat16" else 4
        tensor = hosts * args.rows_per_host * args.width * size
        bound = (hosts - 1) / hosts * tensor * 8 / bits_per_second(args.bandwidth)
        medians = {way: statistics.median(seconds[way]) for way in WAYS}
        rows.append({"hosts": hosts, "speedup": speedup, "time_scale": time_scale,
                     "dtype": name, "tensor_bytes": tensor, "bound_seconds": bound,
                     **{f"{way}_seconds": spread(seconds[way], 6) for way in WAYS},
                     "libnbc_over_hybriddl": medians["libnbc"] / medians["hybriddl"]})
        print(f"bench_rows_exchange: {hosts} hosts, S = {speedup:g}, {name} "
              f"{tensor / 1e6:.2f} MB: libnbc {medians['libnbc'] * 1e3:.2f} ms, hybriddl "
              f"{medians['hybriddl'] * 1e3:.2f} ms, bound {bound * 1e3:.2f} ms", flush=True)
    return rows


# ---------------------------------------------------------------- its page in docs/benchmarks

def bench_rows_exchange_table(data: dict) -> str:
    lines = ["| hosts | S | D | dtype | MB | libnbc ms (spread) | hybriddl ms (spread) | "
             "bound ms | libnbc / hybriddl |", "|---:|---:|---:|---|---:|---|---|---:|---:|"]
    for r in data["rows"]:
        ways = [f"{r[f'{way}_seconds']['median'] * 1e3:.1f} "
                f"({r[f'{way}_seconds']['min'] * 1e3:.1f}–{r[f'{way}_seconds']['max'] * 1e3:.1f})"
                for way in ("libnbc", "hybriddl")]
        lines.append(f"| {r['hosts']} | {r['speedup']:g} | {r['time_scale']:g} | {r['dtype']} | "
                     f"{r['tensor_bytes'] / 1e6:.2f} | {ways[0]} | {ways[1]} | "
                     f"{r['bound_seconds'] * 1e3:.1f} | {r['libnbc_over_hybriddl']:.2f} |")
    return "\n".join(lines)


def bench_rows_exchange_setting(data: dict) -> str:
    return (f"{data['rows_per_host']} rows of {data['width']} values from each emulated host "
            f"of one core, {data['bandwidth']} links, {data['rounds']} interleaved rounds, "
            "emulated ms")


BENCH_ROWS_EXCHANGE_NOTES = """How to read it: the split classifier's features' gradient (AlexNet's and VGG16's 9216
features at 32 images a host) returned to the hosts that computed them, a reduce-scatter of
rows. *libnbc* is Open MPI's non-blocking reduce-scatter, which the hosts ran before: a
reduce to one host along a tree, then a scatter from it, so one host receives every other
host's whole tensor before anything goes back. *hybriddl* is `MPIHosts.reduce_scatter_rows`:
one alltoallv (each host sends every other host that host's rows, all links at once), then
each host's own sum in rank order. The bound is what each host must send, (H-1)/H of the
tensor, over the link. Where D > 1 the hosts share the cores under a CPU quota each, and at
S = 1 their TCP processing is not dilated: the bound is then out of reach for both."""


PAGES = [
    Page("bench_rows_exchange", "The split's features' gradient: two reduce-scatters",
         "results/bench_rows_exchange.json", bench_rows_exchange_table,
         bench_rows_exchange_setting, BENCH_ROWS_EXCHANGE_NOTES),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = [row for hosts in args.hosts for speedup in args.speedup
            for row in measure(hosts, speedup, args)]
    from hybriddl.files import atomic_write_json
    atomic_write_json(Path(args.output), {
        "what": ("the split's features' gradient reduce-scattered over emulated hosts of one "
                 f"core at {args.bandwidth}: Open MPI's libnbc Ireduce_scatter against "
                 "hybriddl's (an alltoallv and each host's own sum), emulated seconds, "
                 f"{args.rounds} interleaved rounds"),
        "bandwidth": args.bandwidth, "rows_per_host": args.rows_per_host, "width": args.width,
        "rounds": args.rounds, **results_header("bench_rows_exchange.py", argv), "rows": rows})
    print(f"bench_rows_exchange: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gradient averaging on H emulated hosts: seconds and per-host NIC bytes against the bound.

    sudo PYTHONPATH=. python scripts/bench_allreduce.py --hosts 4 --bandwidth 1gbit \
        --mib 64 --output results/bench_allreduce-4.json

Runs the trainer's own averaging (`hybriddl.hosts.cluster.connect()` under mpirun, i.e.
`MPIHosts.averaging`) on H emulated hosts, one rank each, every link limited to
--bandwidth. The gradient is one float32 tensor of --mib MiB, averaged once to warm up,
then --repeats times, each between two barriers; seconds is the median of the repeats.
Each rank reads its own host's NIC (`eth0` in its namespace) before and after the
repeats, so the bytes are what crossed the network for the allreduces alone (TCP/IP
headers included; veth carries up to 64 KiB segments, so they add well under 1 %).

Theory: a ring (or reduce-scatter + allgather) allreduce sends 2(H-1)/H*S from every
host, and no host can finish sooner than that over its link: bound = 2(H-1)/H*S*8/rate.
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
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, required=True, help="emulated hosts, one rank each")
    parser.add_argument("--bandwidth", help="every link's rate, e.g. 1gbit (default: no "
                        "limit, no bound)")
    parser.add_argument("--latency", help="one-way delay added per link, e.g. 0.1ms")
    parser.add_argument("--mib", type=float, required=True, help="gradient size in MiB")
    parser.add_argument("--compression", choices=("none", "fp16"), default="none",
                        help="what travels: float32 (none) or float16 (the trainer's "
                             "--fp16-allreduce); default none")
    parser.add_argument("--repeats", type=int, default=5, help="timed allreduces (default: 5)")
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set when run under mpirun
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One rank: the trainer's averaging on a one-tensor model; rank 0 writes --worker."""
    import psutil
    import torch
    from torch import nn

    from hybriddl.data import epoch_batches
    from hybriddl.hosts.cluster import connect
    from hybriddl.hosts.compression import Compression
    from hybriddl.emulation.hosts import NIC

    hosts = connect(compression=getattr(Compression, args.compression))
    model = nn.Module()
    model.gradient = nn.Parameter(torch.zeros(int(args.mib * 2**20) // 4))
    hosts.attach(model)
    # Each host holds one sample of a global batch of H: it sends 1/H of its gradient.
    share = hosts.share(epoch_batches(hosts.size, hosts.size, seed=0, epoch=0)[0])

    def average() -> float:
        model.gradient.grad = torch.full_like(model.gradient, float(hosts.rank + 1))
        hosts.barrier()
        started = time.perf_counter()
        with hosts.averaging(share) as average_over_hosts:
            average_over_hosts(1)
        hosts.barrier()
        return time.perf_counter() - started

    average()
    expected = (hosts.size + 1) / 2
    # float16 rounds each contribution and the sum: 2**-11 relative, twice.
    tolerance = 1e-3 if args.compression == "fp16" else 1e-5
    if not torch.allclose(model.gradient.grad, torch.full_like(model.gradient, expected),
                          rtol=tolerance):
        raise SystemExit(f"rank {hosts.rank}: the average is wrong")
    before = psutil.net_io_counters(pernic=True)[NIC].bytes_sent
    seconds = [average() for _ in range(args.repeats)]
    sent = (psutil.net_io_counters(pernic=True)[NIC].bytes_sent - before) / args.repeats
    everyone = hosts.allgather((seconds, sent))
    if hosts.rank == 0:
        Path(args.worker).write_text(json.dumps({
            # A repeat ends when the slowest host has its result.
            "seconds": [max(s[i] for s, _ in everyone) for i in range(args.repeats)],
            "host_nic_bytes_sent": [round(b) for _, b in everyone]}))
    hosts.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from hybriddl.emulation import EmulatedHosts
    from hybriddl.errors import UsageError
    from hybriddl.run.rundir import atomic_write_json

    size = int(args.mib * 2**20) // 4 * 4
    try:
        with EmulatedHosts(hosts=args.hosts, bandwidth=args.bandwidth,
                           latency=args.latency) as cluster:
            figures = Path(cluster.folder) / "figures.json"
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            given = sys.argv[1:] if argv is None else list(argv)
            run = cluster.run([sys.executable, str(Path(__file__).resolve()), *given,
                               "--worker", str(figures)], env=env)
            if run.returncode != 0:
                print(f"bench_allreduce: the run failed (exit {run.returncode})", file=sys.stderr)
                return 1
            measured = json.loads(figures.read_text())
    except UsageError as exc:
        print(f"bench_allreduce: {exc}", file=sys.stderr)
        return 2
    rate = cluster.rate
    wire = size // 2 if args.compression == "fp16" else size
    theory = 2 * (args.hosts - 1) / args.hosts * wire
    result = {"hosts": args.hosts, "bandwidth_bits_per_second": rate, "bytes": size,
              "compression": args.compression, "wire_bytes": wire,
              "seconds": statistics.median(measured["seconds"]),
              "bound_seconds": theory * 8 / rate if rate else None,
              "host_nic_bytes_sent": measured["host_nic_bytes_sent"],
              "host_nic_bytes_theory": [round(theory)] * args.hosts,
              "latency": args.latency, "seconds_repeats": measured["seconds"]}
    atomic_write_json(Path(args.output), {"results": [result]})
    bound = (f"bound {result['bound_seconds']:.3f} s, "
             f"x{result['seconds'] / result['bound_seconds']:.2f}") if rate else "no bound"
    print(f"{args.hosts} hosts, {args.mib} MiB {args.compression} at "
          f"{args.bandwidth or 'no limit'}: {result['seconds']:.3f} s ({bound}); MiB sent per host "
          f"{[round(b / 2**20, 1) for b in result['host_nic_bytes_sent']]} "
          f"(theory {theory / 2**20:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

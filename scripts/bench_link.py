"""Does the emulated network reach its link rate? Raw TCP streams, no MPI.

    sudo python scripts/bench_link.py --hosts 4 --bandwidth 1gbit --mib 64 \
        --output results/bench_link-4-1gbit.json

Makes H emulated hosts (as the benchmarks do) and has every host i stream --mib MiB over
one TCP connection to host (i+1) mod H, all at once: the traffic pattern of one ring
allreduce step, each NIC sending and receiving at the same time. Each receiver times
the bytes from its first to its last byte. If the rates come out near the link rate,
the emulation (veth + tc tbf on both ends) is not what keeps an allreduce from its bound.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


PORT = 5201
CHUNK = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default: 2)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="every link's rate (default: 1gbit)")
    parser.add_argument("--mib", type=float, default=64, help="MiB each host sends (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument("--output", help="JSON file to write")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # ADDRESS BYTES ROUNDS
    parser.add_argument("--send", help=argparse.SUPPRESS)  # ADDRESS BYTES ROUNDS
    return parser.parse_args(argv)


def serve(address: str, size: int, rounds: int) -> None:
    with socket.create_server((address, PORT)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            buffer = bytearray(CHUNK)
            for _ in range(rounds):
                got, first = 0, None
                while got < size:
                    n = connection.recv_into(buffer, min(CHUNK, size - got))
                    if n == 0:
                        raise SystemExit("sender closed early")
                    first = first or time.perf_counter()
                    got += n
                last = time.perf_counter()
                connection.sendall(b"k")
                print(json.dumps({"seconds": last - first, "bytes": got}), flush=True)


def send(address: str, size: int, rounds: int) -> None:
    payload = bytes(CHUNK)
    for _ in range(100):
        try:
            connection = socket.create_connection((address, PORT))
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit(f"cannot reach {address}")
    with connection:
        for _ in range(rounds):
            sys.stdin.readline()  # the parent starts every round on every host at once
            sent = 0
            while sent < size:
                sent += connection.send(memoryview(payload)[:min(CHUNK, size - sent)])
            connection.recv(1)
            print("done", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve or args.send:
        address, size, rounds = (args.serve or args.send).split(",")
        (serve if args.serve else send)(address, int(size), int(rounds))
        return 0
    from hybriddl.emulation import EmulatedHosts
    from hybriddl.files import atomic_write_json

    size = int(args.mib * 2**20)
    me = [sys.executable, str(Path(__file__).resolve())]
    with EmulatedHosts(hosts=args.hosts, bandwidth=args.bandwidth) as cluster:
        h = cluster.count
        spec = lambda address: f"{address},{size},{args.repeats}"  # noqa: E731
        servers = [subprocess.Popen(cluster.on_host(i, [*me, "--serve",
                                                        spec(cluster.addresses[i])]),
                                    stdout=subprocess.PIPE, text=True) for i in range(h)]
        for server in servers:
            assert server.stdout.readline().strip() == "ready"
        senders = [subprocess.Popen(cluster.on_host(i, [*me, "--send",
                                                        spec(cluster.addresses[(i + 1) % h])]),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for i in range(h)]
        before = cluster.counters()
        rounds = []
        for _ in range(args.repeats):
            for sender in senders:
                sender.stdin.write("go\n")
                sender.stdin.flush()
            for sender in senders:
                sender.stdout.readline()
            rounds.append([json.loads(server.stdout.readline())["seconds"] for server in servers])
        sent = [(a - b).bytes_sent for a, b in zip(cluster.counters(), before)]
        for process in [*senders, *servers]:
            process.stdin and process.stdin.close()
            process.wait(timeout=30)
    rate = cluster.rate
    seconds = statistics.median(s for r in rounds for s in r)
    result = {"hosts": h, "bandwidth_bits_per_second": rate, "bytes_per_stream": size,
              "pattern": "host i streams to host i+1 mod H, all at once",
              "stream_seconds_median": seconds, "stream_seconds_by_round": rounds,
              "bound_seconds": size * 8 / rate, "rate_fraction": size * 8 / rate / seconds,
              "host_nic_bytes_sent_per_round": [round(b / args.repeats) for b in sent]}
    if args.output:
        atomic_write_json(Path(args.output), result)
    print(f"{h} hosts at {args.bandwidth}: one stream of {args.mib} MiB per host in "
          f"{seconds:.3f} s median (bound {result['bound_seconds']:.3f} s), "
          f"{result['rate_fraction']:.1%} of the link rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())

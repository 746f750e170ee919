"""What the heartbeat between hosts costs: bytes on each host's NIC, and step time.

    sudo python scripts/bench_heartbeat.py --output results/bench_heartbeat.json

On 2 emulated hosts (one rank each, their own NICs), the trainer's hosts
(`hybriddl.hosts.cluster.connect()` under mpirun) with the heartbeat switched on and off
in interleaved rounds (on/off, off/on, ...):

- idle (--idle-rounds): nothing but the heartbeat runs for --idle-seconds; bytes each
  host's NIC sent, per second (TCP/IP headers and ACKs included), on and off;
- steps (--rounds): --steps optimizer steps of the use case (the trainer's
  `optimizer_step`, one sequential worker per host, each host half of --batch-size,
  gradients averaged by `Hosts.averaging`); seconds per step (median of the round), on
  and off, and their ratio per round.

Theory: each rank sends (H - 1) messages of 8 bytes every 2 s, 4 B/s of payload at H = 2;
each beat costs its TCP/IP headers and an ACK (the beats have TCP connections of their own).
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
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds of steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and setting")
    parser.add_argument("--idle-rounds", type=int, default=2, help="interleaved idle rounds")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set when run under mpirun
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import psutil
    import torch

    from hybriddl.data import epoch_batches
    from hybriddl.emulation.hosts import NIC
    from hybriddl.hosts.cluster import connect
    from hybriddl.hosts.heartbeat import Heartbeat
    from hybriddl.step import optimizer_step
    from hybriddl.strategies import make_strategy
    from hybriddl.usecases import build_model, get_usecase

    hosts = connect()
    hosts.heartbeat.close()  # this benchmark switches it on and off itself
    hosts.heartbeat = None
    case = get_usecase(args.usecase)
    torch.manual_seed(0)
    model = build_model(case.model, 3)
    strategy = make_strategy("sequential")
    strategy.setup(model)
    hosts.broadcast_parameters(model)
    hosts.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum)
    mine = args.batch_size // hosts.size
    x = torch.randn(mine, 3, args.image_size, args.image_size)
    y = torch.randint(0, 3, (mine,))
    share = hosts.share(epoch_batches(mine * hosts.size, mine * hosts.size, seed=0, epoch=0)[0])

    def sent() -> int:
        return psutil.net_io_counters(pernic=True)[NIC].bytes_sent

    def step() -> float:
        started = time.perf_counter()
        with hosts.averaging(share) as average_over_hosts:
            optimizer_step(strategy, optimizer, x, y,
                           lambda stats: average_over_hosts(stats.samples))
        return time.perf_counter() - started

    def switched(on: bool, measure):
        heartbeat = None
        if on:
            heartbeat = hosts.heartbeat = Heartbeat(hosts.allgather, hosts.rank, hosts.size)
        hosts.barrier()
        started = time.monotonic()
        figure = measure()
        hosts.barrier()
        if heartbeat:
            # The thread's CPU time over the span: a figure this machine's step-time noise
            # cannot hide.
            figures[True]["thread_cpu_share"].append(
                heartbeat.cpu_seconds / (time.monotonic() - started))
            heartbeat.close()
            hosts.heartbeat = None
        return figure

    def idle() -> float:
        before, started = sent(), time.monotonic()
        time.sleep(args.idle_seconds)
        return (sent() - before) / (time.monotonic() - started)

    step()  # warm-up
    figures = {True: {"idle_bytes_per_second": [], "step_seconds": [], "thread_cpu_share": []},
               False: {"idle_bytes_per_second": [], "step_seconds": []}}
    for round_ in range(args.idle_rounds):
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            figures[on]["idle_bytes_per_second"].append(switched(on, idle))
    for round_ in range(args.rounds):
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            figures[on]["step_seconds"].append(
                switched(on, lambda: statistics.median(step() for _ in range(args.steps))))
    everyone = hosts.allgather({str(k).lower(): v for k, v in
                                {"on": figures[True], "off": figures[False]}.items()})
    if hosts.rank == 0:
        Path(args.worker).write_text(json.dumps(everyone))
    hosts.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from hybriddl.emulation import EmulatedHosts
    from hybriddl.files import atomic_write_json

    with EmulatedHosts(hosts=2) as cluster:
        figures = Path(cluster.folder) / "figures.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        given = sys.argv[1:] if argv is None else list(argv)
        run = cluster.run([sys.executable, str(Path(__file__).resolve()), *given,
                           "--worker", str(figures)], env=env)
        if run.returncode != 0:
            print(f"bench_heartbeat: the run failed (exit {run.returncode})", file=sys.stderr)
            return 1
        by_rank = json.loads(figures.read_text())
    # A step ends when the slower host has its average: the slower rank's figure.
    on = [max(r["on"]["step_seconds"][i] for r in by_rank) for i in range(args.rounds)]
    off = [max(r["off"]["step_seconds"][i] for r in by_rank) for i in range(args.rounds)]
    ratios = [a / b for a, b in zip(on, off)]
    result = {
        "hosts": 2, "usecase": args.usecase, "image_size": args.image_size,
        "global_batch": args.batch_size, "rounds": args.rounds, "steps_per_round": args.steps,
        "idle_rounds": args.idle_rounds, "idle_seconds": args.idle_seconds,
        "idle_nic_bytes_per_second": {
            setting: [statistics.median(r[setting]["idle_bytes_per_second"]) for r in by_rank]
            for setting in ("on", "off")},
        "payload_bytes_per_second_theory": 8 * (2 - 1) / 2.0,
        "step_seconds_on": on, "step_seconds_off": off,
        "step_seconds_on_median": statistics.median(on),
        "step_seconds_off_median": statistics.median(off),
        "step_ratio_on_over_off_median": statistics.median(ratios),
        "step_ratio_on_over_off_range": [min(ratios), max(ratios)],
        "heartbeat_thread_cpu_percent_of_a_core": {
            "median": 100 * statistics.median(
                share for r in by_rank for share in r["on"]["thread_cpu_share"]),
            "max": 100 * max(share for r in by_rank for share in r["on"]["thread_cpu_share"])},
        "by_rank": by_rank,
    }
    atomic_write_json(Path(args.output), result)
    print(json.dumps({k: v for k, v in result.items() if k != "by_rank"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

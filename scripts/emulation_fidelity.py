"""Is time on emulated hosts slowed down faithfully? Compute, link rate and NIC bytes at D.

    sudo flock /tmp/hybriddl-cpu.lock .venv/bin/python scripts/emulation_fidelity.py \
        --output results/emulation_fidelity.json

`hybriddl emulate` emulates H hosts of C cores that exceed this machine's cores by
slowing time down by D (docs/methodology.md, "Emulated hosts"); `--time-scale D` forces D,
so each check compares the same emulated hosts at D = 1 and at D > 1:

(a) compute: one host of --cores cores trains (`hybriddl train`, sequential strategy,
    --steps steps, the first --warmup left out) at each D; its step (metrics.json's
    per-step wall seconds) should be D x the step at D = 1, within 15 %.
(b) link: two hosts of 1 core at --bandwidth; host h0 streams --mib MiB over one TCP
    connection to h1, then 50 one-byte round trips (at --latency, if given). The wire
    rate (h0's NIC bytes over the receiver's first-to-last-byte seconds) should be
    bandwidth / D within 10 %; goodput (payload bytes) is beside it, and with --latency
    the round trip should be 2 x latency x D.
    Then two hosts of --cores cores, which take turns on the machine at D = 2 (one is
    frozen while the other runs), at each --turns-bandwidth: the same wire rate check.
(c) NIC bytes: two hosts of 1 core train --nic-steps steps at each D: each host's NIC
    bytes (the emulate report) should not depend on D.
(d) side by side: H hosts of --cores cores that fill the machine (D = H, for each H in
    --side-hosts) each train as in (a), on their own (one single-process run per host,
    no MPI between them): every host's step should be D x the step of one such host at
    D = 1, within 15 %. This is the case of every multi-host cell in the scaling tables:
    the hosts take turns on the cores, and a host's threads must run together.

(e) exchanges: the exchanges of one step of `--host-parallel hybrid` (AlexNet, 2 hosts, 32
    images each: the features gathered, the row-parallel layer's sum, the features'
    gradient reduce-scattered, the convolutions' 9.9 MB gradient averaged), --exchange-steps
    times back to back through hybriddl's MPI hosts, at --turns-bandwidth[0]: 2 hosts of 1
    core side by side (D = 1) against 2 hosts of --cores cores that take turns (D = 2), in
    emulated seconds per step, within 15 %; at D = 2 also with Open MPI's own eager limits
    (what `emulate` changes for hosts that take turns: the rendezvous handshake waits for
    the other host's turn).

(f) at once under a quota: H hosts of 1 core for each H in --quota-hosts, under `--speedup 1`
    (where they do not fit side by side every host runs at once, held to 1/D core by a CPU
    quota: what the 4-host cells of the scaling_fast tables run), each training on its own
    as in (d): each host's step / D should be one host's alone (D = 1, the rest of the
    machine idle) within 15 %: the hosts that run at once do not slow each other's compute
    (caches, memory bandwidth) beyond what D accounts for.

Each check runs its D values interleaved, --rounds times; figures are medians over the
rounds with their spread [lowest, highest]. Needs root (emulated hosts) and cgroups that
can be frozen (v2, or v1's freezer).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import emulate, emulated_cell, host_options
from pages import Page

PORT = 5202
CHUNK = 1 << 20
PINGS = 50


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[2, 4],
                        help="time scales D compared with D = 1 (default: 2 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default: 2)")
    parser.add_argument("--cores", type=int, default=2,
                        help="cores of the emulated host in (a) (default: 2)")
    parser.add_argument("--usecase", default="SimpleBig", help="(a), (c) (default: SimpleBig)")
    parser.add_argument("--image-size", type=int, default=64, help="(a), (c) (default: 64)")
    parser.add_argument("--steps", type=int, default=5, help="(a) steps (default: 5)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="(a) first steps left out (default: 2)")
    parser.add_argument("--bandwidth", default="200mbit", help="(b) (default: 200mbit)")
    parser.add_argument("--latency", help="(b) one-way delay, e.g. 1ms (needs the kernel's "
                        "netem; default: none, no round trips measured)")
    parser.add_argument("--mib", type=float, default=16, help="(b) MiB streamed (default: 16)")
    parser.add_argument("--turns-bandwidth", nargs="*", default=["1gbit", "10gbit"],
                        help="(b) links of 2 hosts of --cores cores that take turns, at "
                             "D = 2 (none: left out) (default: 1gbit 10gbit)")
    parser.add_argument("--turns-mib", type=float, default=256,
                        help="(b) MiB streamed between hosts that take turns (default: 256)")
    parser.add_argument("--nic-steps", type=int, default=2, help="(c) steps (default: 2)")
    parser.add_argument("--side-hosts", type=int, nargs="+", default=[2],
                        help="(d) host counts H (D = H) (default: 2)")
    parser.add_argument("--quota-hosts", type=int, nargs="+", default=[2, 4],
                        help="(f) host counts, hosts of 1 core (default: 2 4)")
    parser.add_argument("--exchange-steps", type=int, default=20,
                        help="(e) steps of exchanges per run (default: 20)")
    parser.add_argument("--checks", nargs="+", choices="abcdef", default=list("abcdef"),
                        help="which checks to run (default: a b c d e)")
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--link-worker", help=argparse.SUPPRESS)  # OUTPUT_FOLDER,BYTES
    parser.add_argument("--alone-worker", help=argparse.SUPPRESS)  # RUN_DIR_PREFIX
    parser.add_argument("--exchange-worker", help=argparse.SUPPRESS)  # OUTPUT_FILE,STEPS
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- (d)'s ranks
def alone_worker(prefix: str, command: list[str]) -> int:
    """Run `command` (hybriddl train) on this rank's host as a process of its own, outside
    the MPI job that started it (a singleton: no MPI between the hosts), into its own run
    dir, PREFIX<rank>."""
    rank = os.environ["OMPI_COMM_WORLD_RANK"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    return subprocess.run([*command, "--run-dir", f"{prefix}{rank}"], env=env).returncode


# ---------------------------------------------------------------- (e)'s ranks
# One hybrid step's exchanges, AlexNet, 2 hosts of 32 images: rows x floats per row.
FEATURES, HIDDEN, CONVOLUTION_FLOATS, HOST_BATCH = 9216, 4096, 2_469_696, 32


def exchange_worker(output: str, steps: int) -> None:
    """Both ranks run `steps` steps of the hybrid's exchanges; rank 0 writes each step's
    seconds, in emulated time (wall / D)."""
    import torch

    from hybriddl.hosts.cluster import connect

    hosts = connect()
    scale = float(os.environ.get("HYBRIDDL_TIME_SCALE", "1"))
    counts = [HOST_BATCH] * hosts.size
    total = sum(counts)
    features = torch.ones(HOST_BATCH, FEATURES)
    partial = torch.ones(total, HIDDEN)
    features_grad = torch.ones(total, FEATURES)
    gradient = torch.ones(CONVOLUTION_FLOATS)
    seconds = []
    hosts.barrier()
    for _ in range(steps):
        started = time.perf_counter()
        hosts.allgather_rows(features, counts)
        hosts.allreduce_sum(partial)
        hosts.reduce_scatter_rows(features_grad, counts)
        hosts.allreduce_sum(gradient)
        seconds.append((time.perf_counter() - started) / scale)
    hosts.barrier()
    if hosts.rank == 0:
        Path(output).write_text(json.dumps(seconds))
    hosts.close()


# ---------------------------------------------------------------- (b)'s ranks
def link_worker(folder: Path, size: int) -> None:
    """Rank 1 (host h1) receives the stream and answers the pings; rank 0 (h0) sends."""
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if rank == 1:
        with socket.create_server(("0.0.0.0", PORT)) as server:
            connection, _ = server.accept()
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buffer, got, first = bytearray(CHUNK), 0, None
                while got < size:
                    n = connection.recv_into(buffer, min(CHUNK, size - got))
                    if n == 0:
                        raise SystemExit("sender closed early")
                    first = first or time.perf_counter()
                    got += n
                seconds = time.perf_counter() - first
                connection.sendall(b"k")
                for _ in range(PINGS):
                    connection.sendall(connection.recv(1))
        (folder / "receiver.json").write_text(json.dumps({"seconds": seconds, "bytes": got}))
        return
    tx = Path("/sys/class/net/eth0/statistics/tx_bytes")  # this host's NIC
    for _ in range(400):
        try:
            connection = socket.create_connection(("198.18.0.2", PORT))
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit("cannot reach h1")
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before = int(tx.read_text())
        payload, sent = memoryview(bytes(CHUNK)), 0
        while sent < size:
            sent += connection.send(payload[:min(CHUNK, size - sent)])
        connection.recv(1)
        wire = int(tx.read_text()) - before
        trips = []
        for _ in range(PINGS):
            start = time.perf_counter()
            connection.sendall(b"p")
            connection.recv(1)
            trips.append(time.perf_counter() - start)
    (folder / "sender.json").write_text(json.dumps({"wire_bytes": wire,
                                                    "round_trips": trips}))


# ---------------------------------------------------------------- runs
def emulated_report(options: list[str], command: list[str], scratch: Path) -> dict:
    """One `hybriddl emulate` run; its --report."""
    run = emulate(options, command, scratch / "report.json", timeout=600)
    if run.returncode != 0 or run.report is None:
        raise SystemExit(f"emulate {shlex.join(options)} failed:\n{run.output[-6000:]}")
    return run.report


def train(args, scale: float, hosts: int, cores: int, steps: int, scratch: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{hosts}-{scale:g}-", dir=scratch)) / "run"
    ran, metrics = emulated_cell(
        host_options(hosts, cores, speed=["--time-scale", str(scale)]),
        ["hybriddl", "train", "--usecase", args.usecase, "--image-size", str(args.image_size),
         "--max-steps", str(steps), "--strategy", "sequential", "--dropout", "0", "--run-dir",
         str(run_dir)], run_dir, timeout=600)
    if metrics is None:
        raise SystemExit(f"{ran.shown()} failed:\n{ran.output[-6000:]}")
    return {"report": ran.report, "step_seconds": metrics["epochs"][0]["per_step"]["seconds"]}


def step_row(steps: list[list[float]], base: float, scale: float) -> dict:
    """Median and spread of `steps` (lists of step seconds) at time scale `scale`, against
    D x `base` (the step at D = 1)."""
    every = [step for run in steps for step in run]
    median = statistics.median(every)
    return {"time_scale": scale, "step_seconds_median": median,
            "step_seconds_spread": [min(every), max(every)], "ratio_to_d1": median / base,
            "error": median / base / scale - 1,
            "within_15_percent": abs(median / base / scale - 1) <= 0.15}


def compute_check(args, scratch: Path) -> dict:
    scales = [1.0, *args.scales]
    steps: dict[float, list[list[float]]] = {d: [] for d in scales}
    for _ in range(args.rounds):
        for scale in scales:
            run = train(args, scale, 1, args.cores, args.steps, scratch)
            assert run["report"]["time_scale"] == scale
            steps[scale].append(run["step_seconds"][args.warmup:])
            print(f"(a) D={scale:g}: steps {run['step_seconds']}", flush=True)
    base = statistics.median(s for r in steps[1.0] for s in r)
    rows = [{**step_row(steps[scale], base, scale), "step_seconds_by_round": steps[scale]}
            for scale in scales]
    return {"what": f"1 host of {args.cores} cores, hybriddl train {args.usecase} "
                    f"{args.image_size}px sequential, {args.steps} steps, first "
                    f"{args.warmup} left out; wall step seconds at D vs D x those at D = 1",
            "rows": rows}


def link_check(args, scratch: Path) -> dict:
    """(b): 2 hosts of 1 core (side by side) at --bandwidth and each D; then 2 hosts of
    --cores cores, which take turns on the machine (D = 2), at --turns-bandwidth: the
    sockets' buffers must carry the link while one end is frozen."""
    rows = link_rows(args, scratch, 1, args.bandwidth, [1.0, *args.scales], args.mib)
    for bandwidth in args.turns_bandwidth:
        rows += link_rows(args, scratch, args.cores, bandwidth, [2.0], args.turns_mib)
    return {"what": f"2 hosts, {args.latency or 'no'} added delay one way: h0 streams "
                    f"MiB to h1 over TCP (wire: h0's NIC bytes; goodput: payload), then "
                    f"{PINGS} one-byte round trips",
            "rows": rows}


def link_rows(args, scratch: Path, cores: int, bandwidth: str, scales: list[float],
              mib: float) -> list[dict]:
    from hybriddl.emulation import bits_per_second, seconds_of

    rate = bits_per_second(bandwidth)
    delay = seconds_of(args.latency) if args.latency else 0.0
    latency = ["--latency", args.latency] if args.latency else []
    size = int(mib * 2**20)
    runs: dict[float, list[dict]] = {d: [] for d in scales}
    for _ in range(args.rounds):
        for scale in scales:
            for name in ("sender.json", "receiver.json"):
                (scratch / name).unlink(missing_ok=True)
            emulated_report(host_options(2, cores, bandwidth=bandwidth,
                                         speed=["--time-scale", str(scale), *latency]),
                            [sys.executable, str(Path(__file__).resolve()), "--output", "-",
                             "--link-worker", f"{scratch},{size}"], scratch)
            sender = json.loads((scratch / "sender.json").read_text())
            receiver = json.loads((scratch / "receiver.json").read_text())
            run = {"seconds": receiver["seconds"],
                   "wire_bits_per_second": sender["wire_bytes"] * 8 / receiver["seconds"],
                   "goodput_bits_per_second": receiver["bytes"] * 8 / receiver["seconds"],
                   "round_trip_seconds": statistics.median(sender["round_trips"])}
            runs[scale].append(run)
            print(f"(b) {bandwidth} C={cores} D={scale:g}: {json.dumps(run)}", flush=True)
    rows = []
    for scale in scales:
        wire = [r["wire_bits_per_second"] for r in runs[scale]]
        goodput = [r["goodput_bits_per_second"] for r in runs[scale]]
        trips = [r["round_trip_seconds"] for r in runs[scale]]
        expected = rate / scale
        rows.append({"time_scale": scale, "cores_per_host": cores, "bandwidth": bandwidth,
                     "mib": mib, "expected_bits_per_second": expected,
                     "wire_bits_per_second_median": statistics.median(wire),
                     "wire_bits_per_second_spread": [min(wire), max(wire)],
                     "wire_error": statistics.median(wire) / expected - 1,
                     "within_10_percent": abs(statistics.median(wire) / expected - 1) <= 0.10,
                     "goodput_bits_per_second_median": statistics.median(goodput),
                     "goodput_error": statistics.median(goodput) / expected - 1,
                     "expected_round_trip_seconds": 2 * delay * scale,
                     "round_trip_seconds_median": statistics.median(trips),
                     "round_trip_seconds_spread": [min(trips), max(trips)]})
    return rows


def nic_check(args, scratch: Path) -> dict:
    scales = [1.0, max(args.scales)]
    sent: dict[float, list[list[int]]] = {d: [] for d in scales}
    for _ in range(args.rounds):
        for scale in scales:
            run = train(args, scale, 2, 1, args.nic_steps, scratch)
            sent[scale].append([h["bytes_sent"] for h in run["report"]["hosts"]])
            print(f"(c) D={scale:g}: bytes sent {sent[scale][-1]}", flush=True)
    medians = {d: [statistics.median(r[h] for r in sent[d]) for h in range(2)]
               for d in scales}
    scaled = max(args.scales)
    return {"what": f"2 hosts of 1 core, hybriddl train {args.usecase} {args.image_size}px "
                    f"sequential, {args.nic_steps} steps: each host's NIC bytes sent",
            "rows": [{"time_scale": d, "host_bytes_sent_median": medians[d],
                      "host_bytes_sent_by_round": sent[d]} for d in scales],
            "relative_difference": max(abs(a / b - 1)
                                       for a, b in zip(medians[scaled], medians[1.0]))}


def each_on_its_own(args, hosts: int, options: list[str],
                    scratch: Path) -> tuple[dict, list[list[float]]]:
    """`hybriddl emulate --hosts HOSTS OPTIONS` with every host training on its own (one single-process
    run per host, no MPI between them; (d), (f)): the report and each host's wall step
    seconds, the first --warmup left out."""
    prefix = Path(tempfile.mkdtemp(prefix="alone-", dir=scratch)) / "run"
    report = emulated_report(["--hosts", str(hosts), *options], [
        sys.executable, str(Path(__file__).resolve()), "--output", "-", "--alone-worker",
        str(prefix), "--", "hybriddl", "train", "--usecase", args.usecase, "--image-size",
        str(args.image_size), "--max-steps", str(args.steps), "--strategy", "sequential",
        "--dropout", "0"], scratch)
    steps = []
    for host in range(hosts):
        metrics = json.loads(Path(f"{prefix}{host}", "metrics.json").read_text())
        steps.append(metrics["epochs"][0]["per_step"]["seconds"][args.warmup:])
    return report, steps


def side_by_side_check(args, scratch: Path) -> dict:
    counts = [1, *args.side_hosts]
    steps: dict[int, list[list[float]]] = {h: [] for h in counts}
    for _ in range(args.rounds):
        for hosts in counts:
            report, per_host = each_on_its_own(
                args, hosts, ["--cores-per-host", str(args.cores), "--time-scale", str(hosts)],
                scratch)
            assert report["time_scale"] == hosts
            steps[hosts] += per_host
            print(f"(d) H=D={hosts}: steps {steps[hosts][-hosts:]}", flush=True)
    base = statistics.median(s for r in steps[1] for s in r)
    rows = [{"hosts": hosts, **step_row(steps[hosts], base, float(hosts)),
             "step_seconds_by_host_and_round": steps[hosts]} for hosts in counts]
    return {"what": f"H hosts of {args.cores} cores at D = H, each training on its own "
                    f"(hybriddl train {args.usecase} {args.image_size}px sequential, "
                    f"{args.steps} steps, first {args.warmup} left out): each host's wall "
                    f"step vs D x one host's at D = 1",
            "rows": rows}


def quota_check(args, scratch: Path) -> dict:
    """(f): H hosts of 1 core at once under `--speedup 1` (a quota of 1/D core each where
    they do not fit), each training on its own, against one host alone."""
    counts = [1, *args.quota_hosts]
    steps: dict[int, list[list[float]]] = {h: [] for h in counts}
    scales: dict[int, float] = {}
    for _ in range(args.rounds):
        for hosts in counts:
            report, per_host = each_on_its_own(
                args, hosts, ["--cores-per-host", "1", "--speedup", "1"], scratch)
            scales[hosts] = report["time_scale"]
            steps[hosts] += per_host
            print(f"(f) H={hosts} D={scales[hosts]:g}: steps {steps[hosts][-hosts:]}", flush=True)
    base = statistics.median(s for r in steps[1] for s in r)
    rows = [{"hosts": hosts, "quota_cores": 1 / scales[hosts] if scales[hosts] > 1 else None,
             **step_row(steps[hosts], base, scales[hosts]),
             "step_seconds_by_host_and_round": steps[hosts]} for hosts in counts]
    return {"what": f"H hosts of 1 core at once under --speedup 1 (1/D core each where they "
                    f"do not fit), each training on its own (hybriddl train {args.usecase} "
                    f"{args.image_size}px sequential, {args.steps} steps, first "
                    f"{args.warmup} left out): each host's wall step vs D x one host's alone",
            "rows": rows}


OPEN_MPI_EAGER = ["--mca", "btl_tcp_eager_limit", "65536", "--mca", "btl_tcp_rndv_eager_limit",
                  "65536", "--mca", "btl_tcp_max_send_size", "131072"]  # Open MPI's defaults


def exchange_check(args, scratch: Path) -> dict:
    """(e): the hybrid step's exchanges side by side (D = 1) and taking turns (D = 2)."""
    bandwidth = args.turns_bandwidth[0] if args.turns_bandwidth else "1gbit"
    cases = [("side by side", 1, []), ("taking turns", args.cores, []),
             ("taking turns, Open MPI's eager limits", args.cores, OPEN_MPI_EAGER)]
    runs: dict[str, list[list[float]]] = {name: [] for name, _, _ in cases}
    scales: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, cores, mca in cases:
            output = scratch / "exchange.json"
            output.unlink(missing_ok=True)
            report = emulated_report(host_options(2, cores, bandwidth=bandwidth, speed=mca),
                                     [sys.executable, str(Path(__file__).resolve()), "--output",
                                      "-", "--exchange-worker",
                                      f"{output},{args.exchange_steps}"], scratch)
            scales[name] = report["time_scale"]
            runs[name].append(json.loads(output.read_text())[2:])  # the first two warm up
            print(f"(e) {name} D={scales[name]:g}: {statistics.median(runs[name][-1]):.4f} s",
                  flush=True)
    base = statistics.median(s for r in runs["side by side"] for s in r)
    rows = []
    for name, cores, _ in cases:
        every = [s for r in runs[name] for s in r]
        median = statistics.median(every)
        rows.append({"case": name, "cores_per_host": cores, "time_scale": scales[name],
                     "emulated_seconds_median": median,
                     "emulated_seconds_spread": [min(every), max(every)],
                     "error": median / base - 1, "within_15_percent": abs(median / base - 1) <= 0.15,
                     "emulated_seconds_by_round": runs[name]})
    return {"what": f"2 hosts at {bandwidth}: one --host-parallel hybrid step's exchanges "
                    f"(AlexNet, {HOST_BATCH} images per host), {args.exchange_steps} steps "
                    "back to back, the first 2 left out; emulated seconds per step",
            "bandwidth": bandwidth, "rows": rows}


def summary(result: dict) -> list[dict]:
    """One row per check and D: expected, measured, error, within tolerance."""
    def compute_row(row: dict, check: str) -> dict:
        base = row["step_seconds_median"] / row["ratio_to_d1"]  # the step at D = 1
        return {"check": check, "time_scale": row["time_scale"],
                "expected": row["time_scale"], "measured": row["ratio_to_d1"], "unit": "x",
                "spread": [s / base for s in row["step_seconds_spread"]],
                "error": row["error"], "tolerance": 0.15, "within": row["within_15_percent"]}

    rows = [compute_row(row, "compute, one host (step / step at D = 1)")
            for row in result.get("compute", {}).get("rows", []) if row["time_scale"] != 1]
    rows += [compute_row(row, f"compute, {row['hosts']} hosts side by side (step / one "
                              "host's step at D = 1)")
             for row in result.get("side_by_side", {}).get("rows", []) if row["hosts"] != 1]
    rows += [compute_row(row, f"compute, {row['hosts']} hosts of 1 core at once, "
                              + ("under a quota" if row["time_scale"] > 1 else "side by side")
                              + " (step / one host's alone)")
             for row in result.get("quota", {}).get("rows", []) if row["hosts"] != 1]
    for row in result.get("link", {}).get("rows", []):
        turns = " (hosts taking turns)" if row.get("cores_per_host", 1) > 1 else ""
        rows.append({"check": f"link at {row.get('bandwidth', '')}{turns} (wire rate)",
                     "time_scale": row["time_scale"],
                     "expected": row["expected_bits_per_second"] / 1e6,
                     "measured": row["wire_bits_per_second_median"] / 1e6, "unit": "Mbit/s",
                     "spread": [s / 1e6 for s in row["wire_bits_per_second_spread"]],
                     "error": row["wire_error"], "tolerance": 0.10,
                     "within": row["within_10_percent"]})
    for row in result.get("exchanges", {}).get("rows", []):
        if row["time_scale"] == 1:
            continue
        base = row["emulated_seconds_median"] / (1 + row["error"])
        rows.append({"check": f"a hybrid step's exchanges at {result['exchanges']['bandwidth']}, "
                              f"hosts {row['case']} (emulated s)",
                     "time_scale": row["time_scale"], "expected": base,
                     "measured": row["emulated_seconds_median"], "unit": "s",
                     "spread": row["emulated_seconds_spread"], "error": row["error"],
                     "tolerance": 0.15, "within": row["within_15_percent"]})
    nic = result.get("nic_bytes")
    if nic:
        scaled, base = nic["rows"][-1], nic["rows"][0]
        sent, expected = sum(scaled["host_bytes_sent_median"]), sum(base["host_bytes_sent_median"])
        every = [sum(r) for r in scaled["host_bytes_sent_by_round"]]
        rows.append({"check": "NIC bytes (both hosts, whole run)",
                     "time_scale": scaled["time_scale"], "expected": expected / 1e6,
                     "measured": sent / 1e6, "unit": "MB",
                     "spread": [min(every) / 1e6, max(every) / 1e6],
                     "error": sent / expected - 1, "tolerance": 0.01,
                     "within": abs(sent / expected - 1) <= 0.01})
    return rows


# ---------------------------------------------------------------- its page in docs/benchmarks

def fidelity_table(data: dict) -> str:
    lines = ["| check | time scale D | expected | measured (median) | spread | error "
             "| within |", "|---|---:|---:|---:|---|---:|---|"]
    for r in data["summary"]:
        unit = r["unit"]
        lines.append(f"| {r['check']} | {r['time_scale']:g} | {r['expected']:.3g} {unit} | "
                     f"{r['measured']:.3g} {unit} | {r['spread'][0]:.3g}–{r['spread'][1]:.3g} | "
                     f"{r['error']:+.1%} | {'yes' if r['within'] else '**no**'} "
                     f"(±{r['tolerance']:.0%}) |")
    return "\n".join(lines)


def fidelity_setting(data: dict) -> str:
    return (f"{data['rounds']} interleaved round(s) per check; D = 1 is the reference of "
            f"every compute check")


FIDELITY_NOTES = """How to read it: emulated hosts that do not fit this machine run slowed down by D (see
[methodology](../methodology.md)). *compute, one host*: a host alone, its step at D against
D × its step at D = 1. *compute, hosts side by side*: H hosts at D = H, each training on
its own, their steps against D × one host's at D = 1 (the case of every multi-host cell).
*link*: the wire rate against rate / D. *NIC bytes*: bytes a host sent at the largest D
against D = 1 (expected: equal)."""


EXCHANGE_NOTES = """How to read it: one step's exchanges of `--host-parallel hybrid` (AlexNet, 2 hosts of 32
images: the features gathered, the row-parallel layer's sum, the features' gradient
reduce-scattered, the convolutions' gradient averaged), run back to back through hybriddl's
MPI hosts, in emulated seconds. *Expected* is the same exchanges between 2 hosts of 1 core
side by side (D = 1, real time); *measured*, between 2 hosts of 2 cores that take turns
(D = 2), the case of every multi-host cell of the scaling tables. Each exchange needs both
hosts running, so hosts that take turns wait for each other's turn; the gap is what the
scaling tables' hybrid cells carry on top of real hosts. `emulate` sends messages up to
16 MiB eagerly between hosts that take turns (the row with Open MPI's own limits shows
why)."""


QUOTA_NOTES = """How to read it: *compute, H hosts of 1 core at once under a quota*: H emulated hosts of one
core started with `--speedup 1`, each training on its own (no exchange between them), their
steps against one host's alone on this machine (the other core idle), × D. Where H hosts do
not fit the cores side by side (4 on 2 cores: D = 2) every host runs at once, held to 1/D
core by a CPU quota over a 10 ms period: the case of every 4-host cell of the scaling_fast
tables. An error near 0 says that hosts running at once do not slow each other's compute
(shared caches, memory bandwidth) beyond the D the emulation divides by; a positive one is
the share of a multi-host cell's step that real hosts would not pay."""


PAGES = [
    Page("emulation_fidelity", "Emulated time: is it faithful?",
         "results/emulation_fidelity.json", fidelity_table, fidelity_setting, FIDELITY_NOTES),
    Page("emulation_fidelity-exchanges",
         "Emulated time: the hybrid step's exchanges between hosts that take turns",
         "results/emulation_fidelity-exchanges.json", fidelity_table, fidelity_setting,
         EXCHANGE_NOTES),
    Page("emulation_fidelity-quota-*",
         "Emulated time: hosts at once under a CPU quota, do they slow each other?",
         "results/emulation_fidelity-quota-*.json", fidelity_table, fidelity_setting,
         QUOTA_NOTES, none_yet="scripts/emulation_fidelity.py --checks f writes them"),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.alone_worker:
        return alone_worker(args.alone_worker, args.command[1:] if args.command[:1] == ["--"]
                            else args.command)
    if args.exchange_worker:
        output, steps = args.exchange_worker.rsplit(",", 1)
        exchange_worker(output, int(steps))
        return 0
    if args.link_worker:
        folder, size = args.link_worker.split(",")
        link_worker(Path(folder), int(size))
        return 0
    from bench_common import results_header
    from hybriddl.files import atomic_write_json

    result = {
        "what": __doc__.splitlines()[0],
        **results_header("emulation_fidelity.py", argv),
        "rounds": args.rounds,
        "limits": "compute is assumed to scale with cores; the kernel's networking (veth, "
                  "tc) shares the machine and is not slowed down",
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybriddl-fidelity-") as scratch:
        checks = {"a": ("compute", compute_check), "b": ("link", link_check),
                  "c": ("nic_bytes", nic_check), "d": ("side_by_side", side_by_side_check),
                  "e": ("exchanges", exchange_check), "f": ("quota", quota_check)}
        for letter in args.checks:
            key, check = checks[letter]
            result[key] = check(args, Path(scratch))
    result["seconds"] = round(time.monotonic() - started, 1)
    result["summary"] = summary(result)
    atomic_write_json(Path(args.output), result)
    print(fidelity_table(result))  # each run's figures were printed as it ended
    return 0


if __name__ == "__main__":
    sys.exit(main())

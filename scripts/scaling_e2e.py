"""Weak scaling measured end to end on emulated hosts that run at their real speed.

Each cell is one `hybriddl emulate --hosts H --cores-per-host C --bandwidth R -- hybriddl
train ...` run: H emulated hosts of C cores (time slowed down by D = H*C / this machine's
cores when they do not fit side by side: the hosts take turns on the cores, so each gets
C/D cores of CPU time, and links run at R/D), each with the use case's per-host batch (AlexNet 32, VGG16 16), so the global batch is H
times it. Nothing is composed from parts: a step's time is the trainer's own (metrics.json
per_step seconds, wall time), divided by D for emulated time; a host's bytes on the network
are what its own interface sent during each step (per_step nic_bytes_sent), with each
scheme's theory beside them.

Contenders, per cell: `hybrid` (--host-parallel hybrid), `data` (--host-parallel data),
`flat` (Horovod's model: one rank per core, each sequential, the whole gradient averaged
over all H*C ranks), `auto` (what --host-parallel auto picks, and how fast it ran), and
`ddp` (PyTorch DDP as a CPU user runs it: one single-threaded process per core, gloo over
the hosts' NICs, each host's NIC counted over the timed steps); and, asked for by name, the
peers of compression: `ddp-fp16` (DDP with torch's fp16_compress_hook), `ddp-powersgd`
(DDP with torch's powerSGD_hook at --powersgd-rank, in one bucket: with DDP's 25 MB buckets
it aborts on gloo; compressing from step 2, so its warm-up is at least 3 steps) and
`flat-fp16` (Horovod's model with fp16 compression), beside hybriddl's own PowerSGD at the
same rank (`hybrid-powersgd`, `data-powersgd`). A contender is a scheme and what its
gradients look like on the wire (WIRE).
Cells run in interleaved rounds (every contender of a cell, then the next round), and the
report gives medians and spread of the timed steps.

    python scripts/scaling_e2e.py --usecase SimpleBig --hosts 1 2 4 --bandwidth 1gbit \\
        --output results/scaling_e2e-SimpleBig.json

Faster hosts: `--speedup S` (or `--host-step 10ms`, which measures one host's step here once,
at the cells' settings, and takes S = that step / 10 ms) runs every cell with `hybriddl
emulate --speedup S`: each host stands for one S times faster, links at R/S, emulated time
= wall time / (S x D). Every cell and summary row records `speedup`, and each row
`host_step_seconds`, the emulated one-host step (the 1-host `data` cell's, else the
measured step / S). At a large S a link runs at a small fraction of its rate, so an exact
data-parallel step can take minutes of wall time: `--max-step-wall SECONDS` leaves out every
cell whose predicted wall time per step exceeds it, recorded as `skipped` with
`predicted_step_wall_seconds` (never as a measured figure). DDP starts with three dense
exchanges whatever its hook (its broadcast of the model, powerSGD_hook's two warm-up
steps): `--max-start-wall SECONDS` judges that start apart, so ddp-powersgd runs where a
dense step would not.

    python scripts/scaling_e2e.py --usecase SimpleBig --hosts 1 2 --cores-per-host 1 \\
        --bandwidth 1gbit --host-step 10ms --max-step-wall 60 --max-start-wall 400 \\
        --contenders hybrid hybrid-powersgd data-powersgd ddp-powersgd ddp-fp16 flat-fp16 \\
        data --rounds 2 --output results/scaling_fast-SimpleBig-1gbit.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import results_header
from hybriddl.files import atomic_write_json
from hybriddl.usecases import get_usecase

REPO = Path(__file__).resolve().parents[1]


CONTENDERS = ("hybrid", "data", "flat", "auto", "ddp")
# The compressed contenders, each (scheme, compression): the scheme's own run with its
# gradients sent as float16 or PowerSGD's factors. Asked for by name.
WIRE = {"ddp-fp16": ("ddp", "fp16"), "ddp-powersgd": ("ddp", "powersgd"),
        "flat-fp16": ("flat", "fp16"),
        # hybriddl's own PowerSGD (--compression powersgd:R) at the same rank.
        "hybrid-powersgd": ("hybrid", "powersgd"), "data-powersgd": ("data", "powersgd")}


def scheme_of(contender: str) -> str:
    return WIRE[contender][0] if contender in WIRE else contender


def wire_flags(contender: str, powersgd_rank: int) -> list[str]:
    """A contender's compression, as its command line says it (DDP's hooks are
    hybriddl.cli.compare_ddp's flags, hybriddl's compressions `train --compression`)."""
    scheme, compression = WIRE.get(contender, (contender, None))
    if compression == "fp16":
        return ["--fp16-allreduce"]
    if compression == "powersgd":
        return (["--powersgd-rank", str(powersgd_rank)] if scheme == "ddp"
                else ["--compression", f"powersgd:{powersgd_rank}"])
    return []


# The local strategy of every contender but flat and ddp: PyTorch's intra-op threads, the
# fastest local strategy for one host at 224 px on 2 cores (within noise of layerwise for
# AlexNet, results/bench_local-SimpleBig.json), and one that writes each gradient once, so
# --overlap sends buckets during backward (layerwise adds its threads' gradients at the end).
# Its workers are the host's cores (--cores-per-host).
LOCAL = {"SimpleBig": ["--strategy", "intraop", "--channels-last"],
         "ComplexSmall": ["--strategy", "intraop", "--channels-last"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cores-per-host", type=int, default=2)
    parser.add_argument("--bandwidth", nargs="+", default=["1gbit"])
    parser.add_argument("--speedup", type=float, metavar="S",
                        help="each host stands for one S times faster (hybriddl emulate "
                             "--speedup)")
    parser.add_argument("--host-step", metavar="DURATION",
                        help="derive S from one host's step measured here: S = that step / "
                             "DURATION (e.g. 10ms)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=[*CONTENDERS, *WIRE],
                        help=f"default: the exact ones, {' '.join(CONTENDERS)}")
    parser.add_argument("--powersgd-rank", type=int, default=2,
                        help="rank of every PowerSGD contender: ddp-powersgd's powerSGD_hook, "
                             "hybriddl's --compression powersgd:R (default: 2)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory-fraction", type=float, default=0.85,
                        help="skip a cell whose ranks' peak RSS, measured at fewer hosts, "
                             "would exceed this fraction of the machine's memory (RSS counts "
                             "the libraries the ranks share once per rank, so it "
                             "overestimates; default: 0.85)")
    parser.add_argument("--max-step-wall", type=float, metavar="SECONDS",
                        help="skip a cell whose predicted wall time per step (S x D x (the "
                             "emulated one-host step + its theory bytes over the link)) "
                             "exceeds SECONDS; it is recorded as skipped with its prediction "
                             "(default: no limit)")
    parser.add_argument("--max-start-wall", type=float, metavar="SECONDS",
                        help="with --max-step-wall: the limit for DDP's start instead (its "
                             "broadcast of the model and powerSGD_hook's two dense warm-up "
                             "steps, three dense exchanges before the first timed step), so "
                             "that ddp-powersgd runs on a slow link where dense steps would "
                             "not (default: --max-step-wall's)")
    parser.add_argument("--append", action="store_true",
                        help="keep the cells already in --output (the same use case and "
                             "hosts' cores) and add this run's; the file records every "
                             "run's command, commit and date")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    from hybriddl.emulation.hosts import check_speedup, duration_seconds
    from hybriddl.errors import UsageError

    if args.speedup is not None and args.host_step is not None:
        parser.error("give --speedup S or --host-step DURATION (which derives S), not both")
    try:
        args.host_step_seconds = (None if args.host_step is None
                                  else duration_seconds(args.host_step, "--host-step"))
        if args.speedup is not None:
            check_speedup(args.speedup)
    except UsageError as exc:
        parser.error(str(exc))
    for flag, value in (("--max-step-wall", args.max_step_wall),
                        ("--max-start-wall", args.max_start_wall)):
        if value is not None and not value > 0:
            parser.error(f"{flag} {value:g}: give a positive number of seconds")
    if args.max_start_wall is not None and args.max_step_wall is None:
        parser.error("--max-start-wall limits DDP's start beside --max-step-wall: give both")
    return args


def derive_speedup(args) -> dict:
    """S for every cell, from --speedup or from one host's step measured here (--host-step:
    the cells' local strategy, cores, per-host batch and image size); the file's record."""
    if args.host_step_seconds is None:
        return {"speedup": args.speedup, "host_step": None}
    from hybriddl.emulation.hosts import speedup_for_step
    from hybriddl.errors import UsageError
    from hybriddl.tuning.host_step import measure_host_step

    measured = measure_host_step(args.usecase, args.cores_per_host, image_size=args.image_size,
                                 channels_last="--channels-last" in LOCAL[args.usecase])
    try:
        speedup = speedup_for_step(measured.seconds, args.host_step_seconds)
    except UsageError as exc:
        raise SystemExit(f"scaling_e2e.py: {exc}") from None
    low, high = measured.spread
    print(f"host step {args.host_step_seconds * 1e3:g} ms: one host here takes "
          f"{measured.seconds:.4g} s ({low:.4g}-{high:.4g}): speedup S = {speedup:.4g}",
          flush=True)
    return {"speedup": speedup, "host_step": {"asked_seconds": args.host_step_seconds,
                                              "measured": measured.as_dict()}}


def speed_flags(args) -> list[str]:
    """hybriddl emulate's --speedup for every cell (none: the hosts at their own speed)."""
    return [] if args.speedup is None else ["--speedup", repr(args.speedup)]


def dilation_of(emulation: dict) -> float:
    """Wall seconds per emulated second from an emulate report: S x D (D alone before
    --speedup existed)."""
    return emulation.get("dilation", emulation.get("time_scale", 1.0))


def train_args(args, contender: str, hosts: int, run_dir: Path) -> tuple[list[str], int]:
    """(hybriddl train arguments, ranks per host) of one contender."""
    case = get_usecase(args.usecase)
    common = ["train", "--usecase", args.usecase, "--image-size", str(args.image_size),
              "--batch-size", str(case.batch_size * hosts), "--epochs", "1",
              "--max-steps", str(args.warmup + args.steps), "--monitor-interval", "0",
              # The steps' figures only: no checkpoint, validation or model.pt, which took
              # minutes after the steps on slow links (PowerSGD's error buffers and the
              # split classifier gathered over the wire).
              "--measure-only", "--run-dir", str(run_dir)]
    if scheme_of(contender) == "flat":
        return [*common, "--strategy", "flat", "--overlap", "--host-parallel", "data",
                *wire_flags(contender, args.powersgd_rank)], args.cores_per_host
    # --overlap for every contender: where the local strategy allows it, gradients leave
    # during backward (the hybrid's: the convolutions').
    return [*common, *LOCAL[args.usecase], "--workers", str(args.cores_per_host), "--overlap",
            "--host-parallel", scheme_of(contender),
            *wire_flags(contender, args.powersgd_rank)], 1


def run_ddp_cell(args, hosts: int, bandwidth: str, scratch: Path, contender: str = "ddp") -> dict:
    """PyTorch DDP as a user would run it on CPU hosts: one process (one thread) per core,
    gloo over each host's NIC (hybriddl.cli.compare_ddp, started once per host), with
    DDP's own allreduce or the contender's comm hook."""
    case = get_usecase(args.usecase)
    result_dir = scratch / f"{contender}-{hosts}-{bandwidth}"
    shutil.rmtree(result_dir, ignore_errors=True)  # an earlier round's
    report = scratch / f"{contender}-{hosts}-{bandwidth}.report.json"
    processes = hosts * args.cores_per_host
    ddp = shlex.join([sys.executable, "-m", "hybriddl.cli.compare_ddp", "--processes",
                      str(processes), "--hosts", str(hosts), "--master-addr", "198.18.0.1",
                      "--interface", "eth0", "--result-dir", str(result_dir), "--usecase",
                      args.usecase, "--image-size", str(args.image_size), "--batch-size",
                      str(case.batch_size * hosts), "--warmup", str(args.warmup),
                      "--steps", str(args.steps), *wire_flags(contender, args.powersgd_rank)])
    command = [sys.executable, "-m", "hybriddl", "emulate", "--hosts", str(hosts),
               "--cores-per-host", str(args.cores_per_host), "--bandwidth", bandwidth,
               *speed_flags(args), "--report", str(report), "--", "sh", "-c",
               f'exec {ddp} --host-index "$OMPI_COMM_WORLD_RANK"']
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return {"contender": contender, "hosts": hosts, "bandwidth": bandwidth,
                "failed": done.returncode, "output_tail": lines[-5:]}
    rank0 = json.loads((result_dir / "rank0.json").read_text())
    emulation = json.loads(report.read_text())
    scale = dilation_of(emulation)
    emulated = [s / scale for s in rank0["step_seconds"]]
    global_batch = case.batch_size * hosts
    return {
        "contender": contender, "hosts": hosts, "bandwidth": bandwidth,
        "ranks_per_host": args.cores_per_host, "time_scale": emulation.get("time_scale", 1.0),
        "speedup": emulation.get("speedup", 1.0), "dilation": scale,
        # Whether the hosts took turns on the cores (no --speedup) or ran at once under a
        # CPU quota: docs/benchmarks words D > 1 after it.
        "turns": emulation.get("turns"),
        # Which hook ran, and (powerSGD_hook) its rank, start step, one bucket and warm-up.
        "comm_hook": rank0.get("comm_hook"), "warmup": rank0.get("warmup"),
        "global_batch": global_batch, "emulated_step_seconds": emulated,
        "median_emulated_step_seconds": statistics.median(emulated),
        "images_per_second": global_batch / statistics.median(emulated),
        # The meter reads the host's NIC over the timed steps: their mean per step.
        "median_nic_bytes_per_step": rank0["nic_bytes_sent"] / rank0["timed_steps"],
        "host_parallel": None, "strategy": rank0["strategy"],
        "memory": {"peak_rss_bytes": rank0["peak_rss_bytes"]},
        "wall_seconds": round(time.time() - started, 1),
        "command": shlex.join(["hybriddl", *command[3:]]),
    }


def run_cell(args, contender: str, hosts: int, bandwidth: str, scratch: Path) -> dict:
    if scheme_of(contender) == "ddp":
        return run_ddp_cell(args, hosts, bandwidth, scratch, contender)
    run_dir = scratch / f"{contender}-{hosts}-{bandwidth}"
    report = scratch / f"{contender}-{hosts}-{bandwidth}.report.json"
    # The same cell's run of an earlier round: train refuses a run directory that exists
    # (every hybriddl cell of round 2 exited 2 on it).
    shutil.rmtree(run_dir, ignore_errors=True)
    report.unlink(missing_ok=True)
    train, ranks = train_args(args, contender, hosts, run_dir)
    command = [sys.executable, "-m", "hybriddl", "emulate", "--hosts", str(hosts),
               "--cores-per-host", str(args.cores_per_host), "--ranks-per-host", str(ranks),
               "--bandwidth", bandwidth, *speed_flags(args), "--report", str(report), "--",
               "hybriddl", *train]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        tail = [line for line in lines if "hybriddl:" in line or "rror" in line][-5:] or lines[-5:]
        return {"contender": contender, "hosts": hosts, "bandwidth": bandwidth,
                "failed": done.returncode, "output_tail": tail}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    emulation = json.loads(report.read_text())
    scale = dilation_of(emulation)
    epoch = metrics["epochs"][0]
    seconds = epoch["per_step"]["seconds"][args.warmup:]
    nic = epoch["per_step"].get("nic_bytes_sent", [])[args.warmup:]
    emulated = [s / scale for s in seconds]
    record = {
        "contender": contender, "hosts": hosts, "bandwidth": bandwidth,
        "ranks_per_host": ranks, "time_scale": emulation.get("time_scale", 1.0),
        "speedup": emulation.get("speedup", 1.0), "dilation": scale,
        # Whether the hosts took turns on the cores (no --speedup) or ran at once under a
        # CPU quota: docs/benchmarks words D > 1 after it.
        "turns": emulation.get("turns"),
        "global_batch": metrics["config"]["global_batch"],
        "emulated_step_seconds": emulated,
        "median_emulated_step_seconds": statistics.median(emulated),
        "images_per_second": metrics["config"]["global_batch"] / statistics.median(emulated),
        "nic_bytes_per_step_rank0_host": nic,
        "median_nic_bytes_per_step": statistics.median(nic) if nic else None,
        "host_parallel": metrics["config"].get("host_parallel"),
        "strategy": metrics["config"]["strategy"],
        "memory": metrics.get("memory"),
        "wall_seconds": round(time.time() - started, 1),
        "command": shlex.join(["hybriddl", *command[3:]]),
    }
    return record


def memory_refusal(cells: list[dict], contender: str, hosts: int, cores: int,
                   fraction: float = 0.85) -> str | None:
    """Why a cell would not fit this machine's memory, from the peak RSS its contender's
    rank 0 measured at fewer hosts (each rank's share of work is the same in weak
    scaling); None when it fits or nothing was measured yet."""
    import psutil

    measured = [c for c in cells if c["contender"] == contender and c.get("memory")]
    if not measured:
        return None
    peak = max(c["memory"]["peak_rss_bytes"] for c in measured)
    ranks = hosts * (cores if scheme_of(contender) in ("flat", "ddp") else 1)
    total = psutil.virtual_memory().total
    if ranks * peak <= fraction * total:
        return None
    return (f"not run: {ranks} ranks x {peak / 2**30:.1f} GiB (rank 0's peak RSS measured "
            f"at {measured[-1]['hosts']} hosts) exceed {fraction:.0%} of this machine's "
            f"{total / 2**30:.0f} GiB")


def theory(usecase: str, hosts: int, cores: int, powersgd_rank: int = 2) -> dict:
    """Bytes per host NIC per step, in theory, for each contender."""
    import torch

    from hybriddl.compare.theory import powersgd_elements
    from hybriddl.hosts.compression import parse_compression
    from hybriddl.hybrid.parallel import traffic_bytes
    from hybriddl.hybrid.planner import ModelShapes
    from hybriddl.usecases import build_model

    case = get_usecase(usecase)
    with torch.device("meta"):
        model = build_model(case.model, case.num_classes)
    bytes_ = traffic_bytes(model, hosts, case.batch_size * hosts)
    whole = sum(p.numel() for p in model.parameters()) * 4
    ranks = hosts * cores
    # A ring over H*K ranks placed host-contiguously crosses each host's NIC on one edge.
    flat = 2 * (ranks - 1) / ranks * whole if hosts > 1 else 0.0
    # DDP (gloo) runs the same ring over one process per core.
    # Horovod's hierarchical allreduce (reduce inside each host, a ring across hosts,
    # broadcast inside each host) puts data's bytes on each NIC: one ring rank per host.
    # The compressed peers: the same ring over half the bytes, or over powerSGD_hook's
    # factors and uncompressed tensors.
    powersgd = powersgd_elements([tuple(p.shape) for p in model.parameters()], powersgd_rank) * 4
    # hybriddl's PowerSGD: one ring over one rank per host of what it sends (the whole
    # gradient's for data, the convolutions' for hybrid, beside the split's exchange).
    ours, shapes = parse_compression(f"powersgd:{powersgd_rank}"), ModelShapes.of(model)
    ring = 2 * (hosts - 1) / hosts
    return {"hybrid": bytes_.get("hybrid", 0.0), "data": bytes_["data"], "flat": flat,
            "ddp": flat, "hierarchical": bytes_["data"], "flat-fp16": flat / 2,
            "ddp-fp16": flat / 2, "ddp-powersgd": flat * powersgd / whole,
            "data-powersgd": ring * ours.wire_bytes(shapes.parameters),
            "hybrid-powersgd": ring * ours.wire_bytes(shapes.averaged_in_hybrid)
            + bytes_.get("hybrid_activations", 0.0) if "hybrid" in bytes_ else None}


def predicted_step_wall(nic_bytes: float, bandwidth: str, hosts: int, cores: int,
                        speedup: float, host_step_seconds: float | None) -> float:
    """Wall seconds one step of a cell would take: S x D x (the emulated one-host step +
    the bytes its host NIC sends per step, in theory, at the emulated link rate). The sum,
    not the larger: no overlap is counted, so it errs towards skipping. Without a known
    host step (no --host-step) only the wire's part is counted."""
    from hybriddl.emulation.hosts import bits_per_second, least_time_scale

    wire = 0.0 if bandwidth == "none" else nic_bytes * 8 / bits_per_second(bandwidth)
    dilation = speedup * least_time_scale(hosts, cores, len(os.sched_getaffinity(0)))
    return dilation * ((host_step_seconds or 0.0) + wire)


def wall_refusal(args, contender: str, hosts: int, bandwidth: str, speedup: float,
                 theory_bytes: dict) -> tuple[str, float] | None:
    """(why, predicted wall seconds per step) for a cell --max-step-wall leaves out; None
    when it fits or no limit was given."""
    if args.max_step_wall is None:
        return None
    per_host = theory_bytes[str(hosts)]
    nic = (min(b for b in (per_host.get("hybrid"), per_host["data"]) if b)
           if contender == "auto" else per_host.get(contender)) or 0.0
    wall = predicted_step_wall(nic, bandwidth, hosts, args.cores_per_host, speedup,
                               args.host_step_seconds)
    if wall > args.max_step_wall:
        return (f"not run (predicted {wall:.3g} s/step of wall time: {nic / 1e6:.3g} MB per "
                f"host per step at {bandwidth} / (S x D) beside the host's step, over "
                f"--max-step-wall {args.max_step_wall:g} s)", wall)
    if scheme_of(contender) == "ddp" and per_host["ddp"] > nic:
        # DDP's start sends the dense model's bytes whatever the hook: its constructor
        # broadcasts the model, and powerSGD_hook's two warm-up steps are plain allreduces.
        dense = predicted_step_wall(per_host["ddp"], bandwidth, hosts, args.cores_per_host,
                                    speedup, args.host_step_seconds)
        if args.max_start_wall:
            start, limit, what, flag = 3 * dense, args.max_start_wall, "for DDP's start", "start"
        else:
            start, limit, what, flag = dense, args.max_step_wall, "per step", "step"
        if start > limit:
            return (f"not run (predicted {start:.3g} s of wall time {what}: "
                    f"{per_host['ddp'] / 1e6:.3g} MB per host in each of DDP's broadcast and "
                    f"powerSGD_hook's dense warm-up steps at {bandwidth} / (S x D), over "
                    f"--max-{flag}-wall {limit:g} s)", start)
    return None


def _classifier_held(cell: dict) -> int | None:
    """Host 0's classifier parameters plus their momentum, measured at the run's end."""
    memory = cell.get("memory")
    if not memory or "parameters" not in memory:
        return None
    return memory["parameters"]["classifier"] + memory["optimizer_state"]["classifier"]


def drop_superseded(cells: list[dict]) -> list[dict]:
    """The cells without those skipped or failed where a later run (--append) measured the
    same contender, host count and link."""
    def key(c):
        return c["contender"], c["hosts"], c["bandwidth"], c.get("speedup", 1.0)

    measured = {key(c) for c in cells if "skipped" not in c and "failed" not in c}
    return [c for c in cells if not (("skipped" in c or "failed" in c) and key(c) in measured)]


def contender_note(cell: dict) -> str | None:
    """What stands beside a compressed peer's figures."""
    hook = cell.get("comm_hook") or {}
    if hook.get("hook") == "powerSGD_hook":
        return (f"torch's powerSGD_hook, rank {hook['matrix_approximation_rank']}, in one bucket "
                f"(bucket_cap_mb {hook['bucket_cap_mb']}: with DDP's 25 MB buckets it aborts on "
                f"gloo); compressing from step {hook['start_powerSGD_iter']}, after a warm-up of "
                f"{cell['warmup']} steps, so every timed step was compressed")
    if hook.get("hook") == "fp16_compress_hook":
        return "torch's fp16_compress_hook"
    if WIRE.get(cell["contender"], (None, None))[1] == "fp16":
        return "fp16 compression (hybriddl's Compression.fp16, Horovod's)"
    if cell["contender"] in WIRE:
        return ("hybriddl's PowerSGD (--compression powersgd:R), one allreduce per step (two "
                "with --overlap, which every cell runs: the classifier's factors during "
                "backward)")
    return None


def summarise(cells: list[dict], measured_host_step: dict | None = None) -> list[dict]:
    """Per (bandwidth, speedup, contender, H): median img/s over rounds, and efficiency
    against one host of `data` (the same model on one host) at the same link and speedup.
    `measured_host_step`: {speedup: one host's step here / S}, the emulated one-host step
    where no 1-host `data` cell measured it."""
    rows = {}
    for cell in cells:
        if "failed" in cell or "skipped" in cell:
            continue
        # One host speed per S to 3 significant digits: a later run given --speedup 74.16
        # continues the run that derived S = 74.158 from --host-step.
        speedup = float(f"{cell.get('speedup', 1.0):.3g}")
        key = (cell["bandwidth"], speedup, cell["contender"], cell["hosts"])
        rows.setdefault(key, []).append(cell)
    one_host, one_host_step = {}, {}
    for (bandwidth, speedup, contender, hosts), group in rows.items():
        if hosts == 1 and contender == "data":
            one_host[bandwidth, speedup] = statistics.median(c["images_per_second"] for c in group)
            one_host_step[bandwidth, speedup] = statistics.median(
                s for c in group for s in c["emulated_step_seconds"])
    out = []
    for (bandwidth, speedup, contender, hosts), group in sorted(rows.items()):
        speeds = [c["images_per_second"] for c in group]
        steps = [s for c in group for s in c["emulated_step_seconds"]]
        base = one_host.get((bandwidth, speedup))
        speed = statistics.median(speeds)
        out.append({
            "bandwidth": bandwidth, "contender": contender, "hosts": hosts,
            "speedup": speedup,
            "host_step_seconds": one_host_step.get((bandwidth, speedup), next(
                (step for s, step in (measured_host_step or {}).items()
                 if float(f"{float(s):.3g}") == speedup), None)),
            "images_per_second": speed,
            "step_seconds_median": statistics.median(steps),
            "step_seconds_spread": [min(steps), max(steps)],
            "efficiency": speed / (hosts * base) if base else None,
            "nic_bytes_per_step": statistics.median(
                c["median_nic_bytes_per_step"] for c in group
                if c["median_nic_bytes_per_step"] is not None) if hosts > 1 else 0,
            "picked": group[0]["host_parallel"]["scheme"] if group[0].get("host_parallel") else None,
            "note": contender_note(group[0]),
            "classifier_bytes_held": _classifier_held(group[0]),
        })
    return out


# What a file's author wrote by hand, kept by --append: a note shown with its figures and
# the cells taken out (and why).
BY_HAND = ("note", "replaced_cells")


def continue_from(earlier: dict, result: dict, args, measured_steps: dict,
                  output: Path) -> dict:
    """--append: `result` takes `earlier`'s cells, runs and what was written by hand
    (BY_HAND); returns the measured host steps of both. SystemExit where `earlier` is of
    another use case, image size or hosts' cores."""
    for key in ("usecase", "image_size", "cores_per_host"):
        if earlier.get(key) != result[key]:
            raise SystemExit(f"--append: {output} has {key} {earlier.get(key)!r}, this run "
                             f"{result[key]!r}")
    result["cells"] = earlier["cells"]
    result.update({key: earlier[key] for key in BY_HAND if earlier.get(key)})
    result["earlier_runs"] = earlier.get("earlier_runs", []) + [
        {k: earlier.get(k) for k in ("command", "commit", "date", "cpu_model", "speedup",
                                     "host_step_seconds")}]
    hosts = sorted({int(h) for h in earlier["theory_nic_bytes_per_step"]} | set(args.hosts))
    result["theory_nic_bytes_per_step"] = {str(h): theory(args.usecase, h, args.cores_per_host,
                                                          args.powersgd_rank)
                                           for h in hosts}
    return {**{float(k): v for k, v in earlier.get("measured_host_step_seconds", {}).items()},
            **measured_steps}


def main(argv=None) -> int:
    args = parse_args(argv)
    output = Path(args.output)
    speed = derive_speedup(args)
    args.speedup = speed["speedup"]
    speedup = args.speedup or 1.0
    # The emulated one-host step each speedup stands for, where this script measured it.
    measured_steps = ({speedup: args.host_step_seconds} if speed["host_step"] else {})
    result = {
        "what": __doc__.splitlines()[0],
        "usecase": args.usecase, "image_size": args.image_size,
        "cores_per_host": args.cores_per_host, "warmup": args.warmup, "steps": args.steps,
        "rounds": args.rounds,
        # S (1: the hosts at their own speed) and the emulated one-host step it stands for
        # (--host-step's; else the 1-host data cell's once measured).
        "speedup": speedup, "host_step_seconds": args.host_step_seconds,
        "host_step": speed["host_step"],
        **results_header("scaling_e2e.py", argv),
        "theory_nic_bytes_per_step": {str(h): theory(args.usecase, h, args.cores_per_host,
                                                     args.powersgd_rank) for h in args.hosts},
        "cells": [],
    }
    if args.append and output.exists():
        measured_steps = continue_from(json.loads(output.read_text()), result, args,
                                       measured_steps, output)
    with tempfile.TemporaryDirectory(prefix="hybriddl-scaling-") as scratch:
        for round_ in range(args.rounds):
            for bandwidth in args.bandwidth:
                for hosts in args.hosts:
                    for contender in args.contenders:
                        if hosts == 1 and (contender in ("flat", "auto", "hybrid")
                                           or contender in WIRE):
                            continue  # one host: data is the reference; nothing crosses a link
                        too_big = memory_refusal(result["cells"], contender, hosts,
                                                 args.cores_per_host, args.memory_fraction)
                        too_slow = wall_refusal(args, contender, hosts, bandwidth, speedup,
                                                result["theory_nic_bytes_per_step"])
                        if too_big or too_slow:
                            cell = {"contender": contender, "hosts": hosts,
                                    "bandwidth": bandwidth, "skipped": too_big or too_slow[0]}
                            if too_slow:
                                cell["predicted_step_wall_seconds"] = too_slow[1]
                                cell["host_step_seconds"] = args.host_step_seconds
                        else:
                            cell = run_cell(args, contender, hosts, bandwidth, Path(scratch))
                        cell["round"] = round_
                        cell.setdefault("speedup", speedup)
                        result["cells"].append(cell)
                        print(json.dumps({k: cell.get(k) for k in (
                            "contender", "hosts", "bandwidth", "images_per_second",
                            "median_nic_bytes_per_step", "speedup", "time_scale", "failed",
                            "skipped", "wall_seconds")}), flush=True)
                        result["cells"] = drop_superseded(result["cells"])
                        result["summary"] = summarise(result["cells"], measured_steps)
                        result["measured_host_step_seconds"] = {
                            str(k): v for k, v in measured_steps.items()}
                        if result["host_step_seconds"] is None:
                            result["host_step_seconds"] = next(
                                (row["host_step_seconds"] for row in result["summary"]
                                 if row["speedup"] == speedup and row["hosts"] == 1
                                 and row["contender"] == "data"), None)
                        atomic_write_json(output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

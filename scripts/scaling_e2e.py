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
import re
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import REPO, ddp_command, emulated_cell, host_options, results_header
from time_to_accuracy import LOCAL, accuracy_links
import powersgd_cost
from pages import Page, model_name, provenance, ratio_text, save_chart
from hybriddl.compare.compare import wire_flags as compare_wire_flags
from hybriddl.compare.settings import FLAT_MPI, KNOWN
from hybriddl.emulation.pace import OUTLASTED
from hybriddl.files import atomic_write_json
from hybriddl.hosts.compression import EXACT
from hybriddl.usecases import get_usecase



CONTENDERS = ("hybrid", "data", "flat", "auto", "ddp")
# The compressed contenders, (scheme, compression) by name: hybriddl compare's table
# (hybriddl.compare.settings.KNOWN), whose flat-mpi is this script's flat. Asked for by name.
WIRE = {name: ("flat" if kind.scheme == FLAT_MPI else kind.scheme, kind.compression)
        for name, kind in KNOWN.items() if kind.compression != EXACT}


def scheme_of(contender: str) -> str:
    return WIRE[contender][0] if contender in WIRE else contender


def wire_flags(contender: str, powersgd_rank: int) -> list[str]:
    """A contender's compression, as its command line says it (compare's wire_flags: DDP's
    hooks are hybriddl.cli.compare_ddp's flags, hybriddl's compressions `train --compression`)."""
    return compare_wire_flags(KNOWN[contender], powersgd_rank) if contender in WIRE else []


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
    parser.add_argument("--compression-seconds-from", metavar="JSON",
                        help="scripts/powersgd_cost.py's results on the device the hosts stand "
                             "for (a GPU's): data-powersgd and ddp-powersgd run with emulate "
                             "--compression-seconds set to its median for the use case's "
                             "model (hybriddl's powersgd:2; DDP's step with powerSGD_hook less "
                             "its step with allreduce_hook), in place of this CPU's / S")
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
    args.compression_seconds, args.compression_device, args.compression_timed = {}, None, {}
    if args.compression_seconds_from:
        try:
            measured = json.loads(Path(args.compression_seconds_from).read_text())
            args.compression_seconds = compression_seconds_from(
                measured, get_usecase(args.usecase).model, args.contenders, args.powersgd_rank)
        except (OSError, ValueError) as exc:
            parser.error(f"--compression-seconds-from {args.compression_seconds_from}: {exc}")
        args.compression_device = measured.get("gpu_name") or "its CPU"
        # What was timed there: the commit, and how hybriddl orthogonalised its factors.
        args.compression_timed = {
            "commit": measured.get("commit"),
            "orthogonalisation": measured.get("orthogonalisation")}  # None: before it said
    return args


# The contenders whose compute scripts/powersgd_cost.py measures, by its labels (a file
# written before it measured the convolutions alone has no figure for hybrid-powersgd).
MEASURED_COMPRESSION = {"data-powersgd": powersgd_cost.OURS, "ddp-powersgd": powersgd_cost.PEER,
                        "hybrid-powersgd": powersgd_cost.CONVOLUTIONS}


def compression_seconds_from(measured: dict, model: str, contenders, rank: int) -> dict:
    """{contender: seconds a step of its PowerSGD compute} from powersgd_cost.py's `measured`
    (its median for `model`); ValueError, said as a usage error, where it cannot stand in."""
    if rank != powersgd_cost.RANK:
        raise ValueError(f"it measured rank {powersgd_cost.RANK}; give --powersgd-rank "
                         f"{powersgd_cost.RANK}")
    figures = next((m["seconds"] for m in measured.get("models", []) if m["model"] == model),
                   None)
    if figures is None:
        raise ValueError(f"it has no figures for {model}")
    missing = [c for c, label in MEASURED_COMPRESSION.items()
               if c in contenders and label not in figures]
    if missing:
        raise ValueError(f"it has no figure for {', '.join(missing)} "
                         f"({', '.join(MEASURED_COMPRESSION[c] for c in missing)}): measure "
                         "it again with scripts/powersgd_cost.py")
    return {c: figures[label]["median"] for c, label in MEASURED_COMPRESSION.items()
            if c in contenders}


def derive_speedup(args) -> dict:
    """S for every cell, from --speedup or from one host's step measured here (--host-step:
    the cells' local strategy, cores, per-host batch and image size); the file's record."""
    if args.host_step_seconds is None:
        return {"speedup": args.speedup, "host_step": None}
    from hybriddl.emulation.hosts import speedup_for_step
    from hybriddl.errors import UsageError
    from hybriddl.tuning.host_step import measure_host_step

    measured = measure_host_step(args.usecase, args.cores_per_host, image_size=args.image_size,
                                 channels_last="--channels-last" in LOCAL)
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


def speed_flags(args, contender: str | None = None) -> list[str]:
    """hybriddl emulate's --speedup for every cell (none: the hosts at their own speed), and
    the contender's --compression-seconds where --compression-seconds-from gives it."""
    seconds = args.compression_seconds.get(contender)
    return ([] if args.speedup is None else ["--speedup", repr(args.speedup)]) + (
        [] if seconds is None else ["--compression-seconds", f"{seconds!r}s"])


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
    # The local strategy of every contender but flat and ddp: PyTorch's intra-op threads, the
    # fastest local strategy for one host at 224 px on 2 cores (within noise of layerwise for
    # AlexNet, results/bench_local-SimpleBig.json), and one that writes each gradient once, so
    # --overlap sends buckets during backward (layerwise adds its threads' gradients at the end).
    # Its workers are the host's cores (--cores-per-host); time_to_accuracy's LOCAL.
    return [*common, *LOCAL, "--workers", str(args.cores_per_host), "--overlap",
            "--host-parallel", scheme_of(contender),
            *wire_flags(contender, args.powersgd_rank)], 1


def run_ddp_cell(args, hosts: int, bandwidth: str, scratch: Path, contender: str = "ddp") -> dict:
    """PyTorch DDP as a user would run it on CPU hosts: one process (one thread) per core,
    gloo over each host's NIC (hybriddl.cli.compare_ddp, started once per host), with
    DDP's own allreduce or the contender's comm hook."""
    case = get_usecase(args.usecase)
    result_dir = scratch / f"{contender}-{hosts}-{bandwidth}"
    command = ddp_command(hosts, args.cores_per_host, result_dir, [
        "--usecase", args.usecase, "--image-size", str(args.image_size), "--batch-size",
        str(case.batch_size * hosts), "--warmup", str(args.warmup), "--steps", str(args.steps),
        *wire_flags(contender, args.powersgd_rank)])
    ran, rank0 = emulated_cell(host_options(hosts, args.cores_per_host, bandwidth=bandwidth,
                                            speed=speed_flags(args, contender)),
                               command, result_dir, "rank0.json")
    if rank0 is None:
        return {"contender": contender, "hosts": hosts, "bandwidth": bandwidth,
                "failed": ran.returncode, "output_tail": ran.tail()}
    return {
        **cell_record(ran, contender, hosts, bandwidth, args.cores_per_host,
                      case.batch_size * hosts, rank0["step_seconds"]),
        # Which hook ran, and (powerSGD_hook) its rank, start step, one bucket and warm-up.
        "comm_hook": rank0.get("comm_hook"), "warmup": rank0.get("warmup"),
        # The meter reads the host's NIC over the timed steps: their mean per step.
        "median_nic_bytes_per_step": rank0["nic_bytes_sent"] / rank0["timed_steps"],
        "host_parallel": None, "strategy": rank0["strategy"],
        "memory": {"peak_rss_bytes": rank0["peak_rss_bytes"]},
    }


def cell_record(ran, contender: str, hosts: int, bandwidth: str, ranks: int,
                global_batch: int, step_seconds: list[float]) -> dict:
    """What every cell's record holds: its emulation, and its steps in emulated seconds."""
    emulation, scale = ran.report, ran.dilation
    emulated = [s / scale for s in step_seconds]
    return {
        "contender": contender, "hosts": hosts, "bandwidth": bandwidth,
        "ranks_per_host": ranks, "time_scale": emulation.get("time_scale", 1.0),
        "speedup": emulation.get("speedup", 1.0), "dilation": scale,
        # Whether the hosts took turns on the cores (no --speedup) or ran at once under a
        # CPU quota: docs/benchmarks words D > 1 after it.
        "turns": emulation.get("turns"),
        "global_batch": global_batch, "emulated_step_seconds": emulated,
        "median_emulated_step_seconds": statistics.median(emulated),
        "images_per_second": global_batch / statistics.median(emulated),
        "wall_seconds": ran.wall_seconds, "command": ran.shown(),
        # emulate --compression-seconds: PowerSGD's compute a step, measured elsewhere, and
        # each host's warning where its compute here outlasted it (its step then overstated).
        "compression_seconds": emulation.get("compression_seconds"),
        "compression_outlasted": [line for line in ran.output.splitlines()
                                  if line.startswith(OUTLASTED)],
    }


def run_cell(args, contender: str, hosts: int, bandwidth: str, scratch: Path) -> dict:
    if scheme_of(contender) == "ddp":
        return run_ddp_cell(args, hosts, bandwidth, scratch, contender)
    run_dir = scratch / f"{contender}-{hosts}-{bandwidth}"
    train, ranks = train_args(args, contender, hosts, run_dir)
    ran, metrics = emulated_cell(host_options(hosts, args.cores_per_host, bandwidth=bandwidth,
                                              ranks_per_host=ranks,
                                              speed=speed_flags(args, contender)),
                                 ["hybriddl", *train], run_dir)
    if metrics is None:
        return {"contender": contender, "hosts": hosts, "bandwidth": bandwidth,
                "failed": ran.returncode,
                "output_tail": ran.tail(keep=lambda line: "hybriddl:" in line or "rror" in line)}
    epoch = metrics["epochs"][0]
    nic = epoch["per_step"].get("nic_bytes_sent", [])[args.warmup:]
    return {
        **cell_record(ran, contender, hosts, bandwidth, ranks, metrics["config"]["global_batch"],
                      epoch["per_step"]["seconds"][args.warmup:]),
        "nic_bytes_per_step_rank0_host": nic,
        "median_nic_bytes_per_step": statistics.median(nic) if nic else None,
        "host_parallel": metrics["config"].get("host_parallel"),
        "strategy": metrics["config"]["strategy"],
        "memory": metrics.get("memory"),
    }


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


# ---------------------------------------------------------------- its pages in docs/benchmarks

EXCHANGES_JSON = REPO / "results" / "emulation_fidelity-exchanges.json"


def _mb(n) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f}"


CONTENDER_WORDS = {
    "hybrid": "hybrid (`--host-parallel hybrid`)",
    "data": "data (`--host-parallel data`)",
    "flat": "flat (Horovod's model: one rank per core)",
    "auto": "auto (`--host-parallel auto`)",
    "ddp": "PyTorch DDP (gloo, one process per core)",
    "hybrid-powersgd": "hybrid + hybriddl's PowerSGD (`--compression powersgd:R`)",
    "data-powersgd": "data + hybriddl's PowerSGD (`--compression powersgd:R`)",
    "ddp-powersgd": "DDP + torch's powerSGD_hook (one bucket: DDP's 25 MB buckets abort on "
                    "gloo; compressing from step 2)",
    "ddp-fp16": "DDP + torch's fp16_compress_hook",
    "flat-fp16": "flat + fp16 (Horovod's model with fp16 compression)",
}


def scaling_e2e_table(data: dict) -> str:
    theory = data.get("theory_nic_bytes_per_step", {})
    rows = sorted(data["summary"], key=lambda r: (r["bandwidth"], r["hosts"],
                                                  list(CONTENDER_WORDS).index(r["contender"])
                                                  if r["contender"] in CONTENDER_WORDS else 9))
    lines = ["| link | hosts | contender | images/s | step s (median, spread) | efficiency "
             "| MB per host NIC per step | MB in theory | classifier MB held |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        contender = CONTENDER_WORDS.get(r["contender"], r["contender"])
        if r["contender"] == "auto" and r.get("picked"):
            contender += f", picked {r['picked']}"
        low, high = r["step_seconds_spread"]
        scheme = r.get("picked") if r["contender"] == "auto" else r["contender"]
        expected = theory.get(str(r["hosts"]), {}).get(scheme)
        lines.append(f"| {r['bandwidth']} | {r['hosts']} | {contender} | "
                     f"{r['images_per_second']:.1f} | {r['step_seconds_median']:.2f} "
                     f"({low:.2f}–{high:.2f}) | {ratio_text(r['efficiency'])} | "
                     f"{_mb(r['nic_bytes_per_step'])} | {_mb(expected)} | "
                     f"{_mb(r.get('classifier_bytes_held'))} |")
    lines += emulation_caveats(data)
    for cell in data["cells"]:
        if "skipped" in cell or "failed" in cell:
            why = cell.get("skipped") or ("failed (exit %s): %s" % (
                cell["failed"], " / ".join(cell.get("output_tail", [])[-2:])))
            lines.append(f"\n{cell['bandwidth']}, {cell['hosts']} hosts, "
                         f"{CONTENDER_WORDS.get(cell['contender'], cell['contender'])}: {why}")
    return "\n".join(lines)


def time_scales(data: dict, keep=lambda cell: True) -> dict[int, float]:
    """The time scale D each host count ran at (the largest, should cells differ), of the
    cells `keep` keeps, by host count."""
    scales = {}
    for cell in data["cells"]:
        if cell.get("time_scale") is not None and keep(cell):
            scales[cell["hosts"]] = max(scales.get(cell["hosts"], 0), cell["time_scale"])
    return dict(sorted(scales.items()))


def took_turns(cell: dict) -> bool:
    """Whether a cell's hosts took turns on the cores (D > 1 without --speedup): under
    --speedup they all run at once, each held to C/D cores by a CPU quota
    (docs/methodology.md). Cells from before the report said so: turns unless S > 1."""
    if cell.get("time_scale", 1.0) <= 1:
        return False
    if cell.get("turns") is not None:
        return bool(cell["turns"])
    return cell.get("speedup", 1.0) <= 1


def quota_line(data: dict) -> str | None:
    """What hosts held to C/D cores by a CPU quota (D > 1 under --speedup) do to the figures."""
    quota = sorted({(c["hosts"], c["time_scale"]) for c in data["cells"]
                    if c.get("time_scale", 1.0) > 1 and not took_turns(c)})
    if not quota:
        return None
    which = ", ".join(f"{h} hosts at D = {d:g}" for h, d in quota)
    return (f"Hosts under a CPU quota: {which} run at once, each held to C/D cores of CPU time "
            f"over a 10 ms period ([methodology](../methodology.md#faster-hosts---speedup-s)); "
            f"a host held back by its quota waits up to one period before it answers, so every "
            f"exchange is slower than between hosts side by side (D = 1), and these rows "
            f"understate real hosts.")


def turns_line(data: dict) -> str | None:
    """What hosts that take turns (D > 1) do to the figures, and the measurement saying so."""
    turns = time_scales(data, keep=took_turns)
    if not turns:
        return None
    which = ", ".join(f"{h} hosts at D = {d:g}" for h, d in turns.items())
    slower = ""
    if EXCHANGES_JSON.exists():
        row = json.loads(EXCHANGES_JSON.read_text())["summary"][0]
        slower = (f" (a hybrid step's exchanges took {row['error']:+.0%} at D = "
                  f"{row['time_scale']:g}: [fidelity](emulation_fidelity-exchanges.md))")
    return (f"Hosts taking turns: {which} share this machine's cores in turns, which slows "
            f"every exchange between them{slower}; these rows understate real hosts. The "
            f"README quotes scaling only from hosts side by side (D = 1).")


def emulation_caveats(data: dict) -> list[str]:
    """The lines below a table that say what hosts taking turns, or held to a CPU quota,
    do to its figures (each after a blank line)."""
    return [part for line in (turns_line(data), quota_line(data)) if line for part in ("", line)]


def scaling_e2e_setting(data: dict) -> str:
    model = model_name(data["usecase"])
    cores = data["cores_per_host"]
    slowed = (f"**Its one-host reference ran slowed**: {data['reference_slowed']} "
              if data.get("reference_slowed") else "")
    return (f"{slowed}{data['usecase']} ({model}), {data['image_size']} px, emulated hosts of "
            f"{cores} core{'s' if cores != 1 else ''} each, {data['warmup']} untimed and "
            f"{data['steps']} timed steps per run, {data['rounds']} interleaved round(s)")


SCALING_E2E_NOTES = """\
How to read it: each row is one `hybriddl emulate -- hybriddl train` run per round (weak
scaling: each host keeps the use case's per-host batch, so the global batch grows with the
hosts). *Efficiency* is images/s over (hosts × images/s of `data` on one host). *MB per
host NIC* is the median over timed steps of what rank 0's host interface sent; *in theory*
is the scheme's own count (a hierarchical allreduce, Horovod's reduce inside each host then
ring across hosts, would put data's bytes on each NIC: one ring rank per host). *Classifier MB held* is what host 0 held at the end of the run:
the classifier's parameters and their momentum, counted from the tensors (runs older than
this column show –). Emulated hosts that do not fit this machine side by side run
slowed down by D = H·C / cores (see [methodology](../methodology.md)): the figures are
emulated time, compute assumed to scale with cores."""


def scaling_headline(table: Page, data: dict) -> str | None:
    """Efficiency and NIC bytes of every scheme at the widest host count measured with the
    hosts side by side (D = 1): hosts that take turns slow every exchange, so they would
    understate the scaling (docs/benchmarks says so beside those tables)."""
    p = provenance(data)
    by = {(r["contender"], r["hosts"]): r for r in data["summary"]}
    contenders = ("hybrid", "data", "flat", "ddp")
    side_by_side = {h for h, d in time_scales(data).items() if d == 1}
    # The widest host count where hybrid ran beside another scheme (the comparison).
    widest = max((h for (c, h) in by if c == "hybrid" and h in side_by_side and
                  any((other, h) in by for other in contenders[1:])), default=None)
    if widest is None or widest < 2:
        return None
    row = {c: by.get((c, widest)) for c in contenders}
    model = model_name(data["usecase"])
    parts = [f"{c} {ratio_text(row[c]['efficiency'])} at {_mb(row[c]['nic_bytes_per_step'])} MB"
             for c in contenders if row[c]]
    cores = data["cores_per_host"]
    return (f"- **{model}, {data['image_size']} px, {widest} emulated hosts × {cores} "
            f"core{'s' if cores != 1 else ''} side by side (D = 1), "
            f"{row['hybrid']['bandwidth']} links** — scaling "
            f"efficiency (against one host) and bytes each host's NIC sent per step: "
            + "; ".join(parts) + f" (flat = Horovod's model, one rank per core; ddp = PyTorch "
            f"DDP, one process per core; {p['cpu_model']}, torch {p['torch']}; "
            f"[table](docs/benchmarks/{table.name}.md)).")


def traffic_headline(table: Page, data: dict) -> str | None:
    """The bytes each host's NIC sent per step at 2 hosts and at the widest host count,
    each scheme's theory beside it, and a hierarchical allreduce's theory."""
    p = provenance(data)
    by = {(r["contender"], r["hosts"]): r for r in data["summary"]}
    theory = data.get("theory_nic_bytes_per_step", {})
    counts = sorted({h for (c, h) in by if c == "hybrid" and h >= 2})
    if not counts:
        return None
    parts = []
    for hosts in dict.fromkeys([counts[0], counts[-1]]):
        expected = theory.get(str(hosts), {})
        cells = [f"{c} {_mb(by[(c, hosts)]['nic_bytes_per_step'])} ({_mb(expected.get(c))})"
                 if (c, hosts) in by else f"{c} not run ({_mb(expected.get(c))})"
                 for c in ("hybrid", "data", "flat") if expected.get(c) is not None]
        if expected.get("hierarchical") is not None:
            cells.append(f"a hierarchical allreduce in theory {_mb(expected['hierarchical'])}")
        parts.append(f"{hosts} hosts: " + ", ".join(cells))
    model = model_name(data["usecase"])
    rate = by[("hybrid", counts[0])]["bandwidth"]
    return (f"- **Traffic, {model}, {data['image_size']} px, emulated hosts, {rate} links** — MB "
            f"each host's NIC sent per step, measured (theory): " + "; ".join(parts)
            + f" (bytes do not depend on the time scale D; hybrid splits the classifier; data averages the whole gradient, one rank per "
            f"host, which is also what Horovod's hierarchical allreduce puts on a NIC; flat = "
            f"Horovod's model, one rank per core; {p['cpu_model']}; "
            f"[table](docs/benchmarks/{table.name}.md)).")


def scaling_and_traffic_headline(table: Page, data: dict) -> str | None:
    lines = [scaling_headline(table, data), traffic_headline(table, data)]
    return "\n".join(line for line in lines if line) or None


PAGES = [
    Page("scaling_e2e-SimpleBig-1gbit-D1",
         "End-to-end weak scaling, AlexNet, 1 Gbit/s links, hosts side by side (D = 1)",
         "results/scaling_e2e-SimpleBig-1gbit-D1.json", scaling_e2e_table, scaling_e2e_setting,
         SCALING_E2E_NOTES, headline=scaling_headline),
    Page("scaling_e2e-SimpleBig-1gbit", "End-to-end weak scaling, AlexNet, 1 Gbit/s links",
         "results/scaling_e2e-SimpleBig-1gbit.json", scaling_e2e_table, scaling_e2e_setting,
         SCALING_E2E_NOTES, headline=scaling_and_traffic_headline),
    Page("scaling_e2e-SimpleBig-10gbit", "End-to-end weak scaling, AlexNet, 10 Gbit/s links",
         "results/scaling_e2e-SimpleBig-10gbit.json", scaling_e2e_table, scaling_e2e_setting,
         SCALING_E2E_NOTES),
    Page("scaling_e2e-ComplexSmall-1gbit", "End-to-end weak scaling, VGG16, 1 Gbit/s links",
         "results/scaling_e2e-ComplexSmall-1gbit.json", scaling_e2e_table, scaling_e2e_setting,
         SCALING_E2E_NOTES, headline=scaling_headline),
    Page("scaling_e2e-ComplexSmall-10gbit", "End-to-end weak scaling, VGG16, 10 Gbit/s links",
         "results/scaling_e2e-ComplexSmall-10gbit.json", scaling_e2e_table,
         scaling_e2e_setting, SCALING_E2E_NOTES),
]


# ---------------------------------------------------------------- faster hosts (--speedup, --host-step): their pages

FAST_COLORS = {"hybrid": "#4C72B0", "data": "#55A868", "flat": "#8172B2", "auto": "#64B5CD",
               "ddp": "#8C8C8C", "hybrid-powersgd": "#1F3A93", "data-powersgd": "#2E7D32",
               "ddp-powersgd": "#C44E52", "ddp-fp16": "#DD8452", "flat-fp16": "#937860"}


def fast_compression(contender: str, data: dict) -> str | None:
    """What a contender's gradients look like on the wire, None for exact ones: fp16, or
    PowerSGD at the rank its cells' commands name."""
    if contender.endswith("-fp16"):
        return "fp16"
    if contender.endswith("-powersgd"):
        ranks = {m for c in data["cells"] if c["contender"] == contender
                 for m in re.findall(r"(?:powersgd:|--powersgd-rank )(\d+)", c.get("command", ""))}
        return "PowerSGD" + (f" rank {'/'.join(sorted(ranks))}" if ranks else "")
    return None


def _exactness(contender: str, data: dict) -> str:
    compression = fast_compression(contender, data)
    return "exact" if compression is None else f"**not exact**: {compression}"


def fast_speeds(data: dict) -> list[tuple[float, float | None]]:
    """(S, the emulated one-host step it stands for), slowest host first."""
    steps = {}
    for speedup, step in [(r["speedup"], r.get("host_step_seconds")) for r in data["summary"]] \
            + [(c.get("speedup", 1.0), c.get("host_step_seconds")) for c in data["cells"]]:
        if steps.get(speedup) is None:
            steps[speedup] = step
    return sorted(steps.items())


def _speed_label(speedup: float, step: float | None) -> str:
    step_text = ("?" if step is None else f"{step:.2f} s" if step >= 1
                 else f"{step * 1e3:.3g} ms")
    return f"{step_text} (S = {speedup:.3g})"


def fast_not_run(data: dict) -> list[dict]:
    """The cells --max-step-wall left out (or that failed) and no later run measured, once
    each: (link, S, contender, hosts)."""
    measured = {(r["bandwidth"], r["speedup"], r["contender"], r["hosts"]) for r in data["summary"]}
    out = {}
    for cell in data["cells"]:
        key = (cell["bandwidth"], cell.get("speedup", 1.0), cell["contender"], cell["hosts"])
        if ("skipped" in cell or "failed" in cell) and key not in measured:
            out[key] = cell
    return [out[k] for k in sorted(out)]


def fast_winners(data: dict) -> list[dict]:
    """Per (link, S, hosts > 1): the row of highest images/s, the best exact one, and
    ddp-powersgd's (the peer at the same rank)."""
    groups = {}
    for row in data["summary"]:
        if row["hosts"] > 1:
            groups.setdefault((row["bandwidth"], row["speedup"], row["hosts"]), []).append(row)
    out = []
    for key, rows in sorted(groups.items()):
        ours = [r for r in rows if not r["contender"].startswith(("ddp", "flat"))]
        exact = [r for r in rows if fast_compression(r["contender"], data) is None]
        by = {r["contender"]: r for r in rows}
        out.append({"bandwidth": key[0], "speedup": key[1], "hosts": key[2],
                    "winner": max(rows, key=lambda r: r["images_per_second"]),
                    "ours": max(ours, key=lambda r: r["images_per_second"]) if ours else None,
                    "exact": max(exact, key=lambda r: r["images_per_second"]) if exact else None,
                    "ddp_powersgd": by.get("ddp-powersgd")})
    return out


def _row_words(row: dict | None, data: dict) -> str:
    if row is None:
        return "–"
    return (f"{row['contender']} ({_exactness(row['contender'], data)}): "
            f"{ratio_text(row['efficiency'])}, {row['images_per_second']:.0f} img/s")


def scaling_fast_table(data: dict) -> str:
    steps = dict(fast_speeds(data))
    lines = ["Which scheme wins, per host speed and host count (the highest images/s; "
             "efficiency against one host of `data` at the same S):", "",
             "| link | host step (S) | hosts | winner | hybriddl's best | best exact scheme | "
             "hybriddl's best ÷ ddp-powersgd (images/s) |",
             "|---|---|---:|---|---|---|---:|"]
    for w in fast_winners(data):
        peer, ours = w["ddp_powersgd"], w["ours"]
        ratio = (f"{ours['images_per_second'] / peer['images_per_second']:.2f}"
                 if peer and ours else "– (ddp-powersgd not measured)")
        lines.append(f"| {w['bandwidth']} | {_speed_label(w['speedup'], steps.get(w['speedup']))} "
                     f"| {w['hosts']} | {_row_words(w['winner'], data)} | "
                     f"{_row_words(ours, data)} | {_row_words(w['exact'], data)} | {ratio} |")
    theory = data.get("theory_nic_bytes_per_step", {})
    lines += ["", "Every row (emulated time: wall time / (S·D)):", "",
              "| link | host step (S) | D | hosts | contender | wire | images/s | "
              "step ms (median, spread) | efficiency | MB per host NIC per step | MB in theory |",
              "|---|---|---:|---:|---|---|---:|---|---:|---:|---:|"]
    scales = time_scales(data)
    rows = [(r["bandwidth"], r["speedup"], r["hosts"], r["contender"], r) for r in data["summary"]]
    rows += [(c["bandwidth"], c.get("speedup", 1.0), c["hosts"], c["contender"], c)
             for c in fast_not_run(data)]
    order = list(FAST_COLORS)
    for bandwidth, speedup, hosts, contender, r in sorted(
            rows, key=lambda t: (t[0], t[1], t[2], order.index(t[3]) if t[3] in order else 99)):
        label = _speed_label(speedup, steps.get(speedup))
        expected = _mb(theory.get(str(hosts), {}).get(contender))
        wire = _exactness(contender, data)
        scale = f"{scales[hosts]:g}" if hosts in scales else "–"
        if "skipped" in r or "failed" in r:
            why = (f"not run (predicted {r['predicted_step_wall_seconds']:.0f} s/step of wall time)"
                   if r.get("predicted_step_wall_seconds") else
                   r.get("skipped") or f"failed (exit {r['failed']})")
            lines.append(f"| {bandwidth} | {label} | {scale} | {hosts} | {contender} | {wire} | "
                         f"{why} | – | – | – | {expected} |")
            continue
        low, high = r["step_seconds_spread"]
        lines.append(f"| {bandwidth} | {label} | {scale} | {hosts} | {contender} | {wire} | "
                     f"{r['images_per_second']:.0f} | {r['step_seconds_median'] * 1e3:.1f} "
                     f"({low * 1e3:.1f}–{high * 1e3:.1f}) | {ratio_text(r['efficiency'])} | "
                     f"{_mb(r['nic_bytes_per_step'])} | {expected} |")
    lines += emulation_caveats(data)
    return "\n".join(lines)


def gpu_compression(data: dict) -> str | None:
    """Where PowerSGD's compute came from another device's measurement (emulate
    --compression-seconds), what the page and the README say of it; None elsewhere."""
    given = data.get("compression_seconds")
    if not given:
        return None
    seconds = ", ".join(f"{c} {s * 1e3:.1f} ms" for c, s in given["seconds"].items())
    outlasted = sorted({c["contender"] for c in data["cells"] if c.get("compression_outlasted")})
    commit = f" at {given['commit'][:7]}" if given.get("commit") else ""
    how = given.get("orthogonalisation") or powersgd_cost.QR_BEFORE
    return (f"PowerSGD's compute a step as measured on the {given['device']} "
            f"(`{given['from']}`{commit}, hybriddl's factors orthogonalised by {how}: "
            f"{seconds}), not this CPU's / S"
            + (f"; **{', '.join(outlasted)}**: its compute here outlasted that × S·D, so "
               "nothing was padded and its step is emulated slower than on that device (an "
               "upper bound)" if outlasted else ""))


def scaling_fast_setting(data: dict) -> str:
    speeds = ", ".join(_speed_label(s, t) for s, t in fast_speeds(data))
    gpu = gpu_compression(data)
    return (scaling_e2e_setting(data) + f"; each host stands for one S× faster "
            f"(`--speedup`/`--host-step`): {speeds}" + (f"; {gpu}" if gpu else ""))


def scaling_fast_notes(data: dict) -> str:
    return f"""\
How to read it: each host computes as one S× faster than its core here (`hybriddl emulate
--speedup S`; S derived from `--host-step`, one host's step measured here / the step asked):
links run at rate / (S·D) and every time is emulated, wall time / (S·D), so the host step
column is what one emulated host takes for one step of the use case's per-host batch. Rows
marked **not exact** send compressed gradients (fp16, or PowerSGD's rank-r factors with
error feedback): they are not the same training as the exact ones, so their images/s count
only at the accuracy they reach (time to accuracy over seeds: {accuracy_links()}). `ddp-powersgd`,
`ddp-fp16` and `flat-fp16` are the peers (torch's DDP hooks, Horovod's model with fp16).
*Not run (predicted X s/step)*: `--max-step-wall` left the cell out because one step would
take X s of wall time here (S·D × (the host step + its bytes at the emulated link)); it
was not measured. The chart shows each row's efficiency; the winner of each group is
outlined. The CPU-side work of every exchange is treated as S× faster too, which flatters
fast hosts ([methodology](../methodology.md#faster-hosts---speedup-s))."""


def scaling_fast_digest(data: dict) -> str:
    """What the chart is drawn from, hashed: the PNG records it, --check compares it."""
    import hashlib

    drawn = {"summary": data["summary"], "not_run": fast_not_run(data),
             "steps": fast_speeds(data)}
    return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()[:16]


def scaling_fast_chart(data: dict, path: Path) -> Path:
    """Efficiency of every contender, grouped by (host step, hosts); each group's winner
    (highest images/s) outlined, compressed schemes hatched, cells not run marked."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    steps = dict(fast_speeds(data))
    groups = sorted({(r["speedup"], r["hosts"]) for r in data["summary"] if r["hosts"] > 1}
                    | {(c.get("speedup", 1.0), c["hosts"]) for c in fast_not_run(data)})
    contenders = [c for c in FAST_COLORS
                  if any(r["contender"] == c for r in data["summary"] if r["hosts"] > 1)
                  or any(c2["contender"] == c for c2 in fast_not_run(data))]
    by = {(r["speedup"], r["hosts"], r["contender"]): r for r in data["summary"]}
    missing = {(c.get("speedup", 1.0), c["hosts"], c["contender"]) for c in fast_not_run(data)}
    winners = {(w["speedup"], w["hosts"]): w["winner"]["contender"] for w in fast_winners(data)}
    width = 0.8 / max(1, len(contenders))
    figure = Figure(figsize=(max(8.0, 1.6 * len(groups) + 5), 4.8), layout="constrained")
    axes = figure.subplots()
    for i, contender in enumerate(contenders):
        compressed = fast_compression(contender, data) is not None
        for g, (speedup, hosts) in enumerate(groups):
            x = g - 0.4 + width * (i + 0.5)
            row = by.get((speedup, hosts, contender))
            if row is not None and row["efficiency"] is not None:
                won = winners.get((speedup, hosts)) == contender
                axes.bar(x, row["efficiency"], width * 0.92, color=FAST_COLORS[contender],
                         hatch="//" if compressed else None, zorder=2,
                         edgecolor="black" if won else "white", linewidth=2 if won else 0.5)
                if won:
                    axes.annotate("best", (x, row["efficiency"]), ha="center", va="bottom",
                                  xytext=(0, 2), textcoords="offset points", fontsize="small")
            elif (speedup, hosts, contender) in missing:
                axes.plot(x, 0.02, marker="x", color=FAST_COLORS[contender], zorder=3)
    axes.set_xticks(range(len(groups)),
                    [f"{_speed_label(s, steps.get(s))}\n{h} hosts" for s, h in groups])
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1, zorder=1)
    tallest = max((r["efficiency"] for r in data["summary"] if r["efficiency"] is not None),
                  default=1.0)
    axes.set_ylim(0, max(1.25, tallest * 1.12))  # above 1: the one-host reference was slow
    axes.set_ylabel("weak-scaling efficiency (higher is better)")
    axes.set_xlabel("emulated host step (speedup S), hosts")
    rates = ", ".join(sorted({r["bandwidth"] for r in data["summary"]}))
    axes.set_title(f"{data['usecase']}, {rates} links: which scheme wins at each host speed")
    axes.grid(axis="y", alpha=0.3, zorder=0)
    handles = [Patch(facecolor=FAST_COLORS[c], hatch="//" if fast_compression(c, data) else None,
                     label=c + (" (not exact)" if fast_compression(c, data) else ""))
               for c in contenders]
    handles.append(axes.plot([], [], "kx", linestyle="none", label="not run (too slow to emulate)")[0])
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save_chart(figure, path, scaling_fast_digest(data))


def outlasted_at(data: dict, speedup: float) -> set[str]:
    """The contenders whose compute here outlasted the other device's (emulate
    --compression-seconds) at this S: their steps are upper bounds."""
    return {c["contender"] for c in data["cells"] if c.get("compression_outlasted")
            and float(f"{c.get('speedup', 1.0):.3g}") == speedup}


def fast_row(data: dict, page: str) -> dict | None:
    """The README's throughput row of one scaling_fast file: 2 hosts side by side at the
    fastest host speed measured, hybriddl's best contender against DDP's best. Where
    PowerSGD's compute was another device's and a contender's compute here outlasted it,
    that contender's step is an upper bound: its efficiency is shown as at least (≥)."""
    if time_scales(data).get(2) != 1:
        return None
    rows = [r for r in data["summary"] if r["hosts"] == 2 and r["efficiency"] is not None]
    if not rows:
        return None
    speedup = max(r["speedup"] for r in rows)
    rows = [r for r in rows if r["speedup"] == speedup]
    ours = [r for r in rows if not r["contender"].startswith(("ddp", "flat"))]
    peers = [r for r in rows if r["contender"].startswith("ddp")]
    if not ours:
        return None
    best = max(ours, key=lambda r: r["efficiency"])
    peer = max(peers, key=lambda r: r["efficiency"]) if peers else None
    outlasted = outlasted_at(data, speedup)

    def shown(row: dict) -> str:
        return (f"{row['contender']} {'≥ ' if row['contender'] in outlasted else ''}"
                f"{ratio_text(row['efficiency'])}")

    compression = fast_compression(best["contender"], data)
    gpu = data.get("compression_seconds")
    return {"workload": f"{model_name(data['usecase'])}, {data.get('image_size', 224)} px, "
                        f"{rows[0]['bandwidth']} links"
                        + (f", PowerSGD's compute the {gpu['device']}'s" if gpu else ""),
            "speed": _speed_label(speedup, dict(fast_speeds(data)).get(speedup)),
            "ours": shown(best), "ddp": "–" if peer is None else shown(peer),
            "mb": f"{best['nic_bytes_per_step'] / 1e6:.2f}" if best.get("nic_bytes_per_step")
            else "–",
            "exact": "yes" if compression is None else f"no ({compression})",
            "cpu": data.get("cpu_model"), "page": page, "gpu": bool(gpu), "speedup": speedup,
            "orthogonalisation": (gpu.get("orthogonalisation") or powersgd_cost.QR_BEFORE)
            if gpu else None,
            "bounded": bool(outlasted & {best["contender"], peer and peer["contender"]}),
            "key": (data["usecase"], data.get("image_size", 224), rows[0]["bandwidth"]),
            "slowed": bool(data.get("reference_slowed"))}


def readme_rows(rows: list[dict]) -> list[dict]:
    """The README's throughput rows (fast_row's), one per workload and link, in their
    order: the one with PowerSGD's compute timed on a GPU where one ran (hosts of a GPU's
    step compress on it), else this CPU's / S; then one whose figures are all measured
    rather than bounds (≥); then the fastest hosts. The others stay on their pages."""
    def rank(row: dict) -> tuple:
        return row["gpu"], not row["bounded"], row["speedup"]

    best = {}
    for row in rows:
        if row["key"] not in best or rank(row) > rank(best[row["key"]]):
            best[row["key"]] = row
    return [r for r in rows if best[r["key"]] is r]


def fast_headline(table: Page, data: dict) -> str | None:
    """Every scheme at the fastest host speed measured and the widest host count side by
    side (D = 1), which are exact, and what was not run."""
    side_by_side = {h for h, d in time_scales(data).items() if d == 1}
    rows = [r for r in data["summary"] if r["hosts"] in side_by_side and r["hosts"] > 1
            and r["efficiency"] is not None]
    if not rows:
        return None
    speedup = max(r["speedup"] for r in rows)
    hosts = max(r["hosts"] for r in rows if r["speedup"] == speedup)
    rows = sorted((r for r in rows if r["speedup"] == speedup and r["hosts"] == hosts),
                  key=lambda r: -r["images_per_second"])
    not_run = [c for c in fast_not_run(data) if c.get("speedup", 1.0) == speedup
               and c["hosts"] == hosts]
    step = dict(fast_speeds(data)).get(speedup)
    model = model_name(data["usecase"])
    bounded = outlasted_at(data, speedup)
    parts = [f"{r['contender']} {'≥ ' if r['contender'] in bounded else ''}"
             f"{ratio_text(r['efficiency'])} ({r['images_per_second']:.0f} img/s)" for r in rows]
    parts += [f"{c['contender']} not run (predicted {c['predicted_step_wall_seconds']:.0f} s of "
              f"wall time per step)" if c.get("predicted_step_wall_seconds")
              else f"{c['contender']} not run" for c in not_run]
    names = [r["contender"] for r in rows] + [c["contender"] for c in not_run]
    exact = [n for n in names if fast_compression(n, data) is None]
    compressed = {}
    for n in names:
        if fast_compression(n, data):
            compressed.setdefault(fast_compression(n, data), []).append(n)
    inexact = "; ".join(f"{how}: {', '.join(ns)}" for how, ns in compressed.items())
    p = provenance(data)
    return (f"- **{model}, {data['image_size']} px, {hosts} emulated hosts as fast as a "
            f"{_speed_label(speedup, step)} step, side by side (D = 1), "
            f"{rows[0]['bandwidth']} links** — efficiency (images/s), best first: "
            + "; ".join(parts) + ". Exact: " + (", ".join(exact) or "none")
            + (f"; not exact (judged by time to accuracy over seeds, not by images/s) — "
               f"{inexact}" if inexact else "")
            + f" ({p['cpu_model']}; [table](docs/benchmarks/{table.name}.md)).")


# One page and chart per use case and link (scripts/scaling_e2e.py --speedup/--host-step).
FAST_PAGES = [
    Page("scaling_fast-*", "Faster hosts: which scheme wins", "results/scaling_fast-*.json",
         scaling_fast_table, scaling_fast_setting, scaling_fast_notes, headline=fast_headline,
         chart=scaling_fast_chart, digest=scaling_fast_digest,
         none_yet="scripts/scaling_e2e.py --host-step 10ms --output "
                  "results/scaling_fast-<usecase>-<rate>.json writes them"),
]


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
        # PowerSGD's compute measured on the hosts' device, where it stands in (else null).
        "compression_seconds": args.compression_seconds and {
            "from": args.compression_seconds_from, "seconds": args.compression_seconds,
            "device": args.compression_device, **args.compression_timed},
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

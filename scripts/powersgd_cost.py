"""PowerSGD's own compute on the device that trains (issue 54): hybriddl's `powersgd:2` (one
round and two) and torch's powerSGD_hook at rank 2 in DDP, beside the copy of a whole
gradient from the device to host memory and back, for the use cases' models.

    python scripts/powersgd_cost.py --output results/powersgd_cost-gpu.json   # on a GPU
    python scripts/powersgd_cost.py --device cpu --models squeezenet1_1 --image-size 32 \\
        --batch-size 4 --repeats 2 --output /tmp/cost.json                      # its CPU check

Per model, in interleaved rounds (each round times every contender once; the device
synchronised before every clock read), the median and spread of:
- `hybriddl powersgd:2` / `powersgd:2:rounds=2`: one step of `PowerSGD.aggregate` on the
  model's gradients, the allreduce left out (one host: the sum is the wire);
- `hybriddl powersgd:2 convolutions`: the same on the convolutions' gradients alone
  (`features.*`), what `--host-parallel hybrid` compresses (hybrid-powersgd);
- `ddp powerSGD_hook:2 minus allreduce_hook`: a DDP step (forward and backward) of one
  process with torch's hook at rank 2 (compressing from its third step) less the same step
  with DDP's default allreduce hook (a world of one: no bytes move);
- `gradient to host and back`: the whole gradient copied into pinned host memory and back,
  what exact averaging over MPI adds on a GPU host (the Open MPI wheel is not CUDA-aware).

The fast-host emulation divides the CPU's seconds of these by S; these are the device's.
The results file names the device (GPU name or CPU model), the commit and, where the
checkout differs from it, `git status --porcelain`.

    python scripts/powersgd_cost.py --device cpu --threads 1 --image-size 64 --batch-size 8 \
        --repeats 5 --output results/powersgd_cost-cpu.json   # what a 1-core host spends
    python scripts/powersgd_cost.py --restate results/powersgd_cost-cpu.json \
        results/powersgd_cost-gpu.json --output results/powersgd_cost-restated.json

`--restate CPU GPU` measures nothing: it takes the fast-host tables
(results/scaling_fast-*.json) and, for every cell of GPU-speed hosts (a host step of at most
25 ms) where hybriddl's `data-powersgd` and DDP + PowerSGD ran at the same hosts, link and
S, restates both steps with each side's
compression time taken from the GPU: step - (CPU seconds) / S + (GPU seconds), then the
peer ratio (DDP's step over hybriddl's, as images/s) before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bench_common import REPO, results_header, spread, synchronize
from pages import Page
from hybriddl.files import atomic_write_json
from hybriddl.hosts.powersgd import PowerSGD
from hybriddl.usecases import build_model, get_usecase

RANK = 2
HOOK_START = 2  # torch's least start_powerSGD_iter with error feedback
OURS, PEER = "hybriddl powersgd:2", "ddp powerSGD_hook:2 minus allreduce_hook"
# What --host-parallel hybrid compresses: the convolutions' gradients (`features.*`) alone.
CONVOLUTIONS = "hybriddl powersgd:2 convolutions"
TABLES = "results/scaling_fast-*.json"
# The cells that stand for GPU hosts: a host step of AlexNet's 10 ms or VGG16's 18-20 ms
# (the tables' slower hosts, 95-105 ms, are CPU servers: their compression stays on the CPU).
GPU_HOST_STEP_SECONDS = 0.025


def timed(device: torch.device, work) -> float:
    synchronize(device)
    started = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - started


def model_gradients(name: str, image_size: int, batch: int, device: torch.device):
    """The model on `device` and one backward's gradients (their values do not change the
    work of any contender)."""
    torch.manual_seed(0)
    model = build_model(name, 10).to(device)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return model, x, y, [p.grad.detach().clone() for p in model.parameters()]


class DdpStep:
    """A DDP step of one process with `hook` (torch's powerSGD_hook at RANK, or allreduce)."""

    def __init__(self, model, x, y, powersgd: bool):
        self.model = DistributedDataParallel(model, bucket_cap_mb=1 + sum(
            p.numel() * 4 for p in model.parameters()) // 2**20)
        if powersgd:
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=RANK,
                                                start_powerSGD_iter=HOOK_START)
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        self.x, self.y = x, y
        for _ in range(HOOK_START + 1):  # the hook compressing, its buffers allocated
            self()

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()


def measure(name: str, image_size: int, batch: int, device: torch.device, repeats: int) -> dict:
    model, x, y, gradients = model_gradients(name, image_size, batch, device)
    schemes = {"hybriddl powersgd:2": PowerSGD(RANK), "hybriddl powersgd:2:rounds=2":
               PowerSGD(RANK, rounds=2)}
    for scheme in schemes.values():
        scheme.setup([g.shape for g in gradients], device=device)
    flat = torch.cat([g.reshape(-1) for g in gradients])
    host = torch.empty(flat.shape, pin_memory=device.type == "cuda")
    back = torch.empty_like(flat)

    def round_trip() -> None:
        host.copy_(flat, non_blocking=True)
        back.copy_(host, non_blocking=True)

    # The convolutions' part, as the hybrid scheme's hosts run it (its own state and factors).
    convolutions = [g for (name, _), g in zip(model.named_parameters(), gradients)
                    if name.startswith("features.")]
    hybrid = PowerSGD(RANK)
    hybrid.setup([g.shape for g in convolutions], device=device)
    with_hook = DdpStep(model, x, y, powersgd=True)
    plain = DdpStep(build_model(name, 10).to(device), x, y, powersgd=False)
    contenders = {**{label: (lambda s=scheme: s.aggregate(gradients, lambda w: w))
                     for label, scheme in schemes.items()},
                  **({CONVOLUTIONS: lambda: hybrid.aggregate(convolutions, lambda w: w)}
                     if convolutions else {}),
                  "gradient to host and back": round_trip,
                  "ddp step with powerSGD_hook:2": with_hook,
                  "ddp step with allreduce_hook": plain}
    for work in contenders.values():  # warm-up
        timed(device, work)
    seconds = {label: [] for label in contenders}
    for _ in range(repeats):  # interleaved rounds
        for label, work in contenders.items():
            seconds[label].append(timed(device, work))
    hook = [a - b for a, b in zip(seconds["ddp step with powerSGD_hook:2"],
                                  seconds["ddp step with allreduce_hook"])]
    figures = {label: spread(values, 6) for label, values in seconds.items()}
    figures["ddp powerSGD_hook:2 minus allreduce_hook"] = spread(hook, 6)
    return {"model": name, "image_size": image_size, "batch_size": batch,
            "gradient_bytes": flat.numel() * 4, "repeats": repeats, "seconds": figures}


def device_record(device: torch.device) -> dict:
    status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                            cwd=REPO).stdout.splitlines()
    record = {"device": str(device), "git_status_porcelain": status}
    if device.type == "cuda":
        record["gpu_name"] = torch.cuda.get_device_name(device)
    return record


# ------------------------------------------------------------------ the fast-host tables, restated

def restate(cpu: dict, gpu: dict, tables: list[Path]) -> list[dict]:
    """Every fast-host cell pair (hybriddl's data-powersgd beside ddp-powersgd at the same
    hosts, link and S), each side's step restated with its compression time from the GPU:
    step - cpu / S + gpu. Its compression is taken as on the step's critical path on both
    sides (hybriddl's --overlap hides part of it on the CPU: its restated step is then an
    upper bound)."""
    def medians(record: dict) -> dict:
        return {m["model"]: {k: v["median"] for k, v in m["seconds"].items()}
                for m in record["models"]}

    on_cpu, on_gpu = medians(cpu), medians(gpu)
    rows = []
    for path in tables:
        table = json.loads(path.read_text())
        model = get_usecase(table["usecase"]).model
        if model not in on_cpu or model not in on_gpu:
            continue
        cells = {(r["bandwidth"], r["speedup"], r["hosts"], r["contender"]): r
                 for r in table["summary"]}
        for (bandwidth, speedup, hosts, contender), ours in sorted(cells.items()):
            peer = cells.get((bandwidth, speedup, hosts, "ddp-powersgd"))
            if (contender != "data-powersgd" or peer is None
                    or ours["host_step_seconds"] > GPU_HOST_STEP_SECONDS):
                continue
            row = {"usecase": table["usecase"], "model": model, "table": str(path),
                   "table_cpu_model": table["cpu_model"], "bandwidth": bandwidth,
                   "speedup": speedup, "host_step_seconds": ours["host_step_seconds"],
                   "hosts": hosts}
            for side, cell, label in (("ours", ours, OURS), ("peer", peer, PEER)):
                emulated = cell["step_seconds_median"]
                row[side] = {"step_seconds_emulated": emulated,
                             "compression_cpu_over_s": on_cpu[model][label] / speedup,
                             "compression_gpu": on_gpu[model][label],
                             "step_seconds_restated": emulated - on_cpu[model][label] / speedup
                             + on_gpu[model][label]}
            row["ratio_emulated"] = (row["peer"]["step_seconds_emulated"]
                                     / row["ours"]["step_seconds_emulated"])
            row["ratio_restated"] = (row["peer"]["step_seconds_restated"]
                                     / row["ours"]["step_seconds_restated"])
            rows.append(row)
    return rows


def restated_table(data: dict) -> str:
    lines = ["| workload | link | S (host step) | hosts | hybriddl step, emulated → restated "
             "(ms) | DDP + PowerSGD step, emulated → restated (ms) | hybriddl's compression, "
             "CPU/S → GPU (ms) | DDP hook's, CPU/S → GPU (ms) | × DDP + PowerSGD, emulated → "
             "restated |", "|---|---|---:|---:|---|---|---|---|---|"]
    def ms(side: dict, before: str, after: str) -> str:
        return f"{side[before] * 1e3:.1f} → {side[after] * 1e3:.1f}"

    for r in data["rows"]:
        cells = [f"{r['usecase']} ({r['model']})", r["bandwidth"],
                 f"{r['speedup']:g} ({r['host_step_seconds'] * 1e3:.1f} ms)", str(r["hosts"])]
        cells += [ms(r[side], f"{what}_emulated", f"{what}_restated")
                  for side in ("ours", "peer") for what in ("step_seconds",)]
        cells += [ms(r[side], "compression_cpu_over_s", "compression_gpu")
                  for side in ("ours", "peer")]
        cells.append(f"{r['ratio_emulated']:.2f} → **{r['ratio_restated']:.2f}**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def restated_setting(data: dict) -> str:
    return (f"the fast-host tables' cells where hybriddl's data-powersgd and DDP + PowerSGD ran "
            f"side by side, restated with PowerSGD's compute measured on {data['gpu_name']} "
            f"(`{data['gpu_file']}`) in place of this CPU's ({data['cpu_file']}, "
            f"{data['cpu_compression_model']}, {data['cpu_threads']} thread(s)) divided by S")


RESTATED_NOTES = """How to read it: each fast-host cell emulates a host S times faster than one
core here, so every second of compute, PowerSGD's products and DDP's hook included, is
divided by S. On a GPU host those products run on the GPU: the restated step takes the
CPU's compression seconds out (as this CPU measured them, divided by the cell's S) and
puts the GPU's in (results/powersgd_cost-gpu.json: hybriddl's `PowerSGD.aggregate` and
DDP's step with powerSGD_hook less its step with the allreduce hook, one process). Both
compressions are counted on the step's critical path; hybriddl's `--overlap` hides part of
its own, so its restated step is an upper bound. *× DDP + PowerSGD* is DDP's step over
hybriddl's (images/s, the same batch). The cells ran on the CPU their table names; the CPU
seconds subtracted were measured on the CPU this page names, which may differ."""


def main_restate(args) -> int:
    cpu, gpu = (json.loads(Path(f).read_text()) for f in args.restate)
    if "gpu_name" not in gpu or "gpu_name" in cpu:
        print("powersgd_cost.py: --restate CPU GPU: give the CPU's results file first, then "
              "the GPU's", file=sys.stderr)
        return 2
    tables = sorted(REPO.glob(TABLES))
    rows = restate(cpu, gpu, [t.relative_to(REPO) if t.is_relative_to(REPO) else t
                              for t in tables])
    if not rows:
        print(f"powersgd_cost.py: no cell of {TABLES} has data-powersgd beside ddp-powersgd "
              "for a model both files measured", file=sys.stderr)
        return 2
    atomic_write_json(Path(args.output), {
        **results_header("powersgd_cost.py", args.argv), "gpu_name": gpu["gpu_name"],
        "gpu_file": args.restate[1], "cpu_file": args.restate[0],
        "cpu_compression_model": cpu["cpu_model"], "cpu_threads": cpu.get("threads"),
        "gpu_commit": gpu["commit"], "cpu_commit": cpu["commit"], "rows": rows})
    for r in rows:
        print(f"{r['model']} {r['bandwidth']} S={r['speedup']:g} {r['hosts']} hosts: "
              f"x DDP+PowerSGD {r['ratio_emulated']:.2f} -> {r['ratio_restated']:.2f}")
    return 0


def restated_headline(page: Page, data: dict) -> str | None:
    """The README's line under its throughput table: what the peer ratio becomes where
    PowerSGD's compute is the GPU's."""
    by_model: dict[str, list[dict]] = {}
    for row in data["rows"]:
        by_model.setdefault(row["model"], []).append(row)
    if not by_model:
        return None
    parts = []
    for model, rows in sorted(by_model.items()):
        low, high = (f(r["ratio_restated"] for r in rows) for f in (min, max))
        was = (f(r["ratio_emulated"] for r in rows) for f in (min, max))
        ratio = f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"
        before = "–".join(dict.fromkeys(f"{x:.2f}" for x in was))
        ours, peer = rows[0]["ours"]["compression_gpu"], rows[0]["peer"]["compression_gpu"]
        speeds = ", ".join(dict.fromkeys(f"S = {r['speedup']:g} ({r['host_step_seconds'] * 1e3:.0f}"
                                         f" ms host step, {r['bandwidth']})" for r in rows))
        parts.append(f"{model} at {speeds}: {ratio}× (from {before}×; its compression "
                     f"{ours * 1e3:.1f} ms a step there, the hook's {peer * 1e3:.1f} ms)")
    return (f"On GPU hosts, with PowerSGD's compute measured on an {data['gpu_name']} in "
            f"place of this CPU's divided by S (restated arithmetically from the cells above "
            f"and the measured compression times, the CPU's as {data['cpu_compression_model']} "
            f"measured them: an estimate; rows whose workload says \"PowerSGD's compute the "
            f"{data['gpu_name']}'s\" ran it end to end, `emulate --compression-seconds`), "
            f"hybriddl's PowerSGD against DDP + PowerSGD is: {'; '.join(parts)} "
            f"([restated](docs/benchmarks/{page.name}.md)).")


PAGES = [
    Page("powersgd_cost-restated", "PowerSGD's compute taken from the GPU: the fast-host peer "
         "ratio restated", "results/powersgd_cost-restated.json", restated_table,
         restated_setting, RESTATED_NOTES, headline=restated_headline),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[32, 16],
                        help="one per model, or one for all (default: 32 16, the use cases')")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int,
                        help="torch's threads (a host of that many cores; default: torch's)")
    parser.add_argument("--restate", nargs=2, metavar=("CPU_JSON", "GPU_JSON"),
                        help="measure nothing: restate the fast-host tables with these files")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.restate:
        return main_restate(args)
    if args.threads is not None:
        if args.threads < 1:
            print("powersgd_cost.py: give --threads >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("powersgd_cost.py: no CUDA device here: give --device cpu for the CPU's check",
              file=sys.stderr)
        return 2
    if args.repeats < 1 or len(args.batch_size) not in (1, len(args.models)):
        print("powersgd_cost.py: give --repeats >= 1 and one --batch-size per model (or one)",
              file=sys.stderr)
        return 2
    batches = args.batch_size * (len(args.models) if len(args.batch_size) == 1 else 1)
    if device.type == "cuda" and device.index is None:  # NCCL wants the device's index
        device = torch.device("cuda", torch.cuda.current_device())
    # A world of one, its store in this process: no port to take.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            store=dist.HashStore(),
                            device_id=device if device.type == "cuda" else None)
    try:
        models = [measure(name, args.image_size, batch, device, args.repeats)
                  for name, batch in zip(args.models, batches)]
    finally:
        dist.destroy_process_group()
    atomic_write_json(Path(args.output), {**results_header("powersgd_cost.py", argv),
                                          **device_record(device),
                                          "threads": torch.get_num_threads(), "models": models})
    for model in models:
        print(model["model"], {k: v["median"] for k, v in model["seconds"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

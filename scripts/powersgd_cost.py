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
- `hybriddl powersgd:2 with QR`: the first with its factors orthogonalised by QR, as
  before Gram-Schmidt replaced it (9cfbb0f): what that change saves on this device;
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

A GPU's file stands in for the CPU's compute divided by S in the fast-host emulation:
`scripts/scaling_e2e.py --compression-seconds-from results/powersgd_cost-gpu.json`
(`hybriddl emulate --compression-seconds`). The file records how hybriddl orthogonalised
its factors (`orthogonalisation`; files without it predate Gram-Schmidt: QR).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bench_common import REPO, results_header, spread, synchronize
from hybriddl.files import atomic_write_json
from hybriddl.hosts import powersgd
from hybriddl.hosts.powersgd import GRAM_SCHMIDT_MAX_RANK, PowerSGD
from hybriddl.usecases import build_model

RANK = 2
HOOK_START = 2  # torch's least start_powerSGD_iter with error feedback
OURS, PEER = "hybriddl powersgd:2", "ddp powerSGD_hook:2 minus allreduce_hook"
# What --host-parallel hybrid compresses: the convolutions' gradients (`features.*`) alone.
CONVOLUTIONS = "hybriddl powersgd:2 convolutions"
# How hybriddl's factors were orthogonalised where these were timed (QR alone before 9cfbb0f).
ORTHOGONALISATION = (f"Gram-Schmidt up to rank {GRAM_SCHMIDT_MAX_RANK} (on a GPU every "
                     "group in one batch, since d5cfbd0), QR above")
QR_BEFORE = ("QR, as before 9cfbb0f (Gram-Schmidt since, up to rank 4, not yet timed on a "
             "GPU)")
WITH_QR = "hybriddl powersgd:2 with QR"


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


def with_qr(work) -> None:
    """`work` with hybriddl's factors orthogonalised by QR at every rank (as before 9cfbb0f):
    what Gram-Schmidt saves on this device, beside it in the same rounds."""
    kept = powersgd.GRAM_SCHMIDT_MAX_RANK
    powersgd.GRAM_SCHMIDT_MAX_RANK = 1
    try:
        work()
    finally:
        powersgd.GRAM_SCHMIDT_MAX_RANK = kept


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
    qr = PowerSGD(RANK)  # the same step with its factors orthogonalised by QR, as before
    qr.setup([g.shape for g in gradients], device=device)
    contenders = {**{label: (lambda s=scheme: s.aggregate(gradients, lambda w: w))
                     for label, scheme in schemes.items()},
                  WITH_QR: lambda: with_qr(lambda: qr.aggregate(gradients, lambda w: w)),
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
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
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
                                          "threads": torch.get_num_threads(),
                                          "orthogonalisation": ORTHOGONALISATION,
                                          "models": models})
    for model in models:
        print(model["model"], {k: v["median"] for k, v in model["seconds"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

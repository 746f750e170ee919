"""hybriddl's GPU step against plain PyTorch on the same GPU, side by side, in one run.

    python scripts/bench_gpu.py --usecase SimpleBig --rounds 5     # AlexNet, batch 32, 224 px
    python scripts/bench_gpu.py --usecase ComplexSmall --rounds 5  # VGG16, batch 16, 224 px

Rows, every one on the same batch already on the device, in interleaved rounds (A B C A B
C ...), each visit `--warmup` steps then `--steps` steps timed together between two
`torch.cuda.synchronize()` (a GPU step returns when its kernels are queued, so a clock
read without one times the queueing; one sync per visit lets the host queue ahead as in
training):
- hybriddl: the `gpu` strategy's optimizer step (hybriddl.step.optimizer_step, what
  training runs) in fp32, channels_last and bf16 autocast + channels_last, with the
  models' keyed dropout on (the default) and at dropout 0;
- pytorch: the textbook loop on a torchvision model (nn.Dropout), fp32, channels_last,
  bf16 autocast + channels_last, its SGD hybriddl's (`step.make_optimizer`: fused), and
  with `--compile-peer` torch.compile of the fastest of those (picked from one untimed
  visit of each, compiled before the rounds, then timed in the same rounds as every row);
- pipeline: both stages on one GPU, M micro-batches, with each stage's busy time and the
  time both stages were busy at once (from CUDA events around each stage's work);
- graph (unless `--no-graph`): the whole training step (forward, backward, fused SGD)
  captured once in a CUDA graph and replayed, fp32 and channels_last: `gpu-graph` is
  hybriddl's model with keyed dropout, `pytorch-graph` torchvision's with nn.Dropout. Not
  what `hybriddl train` runs: whether this route brings keyed dropout to PyTorch's speed
  (`graph_route` in the file: the fastest gpu-graph row against the fastest pytorch row
  and against the fastest pytorch-graph row). A capture that fails is recorded with its
  reason and the other rows go on.
A row's seconds/step is the median over rounds; its spread the lowest and highest round;
vs_fastest_peer = the fastest pytorch row's seconds / the row's, within each round, median
over rounds. Then `--train-steps` steps (default 200, over as many epochs as they take:
the embedded set's epoch is 75 steps for SimpleBig, 30 for ComplexSmall) of `hybriddl
train --strategy gpu` (the fastest hybriddl numerics) give the data wait at the GPU's
rate: the share of the training time the step waited for the next batch; the record
names the steps and epochs it ran. Then `--loader-rounds` rounds (default 3) alternate
that training run with plain PyTorch trained from a real loader on the same images and
steps (torch's DataLoader, `--loader-workers` workers, pinned memory, non_blocking copies,
the same preprocessing on the device): hybriddl's steady images/s (after the first epoch)
over the peer's, median and spread over rounds.

Writes results/bench_gpu-<usecase>.json (gpu_name, torch, commit, command, date,
cpu_model, rows) once the rows are measured, before the training run, and again with the
training's record (or its failure: exit 1). Without a CUDA device it writes nothing and
exits 2: no GPU figure is written where it was not measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import REPO, results_header, spread, synchronize
from pages import Page
from hybriddl.dropout import dropout_keys, sample_keys
from hybriddl.errors import UsageError
from hybriddl.files import atomic_write_json
from hybriddl.step import make_optimizer, optimizer_step
from hybriddl.strategies import StrategyOptions, make_strategy
from hybriddl.strategies.base import criterion, prepare_model, run_forward
from hybriddl.usecases import build_model, get_usecase, use_case_workload

NUMERICS = {"fp32": StrategyOptions(), "fp32-cl": StrategyOptions(channels_last=True),
            "bf16-cl": StrategyOptions(precision="bf16", channels_last=True)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, help="default: the use case's "
                        "(AlexNet 32, VGG16 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--compile-peer", action="store_true",
                        help="add torch.compile of the fastest plain PyTorch numerics")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                        help="add the step captured in a CUDA graph, keyed dropout and "
                        "PyTorch's, fp32 and channels_last (default: on)")
    parser.add_argument("--train-steps", type=int, default=200,
                        help="steps of `hybriddl train` for the data wait, over as many "
                        "epochs as they take (0: none)")
    parser.add_argument("--loader-rounds", type=int, default=3,
                        help="rounds of `hybriddl train` against plain PyTorch with a "
                        "DataLoader (pinned memory, non_blocking) on the same images and "
                        "--train-steps steps, alternating (0: none)")
    parser.add_argument("--loader-workers", type=int, default=4,
                        help="the DataLoader's worker processes")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--output", help="default: results/bench_gpu-<usecase>.json")
    return parser.parse_args(argv)


class Row:
    """One contender: `visit()` returns seconds per step over `steps` steps."""

    def __init__(self, strategy: str, variant: str, dropout: float | None, visit):
        self.strategy, self.variant, self.dropout, self.visit = strategy, variant, dropout, visit
        self.rounds: list[float] = []
        self.extra: dict = {}
        self.state: dict = {}
        self.failed: str | None = None  # why it could not run here (a graph's capture)

    def close(self) -> None:
        """Stop the row's strategy (a pipeline's stage thread) once it is measured."""
        if "strategy" in self.state:
            self.state.pop("strategy").close()


def timed(device: torch.device, step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - started) / steps


def hybriddl_row(model_name, classes, x, y, device, variant, dropout, args,
                 name="gpu", options=None) -> Row:
    options = options or StrategyOptions(devices=(str(device),), precision=NUMERICS[variant].precision,
                                         channels_last=NUMERICS[variant].channels_last)
    state = {}

    def visit() -> float:
        if "strategy" not in state:  # built once, kept between rounds
            torch.manual_seed(0)
            model = build_model(model_name, classes, **({} if dropout is None else
                                                         {"dropout": dropout}))
            strategy = make_strategy(name, options)
            strategy.setup(model)
            state.update(strategy=strategy, x=strategy.stage_batch(x),
                         optimizer=make_optimizer(model.parameters(), 0.001, 0.9),
                         keys=sample_keys(0, 0, torch.arange(len(y))))
        strategy = state["strategy"]

        def step():
            with dropout_keys(state["keys"]):
                optimizer_step(strategy, state["optimizer"], state["x"], y)

        return timed(device, step, args.warmup, args.steps)

    row = Row(name, variant, 0.5 if dropout is None else dropout, visit)
    row.state = state
    return row


def pytorch_row(model_name, classes, x, y, device, variant, args, compile=False) -> Row:
    numerics = NUMERICS[variant]
    state = {}

    def visit() -> float:
        if "model" not in state:
            torch.manual_seed(0)
            import torchvision

            model = torchvision.models.get_model(model_name, num_classes=classes).to(device)
            prepare_model(model, numerics)
            state.update(model=torch.compile(model) if compile else model,
                         optimizer=make_optimizer(model.parameters(), 0.001, 0.9),
                         x=x.to(device), y=y.to(device))

        return timed(device, lambda: plain_step(state, state["x"], state["y"], numerics),
                     args.warmup, args.steps)

    row = Row("pytorch", variant + ("-compile" if compile else ""), 0.5, visit)
    row.state = state
    return row


def plain_step(state: dict, x: torch.Tensor, y: torch.Tensor, numerics: StrategyOptions) -> None:
    """The plain PyTorch peers' training step (state's model and optimizer), the textbook
    loop's."""
    state["optimizer"].zero_grad(set_to_none=True)
    criterion(run_forward(state["model"], x, numerics), y).backward()
    state["optimizer"].step()


# The numerics a graph row captures: bf16 autocast caches its casts of the weights, which a
# captured graph would hold stale (torch.cuda.graphs asks for cache_enabled=False there).
GRAPH_NUMERICS = ("fp32", "fp32-cl")


def graphed(step, device: torch.device, warmup: int = 3):
    """`step` captured once in a CUDA graph, as torch.cuda.graphs' whole-network capture
    does: warm-up calls on a side stream (they build the kernels and the momentum), the
    gradients dropped, then one call captured (its gradients allocated from the graph's
    pool); returns the replay, which reruns every kernel with one launch and no Python. On
    a CPU device (the tests) the step itself."""
    if device.type != "cuda":
        return step
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graph_row(model_name, classes, x, y, device, variant, keyed: bool, args) -> Row:
    """The whole step in a CUDA graph (`graphed`): hybriddl's model with keyed dropout
    (`keyed`, the keys a fixed device tensor) or torchvision's with nn.Dropout, the
    variant's numerics, the fused SGD of every row. Where the capture fails the row is
    recorded as failed, with why, and timed no more."""
    numerics = NUMERICS[variant]
    state = {}
    row = Row("gpu-graph" if keyed else "pytorch-graph", variant, 0.5, None)

    def visit() -> float | None:
        if row.failed:
            return None
        if "replay" not in state:
            torch.manual_seed(0)
            import torchvision

            model = (build_model(model_name, classes) if keyed else
                     torchvision.models.get_model(model_name, num_classes=classes)).to(device)
            prepare_model(model, numerics)
            keys = sample_keys(0, 0, torch.arange(len(y))).to(device) if keyed else None
            state.update(model=model, x=x.to(device), y=y.to(device),
                         optimizer=make_optimizer(model.parameters(), 0.001, 0.9))

            def step():
                with dropout_keys(keys):
                    plain_step(state, state["x"], state["y"], numerics)

            try:
                state["replay"] = graphed(step, device)
            except RuntimeError as exc:
                row.failed = f"capture failed: {str(exc).strip().splitlines()[0]}"
                return None
        try:
            return timed(device, state["replay"], args.warmup, args.steps)
        except RuntimeError as exc:  # the rows beside it are what the run is for
            row.failed = f"replay failed: {str(exc).strip().splitlines()[0]}"
            return None

    row.visit = visit
    row.state = state
    return row


def pipeline_row(model_name, classes, x, y, device, args) -> Row:
    options = StrategyOptions(micro_batches=args.micro_batches, devices=(str(device),) * 2)
    row = hybriddl_row(model_name, classes, x, y, device, "fp32", None, args,
                       name="pipeline", options=options)
    row.variant = f"fp32 M={args.micro_batches} one GPU"
    measure = row.visit

    def visit() -> float:
        seconds = measure()
        pipe = row.state["strategy"]
        pipe.record_timeline = True
        with dropout_keys(row.state["keys"]):
            optimizer_step(pipe, row.state["optimizer"], row.state["x"], y)
        pipe.record_timeline = False
        row.extra.setdefault("timelines", []).append(stage_busy(pipe.timeline()))
        return seconds

    row.visit = visit
    return row


def compiled_peer(rows: list[Row], model_name, classes, x, y, device, args) -> Row:
    """torch.compile of the fastest plain PyTorch numerics, picked from one untimed visit
    of each peer and compiled before the rounds: it is then timed in the same rounds as
    every other row."""
    peers = [r for r in rows if r.strategy == "pytorch"]
    best = min(peers, key=lambda r: r.visit()).variant
    compiled = pytorch_row(model_name, classes, x, y, device, best, args, compile=True)
    compiled.visit()  # compiles
    return compiled


def stage_busy(timeline: list[dict]) -> dict:
    """Each stage's busy milliseconds in one step, and the milliseconds both were busy."""
    stages = {s: [(r["start_ms"], r["end_ms"]) for r in timeline if r["stage"] == s] for s in (1, 2)}
    both = sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in stages[1] for a2, b2 in stages[2])
    return {"stage1_busy_ms": round(sum(b - a for a, b in stages[1]), 3),
            "stage2_busy_ms": round(sum(b - a for a, b in stages[2]), 3),
            "both_busy_ms": round(both, 3),
            "step_ms": round(max(r["end_ms"] for r in timeline), 3), "timeline": timeline}


def measure(rows: list[Row], rounds: int, on_visit=lambda r, row, s: None) -> None:
    for number in range(rounds):
        for row in rows:
            seconds = row.visit()
            if seconds is None:  # it cannot run here (row.failed says why)
                continue
            row.rounds.append(seconds)
            on_visit(number, row, seconds)


def versus(row: Row, peers: list[Row]) -> float | None:
    """The fastest of `peers`' step over the row's, within each round, median over rounds."""
    peers = [p for p in peers if not p.failed]
    if not peers:
        return None
    return statistics.median(min(p.rounds[i] for p in peers) / s
                             for i, s in enumerate(row.rounds))


def summarise(rows: list[Row]) -> list[dict]:
    peers = [r for r in rows if r.strategy == "pytorch"]
    graph_peers = [r for r in rows if r.strategy == "pytorch-graph"]
    out = []
    for row in rows:
        if row.failed:
            out.append({"strategy": row.strategy, "variant": row.variant,
                        "dropout": row.dropout, "failed": row.failed})
            continue
        record = {"strategy": row.strategy, "variant": row.variant, "dropout": row.dropout,
                  "seconds_per_step": statistics.median(row.rounds),
                  "spread_seconds": spread(row.rounds)["min"], "round_seconds": row.rounds,
                  "spread": spread(row.rounds), "vs_fastest_peer": versus(row, peers)}
        if row.strategy.endswith("-graph"):
            record["vs_fastest_graph_peer"] = versus(row, graph_peers)
        if row.extra.get("timelines"):
            last = row.extra["timelines"][-1]
            record["stages"] = {k: v for k, v in last.items() if k != "timeline"}
            record["timeline"] = last["timeline"]
        out.append(record)
    return out


def train_data_wait(usecase: str, image_size: int, batch_size: int, variant: str,
                    steps: int, device: str) -> dict:
    """`hybriddl train --strategy gpu` for `steps` steps (as many epochs as they take):
    images/s and the data wait over all of them."""
    options = NUMERICS[variant]
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        command = [sys.executable, "-m", "hybriddl", "train", "--usecase", usecase,
                   "--strategy", "gpu", "--devices", device, "--image-size", str(image_size),
                   "--batch-size", str(batch_size), "--max-steps", str(steps),
                   "--epochs", str(steps),
                   "--precision", options.precision, "--run-dir", str(run_dir)]
        if options.channels_last:
            command.append("--channels-last")
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"hybriddl train exited {done.returncode}: {last}")
        epochs = json.loads((run_dir / "metrics.json").read_text())["epochs"]
    seconds = sum(e["seconds"] for e in epochs)
    wait = sum(e["data_wait_seconds"] for e in epochs)
    return {"command": shlex.join(["hybriddl", *command[3:]]), "steps": sum(e["steps"] for e in epochs),
            "epochs": len(epochs), "images_per_second": sum(e["samples"] for e in epochs) / seconds,
            "steady_images_per_second": steady_rate(epochs),
            "seconds": seconds, "data_wait_seconds": wait, "data_wait_share": wait / seconds}


def steady_rate(epochs: list[dict]) -> float:
    """Images/s over the epochs after the first (its start-up, cache and warm-up set apart),
    over all of them when there is one."""
    steady = epochs[1:] or epochs
    return sum(e["samples"] for e in steady) / sum(e["seconds"] for e in steady)


def loader_peer(usecase: str, model_name: str, image_size: int, batch_size: int, variant: str,
                steps: int, device: str, workers: int) -> dict:
    """Plain PyTorch training from a real loader on the images `hybriddl train` reads (the
    use case's embedded set): torch's DataLoader, shuffled, `workers` worker processes,
    pinned memory; each uint8 batch copied with non_blocking and scaled, flipped and
    normalised on the device (the same preprocessing); torchvision's model with nn.Dropout,
    the variant's numerics and the fused SGD of the other peers. `steps` steps over as
    many epochs as they take; images/s over the epochs after the first, as steady_rate."""
    import torchvision
    from torch.utils.data import DataLoader, TensorDataset

    from hybriddl.data.loading import load_data
    from hybriddl.usecases import RGB_MEAN, RGB_STD

    case, numerics, target = get_usecase(usecase), NUMERICS[variant], torch.device(device)
    split = load_data("synthetic", variant=case.dataset, image_size=image_size)
    loader = DataLoader(TensorDataset(split.train.images, split.train.labels),
                        batch_size=batch_size, shuffle=True, drop_last=True,
                        num_workers=workers, pin_memory=target.type == "cuda",
                        persistent_workers=workers > 0)
    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, num_classes=len(split.classes)).to(target)
    prepare_model(model, numerics)
    state = {"model": model,
             "optimizer": make_optimizer(model.parameters(), case.lr, case.momentum)}
    mean = torch.tensor(RGB_MEAN, device=target).view(1, 3, 1, 1)
    std = torch.tensor(RGB_STD, device=target).view(1, 3, 1, 1)
    epochs, done = [], 0
    while done < steps:
        synchronize(target)
        started, samples, ran = time.perf_counter(), 0, 0
        for images, labels in loader:
            images = images.to(target, non_blocking=True)
            labels = labels.to(target, non_blocking=True)
            images = torch.nn.functional.interpolate(images.float(), size=(image_size,) * 2,
                                                     mode="bilinear", antialias=True)
            flips = torch.rand(len(images), device=target) < 0.5
            images = torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images)
            plain_step(state, (images.div_(255.0) - mean) / std, labels, numerics)
            samples, ran, done = samples + len(labels), ran + 1, done + 1
            if done == steps:
                break
        synchronize(target)
        epochs.append({"steps": ran, "samples": samples,
                       "seconds": time.perf_counter() - started})
    return {"steps": done, "epochs": len(epochs), "workers": workers,
            "images_per_second": sum(e["samples"] for e in epochs) / sum(
                e["seconds"] for e in epochs),
            "steady_images_per_second": steady_rate(epochs), "epoch_records": epochs}


def loader_rounds(case, model_name: str, image_size: int, batch_size: int, variant: str,
                  args) -> dict:
    """`hybriddl train` and the loader peer on the same images and steps, alternating for
    --loader-rounds rounds (train, peer, train, peer, ...): each round's ratio of steady
    images/s (hybriddl's over the peer's), the median and spread over rounds."""
    rounds = []
    for number in range(args.loader_rounds):
        ours = train_data_wait(case.name, image_size, batch_size, variant, args.train_steps,
                               args.device)
        peer = loader_peer(case.name, model_name, image_size, batch_size, variant,
                           args.train_steps, args.device, args.loader_workers)
        rounds.append({"hybriddl": ours, "pytorch_loader": peer,
                       "ratio": ours["steady_images_per_second"] /
                       peer["steady_images_per_second"]})
        print(f"loader round {number + 1}: hybriddl {ours['steady_images_per_second']:.0f} "
              f"img/s, pytorch with a DataLoader {peer['steady_images_per_second']:.0f} img/s",
              file=sys.stderr)
    ratios = [r["ratio"] for r in rounds]
    return {"variant": variant, "steps": args.train_steps, "workers": args.loader_workers,
            "rounds": rounds, "ratio": statistics.median(ratios), "spread": spread(ratios)}


# ---------------------------------------------------------------- its page in docs/benchmarks

def bench_gpu_table(data: dict) -> str:
    lines = ["| strategy | numerics | dropout | ms/step (median) | spread | vs fastest PyTorch |",
             "|---|---|---:|---:|---|---:|"]
    for r in data["rows"]:
        if "failed" in r:
            lines.append(f"| {r['strategy']} | {r['variant']} | {r['dropout']:g} | "
                         f"{r['failed']} | — | — |")
            continue
        vs = "—" if r.get("vs_fastest_peer") is None else f"{r['vs_fastest_peer']:.2f}×"
        if r.get("vs_fastest_graph_peer") is not None:
            vs += f" ({r['vs_fastest_graph_peer']:.2f}× the fastest pytorch-graph)"
        lines.append(f"| {r['strategy']} | {r['variant']} | {r['dropout']:g} | "
                     f"{r['seconds_per_step'] * 1e3:.2f} | {r['spread']['min'] * 1e3:.2f}–"
                     f"{r['spread']['max'] * 1e3:.2f} | {vs} |")
    for r in data["rows"]:
        if r.get("stages"):
            st = r["stages"]
            lines += ["", f"Pipeline ({r['variant']}), one step: stage 1 busy "
                          f"{st['stage1_busy_ms']:.1f} ms, stage 2 busy {st['stage2_busy_ms']:.1f} ms, "
                          f"both at once {st['both_busy_ms']:.1f} ms, step {st['step_ms']:.1f} ms. "
                          "The two-GPU pipeline's speedup is not measured (one GPU)."]
    if data.get("train"):
        t = data["train"]
        # Files of 2026-11-26 recorded `-m hybriddl train ...`; later ones `hybriddl train ...`.
        command = "hybriddl " + t["command"].removeprefix("-m ").removeprefix("hybriddl ")
        lines += ["", f"`{command}`: {t['images_per_second']:.0f} img/s over "
                      f"{t['steps']} steps, data wait {t['data_wait_share']:.1%} of the time."]
    peer = data.get("loader_peer")
    if peer and "failed" not in peer:
        ours = [r["hybriddl"]["steady_images_per_second"] for r in peer["rounds"]]
        theirs = [r["pytorch_loader"]["steady_images_per_second"] for r in peer["rounds"]]
        lines += ["", f"Real training, the same images and {peer['steps']} steps, "
                      f"{len(peer['rounds'])} alternating rounds, images/s after the first "
                      f"epoch: `hybriddl train` ({peer['variant']}) {statistics.median(ours):.0f}"
                      f", plain PyTorch with a DataLoader ({peer['workers']} workers, pinned "
                      f"memory, non_blocking) {statistics.median(theirs):.0f}: "
                      f"**{peer['ratio']:.2f}×** (rounds {peer['spread']['min']:.2f}–"
                      f"{peer['spread']['max']:.2f})."]
    elif peer:
        lines += ["", f"Real training against PyTorch with a DataLoader: failed "
                      f"({peer['failed']})."]
    return "\n".join(lines)


def bench_gpu_setting(data: dict) -> str:
    return (f"{data['model']} at {data['image_size']} px, batch {data['batch_size']}, "
            f"{data['rounds']} interleaved rounds of {data['warmup_steps']} warm-up and "
            f"{data['timed_steps']} timed steps (one device synchronisation per visit)")


BENCH_GPU_NOTES = """How to read it: every row trains the same batch, already on the GPU, in interleaved
rounds; *vs fastest PyTorch* is the fastest plain PyTorch row's step over the row's, within
each round. The pytorch rows are torchvision's model with nn.Dropout; the gpu rows are
hybriddl's whole optimizer step with keyed dropout (dropout 0.5) or none (0). The -graph
rows (files from 2026-11-29 on) replay the whole step captured in a CUDA graph, against the
eager peers and, in brackets, against the fastest graphed peer: not what `hybriddl train`
runs."""


PAGES = [
    Page("bench_gpu-SimpleBig", "One GPU: hybriddl's step against plain PyTorch, AlexNet",
         "results/bench_gpu-SimpleBig.json", bench_gpu_table, bench_gpu_setting,
         BENCH_GPU_NOTES),
    Page("bench_gpu-ComplexSmall", "One GPU: hybriddl's step against plain PyTorch, VGG16",
         "results/bench_gpu-ComplexSmall.json", bench_gpu_table, bench_gpu_setting,
         BENCH_GPU_NOTES),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here: run it on a GPU host (nothing written: no GPU "
              "figure without a GPU)", file=sys.stderr)
        return 2
    try:
        case = get_usecase(args.usecase)
        model_name, image_size, batch_size = use_case_workload(case.name, None, args.image_size,
                                                               args.batch_size)
    except UsageError as exc:
        print(f"bench_gpu: {exc}", file=sys.stderr)
        return 2
    return measure_and_write(args, device, torch.cuda.get_device_name(device), case,
                             model_name, image_size, batch_size, argv)


def measure_and_write(args, device: torch.device, gpu_name: str, case, model_name: str,
                      image_size: int, batch_size: int, argv=None) -> int:
    """The rows measured and written, then the training run's data wait added (main's
    work once it has a device: tests run it on the CPU)."""
    classes = 3
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    y = torch.randint(classes, (batch_size,), generator=generator)
    rows = [hybriddl_row(model_name, classes, x, y, device, v, None, args) for v in NUMERICS]
    rows += [hybriddl_row(model_name, classes, x, y, device, v, 0.0, args) for v in NUMERICS]
    rows += [pytorch_row(model_name, classes, x, y, device, v, args) for v in NUMERICS]
    rows.append(pipeline_row(model_name, classes, x, y, device, args))
    if args.graph:
        rows += [graph_row(model_name, classes, x, y, device, v, keyed, args)
                 for v in GRAPH_NUMERICS if v in NUMERICS for keyed in (True, False)]
    if args.compile_peer:
        rows.append(compiled_peer(rows, model_name, classes, x, y, device, args))
    measure(rows, args.rounds, lambda n, row, s: print(
        f"round {n + 1}: {row.strategy} {row.variant} dropout {row.dropout}: {s * 1e3:.2f} ms",
        file=sys.stderr))
    for row in rows:
        row.close()
    summary = summarise(rows)
    hybriddl_rows = [r for r in summary if r["strategy"] == "gpu" and r["dropout"] != 0.0]
    fastest = min(hybriddl_rows, key=lambda r: r["seconds_per_step"])
    graphs = [r for r in summary if r["strategy"] == "gpu-graph" and "failed" not in r]
    graph = min(graphs, key=lambda r: r["seconds_per_step"]) if graphs else None
    result = {**results_header("bench_gpu.py", argv), "gpu_name": gpu_name,
              "usecase": case.name, "model": model_name, "image_size": image_size,
              "batch_size": batch_size, "rounds": args.rounds, "warmup_steps": args.warmup,
              "timed_steps": args.steps, "rows": summary,
              "fastest_hybriddl": {"variant": fastest["variant"],
                                   "vs_fastest_peer": fastest["vs_fastest_peer"]},
              # The step in a CUDA graph, keyed dropout: not what training runs (yet).
              "graph_route": graph and {k: graph[k] for k in (
                  "variant", "vs_fastest_peer", "vs_fastest_graph_peer")}}
    output = Path(args.output or REPO / "results" / f"bench_gpu-{case.name}.json")
    # The rows first: a training run that fails must not take them with it.
    atomic_write_json(output, result)
    print(f"bench_gpu: {output} written; fastest hybriddl row {fastest['variant']}: "
          f"{fastest['vs_fastest_peer']:.2f}x the fastest PyTorch peer")
    # Then the training run's data wait, then the rounds against a real loader: each kept
    # as it ends, a failure one line that keeps what came before.
    variant = fastest["variant"]
    stages = [("train", "the data-wait run", "the rows", args.train_steps,
               lambda: train_data_wait(case.name, image_size, batch_size, variant,
                                       args.train_steps, args.device)),
              ("loader_peer", "the loader rounds", "the rows and the data wait",
               args.train_steps and args.loader_rounds,
               lambda: loader_rounds(case, model_name, image_size, batch_size, variant, args))]
    for key, what, kept, wanted, stage in stages:
        if not wanted:
            return 0
        try:
            result[key] = stage()
        except RuntimeError as exc:
            result[key] = {"failed": str(exc)}
        atomic_write_json(output, result)
        if "failed" in result[key]:
            print(f"bench_gpu: {what} failed ({result[key]['failed']}); {kept} are kept "
                  f"in {output}", file=sys.stderr)
            return 1
        print(f"bench_gpu: {output} written again with {what}")
    print(f"bench_gpu: hybriddl train at {result['loader_peer']['ratio']:.2f}x PyTorch with a "
          "DataLoader (steady images/s)")
    return 0

if __name__ == "__main__":
    sys.exit(main())

"""Cost of keyed dropout per optimizer step against torch's nn.Dropout.

Sequential strategy (one core), AlexNet at 64 px, batch 64, the models' default
dropout (0.5). Two figures, both from interleaved rounds (median and spread):

- whole step: a step with keyed dropout against a step with nn.Dropout. Honest, but
  this machine's ±15-20 % noise per step hides a 1-2 % difference;
- isolated: the model's dropout layers alone (forward and backward, on the very inputs
  they get in a step), keyed against nn.Dropout, as a share of the plain step's time.
  The rest of the step is identical code, so this is the cost the keyed masks add.

With `--compiled`, a third isolated row: the keyed layers through the torch.compile'd
kernels that CUDA devices run (hybriddl.dropout.COMPILED_DEVICES), here compiled for the
CPU (compiling is not timed): what fusing the mask's ops does to its cost on this CPU.

Usage: python scripts/bench_dropout.py [--rounds 7] [--compiled] [--output results/dropout_cost.json]
"""

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from bench_common import results_header, spread
from hybriddl import dropout
from hybriddl.dropout import KeyedDropout, dropout_keys, sample_keys
from hybriddl.strategies.base import plain_step
from hybriddl.usecases import build_model

STEPS, BATCH, SIZE, LAYER_REPEATS = 3, 64, 64, 20


def plain_dropout(model: nn.Module) -> nn.Module:
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Dropout):
                setattr(parent, name, nn.Dropout(child.p))
    return model


def step_seconds(model, x, y, keyed: bool) -> float:
    started = time.perf_counter()
    for step in range(STEPS):
        model.zero_grad(set_to_none=False)
        keys = sample_keys(0, 0, torch.arange(step * BATCH, (step + 1) * BATCH)) if keyed else None
        with dropout_keys(keys):
            plain_step(model, x, y)
    return (time.perf_counter() - started) / STEPS


def dropout_inputs(model, x) -> list[tuple[nn.Module, torch.Size]]:
    """Each dropout layer of the model with the shape of the input a step gives it."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0].shape)))
             for m in model.modules() if isinstance(m, nn.Dropout)]
    with torch.no_grad(), dropout_keys(sample_keys(0, 0, torch.arange(len(x)))):
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


def layers_seconds(layers, keyed: bool) -> float:
    """Forward and backward of every dropout layer once, as in one step (mean of repeats)."""
    inputs = [torch.randn(shape, requires_grad=True) for _, shape in layers]
    keys = sample_keys(0, 0, torch.arange(BATCH)) if keyed else None
    started = time.perf_counter()
    for _ in range(LAYER_REPEATS):
        with dropout_keys(keys):
            for (layer, _), x in zip(layers, inputs):
                layer(x).sum().backward()
    return (time.perf_counter() - started) / LAYER_REPEATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compiled", action="store_true",
                        help="also time the compiled kernels CUDA devices run, on this CPU")
    parser.add_argument("--output", type=Path, default=Path("results/dropout_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    keyed = build_model("alexnet", 3).train()
    plain = plain_dropout(build_model("alexnet", 3)).train()
    x, y = torch.randn(BATCH, 3, SIZE, SIZE), torch.randint(3, (BATCH,))
    keyed_layers = dropout_inputs(keyed, x)
    plain_layers = [(nn.Dropout(m.p).train(), shape) for m, shape in keyed_layers]
    assert all(isinstance(m, KeyedDropout) for m, _ in keyed_layers), "the model lost its keyed dropout"
    step_seconds(keyed, x, y, True), step_seconds(plain, x, y, False)  # warm-up
    times = {"keyed": [], "plain": [], "keyed_layers": [], "plain_layers": []}
    step_percent, isolated_percent, compiled_percent = [], [], []
    if args.compiled:
        times["keyed_compiled_layers"] = []
        compiled_devices = dropout.COMPILED_DEVICES | {"cpu"}
        with _compiled_on(compiled_devices):
            layers_seconds(keyed_layers, True)  # compiles, untimed
    for _ in range(args.rounds):
        times["plain"].append(step_seconds(plain, x, y, False))
        times["keyed"].append(step_seconds(keyed, x, y, True))
        times["plain_layers"].append(layers_seconds(plain_layers, False))
        times["keyed_layers"].append(layers_seconds(keyed_layers, True))
        step_percent.append(100 * (times["keyed"][-1] / times["plain"][-1] - 1))
        isolated_percent.append(
            100 * (times["keyed_layers"][-1] - times["plain_layers"][-1]) / times["plain"][-1])
        if args.compiled:
            with _compiled_on(compiled_devices):
                times["keyed_compiled_layers"].append(layers_seconds(keyed_layers, True))
            compiled_percent.append(100 * (times["keyed_compiled_layers"][-1]
                                           - times["plain_layers"][-1]) / times["plain"][-1])
    result = {**results_header("bench_dropout.py"),
              "what": "keyed dropout vs nn.Dropout, cost per optimizer step", "model": "alexnet",
              "image_size": SIZE, "batch": BATCH, "threads": 1, "rounds": args.rounds,
              "steps_per_round": STEPS, "dropout_inputs": [list(s) for _, s in keyed_layers],
              "seconds": times,
              "whole_step_overhead_percent": spread(step_percent, digits=2),
              "isolated_overhead_percent_of_step": spread(isolated_percent, digits=2)}
    if args.compiled:
        if not dropout.compiled_kernels().compiled:
            raise SystemExit(f"bench_dropout: torch.compile failed here "
                             f"({dropout.compiled_kernels().fallback}): no compiled row")
        result["compiled_isolated_overhead_percent_of_step"] = spread(compiled_percent, digits=2)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.endswith("percent")
                      or k.endswith("percent_of_step")}))


@contextlib.contextmanager
def _compiled_on(devices):
    """Keyed dropout runs its compiled kernels on these device types meanwhile."""
    saved, dropout.COMPILED_DEVICES = dropout.COMPILED_DEVICES, devices
    try:
        yield
    finally:
        dropout.COMPILED_DEVICES = saved


if __name__ == "__main__":
    main()

"""Cost of keyed dropout per optimizer step against torch's nn.Dropout.

Sequential strategy (one core), AlexNet at 64 px, batch 64, the models' default
dropout (0.5). Rounds alternate the two models so drift hits both alike; the figure is
the median ratio of step times with its spread. Writes results/dropout_cost.json.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hybriddl.dropout import dropout_keys, sample_keys
from hybriddl.strategies.base import plain_step
from hybriddl.usecases import build_model

ROUNDS, STEPS, BATCH, SIZE = int(sys.argv[1]) if len(sys.argv) > 1 else 7, 3, 64, 64


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


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    keyed = build_model("alexnet", 3).train()
    plain = plain_dropout(build_model("alexnet", 3)).train()
    x, y = torch.randn(BATCH, 3, SIZE, SIZE), torch.randint(3, (BATCH,))
    step_seconds(keyed, x, y, True), step_seconds(plain, x, y, False)  # warm-up
    ratios, times = [], {"keyed": [], "plain": []}
    for _ in range(ROUNDS):
        times["plain"].append(step_seconds(plain, x, y, False))
        times["keyed"].append(step_seconds(keyed, x, y, True))
        ratios.append(times["keyed"][-1] / times["plain"][-1])
    result = {"what": "keyed dropout vs nn.Dropout, seconds per step", "model": "alexnet",
              "image_size": SIZE, "batch": BATCH, "threads": 1, "rounds": ROUNDS,
              "steps_per_round": STEPS, "seconds": times,
              "median_overhead_percent": round(100 * (statistics.median(ratios) - 1), 2),
              "min_overhead_percent": round(100 * (min(ratios) - 1), 2),
              "max_overhead_percent": round(100 * (max(ratios) - 1), 2)}
    Path("results").mkdir(exist_ok=True)
    Path("results/dropout_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}))


if __name__ == "__main__":
    main()

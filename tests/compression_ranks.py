"""Two ranks averaging with PowerSGD, as tests/test_compression.py starts them:

    mpirun -np 2 python tests/compression_ranks.py OUT.json [--overlap] [--rounds 2]

Each rank computes the gradient of its uneven part (5 and 3 of 8 samples) of a small
convolution + linear model, averages it through `hosts.averaging` with powersgd:2, and takes
an SGD step; rank 0 also trains the same steps alone on the whole batches (SingleHost). Rank 0
writes the digests of both ranks' parameters, the allreduces each step made, the bytes each
step handed to MPI with what the compression says it sends, and the largest difference from
the one-host run. With --overlap the classifier's factors leave during backward, in an
allreduce of their own. With --rounds 2 (powersgd:2:rounds=2) each step is two allreduces,
P with the biases then Q, whatever --overlap says. Rank 0 also records how long each step's
end of averaging took (HYBRIDDL_COMPRESSION_SECONDS, as emulate sets it, pads it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from hybriddl.hosts.cluster import SingleHost, connect
from hybriddl.hosts.powersgd import PowerSGD

STEPS, BATCH, SHARES, LR = 4, 8, (5, 3), 0.1


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    batches = [(torch.randn(BATCH, 3, 8, 8), torch.randint(0, 5, (BATCH,))) for _ in range(STEPS)]
    return model, batches


def train(hosts, model, batches, rows, hooks: bool = False) -> None:
    hosts.attach(model, gradient_hooks=hooks)
    for x, y in batches:
        model.zero_grad(set_to_none=False)
        part = slice(*rows)
        share = SimpleNamespace(samples=rows[1] - rows[0], global_samples=len(y))
        with hosts.averaging(share) as average:
            F.cross_entropy(model(x[part]), y[part]).backward()
            average(share.samples)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad


def main(out: str, overlap: bool = False, rounds: int = 1) -> None:
    model, batches = model_and_data()
    alone = copy.deepcopy(model)
    hosts = connect(compression=PowerSGD(2, rounds=rounds), overlap=overlap)
    calls, sent, made, seconds = [], [], [], []
    # The whole-gradient scheme's exchanges: every host's wire summed in logical-rank order.
    start_sum, average = hosts.start_logical_sum, hosts._average
    sent_before = [hosts.traffic.bytes_sent]

    def counted(wire):
        made.append(wire.nbytes)
        return start_sum(wire)

    def counting(share):
        # From the end of the last step: a first phase sent during backward counts too.
        started = time.perf_counter()
        average(share)
        seconds.append(time.perf_counter() - started)
        calls.append(len(made))
        sent.append(hosts.traffic.bytes_sent - sent_before[0])
        sent_before[0] = hosts.traffic.bytes_sent
        made.clear()

    def attach(*args, **options):
        attached(*args, **options)
        sent_before[0] = hosts.traffic.bytes_sent  # the set-up's own exchanges not counted

    attached = hosts.attach
    hosts.start_logical_sum, hosts._average, hosts.attach = counted, counting, attach
    start = sum(SHARES[:hosts.rank])
    train(hosts, model, batches, (start, start + SHARES[hosts.rank]), hooks=overlap)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    digests = hosts.allgather(digest)
    if hosts.rank == 0:
        train(SingleHost(compression=PowerSGD(2, rounds=rounds)), alone, batches, (0, BATCH))
        difference = max(float((a - b).abs().max())
                         for a, b in zip(model.parameters(), alone.parameters()))
        # Q (in x 2) one step, P (out x 2) the next, with the biases dense.
        # Two rounds: P with the biases, then Q, every step.
        q_step, p_step = 2 * (27 + 288) + 8 + 5, 2 * (8 + 5) + 8 + 5
        if rounds == 2:
            q_step = p_step = 2 * (27 + 288) + 2 * (8 + 5) + 8 + 5
        result = {"steps": STEPS, "digests": digests, "allreduces_per_step": calls,
                  "sent_in_backward": hosts.traffic.buckets_sent_in_backward,
                  "bytes_per_step": sent,
                  "wire_bytes_by_step": [4 * (q_step if s % 2 == 0 else p_step)
                                         for s in range(STEPS)],
                  "max_difference_from_one_host": difference,
                  # Rank 0's end of each step's averaging (emulate --compression-seconds pads it).
                  "averaging_seconds": seconds}
        with open(out, "w") as handle:
            json.dump(result, handle)
    hosts.close()


if __name__ == "__main__":
    main(sys.argv[1], overlap="--overlap" in sys.argv[2:],
         rounds=2 if "--rounds" in sys.argv[2:] else 1)

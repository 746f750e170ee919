"""What crosses the wire (hosts/compression.py, hosts/powersgd.py): every scheme says what it
sends; PowerSGD approximates each gradient matrix with rank-R factors in one allreduce per
step, keeps what it leaves out (error feedback), trains on H hosts what it trains on one,
and resumes from a checkpoint as if never stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import REPO, hybriddl_env
from sample_data import write_tinted_classes
from hybriddl.cli import main
from hybriddl.emulation.hosts import COMPRESSION_SECONDS_VARIABLE
from hybriddl.errors import UsageError
from hybriddl.hosts.compression import (AUTO, REGISTRY, Compression, HalfWire, parse_compression,
                                        register)
from hybriddl.hosts.powersgd import PowerSGD
from hybriddl.rundir import METRICS, MODEL

MPIRUN = Path(sys.executable).parent / "mpirun"
LOOPBACK = ["--oversubscribe", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]


def alone(tensor: torch.Tensor) -> torch.Tensor:
    """One host's allreduce: the sum over one host."""
    return tensor


def decaying_matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A matrix whose singular values halve one after the other, as gradients' fall fast."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator))
    k = min(rows, cols)
    return u[:, :k] @ torch.diag(0.5 ** torch.arange(k, dtype=torch.float32)) @ v[:, :k].T


def small_gradients(seed: int = 0) -> list[torch.Tensor]:
    """A convolution's, a bias's, a linear layer's and a small matrix's gradients."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, 3, 3, generator=generator), torch.randn(16, generator=generator),
            torch.randn(10, 40, generator=generator), torch.randn(3, 2, generator=generator)]


# --------------------------------------------------------------------------- what is sent

def test_every_scheme_says_what_it_sends_for_the_planner():
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(64, 10))
    parameters = sum(p.numel() for p in model.parameters())
    assert Compression.none.wire_bytes(model) == 4 * parameters
    assert Compression.fp16.wire_bytes(model) == 2 * parameters
    powersgd = parse_compression("powersgd:2")
    # Conv 16 x 27 and linear 10 x 64 as factors (the mean of P's and Q's steps), biases dense.
    assert powersgd.wire_bytes(model) == 4 * (2 * (16 + 27) // 2 + 2 * (10 + 64) // 2 + 16 + 10)
    assert powersgd.wire_bytes([p.shape for p in model.parameters()]) == powersgd.wire_bytes(model)
    assert [(c.name, c.exact, c.allreduces_per_step) for c in
            (Compression.none, Compression.fp16, powersgd)] == [
        ("none", True, 1), ("fp16", False, 1), ("powersgd:2", False, 1)]
    assert parse_compression("auto") == AUTO


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_rank_r_approximation_errs_less_as_r_grows(rounds):
    """The same gradient step after step (warm start): the approximations of a higher rank
    stay closer to it, error feedback included."""
    gradient = decaying_matrix(32, 48)
    errors = []
    for rank in (1, 2, 4, 8):
        compression = PowerSGD(rank, rounds=rounds)
        steps = [compression.aggregate([gradient], alone)[0] for _ in range(12)]
        errors.append(sum(float((a - gradient).norm() / gradient.norm()) for a in steps[2:]))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.25 * errors[0], errors


def test_two_rounds_approximate_the_gradient_of_this_step_one_round_last_steps():
    """Two rounds (Vogels et al.'s Algorithm 1) take the subspace from this step's M; one
    round projects it on last step's factor. On gradients that change every step (as SGD's
    do) the approximation of two rounds holds far more of each step's gradient."""
    held = {}
    for rounds in (1, 2):
        compression = PowerSGD(2, rounds=rounds)
        shares = []
        for step in range(30):
            gradient = decaying_matrix(64, 48, seed=step)
            approximation = compression.aggregate([gradient], alone)[0]
            shares.append(float((approximation * gradient).sum() / gradient.norm() ** 2))
        held[rounds] = sum(shares[10:]) / 20
    assert held[2] > 2 * held[1] and held[2] > 0.15, held


@pytest.mark.parametrize("rounds", [1, 2])
def test_error_feedback_keeps_the_sum_of_updates_on_the_sum_of_gradients(rounds):
    """What is applied lags the true gradients by exactly the error buffer, which stays
    bounded: nothing is lost, only delayed."""
    compression = PowerSGD(1, rounds=rounds)
    generator = torch.Generator().manual_seed(1)
    base = [decaying_matrix(16, 72).reshape(16, 8, 3, 3), torch.ones(16),
            decaying_matrix(10, 40, seed=2)]
    applied = [torch.zeros_like(g) for g in base]
    true = [torch.zeros_like(g) for g in base]
    lags = []
    for _ in range(100):
        noisy = [g + 0.1 * torch.randn(g.shape, generator=generator) for g in base]
        for total, update in zip(applied, compression.aggregate(noisy, alone)):
            total += update
        for total, g in zip(true, noisy):
            total += g
        lags.append(sum(float((a - t).norm()) for a, t in zip(applied, true)))
    errors = compression.checkpoint_state()["error"]  # one per shape: the conv's, the linear's
    assert float((applied[0] - true[0]).reshape(16, 72).add(errors[0][0]).abs().max()) < 1e-3
    assert float((applied[2] - true[2]).add(errors[1][0]).abs().max()) < 1e-3
    assert torch.allclose(applied[1], true[1])  # the bias travels dense
    assert max(lags[50:]) < 1.5 * max(lags[:50])
    assert lags[-1] / sum(float(t.norm()) for t in true) < 0.1


def allreduces_of(compression, gradients, steps: int) -> list[int]:
    """The size of every allreduce `steps` steps of `compression` hand over (one host)."""
    calls = []

    def allreduce(tensor):
        calls.append(tensor.numel())
        return tensor.clone()

    for _ in range(steps):
        compression.aggregate(gradients, allreduce)
    return calls


def test_one_allreduce_per_step_carries_factors_and_dense_tensors():
    compression = PowerSGD(2)
    gradients = small_gradients()
    calls = allreduces_of(compression, gradients, 4)
    # Q (in x R) then P (out x R) of the two matrices, with the bias and the small matrix.
    dense = 16 + 3 * 2
    q_step, p_step = 2 * (72 + 40) + dense, 2 * (16 + 10) + dense
    assert calls == [q_step, p_step, q_step, p_step]
    assert compression.wire_bytes([g.shape for g in gradients]) == 4 * (q_step + p_step) // 2


def test_two_rounds_send_p_with_the_dense_tensors_then_q():
    compression = parse_compression("powersgd:2:rounds=2")
    assert (compression.rounds, compression.allreduces_per_step, compression.in_phases) == (
        2, 2, False)
    gradients = small_gradients()
    calls = allreduces_of(compression, gradients, 2)
    dense = 16 + 3 * 2
    p_round, q_round = 2 * (16 + 10) + dense, 2 * (72 + 40)
    assert calls == [p_round, q_round, p_round, q_round]
    assert compression.wire_bytes([g.shape for g in gradients]) == 4 * (p_round + q_round)
    assert compression.early_wire_bytes([g.shape for g in gradients]) == 0


def test_a_rank_at_or_above_a_layers_size_sends_it_dense_said_once():
    gradients = [torch.randn(4, 3), torch.randn(4), torch.randn(64, 64), torch.randn(6, 5, 1, 1)]
    compression = PowerSGD(3)
    notes = compression.setup([g.shape for g in gradients], ["small", "bias", "big", "conv"])
    # 4 x 3: rank 3 is its size; 6 x 5: rank-3 factors (33 floats) are no smaller than 30.
    assert notes == ["--compression powersgd:3 sends 2 gradient matrices dense, which rank 3 "
                     "factors would not make smaller: small 4x3, conv 6x5"]
    out = compression.aggregate(gradients, alone)
    for i in (0, 1, 3):
        assert torch.equal(out[i], gradients[i])
    assert not torch.equal(out[2], gradients[2])
    assert PowerSGD(2).setup([(64, 64), (64,)]) == []


def test_min_rate_sends_dense_what_factors_shrink_less_and_names_itself():
    """A classifier's last layer (here 64 x 10: 148 floats of rank-2 factors, 4.3x smaller)
    goes dense at min_rate=5 and travels exactly; a larger matrix (64 x 64, 16x) stays
    compressed; the rate is in the scheme's name, so a checkpoint of another rate is refused."""
    compression = parse_compression("powersgd:2:rounds=2:min_rate=5")
    assert (compression.name, compression.min_rate) == ("powersgd:2:rounds=2:min_rate=5", 5)
    shapes = [(64, 64), (10, 64), (10,)]
    assert [compression.compresses(s) for s in shapes] == [True, False, False]
    assert [PowerSGD(2, rounds=2).compresses(s) for s in shapes] == [True, True, False]
    notes = compression.setup(shapes, ["hidden", "last", "bias"])
    assert notes == ["--compression powersgd:2:rounds=2:min_rate=5 sends 1 gradient matrix "
                     "dense, which rank 2 factors would not make at least 5 times smaller: "
                     "last 10x64"]
    gradients = [torch.randn(s) for s in shapes]
    out = compression.aggregate(gradients, alone)
    assert torch.equal(out[1], gradients[1]) and not torch.equal(out[0], gradients[0])
    assert compression.wire_bytes(shapes) == 4 * (2 * (64 + 64) + 640 + 10)
    with pytest.raises(ValueError, match="not powersgd:2:rounds=2:min_rate=5"):
        compression.load_checkpoint_state(PowerSGD(2, rounds=2).checkpoint_state())
    with pytest.raises(UsageError, match="min_rate=0: give the least compression rate"):
        parse_compression("powersgd:2:min_rate=0")


def test_approximations_written_into_the_gradients_are_those_returned():
    """What the hosts do (out=gradients: no buffer the size of the model) changes no bit."""
    returned, written = PowerSGD(2), PowerSGD(2)
    for step in range(3):
        gradients = small_gradients(seed=step)
        want = returned.aggregate(gradients, alone)
        inplace = [g.clone() for g in gradients]
        got = written.aggregate(inplace, alone, out=inplace)
        assert all(a is b for a, b in zip(got, inplace))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("sends_q", [True, False])
def test_a_cpus_row_chunks_compute_the_whole_matrix_products(monkeypatch, sends_q):
    """On a CPU each matrix is worked through in row chunks (hosts/powersgd.py local_factor):
    the factor and the error left are the whole-matrix formulas' to float rounding, however
    the rows fall into chunks (here 7 chunks of 3 rows and one of 1)."""
    import hybriddl.hosts.powersgd as powersgd

    monkeypatch.setattr(powersgd, "CHUNK_ELEMENTS", 3 * 40)
    generator = torch.Generator().manual_seed(3)
    error, gradient = torch.randn(22, 40, generator=generator), torch.randn(22, 40, generator=generator)
    factor = powersgd.orthogonal(torch.randn(1, 40 if not sends_q else 22, 2,
                                             generator=generator))[0]
    m = error + gradient
    left = error.clone()
    mine = powersgd.local_factor(left, gradient, factor, sends_q)
    want = m.T @ factor if sends_q else m @ factor
    assert torch.allclose(mine, want, atol=1e-5)
    expected_left = m - (factor @ want.T if sends_q else want @ factor.T)
    assert torch.allclose(left, expected_left, atol=1e-5)
    out = torch.empty(22, 40)
    p, q = (factor, want) if sends_q else (want, factor)
    powersgd.outer_products(p, q, out)
    assert torch.equal(out, p[:, :1] * q[:, 0] + p[:, 1:] * q[:, 1])  # elementwise, same bits


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_a_gpus_large_chunk_outer_products_are_a_cpus_row_chunks_bit_for_bit(monkeypatch, rank):
    """On a GPU P Q^T is R operations (one kernel each) per chunk of up to 2^24 elements, on
    a CPU the same operations per cache-sized row chunk: the same bits, so a GPU host and
    CPU hosts apply one update (here 8 chunks of 3 rows on the CPU)."""
    import hybriddl.hosts.powersgd as powersgd

    monkeypatch.setattr(powersgd, "CHUNK_ELEMENTS", 3 * 40)
    generator = torch.Generator().manual_seed(5)
    p, q = torch.randn(22, rank, generator=generator), torch.randn(40, rank, generator=generator)
    chunks, whole = torch.empty(22, 40), torch.empty(22, 40)
    powersgd.outer_products(p, q, chunks)
    launches, multiply = [], torch.mul

    def counted(*args, **kwargs):
        launches.append(1)
        return multiply(*args, **kwargs)

    monkeypatch.setattr(torch, "mul", counted)
    powersgd.outer_products(p, q, whole, in_chunks=False)
    assert len(launches) == rank  # one multiplication per outer product, not per chunk
    monkeypatch.setattr(powersgd, "DEVICE_CHUNK_ELEMENTS", 10 * 40)  # a GPU's chunks bounded
    bounded = torch.empty(22, 40)
    powersgd.outer_products(p, q, bounded, in_chunks=False)
    monkeypatch.undo()
    assert len(launches) == rank + (3 * rank if rank > 1 else 1)  # 10, 10 and 2 rows
    assert torch.equal(whole, chunks) and torch.equal(bounded, chunks)


@pytest.mark.parametrize("scheme", ["powersgd:2", "powersgd:2:start=2"])
def test_a_step_in_two_phases_applies_the_same_bits_as_one_allreduce(scheme):
    """--overlap's split (hosts/mpi.py): the gradients backward writes first (the trailing
    ones, half of what is sent) in an allreduce of their own, the others after; the
    approximations, the state and the steps before `start` are those of one allreduce."""
    whole, split = parse_compression(scheme), parse_compression(scheme)
    shapes = [g.shape for g in small_gradients()]
    whole.setup(shapes)
    split.setup(shapes)
    assert split.split_phases([2, 3]) == [2, 3] and split.phases == 2
    for step in range(5):
        gradients = small_gradients(seed=step)
        want = whole.aggregate(gradients, alone)
        split.begin_step(shapes)
        wires = [split.local_wire(gradients, phase) for phase in range(2)]
        got = split.finish_step(wires)
        if step < 2 and scheme.endswith("start=2"):  # exact: every gradient, dense
            assert sum(w.numel() for w in wires) == sum(g.numel() for g in want)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    assert all(torch.equal(a, b) for a, b in zip(split.checkpoint_state()["error"],
                                                   whole.checkpoint_state()["error"]))


def test_what_leaves_first_is_alexnets_classifier_about_half_the_factors():
    from hybriddl.usecases import build_model

    model = build_model("alexnet", 3)
    compression = PowerSGD(2)
    compression.setup([p.shape for p in model.parameters()])
    names = [name for name, _ in model.named_parameters()]
    early = compression.split_phases(compression.early_positions())
    assert [names[i] for i in early] == [n for n in names if n.startswith("classifier")]
    assert PowerSGD(2).setup([(64, 64)]) == [] and not PowerSGD(2).phases > 1


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_gpus_batched_products_apply_what_a_cpus_row_chunks_do(rounds):
    """The two ways hosts/powersgd.py computes a step (a CPU's row chunks, a GPU's batched
    products, run here on the CPU) train the same steps to float rounding."""
    chunks, batched = PowerSGD(2, rounds=rounds), PowerSGD(2, rounds=rounds)
    batched.cpu_chunks = False
    for step in range(6):
        gradients = small_gradients(seed=step) + [decaying_matrix(64, 96, seed=step)]
        for a, b in zip(chunks.aggregate(gradients, alone), batched.aggregate(gradients, alone)):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), step
    for a, b in zip(chunks.checkpoint_state()["error"], batched.checkpoint_state()["error"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- hosts

class Ring:
    """H hosts' allreduce inside one process: each host's thread waits for the others."""

    def __init__(self, hosts: int):
        self.barrier = threading.Barrier(hosts)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls = 0

    def of(self, host: int):
        def allreduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[host] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts[h] for h in sorted(self.parts))
            self.barrier.wait()
            if host == 0:
                self.calls += 1
            return total
        return allreduce


def run_hosts(compressions, contributions, steps, ring):
    """Each host's outputs per step; contributions[step][host] is its list of gradients."""
    outputs = [[None] * steps for _ in compressions]

    def host(h):
        for step in range(steps):
            outputs[h][step] = compressions[h].aggregate(contributions[step][h], ring.of(h))

    threads = [threading.Thread(target=host, args=(h,)) for h in range(len(compressions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outputs


@pytest.mark.parametrize("rounds", [1, 2])
def test_two_hosts_apply_what_one_host_applies_to_their_sum_the_same_bits_on_both(rounds):
    steps, shares = 6, (5, 3)  # uneven batches: host h contributes n_h/N g_h
    contributions = []
    for step in range(steps):
        per_host = [[g * (n / sum(shares)) for g in small_gradients(seed=10 * step + h)]
                    for h, n in enumerate(shares)]
        contributions.append(per_host)
    ring = Ring(2)
    two = run_hosts([PowerSGD(2, rounds=rounds), PowerSGD(2, rounds=rounds)], contributions,
                    steps, ring)
    one = PowerSGD(2, rounds=rounds)
    for step in range(steps):
        summed = [a + b for a, b in zip(*contributions[step])]
        for got, want, other in zip(two[0][step], one.aggregate(summed, alone), two[1][step]):
            assert torch.equal(got, other)  # every host applies the same update
            assert torch.allclose(got, want, atol=1e-5), step
    assert ring.calls == steps * rounds


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_restored_state_continues_as_if_never_stopped(rounds):
    gradients = [[g * (step + 1) for g in small_gradients(seed=step)] for step in range(6)]
    straight = PowerSGD(2, rounds=rounds)
    expected = [straight.aggregate(g, alone) for g in gradients]
    first = PowerSGD(2, rounds=rounds)
    for g in gradients[:3]:
        first.aggregate(g, alone)
    state = first.checkpoint_state()
    resumed = PowerSGD(2, rounds=rounds)
    resumed.load_checkpoint_state(state)
    for g, want in zip(gradients[3:], expected[3:]):
        for got, w in zip(resumed.aggregate(g, alone), want):
            assert torch.equal(got, w)
    with pytest.raises(ValueError, match=f"{straight.name}'s, not powersgd:4's"):
        PowerSGD(4).load_checkpoint_state(state)


def test_steps_before_start_are_the_exact_sum_then_powersgd_takes_over():
    """powersgd:2:start=3 (DDP's start_powerSGD_iter): three steps averaged dense, in one
    allreduce each, then the same compression as powersgd:2 from its first step."""
    late = parse_compression("powersgd:2:start=3")
    assert (late.name, late.start, late.rank) == ("powersgd:2:start=3", 3, 2)
    assert parse_compression("powersgd:2:start=0").name == "powersgd:2"
    contributions = [[small_gradients(seed=10 * s + h) for h in range(2)] for s in range(6)]
    ring = Ring(2)
    two = run_hosts([parse_compression("powersgd:2:start=3") for _ in range(2)],
                    contributions, 6, ring)
    assert ring.calls == 6
    for step in range(3):
        for got, a, b in zip(two[0][step], *contributions[step]):
            assert torch.equal(got, a + b)
    compressed = PowerSGD(2)  # no warm-up, given the same steps from step 3 on
    for step in range(3, 6):
        summed = [a + b for a, b in zip(*contributions[step])]
        want = compressed.aggregate(summed, alone)
        assert all(torch.allclose(got, w, atol=1e-5) for got, w in zip(two[0][step], want))
        assert not all(torch.equal(got, s) for got, s in zip(two[0][step], summed))
    # Resumed across the start: the step count carries it, the scheme's name must match.
    straight = parse_compression("powersgd:2:start=3")
    gradients = [[g * (step + 1) for g in small_gradients(seed=step)] for step in range(6)]
    expected = [straight.aggregate(g, alone) for g in gradients]
    first = parse_compression("powersgd:2:start=3")
    for g in gradients[:2]:
        first.aggregate(g, alone)
    resumed = parse_compression("powersgd:2:start=3")
    resumed.load_checkpoint_state(first.checkpoint_state())
    for g, want in zip(gradients[2:], expected[2:]):
        assert all(torch.equal(got, w) for got, w in zip(resumed.aggregate(g, alone), want))
    with pytest.raises(ValueError, match="powersgd:2:start=3's, not powersgd:2's"):
        PowerSGD(2).load_checkpoint_state(first.checkpoint_state())


def resumed_two_hosts(resume) -> None:
    """Two hosts run 3 steps, save each its state (no exchange), and `resume(states)` gives
    the states and holds_error the resumed hosts load; their next 3 steps must be the
    uninterrupted run's."""
    steps, cut = 6, 3
    contributions = [[small_gradients(seed=10 * s + h) for h in range(2)] for s in range(steps)]
    straight = run_hosts([PowerSGD(2), PowerSGD(2)], contributions, steps, Ring(2))
    first = [PowerSGD(2), PowerSGD(2)]
    run_hosts(first, contributions[:cut], cut, Ring(2))
    resumed = [PowerSGD(2), PowerSGD(2)]
    for host, (state, holds_error) in zip(resumed, resume([h.checkpoint_state() for h in first])):
        host.load_checkpoint_state(state, holds_error=holds_error)
    after = run_hosts(resumed, contributions[cut:], steps - cut, Ring(2))
    for step in range(steps - cut):
        for got, want in zip(after[0][step], straight[0][cut + step]):
            assert torch.allclose(got, want, atol=1e-6)


def logical_steps(hosts, contributions, rounds: int) -> list[list[list[torch.Tensor]]]:
    """`hosts`: (PowerSGD, the logical ranks it runs) in rank order; each step every host
    makes its logical ranks' wires in turn, they are summed in logical-rank order (as
    hosts/averaging.py gathers them), and each host's outputs per step are returned."""
    shapes = [g.shape for g in contributions[0][0]]
    outputs = [[] for _ in hosts]
    for gradients in contributions:
        for compression, ranks in hosts:
            compression.begin_step(shapes)

        def in_order(wires):
            total = wires[0].clone()
            for wire in wires[1:]:
                total.add_(wire)
            return total

        totals = [in_order([compression.local_wire(gradients[rank], 0, part)
                            for compression, ranks in hosts
                            for part, rank in enumerate(ranks)])]
        more = [compression.next_round(totals) for compression, _ in hosts]
        if more[0] is not None:
            totals.append(in_order([piece for wire, (_, ranks) in zip(more, hosts)
                                    for piece in wire.chunk(len(ranks))]))
        for h, (compression, _) in enumerate(hosts):
            outputs[h].append([o.clone() for o in compression.finish_step(totals)])
    return outputs


def with_parts(compression: PowerSGD, shapes, parts: int) -> PowerSGD:
    compression.setup(shapes)
    if parts > 1:
        compression.use_parts(parts)
    return compression


@pytest.mark.parametrize("rounds", [1, 2])
def test_logical_ranks_on_fewer_hosts_give_the_same_bits_as_their_own_hosts(rounds):
    """3 logical ranks on 3 hosts, on 2 (ranks 0-1 on one, each part its own errors) and on
    1: every step's approximation is the same, bit for bit; and 2 hosts resumed from the 3
    hosts' states, each logical rank's errors put back into its part, go on as the 3 did."""
    steps, cut, shapes = 6, 3, [g.shape for g in small_gradients()]
    contributions = [[[g / 3 for g in small_gradients(seed=10 * s + r)] for r in range(3)]
                     for s in range(steps)]
    three = [(with_parts(PowerSGD(2, rounds=rounds), shapes, 1), [r]) for r in range(3)]
    straight = logical_steps(three, contributions, rounds)
    for layout in ([[0, 1], [2]], [[0, 1, 2]]):
        fewer = [(with_parts(PowerSGD(2, rounds=rounds), shapes, len(ranks)), ranks)
                 for ranks in layout]
        got = logical_steps(fewer, contributions, rounds)
        for step in range(steps):
            for a, b in zip(got[0][step], straight[0][step]):
                assert torch.equal(a, b), (layout, step)
    first = [(with_parts(PowerSGD(2, rounds=rounds), shapes, 1), [r]) for r in range(3)]
    logical_steps(first, contributions[:cut], rounds)
    states = [compression.checkpoint_state() for compression, _ in first]
    resumed = [(with_parts(PowerSGD(2, rounds=rounds), shapes, 2), [0, 1]),
               (with_parts(PowerSGD(2, rounds=rounds), shapes, 1), [2])]
    for compression, ranks in resumed:
        compression.load_checkpoint_state(states[ranks[0]])
        for part, rank in enumerate(ranks[1:], start=1):
            compression.load_part_errors(part, states[rank]["error"])
    assert all(torch.equal(a, b) for a, b in zip(resumed[0][0].part_errors(1), states[1]["error"]))
    after = logical_steps(resumed, contributions[cut:], rounds)
    for step in range(steps - cut):
        for a, b in zip(after[1][step], straight[0][cut + step]):
            assert torch.equal(a, b), step


def test_two_hosts_resumed_from_their_own_errors_continue_as_uninterrupted():
    """A checkpoint keeps each host's errors apart: on the same host count each takes its
    own back."""
    resumed_two_hosts(lambda states: [(state, True) for state in states])


def test_two_hosts_resumed_from_their_summed_errors_continue_as_uninterrupted():
    """On another host count, host 0 holds every host's errors summed, the others none,
    and the updates go on the same (every step is linear in the errors)."""
    def summed(states):
        total = {**states[0], "error": [a + b for a, b in zip(states[0]["error"],
                                                              states[1]["error"])]}
        return [(total, True), (total, False)]

    resumed_two_hosts(summed)


def test_a_checkpoint_keeps_each_hosts_errors_in_a_file_of_its_own(tmp_path):
    """Rank 0's checkpoint keeps its errors and says where the others' are; host 1 writes
    its own file and keeps its newest three; on resume each host reads its own back, and
    on another host count rank 0 reads them all, summed."""
    from types import SimpleNamespace

    from hybriddl.run import resumption
    from hybriddl.run.checkpointer import Checkpointer
    from hybriddl.run.resumption import ERRORS_APART, compression_for_host, errors_file

    def state(value):
        return {"name": "powersgd:2", "step": 4, "shapes": [[3, 2]], "p": [torch.ones(1, 3, 2)],
                "q": [torch.ones(1, 2, 2)], "error": [torch.full((1, 3, 2), value)]}

    def saved_by(rank, steps):
        keeper = Checkpointer.__new__(Checkpointer)  # only what keep_errors_apart reads
        keeper.run_dir, keeper.hosts = tmp_path, SimpleNamespace(
            rank=rank, size=2, logical_count=2, logical_ranks=range(rank, rank + 1))
        keeper.position = resumption.Position(steps_done=steps)
        return keeper.keep_errors_apart(state(float(rank + 1)))

    for steps in (2, 4, 6, 8):
        on_rank_0 = saved_by(0, steps)
        kept = saved_by(1, steps)  # written to its own file, not exchanged
        assert ERRORS_APART not in kept and torch.equal(kept["error"][0], state(2.0)["error"][0])
    assert on_rank_0[ERRORS_APART] == {"hosts": 2, "steps_done": 8}
    assert torch.equal(on_rank_0["error"][0], torch.full((1, 3, 2), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [errors_file(1, s) for s in (4, 6, 8)]
    checkpoint = SimpleNamespace(compression=on_rank_0)
    for rank, holds, value in ((0, True, 1.0), (1, True, 2.0)):
        got, holds_error, line = compression_for_host(checkpoint, tmp_path, rank, 2)
        assert (holds_error, line) == (holds, None) and ERRORS_APART not in got
        assert torch.equal(got["error"][0], torch.full((1, 3, 2), value))
    got, holds_error, _ = compression_for_host(checkpoint, tmp_path, 0, 1)  # one host now
    assert holds_error and torch.equal(got["error"][0], torch.full((1, 3, 2), 3.0))
    assert compression_for_host(checkpoint, tmp_path, 1, 3)[1] is False
    (tmp_path / errors_file(1, 8)).unlink()
    got, holds_error, line = compression_for_host(checkpoint, tmp_path, 1, 2)
    assert holds_error is False and "errors of host 1 could not be read" in line


def test_a_resumed_hosts_error_files_past_its_checkpoint_do_not_push_out_its_own(tmp_path):
    """A host writes its errors before rank 0's checkpoint completes: after a crash, files
    past the checkpoint the run resumed from are left. They must not count among the newest
    kept, or the resumed checkpoint's own file goes while the next checkpoint is still being
    written, and a crash then resumes that host's errors from zero."""
    from types import SimpleNamespace

    from hybriddl.run import resumption
    from hybriddl.run.checkpointer import Checkpointer
    from hybriddl.run.resumption import errors_file

    for steps in (2, 4, 6, 8):  # the crashed attempt's; rank 0 completed step 4's only
        torch.save({"error": [], "steps_done": steps}, tmp_path / errors_file(1, steps))
    keeper = Checkpointer.__new__(Checkpointer)  # only what keep_errors_apart reads
    keeper.run_dir, keeper.hosts = tmp_path, SimpleNamespace(
        rank=1, size=2, logical_count=2, logical_ranks=range(1, 2))
    keeper.position = resumption.Position(steps_done=5)  # resumed at 4, --checkpoint-every 5
    keeper.keep_errors_apart({"name": "powersgd:2", "error": [torch.ones(1, 3, 2)]})
    assert sorted(p.name for p in tmp_path.iterdir()) == [errors_file(1, s) for s in (2, 4, 5)]


def test_the_room_a_run_needs_counts_its_hosts_errors(tmp_path, monkeypatch):
    """A PowerSGD run's errors (each compressed matrix, float32) are counted in the room
    checked at start (trainer.prepare: in rank 0's two checkpoints, in three files of its
    own on another host); none for an exact or a stateless scheme."""
    from collections import namedtuple

    from hybriddl.errors import UsageError
    from hybriddl.hosts.compression import held_state_bytes as held_bytes
    from hybriddl.rundir import check_run_storage

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    errors = 4 * sum(p.numel() for p in model.parameters() if p.dim() > 1)
    assert PowerSGD(2).held_bytes(model) == held_bytes("powersgd:2", model) == errors
    assert held_bytes("auto", model) == errors  # the most any planned scheme holds
    assert held_bytes("none", model) == held_bytes("fp16", model) == 0
    # resnet18's two checkpoints (model and momentum) fit; its errors beside them do not.
    Usage = namedtuple("Usage", "total used free")
    with torch.device("meta"):
        from hybriddl.usecases import build_model
        state = sum(t.numel() * t.element_size() for t in build_model("resnet18", 10)
                    .state_dict().values())
    monkeypatch.setattr("hybriddl.rundir.shutil.disk_usage",
                        lambda path: Usage(10 * state, 0, 4 * state + 1))
    check_run_storage(tmp_path / "run", "resnet18", 10, lambda m: held_bytes("none", m))
    with pytest.raises(UsageError, match="free some space"):
        check_run_storage(tmp_path / "run", "resnet18", 10,
                          lambda m: 3 * held_bytes("powersgd:2", m))


def test_a_checkpoint_names_the_scheme_that_ran_whatever_settled_it():
    """`--compression auto` settles per run: the checkpoint keeps the scheme that ran."""
    from types import SimpleNamespace

    from hybriddl.hosts.cluster import SingleHost

    model = nn.Linear(8, 6)
    ran = SingleHost(compression=PowerSGD(2))
    ran.attach(model)
    model.weight.grad, model.bias.grad = torch.randn(6, 8), torch.randn(6)
    with ran.averaging(SimpleNamespace(samples=4, global_samples=4)) as average:
        average(4)
    saved = ran.compression_state()
    resumed = SingleHost(compression=PowerSGD(2))
    resumed.attach(model)
    assert resumed.restore_compression("auto", saved) is None
    assert resumed.compression.step == 1  # Q was sent: P comes next
    exact = SingleHost()
    exact.attach(model)
    assert exact.compression_state() == {"name": "none"}
    assert exact.restore_compression("auto", saved) == (
        "--compression none resumes a checkpoint of a --compression powersgd:2 run: the steps "
        "from here on are exact")


# --------------------------------------------------------------------------- the command line

@pytest.mark.parametrize("scheme, says", [
    ("powersgd:2:start=-1", "--compression powersgd:2:start=-1: give the first compressed step "
                            "as a whole number of at least 0"),
    ("powersgd:2:from=5", "--compression powersgd:2:from=5: after the rank, give only the first "
                          "compressed step (powersgd:2:start=100) or the rounds per step "
                          "(powersgd:2:rounds=2)"),
    ("powersgd:2:rounds=3", "--compression powersgd:2:rounds=3: give 1 round per step"),
    ("powersgd:2:start=", "--compression powersgd:2:start=: after the rank, give only the first "
                          "compressed step"),
])
def test_a_bad_start_is_refused_as_the_command_line_refuses_a_bad_scheme(scheme, says):
    """The same UsageError (one line, exit 2) as the schemes of the test below, without a
    process each."""
    with pytest.raises(UsageError) as refused:
        parse_compression(scheme)
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("scheme, says", [
    ("zip", "--compression zip: choose one of none, fp16, powersgd:R, auto"),
    ("powersgd:0", "--compression powersgd:0: give a rank of at least 1"),
    ("powersgd:-2", "--compression powersgd:-2: give a rank of at least 1"),
    ("powersgd:R", "--compression powersgd:R: give PowerSGD's rank as a whole number"),
    ("powersgd:1.5", "--compression powersgd:1.5: give PowerSGD's rank as a whole number"),
])
def test_a_bad_scheme_is_one_line_and_exit_2(scheme, says, cli_here, tmp_path):
    done = cli_here("train", "--compression", scheme, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_fp16_allreduce_is_compression_fp16_and_refuses_another(cli_here, tmp_path):
    from hybriddl.cli import build_parser
    from hybriddl.cli.settings import train_flags
    from hybriddl.run.settings import settled_config

    flags = train_flags(build_parser().parse_args(["train", "--fp16-allreduce"]))
    config, _, _ = settled_config(flags.given)
    assert config.compression == "fp16"
    done = cli_here("train", "--fp16-allreduce", "--compression", "powersgd:2",
                    "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "give one of them" in done.stderr


def test_on_one_host_fp16_is_said_to_do_nothing_and_powersgd_applies():
    from hybriddl.cli import build_parser
    from hybriddl.cli.settings import train_flags

    lines = {}
    for scheme in ("fp16", "powersgd:2"):
        flags = train_flags(build_parser().parse_args(["train", "--compression", scheme]))
        lines[scheme] = list(flags.alone)  # the lines shown on a single host
    assert lines == {"fp16": ["--compression fp16 does nothing on a single host: it acts when "
                              "mpirun starts one rank on each of several hosts"],
                     "powersgd:2": []}


# --------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_tinted_classes(tmp_path_factory.mktemp("images"))


def train_args(images: Path, run_dir: Path, *extra: str) -> list[str]:
    # squeezenet1_1: every convolution a gradient matrix, no BatchNorm; 12 train images,
    # 3 steps of 4 per epoch; dropout 0 so no mask depends on anything but the step.
    return ["train", "--model", "squeezenet1_1", "--data", str(images), "--val-fraction", "0.34",
            "--image-size", "32", "--batch-size", "4", "--epochs", "2", "--dropout", "0",
            "--strategy", "sequential", "--compression", "powersgd:2", "--run-dir", str(run_dir),
            *extra]


def max_difference(a: Path, b: Path) -> float:
    want, got = torch.load(a / MODEL), torch.load(b / MODEL)
    return max(float((want[k].double() - got[k].double()).abs().max()) for k in want)


@pytest.mark.slow
def test_a_compressed_run_resumed_equals_it_uninterrupted(images, tmp_path, capsys):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(train_args(images, straight)) == 0
    assert main(train_args(images, cut, "--max-steps", "4")) == 0  # inside epoch 2
    saved = torch.load(cut / "checkpoint.pt", weights_only=True)["compression"]
    assert saved["name"] == "powersgd:2" and saved["step"] == 4 and saved["error"]
    # --compression left out: the checkpoint's.
    assert main(["train", "--resume", str(cut), "--max-steps", "6"]) == 0
    assert max_difference(straight, cut) < 1e-6
    assert max_difference(straight, cut) == 0.0  # one host: the very same arithmetic
    metrics = json.loads((cut / METRICS).read_text())
    assert metrics["config"]["compression"] == "powersgd:2"
    assert metrics["config"]["hosts"]["compression"] == "powersgd:2"
    assert "compression" not in metrics["resumes"][-1]


@pytest.mark.slow
def test_a_compressed_checkpoint_resumed_exact_says_so_in_one_line(images, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(images, run, "--max-steps", "2")) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--compression", "none", "--max-steps", "3"]) == 0
    said = " ".join(capsys.readouterr().err.split())  # rich wraps lines to the terminal
    line = ("--compression none resumes a checkpoint of a --compression powersgd:2 run: the "
            "steps from here on are exact")
    assert said.count(line) == 1 and said.count("--compression") == 2, said
    metrics = json.loads((run / METRICS).read_text())
    assert metrics["resumes"][-1]["compression"] == line
    assert metrics["config"]["compression"] == "none"


# --------------------------------------------------------------------------- under mpirun

def mpirun(ranks: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(MPIRUN), *LOOPBACK, "-np", str(ranks), sys.executable, *args],
                          capture_output=True, text=True, timeout=timeout, env=hybriddl_env())


@pytest.mark.mpi
@pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")
@pytest.mark.parametrize("overlap, rounds", [(False, 1), (True, 1), (True, 2)])
def test_two_ranks_average_with_powersgd_to_the_same_bits(tmp_path, overlap, rounds):
    """tests/compression_ranks.py: both ranks' parameters after powersgd steps, the
    allreduces each step made, and the one-host result of the same global batches. With
    --overlap, the classifier's factors leave during backward in an allreduce of their own,
    and nothing else changes. Two rounds: P then Q, after backward, --overlap or not."""
    out = tmp_path / "ranks.json"
    done = mpirun(2, [str(REPO / "tests" / "compression_ranks.py"), str(out),
                      *(["--overlap"] if overlap else []),
                      *(["--rounds", "2"] if rounds == 2 else [])], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["digests"][0] == result["digests"][1]
    split = overlap and rounds == 1
    assert result["allreduces_per_step"] == [2 if split or rounds == 2 else 1] * result["steps"]
    assert result["sent_in_backward"] == (result["steps"] if split else 0)
    assert result["max_difference_from_one_host"] < 1e-5
    assert result["bytes_per_step"] == result["wire_bytes_by_step"]


@pytest.mark.mpi
@pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")
def test_two_ranks_pace_each_compressed_step_to_the_compression_seconds(tmp_path):
    """As `emulate --compression-seconds 0.25` tells its hosts: each step's compute on each
    rank, the first phase during backward included, is padded to 0.25 s (time scale 1), and
    the ranks still leave the same bits."""
    out = tmp_path / "ranks.json"
    env = {**hybriddl_env(), COMPRESSION_SECONDS_VARIABLE: "0.25"}
    done = subprocess.run([str(MPIRUN), *LOOPBACK, "-np", "2", sys.executable,
                           str(REPO / "tests" / "compression_ranks.py"), str(out), "--overlap"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["digests"][0] == result["digests"][1]
    assert len(result["averaging_seconds"]) == result["steps"]
    # The pace counts the first phase's compute, which ran during backward, before this span
    # began (milliseconds for this model): the span is the rest of the 0.25 s.
    assert min(result["averaging_seconds"]) >= 0.24
    assert "warning" not in done.stderr  # a tiny model's compute: always under 0.25 s


@pytest.mark.mpi
@pytest.mark.slow
# Equality of what its own ranks leave, nothing timed: beside other tests (two_at_once.py).
@pytest.mark.beside
@pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")
# squeezenet averages its whole gradient; AlexNet's classifier splits across the hosts
# (exact) while its convolutions' gradients go through PowerSGD.
@pytest.mark.parametrize("scheme, model", [("data", "squeezenet1_1"), ("hybrid", "alexnet")])
def test_two_ranks_resumed_equal_them_uninterrupted(images, tmp_path, scheme, model):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    common = ["-m", "hybriddl"]
    flags = ["--host-parallel", scheme, "--model", model, "--epochs", "1"]
    if model == "alexnet":
        flags += ["--image-size", "64"]
    # --overlap: the factors of the gradients backward writes first leave during backward,
    # in an allreduce of their own; the run without it sends one allreduce a step: the
    # same mathematics either way.
    for run_dir, extra in ((straight, ["--overlap"]), (cut, ["--max-steps", "2"])):
        done = mpirun(2, [*common, *train_args(images, run_dir, *flags, *extra)])
        assert done.returncode == 0, done.stdout + done.stderr
    epoch = json.loads((straight / METRICS).read_text())["epochs"][0]
    assert epoch["buckets_sent_in_backward"] == len(epoch["per_step"]["seconds"]) > 0
    # Each host's errors kept apart, not summed over the link: rank 0's in the checkpoint,
    # rank 1's in its own file beside it.
    from hybriddl.run.resumption import ERRORS_APART, errors_file
    saved = torch.load(cut / "checkpoint.pt", weights_only=True)["compression"]
    assert saved[ERRORS_APART] == {"hosts": 2, "steps_done": 2}
    assert torch.load(cut / errors_file(1, 2), weights_only=True)["steps_done"] == 2
    done = mpirun(2, [*common, "train", "--resume", str(cut), "--max-steps", "3"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert max_difference(straight, cut) < 1e-6
    metrics = json.loads((cut / METRICS).read_text())
    assert metrics["config"]["host_parallel"]["scheme"] == scheme
    assert metrics["config"]["hosts"]["compression"] == "powersgd:2"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside  # equality of what its own ranks leave, nothing timed
@pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")
def test_a_compressed_run_on_three_ranks_resumed_on_two_then_three_ends_as_uninterrupted(
        images, tmp_path):
    """A compressed run that loses a host goes on as its 3 logical ranks on 2 hosts (one
    host runs two of them in turn, each with its own errors, and the wires are summed in
    logical order), so it trains as on 3 hosts to the bit, and back on 3 hosts it takes
    each logical rank's errors from the files the 2 hosts kept. The uninterrupted run sends
    its first phase during backward (--overlap), the others not: the same sums. (Two rounds
    a step: test_logical_ranks_on_fewer_hosts_give_the_same_bits_as_their_own_hosts.)"""
    compression, extra = "powersgd:2", ["--overlap"]
    from hybriddl.run.resumption import ERRORS_APART, errors_file

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    common = ["-m", "hybriddl"]
    flags = ["--batch-size", "6", "--compression", compression]  # 2 steps an epoch, 2 epochs
    done = mpirun(3, [*common, *train_args(images, straight, *flags, *extra)])
    assert done.returncode == 0, done.stdout + done.stderr
    done = mpirun(3, [*common, *train_args(images, cut, *flags, "--max-steps", "2")])
    assert done.returncode == 0, done.stdout + done.stderr
    done = mpirun(2, [*common, "train", "--resume", str(cut), "--max-steps", "3"])
    assert done.returncode == 0, done.stdout + done.stderr
    saved = torch.load(cut / "checkpoint.pt", weights_only=True)["compression"]
    assert saved[ERRORS_APART] == {"hosts": 3, "steps_done": 3}
    for rank in (1, 2):  # logical rank 1's written by host 0, 2's by host 1
        assert torch.load(cut / errors_file(rank, 3), weights_only=True)["steps_done"] == 3
    done = mpirun(3, [*common, "train", "--resume", str(cut), "--max-steps", "4"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert max_difference(straight, cut) == 0.0
    resumes = json.loads((cut / METRICS).read_text())["resumes"]
    assert [r["hosts"]["count"] for r in resumes] == [2, 3]
    assert resumes[0]["logical_hosts"] == 3 and "logical_hosts" not in resumes[1]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside  # what its own ranks leave, nothing timed
@pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun at {MPIRUN}")
def test_a_compressed_hybrid_run_resumed_on_fewer_hosts_goes_on(images, tmp_path):
    """The hybrid scheme's classifier slices follow the hosts there are: resumed on fewer
    hosts it does not run the logical ranks the data scheme does (it took that path and
    a rank failed at its first step with a traceback, "host share N is not the split's
    M"); rank 0 takes the hosts' errors summed, as on any other host count."""
    run = tmp_path / "run"
    flags = ["--host-parallel", "hybrid", "--model", "alexnet", "--image-size", "64",
             "--epochs", "1"]
    done = mpirun(3, ["-m", "hybriddl", *train_args(images, run, *flags, "--max-steps", "1")])
    assert done.returncode == 0, done.stdout + done.stderr
    done = mpirun(2, ["-m", "hybriddl", "train", "--resume", str(run), "--max-steps", "2"])
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = json.loads((run / METRICS).read_text())
    assert metrics["epochs"][-1]["steps"] == 2 and "logical_hosts" not in metrics["resumes"][0]
    assert metrics["resumes"][0]["host_parallel"]["scheme"] == "hybrid"


@pytest.mark.parametrize("rank, rounds", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_no_rank_freezes_the_layers_behind_a_zero_initialised_head(rank, rounds):
    """At the first step every gradient behind a zero head is exactly zero: its factor
    must not stay zero for ever (rank 1's normalisation kept it so; QR at rank >= 2 not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(),
                          nn.Linear(16, 10))
    nn.init.zeros_(model[4].weight)
    nn.init.zeros_(model[4].bias)  # as torchvision's ViT initialises its head
    compression = PowerSGD(rank, rounds=rounds)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert all(compression.compresses(p.shape) for p in matrices)
    before = [p.detach().clone() for p in matrices]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    for step in range(8):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 0:  # the premise: nothing but the head has a gradient yet
            assert float(model[0].weight.grad.abs().max()) == 0.0
        gradients = [p.grad for p in model.parameters()]
        compression.aggregate(gradients, alone, out=gradients)
        optimizer.step()
    moved = [float((p.detach() - b).abs().max()) for p, b in zip(matrices, before)]
    assert all(m > 0 for m in moved), moved


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_gram_schmidt_gives_qrs_columns_up_to_their_signs_and_survives_dependent_ones(rank):
    """Up to GRAM_SCHMIDT_MAX_RANK the factors are orthogonalised by Gram-Schmidt (a few
    batched operations on any device), not QR: the same orthonormal columns as QR's but for
    each column's sign, which P Q^T does not see (a column of P and its column of Q flip
    together). A zero column, or one that depends on those before it, starts again from a
    fixed direction orthogonal to them: the result stays orthonormal, the same bits twice."""
    from hybriddl.hosts.powersgd import GRAM_SCHMIDT_MAX_RANK, orthogonal

    assert rank <= GRAM_SCHMIDT_MAX_RANK
    factors = torch.randn(3, 50, rank, generator=torch.Generator().manual_seed(rank))
    ours = orthogonal(factors).double()
    qr = torch.linalg.qr(factors.double()).Q
    signs = torch.sign((ours * qr).sum(dim=1, keepdim=True))
    assert float((ours - qr * signs).abs().max()) < 1e-6
    degenerate = factors.clone()
    degenerate[0, :, 0] = 0  # a zero first column
    degenerate[1, :, rank - 1] = 3 * degenerate[1, :, 0]  # a last one on the first's line
    ours = orthogonal(degenerate).double()
    eye = torch.eye(rank, dtype=torch.float64).expand(3, rank, rank)
    assert float((ours.transpose(1, 2) @ ours - eye).abs().max()) < 1e-6
    assert torch.equal(orthogonal(degenerate), orthogonal(degenerate))
    # Where nothing degenerates the columns span what they spanned.
    assert float((ours[2] - qr[2] * signs[2]).abs().max()) < 1e-6


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_every_groups_factors_are_orthogonalised_in_one_batch_as_each_alone(rank, monkeypatch):
    """Groups of different lengths (and a zero one, which restarts from its own fixed
    direction) orthogonalised together, zero-padded to the longest: each gets the columns
    it gets alone, to float rounding, in one call of `orthogonal` for all of them."""
    from hybriddl.hosts import powersgd

    generator = torch.Generator().manual_seed(rank)
    factors = [torch.randn(k, n, rank, generator=generator)
               for k, n in ((2, 37), (1, 500), (3, 5))]
    factors[1][0, :, 0] = 0  # a zero column
    alone = [powersgd.orthogonal(f) for f in factors]
    calls = []
    orthogonal = powersgd.orthogonal
    monkeypatch.setattr(powersgd, "orthogonal", lambda *a, **k: calls.append(1) or orthogonal(*a, **k))
    together = powersgd.orthogonal_all(factors)
    assert len(calls) == 1
    for mine, theirs in zip(together, alone):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        assert float((mine - theirs).abs().max()) < 1e-6


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_gpus_step_orthogonalises_its_groups_in_one_batch_a_cpus_group_by_group(
        rounds, monkeypatch):
    from hybriddl.hosts import powersgd

    batches = []
    together = powersgd.orthogonal_all
    monkeypatch.setattr(powersgd, "orthogonal_all",
                        lambda factors: batches.append(len(factors)) or together(factors))
    gradients = small_gradients(seed=0) + [decaying_matrix(64, 96, seed=0)]
    for gpu_path in (False, True):
        compression = PowerSGD(2, rounds=rounds)
        compression.cpu_chunks = not gpu_path  # the GPU's code path, run on the CPU
        for _ in range(2):
            compression.aggregate(gradients, alone)
        groups = len(compression._groups)
        assert groups > 1 and batches == ([groups] * 2 if gpu_path else []), batches


# --------------------------------------------------------------------------- a new scheme

class BF16Wire(HalfWire):
    """A toy scheme added by ARCHITECTURE.md's recipe alone: bfloat16 on the wire, bucketed
    like fp16 (its class and its line in `register`)."""

    name = syntax = "bf16"
    help = "bf16 halves the bytes in bfloat16"
    wire_dtype = torch.bfloat16


@pytest.fixture
def bf16_registered():
    from hybriddl.hybrid.planner import compression_object
    register(BF16Wire)
    yield
    del REGISTRY[BF16Wire.name]
    compression_object.cache_clear()


class SummingMPI:
    """What `mpi_sum` asks of mpi4py: a 2-byte datatype and a user-defined operation,
    handed back as the callback itself."""

    class BYTE:
        @staticmethod
        def Create_contiguous(count):
            return SimpleNamespace(Commit=lambda: f"{count} bytes")

    class Op:
        @staticmethod
        def Create(function, commute):
            return function


def test_a_scheme_registered_alone_is_parsed_planned_and_averaged_with(bf16_registered):
    from hybriddl.hosts.compression import compression_help, schemes
    from hybriddl.hosts.fusion import GradientBuckets
    from hybriddl.hybrid.planner import HostCosts, Link, ModelShapes, Scheme, make_plan, predict
    scheme = parse_compression("bf16")
    assert isinstance(scheme, BF16Wire) and scheme.kind == "bucketed" and not scheme.exact
    assert "bf16" in schemes() and BF16Wire.help in compression_help()
    with pytest.raises(UsageError, match="choose one of none, fp16, powersgd:R, bf16, auto"):
        parse_compression("zip")

    # The planner weighs it beside the others, from what it answers: fp16's bytes and casts.
    link, costs = Link(1e9 / 8, 1e-4), HostCosts(1e-9, 2e-9, 1e-10, 1e-10)
    shapes = ModelShapes.of(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3)),
                            splittable=False)
    plan = make_plan(shapes, 2, 32, 0.01, link, costs, compression="auto")
    assert Scheme("data", "bf16") in {row.scheme for row in plan.rows}
    ours, fp16 = (predict(Scheme("data", c), shapes, 2, 32, 0.01, link, costs)
                  for c in ("bf16", "fp16"))
    assert (ours.nic_bytes, ours.compression_seconds) == (fp16.nic_bytes, fp16.compression_seconds)
    asked = make_plan(shapes, 2, 32, 0.01, link, costs, compression="bf16")
    assert asked.chosen == Scheme("data", "bf16") and not asked.record()["chosen"]["exact"]

    # The averaging: each bucket's wire in bfloat16, two hosts' wires summed by its MPI op.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    buckets = GradientBuckets(model, scheme)
    buckets.install_views()
    model(torch.randn(5, 8)).sum().backward()
    (bucket,) = buckets.buckets
    buckets.gather(bucket)
    assert bucket.wire.dtype == torch.bfloat16 and buckets.wire_bytes == scheme.wire_bytes(model)
    scheme.compress(bucket.flat, bucket.wire)
    datatype, add = scheme.mpi_sum(SummingMPI)
    summed = bucket.wire.clone()
    add(bucket.wire.view(torch.uint8).numpy(), summed.view(torch.uint8).numpy(), datatype)
    want = (bucket.flat.to(torch.bfloat16) * 2).float()
    bucket.flat.copy_(summed)
    buckets.scatter(bucket)
    assert torch.equal(bucket.flat, want) and torch.equal(bucket.slot(0), model[2].bias.grad)


def test_a_whole_gradient_scheme_by_the_recipe_alone_needs_nothing_else():
    """ARCHITECTURE.md's recipe for a WHOLE_GRADIENT scheme names `setup`, `aggregate`,
    `begin_step` / `local_wire` / `finish_step`: the averaging also asks `next_round` every
    step, and a resume on fewer hosts `use_parts` and `load_part_errors` (AttributeError)."""
    from hybriddl.hosts.cluster import SingleHost
    from hybriddl.hosts.scheme import WHOLE_GRADIENT, WireScheme

    class Whole(WireScheme):  # exact, one round, stateless: the recipe's methods only
        name = syntax = "whole"
        help = "the whole gradient at once"
        exact, kind = True, WHOLE_GRADIENT

        def wire_bytes(self, model_or_shapes):
            return 4 * sum(torch.Size(s).numel() for s in model_or_shapes)

        def setup(self, shapes, names, device):
            return []

        def begin_step(self, gradients):
            self.gradients = gradients

        def local_wire(self):
            return torch.cat([g.flatten() for g in self.gradients])

        def finish_step(self, totals, out=None):
            flat, offset = totals[0], 0
            for gradient in self.gradients:
                yield flat[offset:offset + gradient.numel()].view_as(gradient)
                offset += gradient.numel()

        def aggregate(self, gradients, hosts):
            return gradients

    scheme = Whole()
    assert scheme.next_round([torch.zeros(3)]) is None  # one round
    scheme.use_parts(2)
    scheme.load_part_errors(1, None)
    hosts = SingleHost()
    hosts.compression, hosts._compressed = scheme, [nn.Parameter(torch.zeros(3))]
    assert hosts.restore_compression("whole", {"name": "whole"}, more_errors=[None]) is None

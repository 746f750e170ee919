"""`hybriddl compare` on emulated hosts, the flat (Horovod) strategy, the DDP peer and the
step meter. The comparison runs once per module (squeezenet1_1 at 32 px: seconds per
contender), the peers of compression beside the exact runs they compress, and every
assertion about it reads that one run. The hybrid's local strategy is
threads there: the bytes on the NIC do not depend on it, and worker processes would add
interpreter starts to every run."""

import json
import os
import shutil
import sys
import time

import pytest
import torch
from torch import nn

from hybriddl.compare.outputs import REPORT, RESULT
from hybriddl.compare.theory import host_nic_theory, ring_bytes_per_rank
from hybriddl.errors import UsageError
from hybriddl.compare.stepmeter import StepMeter
from hybriddl.strategies import StrategyOptions, make_strategy

SMALL = ("--usecase", "SimpleBig", "--model", "squeezenet1_1", "--image-size", "32",
         "--batch-size", "8", "--warmup", "1", "--steps", "2")
H, K = 2, 2
SLOW = "100mbit"
# flat-ring is flat-mpi with Open MPI's ring chosen (its launch line: a test below); at
# these 4 ranks coll/tuned runs a ring for flat-mpi too, so a run of it would repeat flat-mpi's.
CONTENDERS_RUN = ["hybrid", "flat-mpi", "ddp", "ddp-fp16", "ddp-powersgd", "flat-fp16"]

CANNOT_EMULATE = (None if os.geteuid() == 0 and all(map(shutil.which, ("ip", "tc", "unshare")))
                  else "emulated hosts need root (network namespaces), ip, tc and unshare")


def compare(cli, output, *args):
    done = cli("compare", *SMALL, "--hosts", str(H), "--workers-per-host", str(K),
               "--local-strategy", "threads", "--output", str(output), *args, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    for written in (REPORT, "images_per_second.png", "host_nic_bytes_per_step.png"):
        assert (output / written).stat().st_size > 0
    comparison = json.loads((output / RESULT).read_text())
    report = (output / REPORT).read_text()
    for c in comparison["contenders"]:  # each row names its scheme and local strategy
        assert f"| {c['name']} | {c['scheme']} | {c['local_strategy']} |" in report
    return {**comparison, "report": report, "output": output}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    from conftest import run_cli

    if CANNOT_EMULATE:
        pytest.skip(CANNOT_EMULATE)
    # Behind a 100 Mbit/s link the hybrid's bytes take longer than its compute, so the run
    # also shows whether the limit is really applied.
    # The data contender is left out: squeezenet's hybrid runs as data (asserted below).
    # The compressed peers run in the same comparison, beside the exact runs they halve.
    return compare(run_cli, tmp_path_factory.mktemp("compare") / "out", "--bandwidth", SLOW,
                   "--contenders", ",".join(CONTENDERS_RUN))


def contender(comparison, name):
    return next(c for c in comparison["contenders"] if c["name"] == name)


def test_flat_is_horovods_model_one_sequential_worker_per_rank():
    with make_strategy("flat") as flat:
        assert "Horovod" in flat.describe()["model"]
    with pytest.raises(UsageError, match="one worker per MPI rank"):
        make_strategy("flat", StrategyOptions(workers=2))


def test_flat_matches_sequential():
    def train(name):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
        generator = torch.Generator().manual_seed(1)
        with make_strategy(name) as local:
            local.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _ in range(3):
                optimizer.zero_grad(set_to_none=False)
                local.compute_gradients(torch.randn(5, 12, generator=generator),
                                        torch.randint(3, (5,), generator=generator))
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    for flat, sequential in zip(train("flat"), train("sequential"), strict=True):
        assert torch.equal(flat, sequential)


def test_host_nic_theory_per_algorithm():
    assert ring_bytes_per_rank(100, 1) == 0
    assert ring_bytes_per_rank(100, 4) == 150
    # K=2 ranks per host, host-contiguous ring over 4: one edge per host leaves the host.
    assert host_nic_theory("ring", 100, hosts=2, ranks=4) == 150
    assert host_nic_theory("hierarchical", 100, hosts=2, ranks=4) == 100
    assert host_nic_theory("ring", 100, hosts=2, ranks=2) == 100


def test_step_meter_counts_only_the_timed_steps():
    handed = {"bytes": 0}
    meter = StepMeter(warmup=1, steps=2, comm_bytes=lambda: handed["bytes"], interface="lo")
    for step, seconds in enumerate((9.0, 1.0, 2.0)):
        handed["bytes"] += 100 * (step + 1)  # the warm-up's 100 bytes fall outside
        meter.on_step(0, step, 8, seconds, 1.0)
    result = meter.result()
    assert meter.remaining == 0
    assert result["step_seconds"] == [1.0, 2.0]
    assert result["comm_bytes"] == 200 + 300


def test_step_meter_refuses_a_result_before_the_last_timed_step():
    meter = StepMeter(warmup=1, steps=2, comm_bytes=lambda: 0, interface="lo")
    meter.on_step(0, 0, 8, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="1 of 3 steps"):
        meter.result()


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside
def test_comparison_json_contract(comparison):
    assert comparison["emulated_hosts"] == H
    assert comparison["bandwidth"] == SLOW and comparison["latency"] is None
    assert [c["name"] for c in comparison["contenders"]] == CONTENDERS_RUN
    # threads cannot run the convolutions alone (and squeezenet has no classifier to
    # split): the hybrid contender ran as data instead of refusing, and its row says so.
    hybrid = contender(comparison, "hybrid")
    assert hybrid["host_parallel"] == hybrid["scheme"] == "data"
    assert hybrid["local_strategy"] == f"threads K={K}"
    for c in comparison["contenders"]:
        assert c["seconds_per_step"] > 0
        assert len(c["host_nic_bytes_per_step"]) == len(c["host_nic_bytes_theory"]) == H
        assert len(c["host_peak_rss_bytes"]) == H
    # A host's memory is its processes', each counted once: a DDP host's first process,
    # the parent of the others, counts only itself (counting them too read 1.46x flat-mpi's).
    ddp, flat = contender(comparison, "ddp"), contender(comparison, "flat-mpi")
    assert max(ddp["host_peak_rss_bytes"]) < 1.25 * max(flat["host_peak_rss_bytes"])
    # An MPI contender's ranks measure steps only: no checkpoint, validation or weights.
    for name in ("hybrid", "flat-mpi"):
        run = comparison["output"] / "contenders" / name / "run"
        assert sorted(p.name for p in run.iterdir() if p.suffix == ".pt") == [], name
        epochs = json.loads((run / "metrics.json").read_text())["epochs"]
        assert epochs and all(e["val_accuracy"] is None for e in epochs), name


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside
def test_hybrid_host_nic_sends_ring_theory_over_hosts(comparison):
    hybrid = contender(comparison, "hybrid")
    gradient = hybrid["gradient_bytes"]
    assert hybrid["host_nic_bytes_theory"] == [2 * (H - 1) / H * gradient] * H
    theory = 2 * (H - 1) / H * gradient
    for sent in hybrid["host_nic_bytes_per_step"]:  # headers, ACKs, retransmits: see below
        assert 0.9 * theory <= sent <= 1.25 * theory


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside
def test_flat_mpis_ring_host_nic_sends_ring_theory_over_all_ranks(comparison):
    """2(P-1)/P S per host: the ring's intra-host edge (shared memory) is not counted;
    were it on the NIC, each host would send twice that. (flat-mpi's allreduce at 4 ranks
    is coll/tuned's ring, as its row says.) The NIC also carries TCP/IP headers (~4 % at a
    1500-byte MTU), the ACKs of what the host receives (~2 %) and, behind a shaped 100 Mbit/s
    link, retransmits: one CI run read 1.109x theory. 1.25x, as the test below allows, still
    tells the ring from one that counted its intra-host edge (2x)."""
    ring = contender(comparison, "flat-mpi")
    assert ring["allreduce"] == "ring"
    p = H * K
    theory = 2 * (p - 1) / p * ring["gradient_bytes"]
    for sent in ring["host_nic_bytes_per_step"]:
        assert 0.9 * theory <= sent <= 1.25 * theory
    # Both sides carry the same kind of overhead; the ratio would be 3.0 were the intra-host
    # edge counted.
    assert ring["host_nic_bytes_vs_hybrid"] == pytest.approx((2 * (p - 1) / p) / (2 * (H - 1) / H),
                                                            rel=0.2)


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside
def test_no_host_counts_intra_host_traffic(comparison):
    """Every rank of every flat contender hands 2(P-1)/P S to its allreduce; a host's NIC
    carries only what one rank of it sends across, not what its K ranks send in all.
    Counting the K ranks would read K = 2 times the payload; the NIC also carries TCP/IP
    headers, the receiver's ACKs and whatever else crossed in that step (one DDP step, on
    one host, once read 1.105x the payload, the other host 1.003x), hence 1.25x."""
    for name in ("flat-mpi", "ddp", "flat-fp16", "ddp-fp16"):
        c = contender(comparison, name)
        per_rank = ring_bytes_per_rank(c["payload_bytes"], H * K)
        assert max(c["host_nic_bytes_per_step"]) <= 1.25 * per_rank, name


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside
def test_compressed_peers_send_what_they_compress(comparison):
    """fp16 halves the bytes on every host's NIC, for DDP's hook as for Horovod's model; DDP's
    PowerSGD sends its factors in every timed step, its settings beside its figures."""
    for compressed, exact in (("ddp-fp16", "ddp"), ("flat-fp16", "flat-mpi")):
        half, whole = contender(comparison, compressed), contender(comparison, exact)
        assert half["compression"] == "fp16" and whole["compression"] == "none"
        for sent, full in zip(half["host_nic_bytes_per_step"], whole["host_nic_bytes_per_step"],
                              strict=True):
            assert sent == pytest.approx(full / 2, rel=0.2), compressed
    powersgd, ddp = contender(comparison, "ddp-powersgd"), contender(comparison, "ddp")
    assert powersgd["compression"] == "powersgd r=2" and powersgd["scheme"] == "ddp"
    # Were any timed step a vanilla allreduce, it would send the whole gradient.
    assert powersgd["comm_bytes_per_step"] == pytest.approx(H * K * powersgd["payload_bytes"])
    assert max(powersgd["host_nic_bytes_per_step"]) < 0.25 * min(ddp["host_nic_bytes_per_step"])
    assert "ddp-powersgd: torch's powerSGD_hook at rank 2, in one bucket" in comparison["report"]
    assert "so its warm-up ran 3 steps" in powersgd["note"]


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.beside
def test_bandwidth_limits_the_hybrids_step(comparison):
    hybrid = contender(comparison, "hybrid")
    assert hybrid["seconds_per_step"] >= max(hybrid["host_nic_bytes_per_step"]) * 8 / 100e6


def test_compare_refuses_a_bad_bandwidth_and_writes_nothing(cli_here, tmp_path):
    output = tmp_path / "out"
    done = cli_here("compare", *SMALL, "--bandwidth", "fast", "--output", str(output))
    assert done.returncode == 2
    assert "bandwidth 'fast'" in done.stderr and "Traceback" not in done.stderr
    assert not output.exists()


def test_compare_refuses_latency_without_netem(cli_here, tmp_path):
    if CANNOT_EMULATE:
        pytest.skip(CANNOT_EMULATE)
    if os.path.exists("/sys/module/sch_netem"):
        pytest.skip("this kernel has netem: --latency works here")
    output = tmp_path / "out"
    done = cli_here("compare", *SMALL, "--latency", "0.1ms", "--contenders", "hybrid",
               "--output", str(output))
    assert done.returncode == 2, done.stderr
    assert "netem" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not output.exists()


def test_compare_refuses_fewer_samples_than_workers_and_writes_nothing(cli_here, tmp_path):
    output = tmp_path / "out"
    done = cli_here("compare", "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "3",
               "--hosts", "2", "--workers-per-host", "2", "--local-strategy", "sequential",
               "--contenders", "ddp", "--output", str(output))
    assert done.returncode == 2
    assert "smaller than the 4 workers" in done.stderr
    assert not output.exists()


def test_the_hybrid_contender_splits_where_its_local_strategy_can_and_averages_where_not():
    from hybriddl.compare.compare import hybrid_scheme
    from hybriddl.compare.settings import CompareConfig

    # The default local strategy must run the split: with it the README's compare line
    # (AlexNet) runs the hybrid contender as a hybrid.
    assert hybrid_scheme(CompareConfig().local_strategy) == "hybrid"
    assert hybrid_scheme("layerwise") == "hybrid"
    assert hybrid_scheme("processes") == "data"
    assert hybrid_scheme("threads") == "data"


def test_the_table_names_each_rows_scheme_and_local_strategy():
    from hybriddl.compare.outputs import table_cells

    row = {"name": "hybrid", "scheme": "data", "local_strategy": "processes K=2", "ranks": 2,
           "seconds_per_step": 1.0, "seconds_per_step_vs_hybrid": 1.0,
           "host_nic_bytes_per_step": [1e6, 1e6], "host_nic_bytes_theory": [1e6, 1e6],
           "allreduce": "ring", "host_nic_bytes_vs_hybrid": 1.0,
           "host_peak_rss_bytes": [1e8, 1e8], "host_peak_rss_vs_hybrid": 1.0}
    cells = table_cells({"contenders": [row]})[0]
    assert cells[:3] == ["hybrid", "data", "processes K=2"]



def test_the_table_comes_whole_into_a_log_and_at_the_terminals_width_on_one(monkeypatch):
    """Printed to a file or a pipe (a SLURM log), rich drew 80 columns: compare's 13 columns
    came out as "co…", "sc…". There it gets display.LOG_WIDTH; COLUMNS, where set, rules."""
    from hybriddl import display
    from hybriddl.compare.outputs import COLUMNS, table_cells

    row = {"name": "ddp-powersgd", "scheme": "ddp", "local_strategy": "ddp (4 processes)",
           "compression": "powersgd r=2", "ranks": 4, "seconds_per_step": 1.25,
           "seconds_per_step_vs_hybrid": 1.5, "host_nic_bytes_per_step": [1.2e5, 1.1e5],
           "host_nic_bytes_theory": [1e5, 1e5], "allreduce": "ring",
           "host_nic_bytes_vs_hybrid": 0.04, "host_peak_rss_bytes": [1.6e9, 1.6e9],
           "host_peak_rss_vs_hybrid": 1.9}
    table = display.comparison_table({"contenders": [row]}, COLUMNS,
                                     table_cells({"contenders": [row]}))
    monkeypatch.delenv("COLUMNS", raising=False)
    log = display.terminal_console()
    assert not log.is_terminal and log.width == display.LOG_WIDTH
    with log.capture() as drawn:
        log.print(table)
    assert "…" not in drawn.get() and "ddp-powersgd" in drawn.get()
    for _, header, _ in COLUMNS:
        assert header.split()[0] in drawn.get()
    monkeypatch.setenv("COLUMNS", "60")
    assert display.terminal_console().width == 60

class PlannedHosts:
    """What compare.plan asks of EmulatedHosts, without namespaces: the launch lines."""

    count, addresses = H, ["198.18.0.1", "198.18.0.2"]

    def mpirun(self, command, ranks_per_host=1, mca=None, mpirun=None, logged=False):
        options = [word for key, value in (mca or {}).items() for word in ("--mca", key, value)]
        told = ["--logged"] if logged else []
        return ["mpirun", "--ranks-per-host", str(ranks_per_host), *options, *told, *command]

    def on_host(self, index, argv):
        return ["on-host", str(index), *argv]


def test_the_compressed_peers_are_their_schemes_with_what_they_send(monkeypatch, tmp_path):
    from hybriddl.compare import compare
    from hybriddl.compare.settings import CONTENDERS, KNOWN, CompareConfig, MeasureSettings

    monkeypatch.setattr(compare, "mpi_launcher", lambda: "mpirun")
    config = CompareConfig(MeasureSettings(warmup=1), hosts=H, workers_per_host=K,
                           local_strategy="threads", powersgd_rank=3)

    def planned(name):
        return compare.plan(config, PlannedHosts(), tmp_path, name)

    # Left out of --contenders, only the exact ones run: each peer is one more run.
    assert all(KNOWN[name].compression == "none" for name in CONTENDERS)
    powersgd, fp16, ddp = planned("ddp-powersgd"), planned("ddp-fp16"), planned("ddp")
    for peer in (powersgd, fp16, ddp):
        assert peer.ranks == H * K and len(peer.commands()) == H  # one DDP launch per host
        assert all("hybriddl.cli.compare_ddp" in argv for argv in peer.commands())
        assert all(str(tmp_path / peer.name) in argv for argv in peer.commands())
    hook = powersgd.commands()[0]
    assert hook[hook.index("--powersgd-rank") + 1] == "3" and "--fp16-allreduce" not in hook
    assert "--fp16-allreduce" in fp16.commands()[0] and "--powersgd-rank" not in fp16.commands()[0]
    assert not {"--fp16-allreduce", "--powersgd-rank"} & set(ddp.commands()[0])
    flat = planned("flat-fp16")
    assert flat.ranks == H * K and flat.algorithm == planned("flat-mpi").algorithm
    (argv,) = flat.commands()
    assert argv[argv.index("--ranks-per-host") + 1] == str(K)
    assert argv[argv.index("--strategy") + 1] == "flat" and "--fp16-allreduce" in argv
    # flat-ring: flat-mpi's ranks, with Open MPI's ring asked for, blocking and started.
    (ring,) = planned("flat-ring").commands()
    (default,) = planned("flat-mpi").commands()
    asked = {ring[i + 1]: ring[i + 2] for i, word in enumerate(ring) if word == "--mca"}
    assert asked == compare.RING_ALLREDUCE and "--mca" not in default
    mca_words = {i + k for i, word in enumerate(ring) if word == "--mca" for k in range(3)}
    rest = [word for i, word in enumerate(ring) if i not in mca_words]
    assert rest == [word.replace("flat-mpi", "flat-ring") for word in default]
    assert planned("flat-ring").algorithm == "ring"
    # Every MPI contender's ranks are told their output goes to its log, not a terminal.
    assert all("--logged" in planned(name).commands()[0]
               for name in ("flat-mpi", "flat-ring", "flat-fp16", "hybrid", "data-powersgd"))
    # hybriddl's own PowerSGD at the same rank, on the hybrid's and data's hosts.
    for name, scheme in (("hybrid-powersgd", "data"), ("data-powersgd", "data")):
        (argv,) = planned(name).commands()
        assert argv[argv.index("--compression") + 1] == "powersgd:3", name
        assert argv[argv.index("--host-parallel") + 1] == scheme  # threads cannot split
        assert argv[argv.index("--result-dir") + 1] == str(tmp_path / name)


def test_powersgd_sends_factors_of_the_matrices_worth_compressing():
    from hybriddl.compare.theory import powersgd_elements

    # A 64 x 288 matrix (a convolution) sends (64 + 288) x 2; a bias, and a 3 x 64 matrix
    # whose factors would not be half its size, are sent whole.
    assert powersgd_elements([(64, 32, 3, 3), (64,), (3, 64)], rank=2) == 704 + 64 + 192


def test_compare_refuses_a_powersgd_rank_below_1_and_fp16_twice(cli_here, tmp_path):
    output = tmp_path / "out"
    for args, says in ((["--contenders", "ddp-powersgd", "--powersgd-rank", "0"],
                        "--powersgd-rank 0: give a rank of 1 or more"),
                       (["--contenders", "ddp,ddp-fp16", "--fp16-allreduce"],
                        "ddp-fp16 name their own"),
                       # (the second hybrid's folder was refused after the first one ran)
                       (["--contenders", "hybrid,ddp,hybrid"],
                        "hybrid given twice; name each contender once")):
        done = cli_here("compare", *SMALL, "--output", str(output), *args)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert not output.exists()


def test_a_powersgd_rank_without_a_powersgd_contender_is_warned_about(cli_here, tmp_path,
                                                                     monkeypatch):
    from hybriddl.compare import compare
    from hybriddl.compare.settings import idle_powersgd_rank
    from hybriddl.errors import UsageError

    assert idle_powersgd_rank(None, ("hybrid", "data")) is None  # not typed
    assert idle_powersgd_rank(4, ("hybrid", "ddp-powersgd")) is None  # acts
    assert idle_powersgd_rank(4, ("hybrid", "data")) == (
        "--powersgd-rank 4 does nothing: no contender runs PowerSGD (these do: ddp-powersgd, "
        "hybrid-powersgd, data-powersgd)")

    def stop(*_):  # the warning is shown before anything runs
        raise UsageError("stopped before the contenders ran")

    monkeypatch.setattr(compare, "run_comparison", stop)
    done = cli_here("compare", *SMALL, "--output", str(tmp_path / "out"), "--contenders", "ddp",
                    "--powersgd-rank", "4")
    assert done.returncode == 2
    assert "warning: --powersgd-rank 4 does nothing" in done.stderr, done.stderr


def test_a_compressed_rows_theory_is_what_its_compression_sends():
    """hybriddl's PowerSGD rows take the planner's bytes for the scheme that ran; DDP's the
    bytes its hook hands to gloo in theory; each compressed row says what ran."""
    from hybriddl.compare.compare import Contender, summarize
    from hybriddl.compare.settings import CompareConfig, MeasureSettings

    config = CompareConfig(MeasureSettings(batch_size=8), hosts=H, workers_per_host=1)

    def records(**extra):
        return [{"timed_steps": 1, "step_seconds": [0.5], "gradient_bytes": 1000,
                 "host": host, "nic_bytes_sent": 100, "comm_bytes": 50, "peak_rss_bytes": 1,
                 "strategy": {"name": "sequential"}, **extra} for host in ("h0", "h1")]

    plan = {"chosen": {"scheme": "data + powersgd:2"},
            "rows": [{"scheme": "data", "nic_bytes_per_step": 1000},
                     {"scheme": "data + powersgd:2", "nic_bytes_per_step": 40}]}
    data = summarize(Contender("data-powersgd", H, ["x"], "ring"),
                     records(host_parallel={"scheme": "data"}, plan=plan), config, ["h0", "h1"])
    assert data["host_nic_bytes_theory"] == [40, 40]
    assert data["compression"] == "powersgd r=2" and "hybriddl's PowerSGD" in data["note"]
    hook = {"hook": "powerSGD_hook", "matrix_approximation_rank": 2, "start_powerSGD_iter": 2,
            "bucket_cap_mb": 1}
    ddp = summarize(Contender("ddp-powersgd", H, [["x"], ["y"]], "ring"),
                    records(payload_bytes=30, comm_hook=hook, warmup=3), config, ["h0", "h1"])
    assert ddp["host_nic_bytes_theory"] == [30, 30]  # a ring of 2 ranks: 2 (P-1)/P = 1
    assert ddp["scheme"] == "ddp" and "in one bucket (bucket_cap_mb 1" in ddp["note"]


@pytest.mark.parametrize("args", [["--powersgd-min-rate", "200"],
                                  ["--powersgd-rank", "2", "--powersgd-min-rate", "0.5"]])
def test_the_ddp_peer_refuses_a_min_compression_rate_without_its_hook_or_below_1(args, capsys,
                                                                                 tmp_path):
    from hybriddl.cli import compare_ddp

    with pytest.raises(SystemExit) as stop:
        compare_ddp.main(["--processes", "1", "--result-dir", str(tmp_path / "r"), *args])
    assert stop.value.code == 2
    assert "--powersgd-min-rate" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "r").exists()


def test_a_failed_contender_keeps_what_the_contenders_before_it_measured(tmp_path, monkeypatch):
    """A comparison of hours whose last contender fails (OOM) wrote nothing, and the same
    --output was refused after: every contender had to run again."""
    from hybriddl.compare import compare
    from hybriddl.compare.settings import CompareConfig, MeasureSettings
    from hybriddl.errors import TrainingError

    class Hosts:  # the emulated hosts, not needed here: the contenders are stand-ins
        names, notes = ["h0", "h1"], []

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def run(contender, log):
        if contender.name == "ddp":
            raise TrainingError("the ddp contender failed (exit 137): Killed (full log: x)")

    records = [{"timed_steps": 1, "step_seconds": [0.5], "gradient_bytes": 1000, "host": host,
                "nic_bytes_sent": 100, "comm_bytes": 50, "peak_rss_bytes": 1,
                "strategy": {"name": "sequential"}, "host_parallel": {"scheme": "data"}}
               for host in ("h0", "h1")]
    monkeypatch.setattr(compare, "EmulatedHosts", Hosts)
    monkeypatch.setattr(compare, "plan", lambda config, cluster, root, name:
                        compare.Contender(name, 2, ["x"], "ring"))
    monkeypatch.setattr(compare, "run_contender", run)
    monkeypatch.setattr(compare, "read_rank_results", lambda folder, ranks: records)
    config = CompareConfig(MeasureSettings(batch_size=8), hosts=2, workers_per_host=1,
                           contenders=("data", "ddp", "hybrid"))
    output = tmp_path / "out"
    with pytest.raises(TrainingError, match=r"the ddp contender failed \(exit 137\): Killed .*; "
                                            r"what the 1 contender\(s\) before it measured is "
                                            r"written to .*comparison.json"):
        compare.run_comparison(config, output)
    written = json.loads((output / RESULT).read_text())
    assert [row["name"] for row in written["contenders"]] == ["data"]
    assert written["unfinished"]["contender"] == "ddp"
    assert "unfinished: the ddp contender failed (exit 137): Killed (full log: x); the " \
        "contenders after ddp did not run" in (output / REPORT).read_text()


def test_a_contender_host_that_fails_stops_the_others_at_once(tmp_path):
    """One of a DDP contender's host processes fails at its start: the others (here: one
    that would wait ten minutes, as gloo's rendezvous waits 30) are stopped at once and the
    failure is named, not waited out."""
    import psutil

    from hybriddl.compare import compare
    from hybriddl.errors import TrainingError

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    failing = [sys.executable, "-c", "import sys; print('no route to h0'); sys.exit(3)"]
    contender = compare.Contender("ddp", 2, [sleeper, failing], "ring")
    started = time.monotonic()
    with pytest.raises(TrainingError, match=r"the ddp contender failed \(exit 3\): "
                                            r"no route to h0"):
        compare.run_contender(contender, tmp_path / "ddp.log")
    assert time.monotonic() - started < 60
    assert not [p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and p.info["cmdline"][-1:] == ["import time; time.sleep(600)"]]

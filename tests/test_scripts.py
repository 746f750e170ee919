"""The scripts read alike: each runs as `python scripts/NAME.py` with no path set-up, the
shared helpers live once in bench_common, and a training step is hybriddl/step.py's."""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hybriddl_env

SCRIPTS = sorted(path for path in (REPO / "scripts").rglob("*.py") if "__pycache__" not in path.parts)
# What the scripts import, not commands: results files' header, and the docs' pages.
SHARED = ("bench_common.py", "pages.py")
COMMANDS = [path for path in SCRIPTS if path.name not in SHARED]


def calls(path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]


def attribute_call(node: ast.Call) -> str:
    """'sys.path.insert' for sys.path.insert(...), '' for a call of anything else."""
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def test_no_script_sets_up_its_own_path():
    patched = [f"{path.relative_to(REPO)}:{node.lineno}" for path in SCRIPTS for node in calls(path)
               if attribute_call(node).startswith("sys.path.")]
    assert SCRIPTS and patched == []


def test_shared_helpers_are_defined_once_in_bench_common():
    shared = {"spread", "results_header", "synchronize"}
    copies = [f"{path.relative_to(REPO)}: {node.name}" for path in SCRIPTS
              if path.name != "bench_common.py"
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.FunctionDef) and node.name in shared]
    assert copies == []


def test_no_script_writes_its_own_optimizer_step():
    """optimizer.step() belongs to hybriddl/step.py: scripts call optimizer_step or time a
    strategy as the tuner does."""
    steps = [f"{path.relative_to(REPO)}:{node.lineno}" for path in SCRIPTS for node in calls(path)
             if attribute_call(node).endswith("optimizer.step")]
    assert steps == []


# Every script's --help, run as `python scripts/NAME.py --help` would run it, in one
# process (torch imported once, not once per script).
HELP_DRIVER = """
import contextlib, io, json, runpy, sys
result = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    sys.path.pop(0)
    result[path] = [code, out.getvalue()[:200]]
print(json.dumps(result))
"""


def test_every_script_answers_help():
    import json
    done = subprocess.run([sys.executable, "-c", HELP_DRIVER, *map(str, COMMANDS)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=hybriddl_env())
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(answers) == sorted(map(str, COMMANDS))
    failed = {path: answer for path, answer in answers.items()
              if answer[0] != 0 or not answer[1].startswith("usage:")}
    assert failed == {}


def test_scaling_skips_a_cell_that_would_not_fit_memory_at_the_fraction_asked():
    import psutil
    import scaling_e2e

    total = psutil.virtual_memory().total
    cells = [{"contender": "flat", "hosts": 2, "memory": {"peak_rss_bytes": total // 10}}]
    # 8 ranks of a tenth of the memory each: over 0.5 of it, under 0.9.
    why = scaling_e2e.memory_refusal(cells, "flat", 4, 2, fraction=0.5)
    assert why and "8 ranks" in why and "50%" in why
    assert scaling_e2e.memory_refusal(cells, "flat", 4, 2, fraction=0.9) is None
    assert scaling_e2e.memory_refusal(cells, "hybrid", 4, 2) is None  # nothing measured


def test_scaling_leaves_out_a_cell_whose_predicted_wall_time_per_step_is_over_the_limit(
        monkeypatch):
    import scaling_e2e

    monkeypatch.setattr(scaling_e2e.os, "sched_getaffinity", lambda pid: {0, 1})
    args = scaling_e2e.parse_args(["--hosts", "2", "--cores-per-host", "1", "--host-step",
                                   "10ms", "--max-step-wall", "60", "--output", "x.json"])
    theory = {"2": {"data": 228e6, "hybrid": 13.3e6, "ddp": 228e6, "ddp-powersgd": 0.34e6,
                    "data-powersgd": 0.18e6}}
    # S = 100: 228 MB at 10 Mbit/s is 182 s of wall time per step, beside 1 s of compute.
    why, wall = scaling_e2e.wall_refusal(args, "data", 2, "1gbit", 100.0, theory)
    assert wall == pytest.approx(100 * (0.01 + 228e6 * 8 / 1e9))
    assert why.startswith(f"not run (predicted {wall:.3g} s/step") and "--max-step-wall 60" in why
    assert scaling_e2e.wall_refusal(args, "hybrid", 2, "1gbit", 100.0, theory) is None  # 12 s
    assert scaling_e2e.wall_refusal(args, "data-powersgd", 2, "1gbit", 100.0, theory) is None
    # DDP's start sends the dense model whatever its hook: judged by those bytes.
    assert scaling_e2e.wall_refusal(args, "ddp-powersgd", 2, "1gbit", 100.0, theory)
    assert scaling_e2e.wall_refusal(args, "data", 2, "10gbit", 100.0, theory) is None  # 19 s
    # --max-start-wall: DDP's start (broadcast + 2 dense warm-up steps, 3 x 182 s) is judged
    # apart from its compressed steps; the dense contender still by its step.
    args.max_start_wall = 600
    assert scaling_e2e.wall_refusal(args, "ddp-powersgd", 2, "1gbit", 100.0, theory) is None
    assert scaling_e2e.wall_refusal(args, "data", 2, "1gbit", 100.0, theory)
    args.max_start_wall = 500
    why, start = scaling_e2e.wall_refusal(args, "ddp-powersgd", 2, "1gbit", 100.0, theory)
    assert start == pytest.approx(3 * wall) and "for DDP's start" in why
    assert "--max-start-wall 500" in why
    args.max_step_wall = args.max_start_wall = None
    assert scaling_e2e.wall_refusal(args, "data", 2, "1gbit", 100.0, theory) is None
    with pytest.raises(SystemExit):
        scaling_e2e.parse_args(["--max-step-wall", "0", "--output", "x.json"])
    with pytest.raises(SystemExit):
        scaling_e2e.parse_args(["--max-start-wall", "600", "--output", "x.json"])


def test_scaling_append_refuses_a_file_of_another_use_case(tmp_path):
    import json

    import scaling_e2e

    output = tmp_path / "scaling.json"
    output.write_text(json.dumps({"usecase": "ComplexSmall", "image_size": 224,
                                  "cores_per_host": 2, "cells": [],
                                  "theory_nic_bytes_per_step": {}}))
    with pytest.raises(SystemExit, match="usecase 'ComplexSmall'"):
        scaling_e2e.main(["--usecase", "SimpleBig", "--hosts", "2", "--append",
                          "--output", str(output)])
    assert json.loads(output.read_text())["usecase"] == "ComplexSmall"  # left as it was


def test_scaling_append_keeps_the_cells_runs_and_what_was_written_by_hand(tmp_path):
    import scaling_e2e

    args = scaling_e2e.parse_args(["--usecase", "SimpleBig", "--hosts", "4", "--output", "x"])
    cell = {"contender": "hybrid", "hosts": 2, "bandwidth": "1gbit", "images_per_second": 1.0}
    earlier = {"usecase": "SimpleBig", "image_size": 224, "cores_per_host": 1,
               "cells": [cell], "theory_nic_bytes_per_step": {"2": {}},
               "command": "python scripts/scaling_e2e.py --hosts 2", "commit": "abc",
               "note": "the hybrid cells predate the alltoallv",
               "replaced_cells": [{"why": "token bucket", "cells": []}],
               "measured_host_step_seconds": {"74.2": 0.01}}
    result = {"usecase": "SimpleBig", "image_size": 224, "cores_per_host": 1, "cells": []}
    steps = scaling_e2e.continue_from(earlier, result, args, {127.0: 0.0101}, Path("x"))
    assert result["cells"] == [cell]
    assert result["note"] == earlier["note"]
    assert result["replaced_cells"] == earlier["replaced_cells"]
    assert result["earlier_runs"][-1]["command"] == earlier["command"]
    assert sorted(result["theory_nic_bytes_per_step"]) == ["2", "4"]
    assert steps == {74.2: 0.01, 127.0: 0.0101}


def test_scaling_drops_a_skipped_cell_that_a_later_run_measured():
    import scaling_e2e

    cells = [{"contender": "flat", "hosts": 4, "bandwidth": "1gbit", "skipped": "memory"},
             {"contender": "flat", "hosts": 8, "bandwidth": "1gbit", "skipped": "memory"},
             {"contender": "flat", "hosts": 4, "bandwidth": "1gbit", "images_per_second": 1.0}]
    kept = scaling_e2e.drop_superseded(cells)
    assert [c.get("skipped") for c in kept] == ["memory", None]
    assert kept[0]["hosts"] == 8


def test_the_ddp_cell_command_starts_one_peer_per_host_with_every_core_a_process(tmp_path):
    import shlex

    import bench_common

    kind, script, line = bench_common.ddp_command(2, 3, tmp_path, ["--steps", "4"])
    words = shlex.split(line)
    assert (kind, script, words[0]) == ("sh", "-c", "exec")
    assert words[words.index("-m") + 1] == "hybriddl.cli.compare_ddp"
    assert words[words.index("--processes") + 1] == "6" and words[words.index("--hosts") + 1] == "2"
    assert words[words.index("--result-dir") + 1] == str(tmp_path)
    assert words[-4:] == ["--steps", "4", "--host-index", "$OMPI_COMM_WORLD_RANK"]


def test_time_to_accuracy_scores_as_mlperf_dropping_the_fastest_and_the_slowest():
    from time_to_accuracy import mlperf_score

    assert mlperf_score([5.0, 1.0, 3.0, 9.0, 4.0])["score_seconds"] == 4.0  # (3 + 4 + 5) / 3
    # One miss is the slowest run, dropped; two misses give no score.
    missed_once = mlperf_score([5.0, None, 3.0, 9.0, 4.0])
    assert missed_once["score_seconds"] == 6.0 and missed_once["dropped"] == [3.0, None]
    assert mlperf_score([5.0, None, 3.0, None, 4.0])["score_seconds"] is None
    assert mlperf_score([5.0, 4.0])["score_seconds"] is None  # too few runs to drop two


def test_time_to_accuracy_fixes_the_target_all_but_one_reference_seed_reaches():
    from time_to_accuracy import target_from_reference

    # The second lowest best accuracy, rounded down to the percent.
    assert target_from_reference([0.951, 0.912, 0.97, 0.5, 0.93]) == 0.91
    assert target_from_reference([0.9, 0.9]) == 0.9


def test_time_to_accuracy_summary_has_a_row_per_cell_with_its_misses_and_ratio():
    import time_to_accuracy

    def run(hosts, contender, seed, reached_at):
        accuracy = [0.5, 0.95 if reached_at else 0.6]
        return {"hosts": hosts, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"epochs": e + 1, "accuracy": a, "emulated_seconds":
                                 (reached_at or 10.0) * (e + 1) / 2}
                                for e, a in enumerate(accuracy)]}

    runs = [run(1, "exact", s, 10.0 + s) for s in range(1, 6)]
    runs += [run(2, "powersgd:2", s, 5.0 + s if s != 3 else None) for s in range(1, 6)]
    runs += [{"hosts": 2, "contender": "ddp-powersgd:2", "seed": 1, "failed": 1}]
    rows = time_to_accuracy.summarise(runs, 0.9, "1gbit", 0.01)
    assert [(r["hosts"], r["contender"]) for r in rows] == [(1, "exact"), (2, "powersgd:2")]
    one, two = rows
    assert (one["seeds"], one["reached"], one["score_seconds"]) == (5, 5, 13.0)
    # 6, 7, 9, 10 and a miss: 6 and the miss dropped.
    assert (two["reached"], two["score_seconds"]) == (4, pytest.approx(26 / 3))
    assert two["ratio_to_one_host"] == pytest.approx(26 / 3 / 13)
    assert two["exact"] is False and one["exact"] is True
    assert two["seconds_by_seed"]["3"] is None
    assert two["final_accuracy_mean"] == (4 * 0.95 + 0.6) / 5
    assert {"model", "bandwidth", "host_step_seconds", "median_epochs_to_target",
            "final_accuracy_spread"} <= set(two)


def test_time_to_accuracy_scores_a_given_target_again_at_the_lower_one_its_own_seeds_fix():
    """A target given from another file (another CPU) where this file's one-host exact seeds
    fix a lower one: the page scores the same runs there too, a run stopped at the given
    target counting as reached at its first evaluation above the lower one; never above."""
    import time_to_accuracy

    def run(contender, seed, accuracies):
        return {"hosts": 1, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"step": e, "epochs": float(e), "accuracy": a,
                                 "emulated_seconds": 10.0 * e, "wall_seconds": 10.0 * e}
                                for e, a in enumerate(accuracies, 1)]}

    # Best accuracies 0.895, 0.91, 0.92, 0.93, 0.88: all but one reach 0.89, two miss 0.90.
    runs = [run("exact", s, [0.5, best]) for s, best in
            zip(range(1, 6), (0.895, 0.91, 0.92, 0.93, 0.88))]
    # Stopped at 0.90 at step 3: it passed 0.89 at step 2 already.
    runs += [run("powersgd:2", s, [0.6, 0.895, 0.9]) for s in range(1, 6)]
    given = {"accuracy": 0.9, "how": "given (--target 0.90): another CPU's"}
    data = {"target": given, "runs": runs, "bandwidth": "1gbit",
            "summary": time_to_accuracy.summarise(runs, 0.9, "1gbit", None)}
    assert [r["score_seconds"] for r in data["summary"]] == [None, 30.0]  # exact: 2 misses
    own = time_to_accuracy.own_target(data)
    assert own["accuracy"] == 0.89
    exact, compressed = own["summary"]
    assert (exact["reached"], exact["score_seconds"]) == (4, 20.0)
    assert (compressed["reached"], compressed["score_seconds"]) == (5, 20.0)
    table = time_to_accuracy.mlperf_table(data)
    assert "The same runs scored at 0.89" in table and "another CPU's" in table
    # Fixed by its own seeds, or a higher target than given: no second scoring.
    assert time_to_accuracy.own_target({**data, "target": {"accuracy": 0.89, "how": "the "
                                                           "highest accuracy ..."}}) is None
    assert time_to_accuracy.own_target({**data, "target": {**given, "accuracy": 0.85}}) is None


def test_time_to_accuracy_compares_cells_at_equal_epochs_and_marks_runs_that_stopped():
    import time_to_accuracy

    def run(hosts, contender, seed, accuracies):
        return {"hosts": hosts, "contender": contender, "seed": seed,
                "evaluations": [{"epochs": float(e + 1), "accuracy": a}
                                for e, a in enumerate(accuracies)]}

    runs = [run(1, "exact", 1, [0.2, 0.4, 0.6]), run(1, "exact", 2, [0.4, 0.6, 0.8]),
            run(2, "powersgd:2", 1, [0.4, 0.9]), run(2, "powersgd:2", 2, [0.3, 0.7, 0.75]),
            {"hosts": 2, "contender": "powersgd:2", "seed": 3, "failed": 1}]
    lines = time_to_accuracy.equal_epochs_table({"runs": runs}).splitlines()
    assert lines[0] == "| hosts | contender | epoch 1 | epoch 2 | epoch 3 |"
    assert lines[2] == "| 1 | exact | 0.300 | 0.500 | 0.700 |"
    # Seed 1 stopped at the target after epoch 2: epoch 3 is seed 2's alone, marked so.
    assert lines[3] == "| 2 | powersgd:2 | 0.350 (+5.0) | 0.800 (+30.0) | 0.750 (+5.0) [1 of 2] |"


def test_time_to_accuracy_interleaves_the_reference_with_the_cells_once_a_target_is_fixed(
        monkeypatch, tmp_path):
    import time_to_accuracy

    ran = []

    def fake_run(args, hosts, contender, seed, speed, stop_at, scratch, cores=None):
        ran.append((hosts, contender, seed, stop_at))
        return {"hosts": hosts, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"step": 1, "epochs": 1.0, "accuracy": 0.6,
                                 "emulated_seconds": float(hosts), "wall_seconds": 1.0}]}

    monkeypatch.setattr(time_to_accuracy, "run_once", fake_run)
    common = ["--data", "x", "--image-size", "64", "--lr", "0.01", "--epochs", "1", "--seeds",
              "1", "2", "--cells", "2:exact", "1:exact", "--output", str(tmp_path / "a.json")]
    assert time_to_accuracy.main([*common, "--target", "0.5", "--interleave"]) == 0
    # Seed by seed, the reference first in each, and it stops at the target too.
    assert ran == [(1, "exact", 1, 0.5), (2, "exact", 1, 0.5), (1, "exact", 2, 0.5),
                   (2, "exact", 2, 0.5)]
    ran.clear()
    common[-1] = str(tmp_path / "b.json")
    with pytest.raises(SystemExit, match="--interleave needs a fixed target"):
        time_to_accuracy.main([*common, "--interleave"])
    assert ran == []


def test_results_name_the_cpu_with_its_family_model_and_vector_unit(tmp_path):
    """A VM may cut the model name to the line ("AMD EPYC"): two CPUs of that name, one with
    AVX-512 and one without, are told apart by what follows it."""
    import bench_common

    def info(flags):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 26\n"
                        f"model\t\t: 2\nflags\t\t: fpu {flags}\n\nprocessor\t: 1\n")
        return bench_common.cpu_name("AMD EPYC", str(path))

    assert info("avx2 avx512f avx512_bf16") == "AMD EPYC (family 26 model 2, AVX-512 with BF16)"
    assert info("avx2") == "AMD EPYC (family 26 model 2, AVX2)"
    assert bench_common.cpu_name("x", str(tmp_path / "absent")) == "x"


def test_time_to_accuracy_adds_no_run_to_a_file_of_another_cpu(monkeypatch, tmp_path, capsys):
    """A file's times and roundings are one CPU's: a run on another is refused in one line,
    exit 2, the file unchanged; each run records the CPU it ran on."""
    import json

    import time_to_accuracy

    def fake_run(args, hosts, contender, seed, speed, stop_at, scratch, cores=None):
        return {"hosts": hosts, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"step": 1, "epochs": 1.0, "accuracy": 0.6,
                                 "emulated_seconds": 1.0, "wall_seconds": 1.0}]}

    monkeypatch.setattr(time_to_accuracy, "run_once", fake_run)
    out = tmp_path / "a.json"
    argv = ["--data", "x", "--image-size", "64", "--lr", "0.01", "--epochs", "1", "--seeds",
            "1", "--cells", "1:exact", "--output", str(out)]
    assert time_to_accuracy.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["runs"][0]["cpu_model"] == data["cpu_model"]
    data["cpu_model"] = "Another CPU"
    out.write_text(json.dumps(data))
    assert time_to_accuracy.main([*argv[:-3], "2", "--cells", "1:exact", "--output",
                                  str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} was measured on Another CPU" in err
    assert json.loads(out.read_text()) == data


def test_time_to_accuracy_runs_jobs_at_once_each_on_its_own_cores(monkeypatch, tmp_path,
                                                                  capsys):
    """--jobs 2: the reference's seeds run two at a time, each pinned to its own core, and
    the target is fixed from them before any other cell starts; a --jobs the cells do not
    fit is one line and exit 2."""
    import json
    import threading

    import time_to_accuracy

    monkeypatch.setattr(time_to_accuracy.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    both = threading.Barrier(2, timeout=60)  # the two runs of a wave meet: they ran at once
    ran = []

    def fake_run(args, hosts, contender, seed, speed, stop_at, scratch, cores=None):
        both.wait()
        ran.append((hosts, contender, seed, stop_at, tuple(cores)))
        return {"hosts": hosts, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"step": 1, "epochs": 1.0, "accuracy": 0.5 + seed / 100,
                                 "emulated_seconds": 1.0, "wall_seconds": 1.0}]}

    monkeypatch.setattr(time_to_accuracy, "run_once", fake_run)
    output = tmp_path / "a.json"
    common = ["--data", "x", "--image-size", "64", "--lr", "0.01", "--epochs", "1", "--seeds",
              "1", "2", "--cells", "1:exact", "1:powersgd:2"]
    assert time_to_accuracy.main([*common, "--jobs", "2", "--output", str(output)]) == 0
    references, others = ran[:2], ran[2:]
    assert {r[:4] for r in references} == {(1, "exact", 1, None), (1, "exact", 2, None)}
    assert {r[4] for r in references} == {(0,), (1,)}  # a core each
    # The target (0.52: all but one of the reference's seeds reach it) came before them.
    assert {r[:4] for r in others} == {(1, "powersgd:2", 1, 0.52), (1, "powersgd:2", 2, 0.52)}
    data = json.loads(output.read_text())
    assert data["jobs"] == 2 and len(data["runs"]) == 4
    assert "2 runs at once, each pinned to its own cores" in time_to_accuracy.mlperf_setting(data)
    with pytest.raises(SystemExit) as exit_:
        time_to_accuracy.main([*common, "--cells", "2:exact", "--jobs", "2", "--output",
                               str(tmp_path / "b.json")])
    assert exit_.value.code == 2 and not (tmp_path / "b.json").exists()
    assert "need 4 cores, this machine gives 3: give --jobs 1 or fewer" in capsys.readouterr().err


def test_time_to_accuracy_records_the_emulated_seconds_between_epochs(monkeypatch, tmp_path):
    """A run's record keeps, per pair of epochs, the emulated seconds from one's last step to
    the next one's first (validation and checkpoint): wall / the run's dilation."""
    import argparse

    import bench_common
    import time_to_accuracy

    target = {"reached": False, "evaluations": [
        {"step": 2, "epochs": 1.0, "accuracy": 0.3, "emulated_seconds": 1.0, "wall_seconds": 25.0}]}
    epochs = [{"train_loss": 2.0, "started_at": 100.0, "ended_at": 150.0},
              {"train_loss": 1.5, "started_at": 200.0, "ended_at": 250.0}]
    ran = bench_common.Emulated(["hybriddl", "emulate"], 0, "", {"dilation": 25.0}, 300.0)
    monkeypatch.setattr(time_to_accuracy, "emulated_cell",
                        lambda *a, **k: (ran, {"target": target, "epochs": epochs}))
    args = argparse.Namespace(usecase="SimpleBig", data="x", image_size=64, batch_size=32,
                              lr=0.01, epochs=2, model=None, eval_every=None, cores_per_host=1,
                              bandwidth="1gbit")
    record = time_to_accuracy.run_once(args, 2, "exact", 1, [], None, tmp_path)
    assert record["between_epochs_seconds"] == [2.0]  # (200 - 150) s wall / 25


def test_time_to_accuracy_says_where_hosts_took_turns_on_the_cores():
    """4 one-core hosts on 2 cores take turns (D = 2): the lead and the README's footnote
    say so, where 2 hosts ran side by side."""
    import time_to_accuracy
    import write_docs

    data = {"cores_per_host": 1, "speedup": None,
            "runs": [{"hosts": 1, "time_scale": 1.0}, {"hosts": 4, "time_scale": 2.0}]}
    assert time_to_accuracy.taking_turns(data) == {4: 2.0}
    assert "4 of them taking turns on this machine's cores (D = 2, which slows every " \
           "exchange), fewer side by side" in time_to_accuracy.host_speed(data)
    assert time_to_accuracy.host_speed({**data, "runs": data["runs"][:1]}).endswith(
        "side by side")
    assert write_docs.shared_cores({4: 2.0}) == "D = 2 at 4 hosts; D = 1, side by side, elsewhere"
    assert write_docs.shared_cores({}) == "D = 1 here: side by side"


def test_time_to_accuracy_claims_hosts_against_one_at_its_own_target_where_one_host_missed():
    """A given target one host exact misses twice has no one-host score, so no ratio; at the
    lower target its own one-host seeds fix, both are scored and the claim says which target
    that is. A synthetic file: 1 host reaches 0.9 in 2 of 5, 0.89 in 4 of 5; 2 hosts 0.89
    in 4 of 5 in less time."""
    import time_to_accuracy

    def run(hosts, seed, accuracies, seconds, contender="exact"):
        return {"hosts": hosts, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"step": e, "epochs": float(e), "accuracy": a,
                                 "emulated_seconds": seconds * e, "wall_seconds": seconds * e}
                                for e, a in enumerate(accuracies, 1)]}

    ones = [0.91, 0.905, 0.895, 0.893, 0.85]
    runs = [run(1, s, [0.5, best], 10.0) for s, best in enumerate(ones, 1)]
    runs += [run(2, s, [0.5, best], 8.0) for s, best in enumerate(ones, 1)]
    data = {"usecase": "SimpleBig", "image_size": 64, "cores_per_host": 1, "bandwidth": "1gbit",
            "epoch_cap": 2,
            "cpu_model": "AMD", "target": {"accuracy": 0.9, "how": "given (--target)"},
            "runs": runs, "summary": time_to_accuracy.summarise(runs, 0.9, "1gbit", None)}
    assert time_to_accuracy.compressed_row(data, "page") is None  # more hosts: a table's row
    page = "time_to_accuracy-mnist-SimpleBig-1gbit-s1-interleaved"
    _, _, _, _, row = time_to_accuracy.hosts_table([time_to_accuracy.hosts_row(data, page)])
    assert time_to_accuracy.headline_claim([time_to_accuracy.hosts_row(data, page)], []) == (
        "**2 hosts reach AlexNet's target accuracy on real images in 0.80× one host's time "
        "(exact; SimpleBig (alexnet, 64 px), 1gbit links, at most 2 epochs; 2 of 1 core(s), "
        "S = 1, side by side; AMD; MLPerf-scored over 5 seeds).**")
    assert row.endswith("| 0.80× (runs not interleaved: indicative) | not measured |")
    data["commands"] = ["python scripts/time_to_accuracy.py ... --interleave --target 0.9"]
    _, _, _, _, row = time_to_accuracy.hosts_table([time_to_accuracy.hosts_row(data, page)])
    assert row == (f"| [SimpleBig (alexnet, 64 px), 1gbit links, at most 2 epochs]"
                   f"(docs/benchmarks/{page}.md) | "
                   "2 of 1 core(s), S = 1, side by side (AMD) | 0.89 (its own; 0.9 given: one "
                   "host 2/5) | 4/5, 20 s | exact: 4/5, 16 s | 0.80× | not measured |")
    # 2 hosts reaching neither target: no score, each epoch's time against one host's.
    runs[5:] = [run(2, s, [0.5, 0.85], 8.0) for s in range(1, 6)]
    missed = {**data, "summary": time_to_accuracy.summarise(runs, 0.9, "1gbit", None)}
    claim, _, _, _, row = time_to_accuracy.hosts_table([time_to_accuracy.hosts_row(missed, "p")])
    assert "with the most runs, newest; each CPU's row: [docs/benchmarks]" in claim
    assert time_to_accuracy.headline_claim([time_to_accuracy.hosts_row(missed, "p")], []) is None
    assert row.endswith("| exact: 0/5, none | none (an epoch 0.80×) | not measured |")
    # The best of hybriddl's cells on more hosts, DDP + PowerSGD's beside it.
    runs += [run(2, s, [0.5, 0.95], 6.0, "powersgd:2") for s in range(1, 6)]
    runs += [run(2, s, [0.5, 0.95], 9.0, "ddp-powersgd:2") for s in range(1, 6)]
    both = {**data, "summary": time_to_accuracy.summarise(runs, 0.9, "1gbit", None)}
    _, _, _, _, row = time_to_accuracy.hosts_table([time_to_accuracy.hosts_row(both, "p")])
    assert "2 hosts reach AlexNet's target accuracy on real images in 0.60× one host's time " \
           "(powersgd:2, **not exact**;" in time_to_accuracy.headline_claim(
               [time_to_accuracy.hosts_row(both, "p")], [])
    assert row.endswith("| powersgd:2 (**not exact**): 5/5, 12 s | 0.60× | 0.90× |")


def test_time_to_accuracy_makes_no_readme_claim_from_a_one_host_reference_that_ran_slowed():
    """A file whose one-host runs were timed slower than that host trains (`reference_slowed`:
    before e28cbb0 one MPI rank copied its gradient for nothing) keeps its page, which says
    so first, but makes no README claim from ratios to that reference."""
    import json

    import time_to_accuracy

    data = json.loads((REPO / "results" / "time_to_accuracy-mnist-SimpleBig-1gbit-s1.json"
                       ).read_text())
    data.pop("reference_slowed", None)
    assert time_to_accuracy.hosts_row(data, "page")  # a row, from 2 hosts against one
    slowed = {**data, "reference_slowed": "why."}
    assert time_to_accuracy.hosts_row(slowed, "page") is None
    assert time_to_accuracy.mlperf_setting(slowed).startswith(
        "**Its one-host reference ran slowed**: why. ")


def test_time_to_accuracy_judges_one_hosts_compressed_schemes_against_ddp_by_the_target():
    """A one-host file with DDP + PowerSGD beside hybriddl's PowerSGD gives the README one
    row: exact, hybriddl's best compressed cell and DDP's (the most seeds reaching the
    target first), and the other cells' seeds; a one-host file without the peer gives none."""
    import time_to_accuracy

    PAGE = "time_to_accuracy-mnist-SimpleBig-1core-vs-ddp"

    def run(contender, seed, accuracies, seconds=10.0):
        return {"hosts": 1, "contender": contender, "seed": seed, "model": "alexnet",
                "evaluations": [{"step": e, "epochs": float(e), "accuracy": a,
                                 "emulated_seconds": seconds * e, "wall_seconds": seconds * e}
                                for e, a in enumerate(accuracies, 1)]}

    runs = [run("exact", s, [0.5, 0.91]) for s in (1, 2)] + \
        [run("powersgd:2", 1, [0.4, 0.7], 8.0), run("powersgd:2", 2, [0.4, 0.92], 8.0),
         run("powersgd:1", 1, [0.4, 0.6], 8.0), run("powersgd:1", 2, [0.4, 0.6], 8.0),
         run("ddp-powersgd:2", 1, [0.3, 0.6], 20.0), run("ddp-powersgd:2", 2, [0.3, 0.5], 20.0)]
    data = {"usecase": "SimpleBig", "image_size": 64, "cores_per_host": 1, "cpu_model": "AMD",
            "bandwidth": "1gbit",
            "target": {"accuracy": 0.9}, "runs": runs,
            "summary": time_to_accuracy.summarise(runs, 0.9, "1gbit", None)}
    row = time_to_accuracy.compressed_row(data, PAGE)
    lead, blank, header, rule, line = time_to_accuracy.compressed_table([row])
    assert lead.startswith("**Compressed schemes, judged by accuracy** (not exact;")
    assert blank == "" and header.startswith("| workload (CPU) | target | exact | hybriddl's best")
    # Target given, no lower one of its own: that target, the best of each side, the rest.
    assert line == (f"| [SimpleBig (alexnet, 64 px), one host of 1 core(s)](docs/benchmarks/"
                    f"{PAGE}.md) (AMD) | 0.9 | 2/2, none; last accuracy 0.910 (0.910–0.910) | "
                    "powersgd:2: 1/2, none; last accuracy 0.810 (0.700–0.920) | "
                    "ddp-powersgd:2: 0/2, none; last accuracy 0.550 (0.500–0.600) | "
                    "powersgd:1 0/2 |")
    assert time_to_accuracy.headline_claim([], [row]) == (
        "**compressed, hybriddl's powersgd:2 trains AlexNet to 0.9 in 1 of 2 seeds, DDP + "
        "PowerSGD's ddp-powersgd:2 in 0 of 2.**")
    # Given from another CPU's file, where its own exact seeds fix a lower target: scored
    # at that one (MLPerf's score, against exact's), which the row names.
    runs += [run("exact", s, [0.5, 0.91]) for s in (3, 4)]
    runs += [run("exact", 5, [0.5, 0.8]), run("powersgd:2", 3, [0.4, 0.915], 8.0),
             run("ddp-powersgd:2", 3, [0.3, 0.4], 20.0)]
    given = {**data, "runs": runs, "target": {"accuracy": 0.92, "how": "given (--target)"},
             "summary": time_to_accuracy.summarise(runs, 0.92, "1gbit", None)}
    *_, line = time_to_accuracy.compressed_table([time_to_accuracy.compressed_row(given, PAGE)])
    assert "| 0.91 (its own; 0.92 given) | 4/5, 20 s (1.00× exact's);" in line
    assert "| powersgd:2: 2/3, 16 s (0.80× exact's);" in line
    no_peer = [r for r in runs if not r["contender"].startswith("ddp")]
    assert time_to_accuracy.compressed_row(
        {**data, "summary": time_to_accuracy.summarise(no_peer, 0.9, "1gbit", None)},
        PAGE) is None


def test_the_readme_keeps_a_time_to_accuracy_row_per_workload_and_the_index_per_cpu():
    """Of several files for one workload (model, image size, link, host step), the README's
    table keeps the one capped last, then interleaved, then with the most runs, then
    newest, whatever its CPU; the benchmarks index keeps that row per CPU (another CPU is
    another host at S = 1), so no measurement leaves the docs."""
    import time_to_accuracy

    def found(page, cap, interleaved=True, runs=10, date="2026-11-28", link="1gbit",
              cpu="AMD EPYC"):
        return {"page": page, "workload_key": ("alexnet", 64, link, None, cpu),
                "preference": (cap, interleaved, runs, date)}

    rows = [found("a", 6), found("b", 8, False), found("c", 8, True, 8),
            found("d", 6, link="10gbit"), found("e", 8, True, 8, "2026-11-29"),
            found("f", 6, cpu="Intel Xeon")]
    assert [r["page"] for r in time_to_accuracy.headline_rows(rows)] == ["e", "d"]
    assert [r["page"] for r in time_to_accuracy.headline_rows(rows, every_cpu=True)] == \
        ["e", "d", "f"]
    # From a file: its CPU is in the key.
    data = {"usecase": "SimpleBig", "image_size": 64, "cores_per_host": 1, "bandwidth": "1gbit",
            "epoch_cap": 2, "cpu_model": "Intel Xeon", "target": {"accuracy": 0.5},
            "summary": [{"hosts": h, "contender": "exact", "exact": True, "model": "alexnet",
                         "score_seconds": 10.0 / h, "seeds": 5, "reached": 5,
                         "ratio_to_one_host": 1.0 / h} for h in (1, 2)]}
    assert time_to_accuracy.hosts_row(data, "g")["workload_key"][-1] == "Intel Xeon"


def test_time_to_accuracy_reads_the_interleaved_check_seed_by_seed():
    import time_to_accuracy

    def run(hosts, seed, seconds, epochs):
        return {"hosts": hosts, "seed": seed,
                "evaluations": [{"epochs": epochs, "emulated_seconds": seconds}]}

    data = {"interleaved_check": {"runs": [run(1, 6, 600.0, 6.0), run(2, 6, 300.0, 5.0),
                                           run(1, 7, 400.0, 5.0), run(2, 7, 240.0, 6.0),
                                           run(2, 8, 100.0, 1.0)]}}
    # Seed 6: 60 s against 100 s an epoch; seed 7: 40 against 80; seed 8 has no one-host run.
    assert time_to_accuracy.interleaved_ratios(data) == {2: [0.6, 0.5]}
    assert time_to_accuracy.interleaved_ratios({}) == {}


def test_time_to_accuracy_auto_cell_names_what_the_planner_picked_and_its_exactness():
    import time_to_accuracy

    def run(seed, picked, exact):
        return {"hosts": 2, "contender": "auto", "seed": seed, "model": "alexnet",
                "plan_chosen": {"scheme": picked, "exact": exact},
                "evaluations": [{"epochs": 1, "accuracy": 0.95, "emulated_seconds": 1.0}]}

    inexact = "hybrid + powersgd:1:rounds=2 + bf16 features"
    rows = time_to_accuracy.summarise([run(1, inexact, False), run(2, "hybrid", True)],
                                      0.9, "1gbit", 0.01)
    assert rows[0]["picked"] == ["hybrid", inexact] and rows[0]["exact"] is False
    assert time_to_accuracy.contender_text(rows[0]) == f"auto (picked: hybrid / {inexact})"
    all_exact = time_to_accuracy.summarise([run(1, "hybrid", True)], 0.9, "1gbit", 0.01)
    assert all_exact[0]["exact"] is True
    table = time_to_accuracy.mlperf_table({"summary": rows, "runs": []})
    assert f"| 2 | auto (picked: hybrid / {inexact}) | **no** |" in table


def test_time_to_accuracy_runs_ddp_at_the_min_compression_rate_its_cell_names(monkeypatch,
                                                                              tmp_path):
    """'ddp-powersgd:2:min_rate=200' is DDP's hook keeping the same layers dense as hybriddl's
    'powersgd:2:min_rate=200': compare_ddp gets the rate; a cell without it, torch's own;
    'ddp', DDP's own allreduce."""
    import argparse

    import time_to_accuracy

    commands = []

    def cell(options, command, *rest, **kw):
        commands.append(command)
        return bench_common.Emulated(["x"], 1, "", None, 1.0), None

    import bench_common
    monkeypatch.setattr(time_to_accuracy, "emulated_cell", cell)
    args = argparse.Namespace(usecase="SimpleBig", data="x", image_size=64, batch_size=32,
                              lr=0.01, epochs=2, model=None, eval_every=None, cores_per_host=1,
                              bandwidth="1gbit")
    for contender in ("ddp-powersgd:2:min_rate=200", "ddp-powersgd:4", "ddp"):
        assert time_to_accuracy.parse_cell(f"1:{contender}") == (1, contender)
        time_to_accuracy.run_once(args, 1, contender, 1, [], None, tmp_path)
    rated, plain, exact = (shlex.split(command[-1]) for command in commands)  # sh -c 'exec'
    assert rated[rated.index("--powersgd-rank") + 1] == "2"
    assert rated[rated.index("--powersgd-min-rate") + 1] == "200"
    assert plain[plain.index("--powersgd-rank") + 1] == "4" and "--powersgd-min-rate" not in plain
    # 'ddp': the peer's loop with DDP's own allreduce, no hook flag; exact in the summary.
    assert "hybriddl.cli.compare_ddp" in exact and "--powersgd-rank" not in exact
    run = {"hosts": 1, "contender": "ddp", "seed": 1, "model": "alexnet",
           "evaluations": [{"step": 1, "epochs": 1.0, "accuracy": 0.5, "emulated_seconds": 1.0}]}
    assert time_to_accuracy.summarise([run], 0.9, "1gbit", None)[0]["exact"] is True


@pytest.mark.parametrize("cell", ["0:exact", "two:exact", "2:", "2:topk:3",
                                  "1:ddp-powersgd:2:min_rate=0", "1:ddp-powersgd:2:start=5"])
def test_time_to_accuracy_refuses_a_cell_it_cannot_run(cell):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "time_to_accuracy.py"),
                           "--data", "x", "--image-size", "64", "--lr", "0.01", "--epochs",
                           "1", "--seeds", "1", "--output", "x.json", "--cells", cell],
                          capture_output=True, text=True, cwd=REPO, env=hybriddl_env())
    assert done.returncode == 2 and "--cells" in done.stderr.strip().splitlines()[-1]


def test_digits_imagefolder_refuses_a_folder_that_holds_files(tmp_path):
    (tmp_path / "kept.txt").write_text("mine")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "digits_imagefolder.py"),
                           str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          env=hybriddl_env())
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def test_scaling_runs_a_cell_of_a_later_round_in_a_fresh_run_directory(monkeypatch, tmp_path):
    """train refuses a run directory that exists: round 2 must not find round 1's."""
    import bench_common
    import scaling_e2e

    args = scaling_e2e.parse_args(["--hosts", "2", "--cores-per-host", "1", "--rounds", "2",
                                   "--output", "x.json"])
    args.image_size = 64
    found = []

    def run(command, **kwargs):
        run_dir = Path(command[command.index("--run-dir") + 1])
        found.append(run_dir.exists())
        run_dir.mkdir()  # what a train run leaves behind
        return subprocess.CompletedProcess(command, 2, "", "hybriddl: stop")

    monkeypatch.setattr(bench_common.subprocess, "run", run)
    for _ in range(2):
        cell = scaling_e2e.run_cell(args, "hybrid", 2, "1gbit", tmp_path)
        assert cell["failed"] == 2
    assert found == [False, False]


def test_scaling_e2e_records_hybriddl_and_ddp_cells_in_emulated_seconds(monkeypatch, tmp_path):
    """Both kinds of cell record their steps as wall seconds / (S·D), after the warm-up,
    and images/s from the median; each keeps what only it measures."""
    import bench_common
    import scaling_e2e

    args = scaling_e2e.parse_args(["--hosts", "2", "--cores-per-host", "1", "--warmup", "1",
                                   "--output", "x.json"])
    args.image_size = 64
    report = {"speedup": 10.0, "time_scale": 1.0, "dilation": 10.0}
    metrics = {"config": {"global_batch": 64, "strategy": "intraop", "host_parallel": "hybrid"},
               "epochs": [{"per_step": {"seconds": [9.0, 2.0, 4.0, 3.0],
                                        "nic_bytes_sent": [0, 5, 7, 6]}}]}
    rank0 = {"step_seconds": [2.0, 4.0], "nic_bytes_sent": 12, "timed_steps": 2,
             "strategy": "ddp", "peak_rss_bytes": 1, "comm_hook": None, "warmup": 1}

    def cell(options, command, result_dir, name="metrics.json"):
        ran = bench_common.Emulated(["hybriddl", "emulate"], 0, "", report, 30.0)
        return ran, (rank0 if name == "rank0.json" else metrics)

    monkeypatch.setattr(scaling_e2e, "emulated_cell", cell)
    ours = scaling_e2e.run_cell(args, "hybrid", 2, "1gbit", tmp_path)
    assert ours["emulated_step_seconds"] == [0.2, 0.4, 0.3]
    assert ours["images_per_second"] == pytest.approx(64 / 0.3)
    assert ours["median_nic_bytes_per_step"] == 6 and ours["host_parallel"] == "hybrid"
    assert (ours["speedup"], ours["dilation"], ours["wall_seconds"]) == (10.0, 10.0, 30.0)
    peer = scaling_e2e.run_cell(args, "ddp", 2, "1gbit", tmp_path)
    assert peer["emulated_step_seconds"] == [0.2, 0.4] and peer["median_nic_bytes_per_step"] == 6
    assert peer["global_batch"] == 2 * scaling_e2e.get_usecase(args.usecase).batch_size
    assert peer["host_parallel"] is None and peer["memory"] == {"peak_rss_bytes": 1}


def test_a_results_header_names_the_code_that_differs_from_its_commit(tmp_path, monkeypatch):
    """A benchmark run on edits not committed yet (or on a copy whose .git is older than its
    files) says so in its results file, beside the commit it names."""
    import subprocess

    import bench_common

    repo = tmp_path / "repo"
    (repo / "hybriddl").mkdir(parents=True)
    (repo / "hybriddl" / "a.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    monkeypatch.setattr(bench_common, "REPO", repo)
    assert "code_changed_since_commit" not in bench_common.results_header("x.py", [])
    (repo / "hybriddl" / "a.py").write_text("x = 2\n")
    header = bench_common.results_header("x.py", [])
    assert header["code_changed_since_commit"] == ["hybriddl/a.py"] and header["commit"]


def test_scaling_e2e_cells_train_for_the_figures_only():
    """Its hybriddl cells time steps: no checkpoint, validation or model.pt after them
    (PowerSGD's error buffers and the split classifier crossed a slow link for minutes)."""
    from pathlib import Path

    import scaling_e2e

    args = scaling_e2e.parse_args(["--hosts", "2", "--cores-per-host", "1", "--output", "x.json"])
    for contender in ("hybrid", "data-powersgd", "flat"):
        train, _ = scaling_e2e.train_args(args, contender, 2, Path("run"))
        assert train[0] == "train" and "--measure-only" in train, contender


def test_bench_powersgd_times_both_ways_side_by_side_and_names_the_cpu(tmp_path):
    import json

    import bench_powersgd

    out = tmp_path / "powersgd.json"
    assert bench_powersgd.main(["--models", "squeezenet1_1", "--rounds", "2", "--steps", "1",
                                "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cpu_model"] and result["command"].startswith("python scripts/bench_powersgd.py")
    rows = result["rows"]
    assert [r["variant"] for r in rows] == ["row chunks", "whole-matrix products"]
    assert all(r["steps_timed"] == 2 and r["seconds_per_step"] > 0 for r in rows)
    assert rows[1]["vs_whole_matrix"] == 1.0
    with pytest.raises(SystemExit):
        bench_powersgd.parse_args(["--rounds", "0"])


def test_powersgd_cost_times_every_contender_side_by_side_and_names_the_device(tmp_path):
    """scripts/powersgd_cost.py, issue 54's GPU measurement, checked on the CPU (a process of
    its own: it holds a gloo group of one)."""
    import json

    from hybriddl.usecases import build_model

    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "powersgd_cost.py"),
                           "--device", "cpu", "--models", "squeezenet1_1", "--image-size", "32",
                           "--batch-size", "4", "--repeats", "2", "--output", str(out)],
                          capture_output=True, text=True, env=hybriddl_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and "gpu_name" not in result and result["cpu_model"]
    assert isinstance(result["git_status_porcelain"], list)
    [model] = result["models"]
    seconds = model["seconds"]
    assert {"hybriddl powersgd:2", "hybriddl powersgd:2:rounds=2", "gradient to host and back",
            "ddp powerSGD_hook:2 minus allreduce_hook",
            "hybriddl powersgd:2 convolutions", "hybriddl powersgd:2 with QR"} <= seconds.keys()
    assert result["orthogonalisation"] == ("Gram-Schmidt up to rank 4 (on a GPU every group "
                                           "in one batch, since d5cfbd0), QR above")
    # The convolutions alone: what the hybrid scheme compresses (squeezenet's are nearly
    # all of it, so no order is asserted between the two, only that it was timed).
    assert seconds["hybriddl powersgd:2 convolutions"]["median"] > 0
    assert all(seconds[k]["median"] > 0 for k in seconds
               if k != "ddp powerSGD_hook:2 minus allreduce_hook")
    assert model["gradient_bytes"] == 4 * sum(
        p.numel() for p in build_model("squeezenet1_1", 10).parameters())



def test_planner_check_compares_the_plans_step_with_the_median_emulated_step(monkeypatch,
                                                                           tmp_path):
    """The prediction is the chosen row of the run's plan, the measurement the median of the
    steps after the warm-up in emulated seconds (wall / dilation)."""
    import json

    import bench_common
    import planner_check

    real_run = subprocess.run

    def run(command, **kwargs):
        if "--run-dir" not in command:  # git, for the results header
            return real_run(command, **kwargs)
        run_dir = Path(command[command.index("--run-dir") + 1])
        run_dir.mkdir(parents=True)
        report = Path(command[command.index("--report") + 1])
        report.write_text(json.dumps({"dilation": 200.0}))
        row = {"scheme": "hybrid", "exact": True, "step_seconds": 0.1, "compute_seconds": 0.002,
               "wire_seconds": 0.098, "latency_seconds": 0.0, "compression_seconds": 0.0,
               "overlap_seconds": 0.0, "nic_bytes_per_step": 11582976}
        plan = {"rows": [{**row, "scheme": "data", "step_seconds": 2.9}, row],
                "chosen": {"scheme": "hybrid"}, "reason": "asked",
                "inputs": {"link_bytes_per_second": 1.2e8, "latency_seconds": 1e-6}}
        # wall seconds: a warm-up step, then 20, 25, 24 s (emulated 0.100, 0.125, 0.120)
        per_step = {"seconds": [60.0, 20.0, 25.0, 24.0], "comm_seconds": [50.0, 16, 21, 20],
                    "compute_seconds": [10.0, 4, 4, 4], "nic_bytes_sent": [1, 2, 3, 4]}
        (run_dir / "metrics.json").write_text(json.dumps(
            {"config": {"plan": plan}, "epochs": [{"per_step": per_step}]}))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench_common.subprocess, "run", run)  # every benchmark's cell runner
    output = tmp_path / "check.json"
    assert planner_check.main(["--speedup", "200", "--schemes", "hybrid", "--warmup", "1",
                               "--steps", "3", "--output", str(output)]) == 0
    [row] = json.loads(output.read_text())["runs"]
    assert row["chosen"] == "hybrid" and row["predicted_step_seconds"] == 0.1
    assert row["measured_step_seconds"] == pytest.approx(0.12)
    assert row["error_percent"] == pytest.approx(100 * (0.1 - 0.12) / 0.12)
    assert row["wall_comm_seconds_per_step"] == [16, 21, 20]


def test_fidelity_summary_judges_hosts_at_once_under_a_quota_against_one_alone():
    import emulation_fidelity

    def row(hosts, scale, median, base=1.6):
        return {"hosts": hosts, **emulation_fidelity.step_row([[median]], base, scale)}

    result = {"quota": {"rows": [row(1, 1.0, 1.6), row(2, 1.0, 1.64), row(4, 2.0, 4.0)]}}
    rows = emulation_fidelity.summary(result)
    assert [(r["check"].split(",")[1].strip()[:1], r["time_scale"]) for r in rows] == \
        [("2", 1.0), ("4", 2.0)]
    at_once, quota = rows
    assert at_once["within"] and at_once["error"] == pytest.approx(0.025)
    # 4 hosts at D = 2 taking 4.0 s where one alone takes 1.6: 25 % slower than D accounts for.
    assert not quota["within"] and quota["error"] == pytest.approx(0.25)
    assert emulation_fidelity.parse_args(["--output", "x"]).checks == list("abcdef")


@pytest.mark.root
@pytest.mark.emulated
@pytest.mark.mpi
@pytest.mark.beside  # times nothing, checks only what it started (tests/two_at_once.py)
def test_the_benchmarks_cell_runner_runs_a_command_on_emulated_hosts(tmp_path):
    """bench_common.emulate, through which every benchmark runs its hosts: the command runs
    on each host, from this checkout, and the report comes back (a failure: its output)."""
    import bench_common
    from emulated import can_emulate

    if not can_emulate():
        pytest.skip("emulated hosts need root, ip, tc and unshare")
    marks = tmp_path / "ran"
    marks.mkdir()
    ran = bench_common.emulate(
        bench_common.host_options(2, bandwidth="1gbit"),
        [sys.executable, "-c", "import os, pathlib, hybriddl; pathlib.Path("
         f"{str(marks)!r}, os.environ['OMPI_COMM_WORLD_RANK']).write_text("
         "str(pathlib.Path(hybriddl.__file__).parents[1]))"], tmp_path / "report.json")
    assert ran.returncode == 0, ran.output[-3000:]
    assert ran.report["emulated_hosts"] == 2 and ran.report["bandwidth"] == "1gbit"
    assert ran.dilation == 1 and ran.wall_seconds > 0
    assert {p.name: p.read_text() for p in marks.iterdir()} == {"0": str(REPO), "1": str(REPO)}
    assert ran.shown().startswith("hybriddl emulate --hosts 2 --cores-per-host 1 --bandwidth "
                                  "1gbit --report ")
    failed = bench_common.emulate(bench_common.host_options(1), ["false"],
                                  tmp_path / "report.json")
    assert failed.returncode != 0 and failed.report is None


def test_powersgd_costs_qr_contender_orthogonalises_by_qr_and_puts_gram_schmidt_back(
        monkeypatch):
    """The QR contender (what Gram-Schmidt replaced) really calls QR at rank 2, and the
    other contenders, timed beside it, still run Gram-Schmidt."""
    import torch

    import powersgd_cost
    from hybriddl.hosts import powersgd

    calls = []
    qr = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda a: calls.append(a.shape) or qr(a))
    scheme = powersgd.PowerSGD(2)
    gradients = [torch.randn(16, 8), torch.randn(4)]
    scheme.setup([g.shape for g in gradients])
    powersgd_cost.with_qr(lambda: scheme.aggregate(gradients, lambda w: w))
    assert calls and powersgd.GRAM_SCHMIDT_MAX_RANK == 4
    calls.clear()
    scheme.aggregate(gradients, lambda w: w)
    assert calls == []

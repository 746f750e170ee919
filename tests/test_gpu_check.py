"""scripts/gpu_check.py: the one command that checks a GPU host. Its steps run here with
stand-in commands (no GPU): each outcome recorded, a failure or a hang not fatal to the
next step; without CUDA it writes nothing."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    import gpu_check  # scripts/ is on the path (conftest.py), as when the script runs

    return gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the check runs")
def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(gpu_check, capsys, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)

    def ran(*args):
        raise AssertionError("a step ran without CUDA")

    monkeypatch.setattr(gpu_check, "check", ran)
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err
    assert list(tmp_path.iterdir()) == []


def test_the_plan_fits_twenty_minutes_and_covers_every_part(gpu_check, tmp_path, capsys):
    steps = gpu_check.plan(tmp_path, mpirun="mpirun")
    assert sum(s.limit for s in steps) <= gpu_check.TOTAL_SECONDS == 20 * 60
    shown = {s.name: s.shown() for s in steps}
    assert "scripts/gpu_tests.py" in shown["gpu-tests"]
    assert "scripts/powersgd_cost.py --output results/powersgd_cost-gpu.json" in \
        shown["powersgd-cost"]
    for usecase in ("SimpleBig", "ComplexSmall"):
        assert f"bench_gpu.py --usecase {usecase}" in shown[f"bench-{usecase}"]
        assert f"train --usecase {usecase} --strategy gpu" in shown[f"train-{usecase}"]
    tune = next(s for s in steps if s.name == "tune-SimpleBig")
    assert "--precision auto" in tune.shown()
    budget = float(tune.command[tune.command.index("--budget") + 1])
    assert budget < 600 and tune.limit > budget  # the tune's own start fits beside it
    assert "-np 2" in shown["two-ranks"] and "--host-parallel auto" in shown["two-ranks"]
    assert all(r.startswith("results/") and r.endswith(".json") for s in steps for r in s.results)
    assert gpu_check.main(["--plan"]) == 0 and "total" in capsys.readouterr().out


def test_within_a_short_lease_the_steps_that_matter_most_run_first(gpu_check, tmp_path,
                                                                   capsys):
    """--within: the GPU tests, AlexNet against PyTorch and PowerSGD's compute fit one device
    call of 10 minutes; the rest is printed as the second part's --only line."""
    steps = gpu_check.plan(tmp_path, mpirun="mpirun")
    assert sorted(gpu_check.PRIORITY) == sorted(s.name for s in steps)
    now, rest = gpu_check.within(steps, 540)
    assert [s.name for s in now] == ["gpu-tests", "powersgd-cost", "bench-SimpleBig"]
    assert sum(s.limit for s in now) <= 540
    assert {s.name for s in now} | {s.name for s in rest} == {s.name for s in steps}
    assert gpu_check.within(steps, 1)[0] == []
    assert gpu_check.main(["--plan", "--within", "540"]) == 0
    out = capsys.readouterr().out
    assert "the rest: python scripts/gpu_check.py --only two-ranks" in out
    assert "bench-ComplexSmall" not in out.split("the rest")[0]
    for bad in (["--within", "0"], ["--within", "60", "--only", "gpu-tests"]):
        with pytest.raises(SystemExit):
            gpu_check.main(bad)
    assert "--within SECONDS" in capsys.readouterr().err


def test_a_failing_or_hanging_step_is_recorded_and_the_next_still_runs(gpu_check, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu_check, "MIN_STEP_SECONDS", 0)
    Step = gpu_check.Step

    def record(gpu, header):
        (tmp_path / "ok.json").write_text(json.dumps({**header, "gpu_name": gpu}))

    steps = [Step("fails", ["-c", "print('boom'); raise SystemExit(3)"], 60, []),
             Step("hangs", ["-c", "import time; print('started', flush=True); time.sleep(60)"],
                  2, []),
             Step("ok", ["-c", "pass"], 60, ["results/ok.json"], record=record),
             Step("no-mpirun", ["mpirun"], 60, [], interpreter=False, needs="no mpirun")]
    assert gpu_check.check(steps, "a GPU", []) == 1
    rows = {r["step"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert (rows["fails"]["outcome"], rows["fails"]["exit_code"]) == ("failed", 3)
    assert rows["fails"]["last_lines"] == ["boom"]
    assert rows["hangs"]["outcome"] == "timed out" and rows["hangs"]["seconds"] < 30
    assert rows["hangs"]["last_lines"] == ["started"]
    assert rows["ok"]["outcome"] == "passed"
    assert rows["no-mpirun"] == {**rows["no-mpirun"], "outcome": "not started", "why": "no mpirun"}
    written = json.loads((tmp_path / "ok.json").read_text())
    assert written["gpu_name"] == "a GPU" and written["command"] == "python -c pass"
    assert written["torch"] == torch.__version__ and written["commit"]
    assert written["check_command"].startswith("python scripts/gpu_check.py")


def test_a_check_run_in_parts_keeps_the_other_parts_rows_on_the_same_gpu(gpu_check, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu_check, "MIN_STEP_SECONDS", 0)
    Step = gpu_check.Step
    order = ["first", "second", "third"]
    first = Step("first", ["-c", "raise SystemExit(1)"], 60, [])
    rest = [Step("second", ["-c", "pass"], 60, []), Step("third", ["-c", "pass"], 60, [])]
    assert gpu_check.check([first], "a GPU", [], order) == 1
    assert gpu_check.check(rest, "a GPU", [], order) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["step"], r["outcome"]) for r in rows] == [
        ("first", "failed"), ("second", "passed"), ("third", "passed")]
    assert all(r["commit"] and r["date"] for r in rows)
    # Run again, the failed part replaces its row; on another GPU model nothing is kept.
    assert gpu_check.check([Step("first", ["-c", "pass"], 60, [])], "a GPU", [], order) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["outcome"] for r in rows] == ["passed"] * 3
    assert gpu_check.check([first], "another GPU", [], order) == 1
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["step"] for r in rows] == ["first"]


def test_a_step_the_twenty_minutes_cannot_hold_is_not_started(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu_check, "TOTAL_SECONDS", 0)
    assert gpu_check.check([gpu_check.Step("late", ["-c", "pass"], 60, [])], "a GPU", []) == 1
    row = json.loads((tmp_path / "gpu_check.json").read_text())["rows"][0]
    assert row["outcome"] == "not started" and "minutes were spent" in row["why"]


def fake_gpu_profile():
    """A profile as `hybriddl tune` writes it, its figures made up for the test."""
    from hybriddl.tuning import profiles, tuner
    from hybriddl.strategies import StrategySpec
    from hybriddl.tuning.profiles import MEASURED, CandidateResult, Profile, Settings

    def result(choice, seconds):
        return CandidateResult(choice, MEASURED, seconds_per_step=seconds, timed_steps=3,
                               images_per_second=32 / seconds, round_seconds=[seconds] * 3,
                               spread_seconds=(seconds, seconds), peak_rss_bytes=1)

    gpu = StrategySpec("gpu", devices=("cuda:0",))
    results = [result(tuner.BASELINE, 2.0), result(gpu, 0.2),
               result(replace(gpu, precision="bf16", channels_last=True), 0.1)]
    tuner.add_speedups(results)
    settings = Settings(usecase="SimpleBig", model="alexnet", image_size=224, batch_size=32,
                        precision="auto")
    return Profile(host="gpu-host", fingerprint=profiles.fingerprint(), settings=settings,
                   candidates=results, pick=results[2].choice,
                   measurement={"warmup_steps": 1, "timed_steps": 2, "rounds": 3,
                                "second_look_rounds": 2, "tie_tolerance": 0.03,
                                "budget_seconds": 150.0, "seconds_spent": 140.0})


def test_the_tune_is_recorded_and_docs_benchmarks_gets_its_table(gpu_check, tmp_path,
                                                                  monkeypatch):
    from hybriddl.tuning.profiles import save_profile

    import write_docs
    monkeypatch.setattr(write_docs, "REPO", tmp_path)
    monkeypatch.setattr(write_docs, "BENCHMARKS", tmp_path / "docs" / "benchmarks")
    (tmp_path / "results").mkdir()
    pages, skipped = write_docs.benchmark_pages()
    assert not [p for p in pages if "tune_gpu" in p.name]
    assert "results/tune_gpu-*.json: none measured yet" in "\n".join(skipped)

    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    profile = save_profile(fake_gpu_profile(), tmp_path / "profile.json")
    header = {"cpu_model": "a CPU", "cores": 16, "torch": torch.__version__, "commit": "abc",
              "command": "python -m hybriddl tune ...", "date": "2026-11-25"}
    gpu_check.record_tune(profile, "a GPU", header)
    record = json.loads((tmp_path / "results" / "tune_gpu-SimpleBig.json").read_text())
    assert record["gpu_name"] == "a GPU" and record["pick"] == "gpu cuda:0 bf16 channels_last"
    assert record["bf16_gain"].startswith("bf16 autocast measured 2.00x float32's speed on gpu")

    pages, skipped = write_docs.benchmark_pages()
    page = pages[(tmp_path / "docs" / "benchmarks" / "tune_gpu-SimpleBig").with_suffix(".md")]
    assert "# Tuning a GPU host: SimpleBig" in page and "- **GPU**: a GPU" in page
    assert "| gpu cuda:0 bf16 channels_last | measured | 0.1000 |" in page
    assert "Pick: **gpu cuda:0 bf16 channels_last**." in page
    assert not [s for s in skipped if "tune_gpu" in s]

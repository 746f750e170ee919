import json
import math
import statistics
from dataclasses import replace

import pytest
import torch

from hybriddl.tuning import profiles, tuner
from hybriddl.tuning.tuner import (BASELINE, enumerate_candidates, measure_candidates, select_pick,
                                   tune_settings)
from hybriddl.tuning.benchmark import StepTiming
from hybriddl.cli import main
from hybriddl.errors import UsageError
from hybriddl.tuning.profiles import (DROPPED, MEASURED, CandidateResult, Profile, Settings,
                                      load_profile, profile_path, save_profile)
from hybriddl.rundir import METRICS
from hybriddl.strategies import STRATEGIES, StrategyOptions, StrategySpec, cpu_strategies
from hybriddl.strategies.resources import HostResources, worker_counts

THREADS2 = StrategySpec("threads", workers=2)
PROCESSES2 = StrategySpec("processes", workers=2)
INTRAOP2 = StrategySpec("intraop", workers=2)


def feasible(name: str) -> type:
    """The registry's strategy, with its candidates, on a host that can run every one."""
    return type(f"Feasible{STRATEGIES[name].__name__}", (STRATEGIES[name],),
                {"check_feasible": classmethod(lambda cls, options: None)})


class NeedsOversubscribe(STRATEGIES["processes"]):
    """Like a CPU strategy on a 3-core host: K above 3 is refused."""

    @classmethod
    def check_feasible(cls, options):
        if options.workers and options.workers > 3:
            raise UsageError("K above the usable cores")


ALL = {name: feasible(name) for name in STRATEGIES}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cost_measure(clock, cost, *, warmup=1, steps=5, batch=4, setup=lambda label: 0.0):
    """A measure that spends `cost(choice, step)` fake seconds per step: no timing at all."""
    def measure(choice, keep_going):
        clock.now += setup(choice.label)
        warm, timed = [], []
        for step in range(warmup + steps):
            seconds = cost(choice, step)
            clock.now += seconds
            (timed if step >= warmup else warm).append(seconds)
            if not keep_going(step, seconds):
                break
        median = statistics.median(timed) if timed else math.inf
        return StepTiming({"name": choice.name}, batch, median, timed, 1000, warmup_seconds=warm)
    return measure


def by_label(costs):
    return lambda choice, step: costs[choice.label]


# --------------------------------------------------------------------------- candidates

def test_worker_counts_cover_every_k_on_small_hosts_and_doublings_on_big_ones():
    assert worker_counts(1) == []
    assert worker_counts(2) == [2]
    assert worker_counts(8) == [2, 3, 4, 5, 6, 7, 8]
    assert worker_counts(64) == [2, 3, 4, 5, 6, 7, 8, 16, 32, 64]
    assert worker_counts(12) == [2, 3, 4, 5, 6, 7, 8, 12]


def test_cpu_host_candidates_are_baseline_then_every_k_in_both_memory_formats():
    labels = [c.label for c in enumerate_candidates(HostResources(cores=3), 16, ALL)]
    assert labels == ["sequential"] + [
        f"{name} K={k}{layout}" for name in cpu_strategies() if name != BASELINE.name
        for k in (2, 3) for layout in ("", " channels_last")]


def test_strategies_this_hybriddl_lacks_are_skipped():
    present = {"sequential": feasible("sequential"), "threads": feasible("threads")}
    assert enumerate_candidates(HostResources(cores=2, cuda_devices=2), 8, present) == [
        BASELINE, THREADS2, replace(THREADS2, channels_last=True)]


def test_candidates_whose_check_feasible_raises_are_skipped():
    present = {"sequential": feasible("sequential"), "processes": NeedsOversubscribe}
    labels = [c.label for c in enumerate_candidates(HostResources(cores=5), 16, present)]
    assert labels == ["sequential", "processes K=2", "processes K=2 channels_last",
                      "processes K=3", "processes K=3 channels_last"]


def test_data_parallel_workers_never_outnumber_the_batch():
    labels = [c.label for c in enumerate_candidates(HostResources(cores=4), 3, ALL)]
    assert "threads K=4" not in labels and "processes K=4" not in labels
    assert "threads K=3" in labels and "intraop K=4" in labels


def test_two_gpu_host_gets_one_gpu_the_pipeline_and_gpu_threads():
    """Two GPUs of one model run the same `gpu` step: it is measured on the first only."""
    labels = [c.label for c in enumerate_candidates(HostResources(cores=1, cuda_devices=2), 16, ALL)]
    assert labels == ["sequential", "gpu cuda:0", "gpu cuda:0 channels_last",
                      "pipeline cuda:0,cuda:1 M=1", "pipeline cuda:0,cuda:1 M=2",
                      "pipeline cuda:0,cuda:1 M=4", "pipeline cuda:0,cuda:1 M=8",
                      "gpu-threads cuda:0,cuda:1"]


def test_gpus_of_different_models_are_each_measured(monkeypatch):
    monkeypatch.setattr(tuner, "_gpu_names", lambda count: ["NVIDIA H100", "NVIDIA T4"][:count])
    labels = [c.label for c in enumerate_candidates(HostResources(cores=1, cuda_devices=2), 16, ALL)]
    assert [label for label in labels if label.startswith("gpu ")] == [
        "gpu cuda:0", "gpu cuda:0 channels_last", "gpu cuda:1", "gpu cuda:1 channels_last"]


def test_one_gpu_host_pipelines_both_stages_on_it():
    """One micro-batch with both stages on one GPU is the `gpu` step's kernels without its
    data path: not a candidate of its own."""
    labels = [c.label for c in enumerate_candidates(HostResources(cores=1, cuda_devices=1), 4, ALL)]
    assert labels == ["sequential", "gpu cuda:0", "gpu cuda:0 channels_last",
                      "pipeline cuda:0,cuda:0 M=2", "pipeline cuda:0,cuda:0 M=4"]


def test_a_gpu_host_tries_channels_last_by_default_and_bf16_only_when_allowed():
    host = HostResources(cores=1, cuda_devices=1)
    numerics = {precision: {(c.precision, c.channels_last) for c in
                            enumerate_candidates(host, 4, ALL, precision=precision)
                            if c.name == "gpu"}
                for precision in ("fp32", "auto")}
    assert numerics["fp32"] == {("fp32", False), ("fp32", True)}
    assert numerics["auto"] == {("fp32", False), ("fp32", True), ("bf16", True)}


# --------------------------------------------------------------------------- selection

def test_pick_is_the_candidate_with_the_lowest_seconds_per_step():
    clock = FakeClock()
    costs = {"sequential": 4.0, "intraop K=2": 2.5, "threads K=2": 2.0, "processes K=2": 2.2}
    results = measure_candidates([BASELINE, INTRAOP2, THREADS2, PROCESSES2],
                                 cost_measure(clock, by_label(costs)), budget=1000, clock=clock)
    assert select_pick(results) == THREADS2
    assert [r.status for r in results] == [MEASURED] * 4
    threads = results[2]
    assert threads.seconds_per_step == 2.0 and threads.timed_steps == 5
    assert threads.speedup == 2.0 and threads.images_per_second == 2.0
    assert results[0].speedup == 1.0 and threads.speedup_over_gpu is None
    assert clock.now == pytest.approx(6 * sum(costs.values()))


def test_tie_goes_to_the_earlier_simpler_candidate():
    clock = FakeClock()
    costs = {"sequential": 2.0, "threads K=2": 1.0, "processes K=2": 1.0}
    results = measure_candidates([BASELINE, THREADS2, PROCESSES2],
                                 cost_measure(clock, by_label(costs)), budget=1000, clock=clock)
    assert select_pick(results) == THREADS2


def test_speedup_over_one_gpu_on_gpu_hosts():
    clock = FakeClock()
    gpu = StrategySpec("gpu", devices=("cuda:0",))
    pipe = StrategySpec("pipeline", micro_batches=4, devices=("cuda:0", "cuda:1"))
    costs = {"sequential": 8.0, gpu.label: 0.5, pipe.label: 0.25}
    results = measure_candidates([BASELINE, gpu, pipe], cost_measure(clock, by_label(costs)),
                                 budget=1000, clock=clock)
    assert select_pick(results) == pipe
    assert (results[2].speedup, results[2].speedup_over_gpu) == (32.0, 2.0)
    assert results[1].speedup_over_gpu == 1.0


def test_nothing_measured_is_a_usage_error():
    with pytest.raises(UsageError, match="larger --budget"):
        select_pick([CandidateResult(THREADS2, DROPPED, note="x")])


# --------------------------------------------------------------------------- budget

def test_candidate_that_cannot_fit_its_share_is_dropped_after_one_step():
    clock = FakeClock()
    costs = {"sequential": 1.0, "threads K=2": 10.0, "processes K=2": 0.5}
    results = measure_candidates([BASELINE, THREADS2, PROCESSES2],
                                 cost_measure(clock, by_label(costs)), budget=30, clock=clock)
    sequential, threads, processes = results
    assert sequential.status == MEASURED and sequential.timed_steps == 5
    # threads' share: (30 - 6) / 2 = 12 s; its warm-up took 10 s, a timed step would end at 20.
    assert threads.status == DROPPED
    assert threads.note == ("a step took 10.00 s: a timed one would overrun its 12.0 s share "
                            "of the budget")
    assert threads.seconds_per_step is None
    # processes then gets the 14 s left, and needs 3.
    assert processes.status == MEASURED and processes.timed_steps == 5
    assert select_pick(results) == PROCESSES2
    assert clock.now == 6 + 10 + 3


def test_candidates_get_only_the_steps_that_fit_their_share():
    clock = FakeClock()
    costs = {"sequential": 1.0, "threads K=2": 2.0}
    results = measure_candidates([BASELINE, THREADS2], cost_measure(clock, by_label(costs)),
                                 budget=14, clock=clock)
    threads = results[1]
    # share 8 s: warm-up 2, then timed steps while the next one ends by 8: 3 timed steps.
    assert threads.status == MEASURED and threads.timed_steps == 3
    assert threads.note == "3 of 5 timed steps fit its 8.0 s share of the budget"
    assert clock.now == 6 + 8


def test_budget_spent_means_later_candidates_are_not_started():
    clock = FakeClock()
    started = []

    def cost(choice, step):
        started.append(choice.label)
        return 50.0

    results = measure_candidates([BASELINE, THREADS2, PROCESSES2], cost_measure(clock, cost),
                                 budget=20, clock=clock)
    assert [r.status for r in results] == [MEASURED, DROPPED, DROPPED]
    assert results[1].note == results[2].note == "not started: the budget was spent"
    assert set(started) == {"sequential"}


def test_baseline_is_measured_even_past_its_share():
    clock = FakeClock()
    results = measure_candidates([BASELINE, THREADS2],
                                 cost_measure(clock, by_label({"sequential": 10.0, "threads K=2": 1.0})),
                                 budget=4, clock=clock)
    baseline = results[0]
    assert baseline.status == MEASURED and baseline.timed_steps == 1
    assert "the baseline ran past its share" in baseline.note
    assert clock.now == 20.0


def test_setup_time_counts_against_the_share():
    costs = {"sequential": 1.0, "processes K=2": 1.0}
    setup = {"sequential": 0.0, "processes K=2": 9.5}  # e.g. spawning worker processes

    def run(budget):
        clock = FakeClock()
        return measure_candidates([BASELINE, PROCESSES2],
                                  cost_measure(clock, by_label(costs), setup=setup.__getitem__),
                                  budget=budget, clock=clock)

    # Budget 20: processes' share is 14 s; setup and warm-up take 10.5, 3 timed steps fit.
    assert run(20)[1].timed_steps == 3
    # Budget 17: its share is 11 s; setup and warm-up leave no room for a timed step.
    assert run(17)[1].status == DROPPED


def test_failed_candidate_is_dropped_with_its_error_and_tuning_goes_on():
    clock = FakeClock()

    def measure(choice, keep_going):
        if choice == THREADS2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore detail")
        return cost_measure(clock, lambda c, s: 1.0)(choice, keep_going)

    results = measure_candidates([BASELINE, THREADS2, PROCESSES2], measure, budget=100, clock=clock)
    assert [r.status for r in results] == [MEASURED, DROPPED, MEASURED]
    assert results[1].note == "failed: CUDA out of memory. Tried to allocate 2 GiB"


def test_progress_is_reported_for_every_candidate_and_step():
    events = []

    class Recorder(tuner.TuneObserver):
        def on_candidate_start(self, index, choice, share_seconds):
            events.append(("start", index, choice.label, share_seconds))

        def on_candidate_step(self, index, step, seconds):
            events.append(("step", index, step))

        def on_candidate_end(self, index, result):
            events.append(("end", index, result.status))

    clock = FakeClock()
    measure_candidates([BASELINE, THREADS2], cost_measure(clock, lambda c, s: 1.0, steps=1),
                       budget=10, steps=1, clock=clock, observer=Recorder())
    assert events == [("start", 0, "sequential", 5.0), ("step", 0, 0), ("step", 0, 1),
                      ("start", 1, "threads K=2", 8.0), ("step", 1, 0), ("step", 1, 1),
                      ("end", 0, MEASURED), ("end", 1, MEASURED)]


# --------------------------------------------------------------------------- rounds and noise

def test_rounds_interleave_the_candidates_then_look_again_at_the_two_fastest():
    visits, rounds_seen = [], []

    class Recorder(tuner.TuneObserver):
        def on_round_start(self, number, visits_in_round, second_look):
            rounds_seen.append((number, visits_in_round, second_look))

        def on_candidate_start(self, index, choice, share_seconds):
            visits.append(choice.label)

    clock = FakeClock()
    costs = {"sequential": 3.0, "intraop K=2": 1.0, "threads K=2": 2.0, "processes K=2": 1.5}
    results = measure_candidates([BASELINE, INTRAOP2, THREADS2, PROCESSES2],
                                 cost_measure(clock, by_label(costs), steps=2), budget=1000,
                                 steps=2, rounds=3, second_look=2, clock=clock,
                                 observer=Recorder())
    order = ["sequential", "intraop K=2", "threads K=2", "processes K=2"]
    assert visits == order * 3 + ["intraop K=2", "processes K=2"] * 2
    assert rounds_seen == [(1, 4, False), (2, 4, False), (3, 4, False), (4, 2, True), (5, 2, True)]
    assert [len(r.round_seconds) for r in results] == [3, 5, 3, 5]
    assert [r.timed_steps for r in results] == [6, 10, 6, 10]


def test_median_and_spread_over_rounds_are_recorded():
    clock = FakeClock()
    per_round = {"sequential": iter([4.0, 4.4, 3.6]), "threads K=2": iter([2.0, 3.0, 2.2])}

    def measure(choice, keep_going):
        seconds = next(per_round[choice.label])
        return cost_measure(clock, lambda c, s: seconds, warmup=0, steps=1)(choice, keep_going)

    results = measure_candidates([BASELINE, THREADS2], measure, budget=1000, warmup=0, steps=1,
                                 rounds=3, clock=clock)
    sequential, threads = results
    assert threads.round_seconds == [2.0, 3.0, 2.2] and threads.spread_seconds == (2.0, 3.0)
    assert threads.seconds_per_step == 2.2  # the median, not the mean (2.4) or the first
    assert sequential.seconds_per_step == 4.0 and sequential.spread_seconds == (3.6, 4.4)
    assert threads.speedup == pytest.approx(4.0 / 2.2)
    record = threads.to_dict()
    assert (record["rounds"], record["spread_seconds"]) == (3, [2.0, 3.0])


def test_second_look_can_overturn_a_lucky_first_pass():
    clock = FakeClock()
    # threads had two lucky rounds; over the second look processes is steadily faster.
    per_round = {"sequential": iter([5.0] * 3), "threads K=2": iter([1.0, 1.1, 2.0, 2.2, 2.1]),
                 "processes K=2": iter([1.8, 1.9, 1.8, 1.8, 1.9])}

    def measure(choice, keep_going):
        seconds = next(per_round[choice.label])
        return cost_measure(clock, lambda c, s: seconds, warmup=0, steps=1)(choice, keep_going)

    first_pass = measure_candidates([BASELINE, THREADS2, PROCESSES2], measure, budget=1000,
                                    warmup=0, steps=1, rounds=3, clock=clock)
    assert select_pick(first_pass) == THREADS2  # what one pass of rounds would have picked
    per_round = {"sequential": iter([5.0] * 3), "threads K=2": iter([1.0, 1.1, 2.0, 2.2, 2.1]),
                 "processes K=2": iter([1.8, 1.9, 1.8, 1.8, 1.9])}
    results = measure_candidates([BASELINE, THREADS2, PROCESSES2], measure, budget=1000,
                                 warmup=0, steps=1, rounds=3, second_look=2, clock=clock)
    assert results[1].seconds_per_step == 2.0 and results[2].seconds_per_step == 1.8
    assert select_pick(results) == PROCESSES2


def test_second_look_takes_the_two_fastest_and_everyone_within_the_span_at_most_four():
    assert tuner.second_look_group({0: [3.0], 1: [1.0], 2: [1.5]}) == [1, 2]  # always two
    near = {0: [3.0], 1: [1.0], 2: [1.05], 3: [1.08], 4: [1.2], 5: [1.09], 6: [1.095]}
    assert tuner.second_look_group(near) == [1, 2, 3, 5]  # 6 is within 10 % but fifth
    assert tuner.second_look_group({4: [2.0]}) == [4] and tuner.second_look_group({}) == []


def test_second_look_takes_a_candidate_whose_fastest_visit_is_within_the_span():
    # 3's median is 40 % off the fastest, but one visit was as fast: noise only slows down.
    figures = {0: [3.0, 3.1, 3.0], 1: [1.0, 1.1, 1.0], 2: [1.2, 1.3, 1.2],
               3: [1.4, 1.05, 1.5], 4: [1.3, 1.3, 1.3]}
    assert tuner.second_look_group(figures) == [1, 2, 3]
    # At most four: the hopefuls with the fastest visits go first.
    figures.update({5: [2.0, 1.02, 2.0], 6: [2.0, 1.08, 2.0], 7: [2.0, 1.09, 2.0]})
    assert tuner.second_look_group(figures) == [1, 2, 3, 5]


def test_a_winner_ranked_third_by_noise_still_gets_the_second_look():
    clock = FakeClock()
    # processes is steadily fastest but two lucky rounds put it third after three rounds.
    per_round = {"sequential": iter([5.0] * 3), "intraop K=2": iter([1.0, 1.0, 1.3, 1.3, 1.3]),
                 "threads K=2": iter([1.02, 1.05, 1.3, 1.3, 1.3]),
                 "processes K=2": iter([1.2, 1.06, 1.06, 1.0, 1.0])}
    visits = []

    def measure(choice, keep_going):
        visits.append(choice.label)
        seconds = next(per_round[choice.label])
        return cost_measure(clock, lambda c, s: seconds, warmup=0, steps=1)(choice, keep_going)

    results = measure_candidates([BASELINE, INTRAOP2, THREADS2, PROCESSES2], measure,
                                 budget=1000, warmup=0, steps=1, rounds=3, second_look=2,
                                 clock=clock)
    assert visits[12:] == ["intraop K=2", "threads K=2", "processes K=2"] * 2
    assert results[3].seconds_per_step == 1.06 and results[1].seconds_per_step == 1.3
    assert select_pick(results) == PROCESSES2


def measured(choice, seconds, spread, rss):
    return CandidateResult(choice, MEASURED, seconds_per_step=seconds, images_per_second=1.0,
                           peak_rss_bytes=rss, round_seconds=[seconds],
                           spread_seconds=(seconds - spread, seconds + spread))


def test_a_tie_within_the_noise_goes_to_less_peak_memory():
    # processes is 2 % slower, each figure wanders +-5 %: a tie; threads uses half the memory.
    fast_heavy = measured(PROCESSES2, 1.00, 0.05, rss=4000)
    slow_light = measured(THREADS2, 1.02, 0.05, rss=2000)
    assert select_pick([measured(BASELINE, 2.0, 0.1, 1000), fast_heavy, slow_light]) == THREADS2


def test_no_tie_when_the_gap_exceeds_the_noise_or_the_tie_tolerance():
    # 2 % apart but each figure steady to +-0.5 %: the faster wins whatever its memory.
    assert select_pick([measured(PROCESSES2, 1.00, 0.005, 4000),
                        measured(THREADS2, 1.02, 0.005, 2000)]) == PROCESSES2
    # Noise of +-20 %, but 4 % apart is past TIE_TOLERANCE (3 %): the faster wins.
    assert tuner.TIE_TOLERANCE == 0.03
    assert select_pick([measured(PROCESSES2, 1.00, 0.2, 4000),
                        measured(THREADS2, 1.04, 0.2, 2000)]) == PROCESSES2


def test_a_dropped_candidate_in_a_later_round_keeps_its_earlier_rounds_with_a_note():
    clock = FakeClock()
    calls = {"threads K=2": 0}

    def cost(choice, step):
        if choice == THREADS2:
            calls["threads K=2"] += 1
            return 1.0 if calls["threads K=2"] <= 2 else 100.0  # the machine got busy
        return 1.0

    results = measure_candidates([BASELINE, THREADS2], cost_measure(clock, cost, warmup=1, steps=1),
                                 budget=40, warmup=1, steps=1, rounds=3, clock=clock)
    threads = results[1]
    assert threads.status == MEASURED and threads.round_seconds == [1.0]
    assert threads.note.startswith("1 of 3 rounds: a step took 100.00 s")
    assert "share of the budget" in threads.note


# --------------------------------------------------------------------------- tune_host and auto

TINY = Settings(usecase="ComplexSmall", model="resnet18", image_size=32, batch_size=2)


def tiny_images():
    return tuner.embedded_images(TINY)


@pytest.fixture
def one_core_host(monkeypatch):
    """Only the baseline is a candidate: what is tested is the re-tune, not the strategies."""
    monkeypatch.setattr(HostResources, "here", classmethod(lambda cls: cls(cores=1)))


def test_a_timed_step_draws_the_keyed_masks_training_draws(monkeypatch):
    """The tuner times the model's own dropout with each step's samples keyed, so that the
    masks' cost counts; bench_local's rows (dropout 0, like its peers) draw none."""
    from hybriddl import dropout
    from hybriddl.tuning import benchmark

    drawn = []
    real = dropout.keep_mask
    monkeypatch.setattr(dropout, "keep_mask", lambda keys, *a: drawn.append(keys) or real(keys, *a))
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([0, 1])
    for rate in (None, 0.0):
        benchmark.measure_strategy("sequential", StrategyOptions(), "alexnet", 3, x, y,
                                   warmup=1, steps=1, dropout=rate)
    assert len(drawn) == 4  # two layers, two steps: none at dropout 0
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])


def test_tune_host_times_every_candidate_with_the_models_dropout(monkeypatch, one_core_host):
    asked = []

    def fake(name, options, *args, **kwargs):
        asked.append(kwargs["dropout"])
        return StepTiming({"name": name}, 2, 0.1, [0.1], 1)

    monkeypatch.setattr(tuner, "measure_strategy", fake)
    tuner.tune_host(TINY, tiny_images(), budget=10, steps=1, rounds=1, second_look=0)
    assert asked and all(rate is None for rate in asked)


def test_tune_host_rejects_an_image_size_the_model_cannot_take():
    with pytest.raises(UsageError, match="--image-size 8 does not work with this model"):
        tuner.tune_host(Settings("ComplexSmall", "vgg16", 8, 2), tiny_images(), budget=10)


def test_tune_settings_fill_the_use_case_defaults():
    assert tune_settings("SimpleBig") == Settings("SimpleBig", "alexnet", 224, 32)
    with pytest.raises(UsageError, match="--batch-size 0"):
        tune_settings("SimpleBig", batch_size=0)
    with pytest.raises(UsageError, match="unknown use case"):
        tune_settings("Nope")


def matching_profile(pick=BASELINE) -> Profile:
    candidates = [CandidateResult(BASELINE, MEASURED, seconds_per_step=1.0, timed_steps=3,
                                  images_per_second=2.0, speedup=1.0, peak_rss_bytes=1)]
    if pick != BASELINE:
        candidates.append(CandidateResult(pick, MEASURED, seconds_per_step=0.5, timed_steps=3,
                                          images_per_second=4.0, speedup=2.0, peak_rss_bytes=1))
    return Profile(host=profiles.this_host(), fingerprint=profiles.fingerprint(), settings=TINY,
                   candidates=candidates, pick=pick)


def test_auto_uses_a_matching_profile_without_measuring(tmp_path, monkeypatch):
    path = save_profile(matching_profile(), profile_path(tmp_path, TINY))
    monkeypatch.setattr(tuner, "tune_host", lambda *a, **k: pytest.fail("tuned"))
    decision = tuner.auto_strategy(TINY, tiny_images(), directory=str(tmp_path))
    assert decision.choice == BASELINE and decision.tuned_because is None
    assert decision.describe()["source"] == "profile" and decision.describe()["speedup"] == 1.0
    assert decision.message().startswith("strategy auto: sequential, the fastest of 1 measured")
    assert decision.path == path


def damage_truncate(path):
    path.write_text(path.read_text()[:50])


def damage_schema(path):
    record = json.loads(path.read_text())
    record["schema_version"] = 0
    path.write_text(json.dumps(record))


def damage_fingerprint(path):
    record = json.loads(path.read_text())
    record["fingerprint"]["cpu_model"] = "a CPU this host does not have"
    path.write_text(json.dumps(record))


def damage_pick(path):
    save_profile(matching_profile(pick=StrategySpec("warp-drive", workers=2)), path)


def damage_settings(path):
    record = json.loads(path.read_text())
    record["settings"]["batch_size"] = 64
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage, problem", [
    (damage_truncate, "is not valid JSON"),
    (damage_schema, "schema version 0"),
    (damage_fingerprint, "is stale"),
    (damage_pick, "picks warp-drive K=2, which this host cannot run"),
    (damage_settings, "was measured at ComplexSmall (resnet18), 32 px, batch 64"),
])
@pytest.mark.slow
def test_auto_retunes_when_the_profile_cannot_be_used(tmp_path, one_core_host, damage, problem):
    path = save_profile(matching_profile(), profile_path(tmp_path, TINY))
    damage(path)
    decision = tuner.auto_strategy(TINY, tiny_images(), directory=str(tmp_path), budget=60, steps=1)
    assert problem in decision.tuned_because
    assert decision.describe()["source"] == "tuned"
    rewritten = load_profile(path)
    assert rewritten.settings == TINY and rewritten.fingerprint == profiles.fingerprint()
    assert rewritten.pick == decision.choice and rewritten.pick.infeasibility() is None


# --------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "--budget 0.0: give a positive number of seconds"),
    (["--image-size", "8"], "--image-size 8 does not work with this model"),
    (["--usecase", "Nope"], "unknown use case 'Nope'"),
    (["--steps", "0"], "give at least 1 timed step"),
    (["--rounds", "0"], "give at least 1 round"),
    (["--accumulate", "3"], "--accumulate 3: give 1 to the batch size (2)"),
])
def test_tune_command_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, args, message):
    output = tmp_path / "p.json"
    assert main(["tune", "--batch-size", "2", *args, "--output", str(output)]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and len(stderr.strip().splitlines()) == 1
    assert not output.exists()


@pytest.mark.slow
def test_train_auto_runs_the_pick_of_a_matching_profile(cli, tmp_path):
    # Tuned with --accumulate 2, so train --accumulate 2 finds it. A small model: the
    # profile is found by its settings whatever the model (VGG16's step and 1.5 GB of
    # checkpoint and model files only took time).
    settings = Settings("ComplexSmall", "squeezenet1_1", 32, 4, accumulate=2)
    profile = matching_profile()
    profile.settings = settings
    profile.pick = profile.candidates[0].choice = StrategySpec("sequential", accumulate=2)
    path = save_profile(profile, profile_path(tmp_path / "profiles", settings))
    before = path.read_bytes()
    run_dir = tmp_path / "run"
    done = cli("train", "--strategy", "auto", "--model", "squeezenet1_1", "--image-size", "32",
               "--batch-size", "4", "--max-steps", "1", "--epochs", "1", "--run-dir", str(run_dir),
               "--profile-dir", str(tmp_path / "profiles"), "--accumulate", "2")
    assert done.returncode == 0, done.stderr
    config = json.loads((run_dir / METRICS).read_text())["config"]
    assert config["strategy"]["name"] == "sequential"
    assert config["strategy"]["accumulate"] == 2
    assert path.name.endswith("-32px-acc2.json")
    assert config["strategy_choice"]["source"] == "profile"
    assert config["strategy_choice"]["profile"] == str(path)
    assert "strategy auto: sequential" in done.stderr and "tuning first" not in done.stderr
    assert path.read_bytes() == before


def test_train_auto_refuses_workers_and_devices(capsys, tmp_path):
    assert main(["train", "--strategy", "auto", "--workers", "2", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--workers, --devices and --channels-last go with a named --strategy" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_rounds_that_would_overrun_the_budget_are_not_started():
    # Each visit costs 2 s (warm-up and one timed step); 3 candidates: a round is 6 s.
    clock = FakeClock()
    results = measure_candidates([BASELINE, THREADS2, PROCESSES2],
                                 cost_measure(clock, lambda c, s: 1.0, steps=1), budget=14,
                                 steps=1, rounds=3, second_look=2, clock=clock)
    # A slow candidate is not dropped to make room for rounds: two rounds fit, the third not.
    assert [len(r.round_seconds) for r in results] == [2, 2, 2]
    assert all(r.note == "2 of 3 rounds fit the budget" for r in results)
    assert clock.now == 12


# --------------------------------------------------------------------------- GPU hosts

def gpu_host_candidates():
    """What a one-GPU, 16-core host tunes at precision auto: about a hundred CPU variants,
    the GPU's three numerics and the pipeline's micro-batch counts, in the registry's order
    (gpu-threads needs two GPUs)."""
    return enumerate_candidates(HostResources(cores=16, cuda_devices=1), 32, ALL, precision="auto")


def gpu_host_costs(choice, step):
    """Seconds per step as an H100 host measured them (issue 33), roughly: the GPU 9x the
    best CPU candidate."""
    if choice.name == "gpu":
        return 0.012 if not choice.channels_last else 0.011
    if choice.name == "pipeline":
        return 0.03
    if choice.name == "gpu-threads":
        return 0.02
    return 4.0 if choice == BASELINE else 0.106 * 16 / (choice.workers or 1) ** 0.5


def test_a_gpu_host_measures_each_kind_first_and_picks_the_gpu():
    clock = FakeClock()
    candidates = gpu_host_candidates()
    visited = []

    def cost(choice, step):
        if not visited or visited[-1] != choice:
            visited.append(choice)
        return gpu_host_costs(choice, step)

    results = measure_candidates(candidates, cost_measure(clock, cost, steps=1), budget=120,
                                 rounds=3, second_look=2, clock=clock)
    kinds = [tuner.candidate_kind(c) for c in visited]
    # The first of each device kind, the baseline, the best-guess CPU candidate: first.
    assert kinds[:4] == ["gpu", "pipeline", "cpu", "cpu"]
    assert visited[2] == BASELINE and visited[3].name == "intraop" and visited[3].workers == 16
    pick = select_pick(results)
    assert pick.name == "gpu"
    by_choice = {r.choice: r for r in results}
    assert by_choice[pick].speedup_over_gpu is not None and by_choice[pick].speedup > 100
    # CPU variations cannot win once a GPU step is several times faster: not started.
    outrun = [r for r in results if tuner.candidate_kind(r.choice) == "cpu"
              and r.choice not in visited]
    assert len(outrun) > 50
    assert all(r.note.startswith("not started: a gpu step measured") for r in outrun)
    # ... so the GPU's numerics got every round and the second look.
    assert all(len(r.round_seconds) >= 3 for r in results if r.choice.name == "gpu")


def vgg16_gpu_host_costs(choice, step):
    """Fake seconds per step for VGG16 at 224 px on a one-GPU host: the one-core baseline
    20 s (the issue's 10-20 s, measured on an H100 host), the device steps a small
    fraction of the CPU's."""
    if choice.name in ("gpu", "pipeline"):
        return 0.03 if choice.name == "gpu" else 0.05
    return 20.0 if choice == BASELINE else 1.2 * 16 / (choice.workers or 1) ** 0.5


def test_a_gpu_host_measures_the_slow_baseline_once_and_the_gpu_every_round():
    """`train --strategy auto`'s tuning (120 s, 3 rounds of one timed step) with a set-up
    of 3 s per visit (a model built, moved, its first step): re-measuring a 20 s baseline
    every round left one round, so the pick rested on one timed step of the GPU."""
    clock = FakeClock()
    results = measure_candidates(gpu_host_candidates(),
                                 cost_measure(clock, vgg16_gpu_host_costs, steps=1,
                                              setup=lambda label: 3.0),
                                 budget=tuner.AUTO_BUDGET_SECONDS, steps=tuner.AUTO_TIMED_STEPS,
                                 rounds=tuner.AUTO_ROUNDS, second_look=2, clock=clock)
    pick = next(r for r in results if r.choice == select_pick(results))
    assert pick.choice.name == "gpu"
    assert pick.timed_steps > 1 and len(pick.round_seconds) == tuner.AUTO_ROUNDS
    baseline = next(r for r in results if r.choice == BASELINE)
    assert baseline.measured and len(baseline.round_seconds) == 1 and pick.speedup > 100
    assert "measured in the first round only (a gpu step measured" in baseline.note
    assert clock.now <= tuner.AUTO_BUDGET_SECONDS


def test_the_baseline_keeps_its_rounds_where_no_device_outruns_the_cpu():
    clock = FakeClock()
    results = measure_candidates([BASELINE, THREADS2], cost_measure(clock, lambda c, s: 1.0,
                                                                    steps=1),
                                 budget=100, steps=1, rounds=3, clock=clock)
    assert [len(r.round_seconds) for r in results] == [3, 3]


def gpu_profile(precision_seconds: dict) -> Profile:
    gpu = StrategySpec("gpu", devices=("cuda:0",))
    candidates = [measured(BASELINE, 20.0, 0.0, 1)] + [
        measured(replace(gpu, precision=p, channels_last=cl), seconds, 0.0, 1)
        for (p, cl), seconds in precision_seconds.items()]
    results = list(candidates)
    tuner.add_speedups(results)
    return Profile(host=profiles.this_host(), fingerprint=profiles.fingerprint(),
                   settings=replace(TINY, precision="auto"), candidates=results,
                   pick=select_pick(results))


def test_the_log_says_what_bf16_autocast_gained_where_it_was_measured(tmp_path):
    profile = gpu_profile({("fp32", False): 0.03, ("fp32", True): 0.024, ("bf16", True): 0.016})
    line = tuner.bf16_gain(profile)
    assert line == ("bf16 autocast measured 1.50x float32's speed on gpu (gpu cuda:0 bf16 "
                    "channels_last 0.016 s/step, gpu cuda:0 channels_last 0.024)")
    message = tuner.AutoDecision(profile, tmp_path / "p.json", "no profile").message()
    assert "\n" not in message and message.endswith("; " + line)
    slower = gpu_profile({("fp32", True): 0.02, ("bf16", True): 0.025})
    assert tuner.bf16_gain(slower).startswith("bf16 autocast measured 0.80x float32's speed")
    # float32 only (no --precision auto): nothing measured, nothing said.
    assert tuner.bf16_gain(gpu_profile({("fp32", False): 0.03, ("fp32", True): 0.024})) is None
    assert "autocast" not in tuner.AutoDecision(
        gpu_profile({("fp32", True): 0.024}), tmp_path / "p.json").message()


def test_tune_shows_what_bf16_autocast_gained_under_its_pick(capsys):
    from hybriddl import display

    profile = gpu_profile({("fp32", True): 0.024, ("bf16", True): 0.016})
    display.show_pick(profile, "p.json")
    assert tuner.bf16_gain(profile) in capsys.readouterr().out.splitlines()  # one line


def test_every_kind_is_measured_before_a_tight_budget_is_spent():
    clock = FakeClock()
    results = measure_candidates(gpu_host_candidates(),
                                 cost_measure(clock, gpu_host_costs, steps=1), budget=10,
                                 rounds=1, clock=clock)
    measured = {tuner.candidate_kind(r.choice) for r in results if r.measured}
    assert measured == {"gpu", "pipeline", "cpu"}
    assert select_pick(results).name == "gpu"


def test_a_kind_that_can_still_win_keeps_its_variations():
    """A GPU only 1.5x faster than the CPU: the CPU variations are measured too."""
    clock = FakeClock()

    def cost(choice, step):
        return 0.1 if choice.name in ("gpu", "pipeline", "gpu-threads") else (
            1.0 if choice == BASELINE else 0.15)

    results = measure_candidates(gpu_host_candidates()[:30] + gpu_host_candidates()[-8:],
                                 cost_measure(clock, cost, steps=1), budget=1000, clock=clock)
    assert all(r.measured for r in results)


def test_a_cpu_host_keeps_the_registry_order():
    cpu = enumerate_candidates(HostResources(cores=4), 32, ALL)
    assert tuner.scouts(cpu, [tuner.candidate_kind(c) for c in cpu]) == []


class FakeDevice(STRATEGIES["sequential"]):
    """A registered "device" strategy as the registry's toy pattern adds one: its step only
    zeroes the gradient, so it is far faster than any CPU step."""

    name = "fake-device"
    summary = "a device that computes nothing, registered by a test"
    needs_gpu = True

    @classmethod
    def tuning_candidates(cls, host, batch_size):
        return [StrategySpec(cls.name)]

    def compute_gradients(self, x, y):
        from hybriddl.strategies import StepStats

        for parameter in self.model.parameters():
            if parameter.grad is None:
                parameter.grad = parameter.detach().new_zeros(parameter.shape)
        return StepStats(len(y), 0.0)


@pytest.fixture
def fake_device(monkeypatch):
    from hybriddl import strategies

    saved = dict(STRATEGIES)
    strategies.register(FakeDevice)
    monkeypatch.setattr(HostResources, "here", classmethod(lambda cls: cls(cores=2)))
    yield FakeDevice
    STRATEGIES.clear()
    STRATEGIES.update(saved)


# Real steps measured within a budget: beside another test the seconds change, what these
# assert does not (which candidates, rounds and files; no pick is asserted).
@pytest.mark.slow
def test_tune_host_measures_real_steps_into_a_profile():
    profile = tuner.tune_host(TINY, tiny_images(), budget=600, steps=1, rounds=2, second_look=1)
    assert profile.settings == TINY and profile.host == profiles.this_host()
    assert (profile.measurement["rounds"], profile.measurement["second_look_rounds"]) == (2, 1)
    assert profile.fingerprint == profiles.fingerprint()
    assert profile.candidates[0].choice == BASELINE
    measured = [c for c in profile.candidates if c.measured]
    assert all(len(c.round_seconds) in (2, 3) and c.timed_steps == len(c.round_seconds)
               and c.peak_rss_bytes > 0 for c in measured)
    # The second look: the two fastest after two rounds, and any whose fastest visit is
    # within the span of the fastest.
    looked = [c for c in measured if len(c.round_seconds) == 3]
    assert min(2, len(measured)) <= len(looked) <= tuner.SECOND_LOOK_MOST
    first_two = {c.choice: c.round_seconds[:2] for c in measured}
    assert {c.choice for c in looked} == {
        measured[i].choice for i in tuner.second_look_group(dict(enumerate(first_two.values())))}
    assert profile.pick_result.seconds_per_step == min(c.seconds_per_step for c in measured)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


@pytest.mark.slow
def test_tune_command_writes_a_valid_profile_and_shows_the_table(cli, tmp_path):
    output = tmp_path / "out" / "here.json"
    # A small model: every candidate is measured all the same, in a fraction of VGG16's time.
    done = cli("tune", "--usecase", "ComplexSmall", "--model", "squeezenet1_1", "--image-size",
               "32", "--batch-size", "4", "--steps", "1", "--rounds", "1", "--second-look", "0",
               "--output", str(output),
               COLUMNS="200")  # the whole table on one line per candidate
    assert done.returncode == 0, done.stderr
    profile = load_profile(output)
    assert profile.settings == Settings("ComplexSmall", "squeezenet1_1", 32, 4)
    # Rounds and the second look are measured in test_tune_host_measures_real_steps_...;
    # here one round keeps the CLI's run short, and the flags must reach the tuner.
    assert (profile.measurement["timed_steps"], profile.measurement["rounds"],
            profile.measurement["second_look_rounds"]) == (1, 1, 0)
    assert profile.candidates[0].choice == BASELINE and profile.candidates[0].measured
    assert "pick" in done.stdout and f"profile written to {output}" in " ".join(done.stdout.split())
    assert profile.pick.label in done.stdout
    assert "median s/step" in done.stdout and "spread" in done.stdout
    low, high = profile.pick_result.spread_seconds
    assert f"{low:.3f}-{high:.3f}" in done.stdout


@pytest.mark.slow
def test_tune_with_accumulate_measures_every_candidate_with_it(cli, tmp_path):
    """Also what a tune without --output writes: one file, in the profile directory
    (HYBRIDDL_PROFILES), under profile_path's name (its parts: tests/test_profiles.py)."""
    done = cli("tune", "--usecase", "ComplexSmall", "--model", "squeezenet1_1", "--image-size",
               "32", "--batch-size", "4", "--steps", "1", "--rounds", "1", "--second-look", "0",
               "--accumulate", "2", HYBRIDDL_PROFILES=str(tmp_path))
    assert done.returncode == 0, done.stderr
    # Its own file: a tune with accumulation never replaces the one without.
    [path] = list(tmp_path.iterdir())
    assert path.name == f"{profiles.this_host()}-ComplexSmall-squeezenet1_1-b4-32px-acc2.json"
    profile = load_profile(path)
    assert profile.settings == Settings("ComplexSmall", "squeezenet1_1", 32, 4, accumulate=2)
    assert {c.choice.accumulate for c in profile.candidates} == {2}
    assert profile.candidates[0].choice.name == "sequential"
    assert profile.candidates[0].speedup == 1.0  # still the baseline of the speedups
    assert "accumulate=2" in profile.pick.label


def test_a_stop_while_tuning_ends_the_visit_at_its_step_and_saves_nothing():
    """`train --strategy auto`'s signal handler only sets a flag: the tune went on to its
    budget (2 minutes by default) before the run could stop."""
    import signal

    from hybriddl.tuning.tuner import TuneInterrupted

    clock, steps = FakeClock(), []
    costs = {"sequential": 4.0, "intraop K=2": 2.5, "threads K=2": 2.0, "processes K=2": 2.2}
    measure = cost_measure(clock, by_label(costs))

    def counted(choice, keep_going):
        return measure(choice, lambda step, seconds: steps.append(choice.label) or
                       keep_going(step, seconds))
    stop = {"signum": None}

    def stop_signal():  # SIGTERM during the second candidate's third step
        if steps[-3:] == ["intraop K=2"] * 3:
            stop["signum"] = int(signal.SIGTERM)
        return stop["signum"]
    with pytest.raises(TuneInterrupted, match="stopped by SIGTERM while tuning") as caught:
        measure_candidates([BASELINE, INTRAOP2, THREADS2, PROCESSES2], counted, budget=1000,
                           clock=clock, stop_signal=stop_signal)
    assert caught.value.exit_code == 143
    assert steps == ["sequential"] * 6 + ["intraop K=2"] * 3  # nothing after the stop's step


def test_a_stop_in_one_hosts_tune_stops_every_host_together():
    """Each host's tune ends in one agreement (trainer._stopped_together), made by every
    host, tuning or not: a host whose tune was stopped leaves, and the others with it."""
    import signal

    from hybriddl.run.trainer import _stopped_together
    from hybriddl.tuning.tuner import TuneInterrupted

    class Rank1Of2:
        rank, size = 1, 2

        def __init__(self, other):
            self.other, self.told = other, []

        def allgather(self, value):
            self.told.append(value)
            return [self.other, value]

    ready = Rank1Of2(int(signal.SIGTERM))  # rank 0 was stopped while it tuned
    with pytest.raises(TuneInterrupted, match="stopped while rank 0 tuned its strategy") as caught:
        _stopped_together(ready, None, TuneInterrupted.on_another_host)
    assert ready.told == [0] and caught.value.exit_code == 143
    stopped = Rank1Of2(0)
    with pytest.raises(TuneInterrupted, match="stopped by SIGINT while tuning"):
        _stopped_together(stopped, TuneInterrupted(int(signal.SIGINT)),
                          TuneInterrupted.on_another_host)
    assert stopped.told == [int(signal.SIGINT)]
    _stopped_together(Rank1Of2(0), None, TuneInterrupted.on_another_host)  # nobody stopped

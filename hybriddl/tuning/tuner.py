"""The auto-tuner: measure every feasible local strategy on this host and pick the fastest.

Lerat et al. (2022) let each host run the local strategy with the best *measured*
speedup, because which one wins depends on the model and the hardware (threads on one
machine, processes on another, a two-GPU pipeline on a third). The tuner enumerates the
candidates this host can run, times each on a real batch of the use case through
`benchmark.measure_strategy`, and keeps the table and its pick as a profile
(hybriddl/tuning/profiles.py).

Noise: on a shared machine one step can be 15-20 % off its neighbours, and the load drifts
over minutes, so one pass per candidate picks noise. The tuner visits the candidates in
interleaved rounds (A B C A B C ...), so drift hits every candidate alike; each visit is
warm-up then timed steps, its figure the median of those; a candidate's figure is the
median of its visits, with the lowest and highest as its spread. The fastest then get a
second look (more interleaved rounds, A B A B): the two fastest by median, and with them
every candidate whose fastest visit is within SECOND_LOOK_SPAN of the fastest median (up
to SECOND_LOOK_MOST). Noise here only ever slows a step down (other work, a hypervisor
taking the CPU), so a real winner with two unlucky visits of three still shows one fast
visit (seen here: a candidate ranked sixth by median after three rounds came out fastest
when re-measured). If the two fastest are still within the noise of each other after
that, the one with less peak memory is picked (`select_pick`).

Budget: in the first round every candidate gets an equal share of what is left of the
budget. After each step the tuner predicts the next from the fastest step so far; a visit
whose next step would end past its share stops there, and a candidate whose visit cannot
time one step is dropped with a note. Only the baseline may overrun its share, since every
speedup is relative to it. Each later round (second look included) runs only when the
last visits of its candidates predict that it fits in what is left, each visit with an
equal share of that; a tight budget thus costs rounds (the note says how many fit), not
candidates. A candidate that cannot time a step in a later round leaves the race with
the rounds it had, and its note says why.

GPU hosts: on a host with GPUs a hundred CPU variants would share out the budget before
the GPU was reached (seen on an H100 host: auto picked a CPU step 9x slower than the GPU's).
Candidates come in kinds (`candidate_kind`: cpu, gpu, pipeline, ...); every round first
visits the scouts (`scouts`: the first candidate of each device kind, the baseline, the
best-guess CPU candidate), each keeping a share for everyone after it, so every kind is
measured before the variations share the rest. A variation is not started, and leaves
the race in later rounds, once another kind's fastest step is DEVICE_DOMINANCE times
faster than its own kind's.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybriddl.tuning.benchmark import StepTiming, measure_strategy, sample_batch, timing_model
from hybriddl.tuning.observer import TuneObserver
from hybriddl.data import ImageSet, synthetic_split
from hybriddl.errors import TrainingInterrupted, UsageError, signal_name
from hybriddl.files import check_writable
from hybriddl.tuning.profiles import (DROPPED, MEASURED, CandidateResult, Profile, Settings,
                               find_profile, fingerprint, profile_dir,
                               save_profile, this_host)
from hybriddl.strategies import (STRATEGIES, Gpu, HostResources, Pipeline, Sequential,
                                 StrategyOptions, StrategySpec)
from hybriddl.strategies.spec import check_accumulate
from hybriddl.usecases import check_image_size, get_usecase, use_case_workload

AUTO = "auto"
BASELINE = StrategySpec(Sequential.name)  # one CPU core: the paper's reference
# Training tunes first when no profile fits; this keeps that detour short.
AUTO_BUDGET_SECONDS = 120.0
AUTO_TIMED_STEPS = 1
AUTO_ROUNDS = 3
# Interleaved rounds of `hybriddl tune`, and the extra rounds for the fastest: the two
# fastest and every other candidate whose fastest visit is within SECOND_LOOK_SPAN of the
# fastest median, at most SECOND_LOOK_MOST of them (one step here wanders 15-20 %).
TUNE_ROUNDS = 3
TUNE_BUDGET_SECONDS = 600.0  # `hybriddl tune`'s, for all candidates together
TUNE_WARMUP_STEPS = 1  # per visit
TUNE_TIMED_STEPS = 2  # per visit
SECOND_LOOK_ROUNDS = 2
SECOND_LOOK_SPAN = 0.10
SECOND_LOOK_MOST = 4
# On a host with GPUs: a kind (cpu, gpu, pipeline) whose fastest measured step is this many
# times another kind's fastest cannot win, and its remaining variations are not measured.
# On an H100 host AlexNet's GPU step was 9x the best CPU candidate's (issue 33); variations
# of numerics or workers moved a kind's step by 1.2-2x at most in the profiles here.
DEVICE_DOMINANCE = 3.0
# A runner-up within this much of the fastest, and within the noise, ties with it: a tie
# costs at most 3 % of a step.
TIE_TOLERANCE = 0.03

# (step index, seconds of that step) -> take another step?
KeepGoing = Callable[[int, float], bool]
Measure = Callable[[StrategySpec, KeepGoing], StepTiming]


# --precision -> the numerics (precision, channels_last) every candidate but the baseline
# is tried in. channels_last alone measured faster in float32 too (README, local
# strategies: the fp32-cl rows); bf16 goes with channels_last: measured with plain PyTorch
# (224 px, 1 thread, a CPU with AVX512-BF16), bf16 autocast alone 1.45-1.51x (AlexNet b32)
# and 1.87x (VGG16 b8), with channels_last 1.62-1.70x and 2.11x. Reduced precision only
# where the user allowed it.
NUMERICS: dict[str, tuple[tuple[str, bool], ...]] = {
    "fp32": (("fp32", False), ("fp32", True)),
    "bf16": (("bf16", True),),
    AUTO: (("fp32", False), ("fp32", True), ("bf16", True)),
}


def enumerate_candidates(host: HostResources, batch_size: int, strategies: dict = STRATEGIES,
                         precision: str = "fp32") -> list[StrategySpec]:
    """Every candidate this host can run, the baseline first: each strategy names its own,
    each tried in every numerics `precision` allows (where the strategy honours them)."""
    candidates = []
    gpus = distinct_gpus(host)
    for cls in strategies.values():
        for plain in cls.tuning_candidates(host, batch_size):
            if duplicate_step(plain, gpus):
                continue
            variants = ([plain] if plain == BASELINE or not getattr(cls, "honours_numerics", True)
                        else [replace(plain, precision=p, channels_last=c)
                              for p, c in NUMERICS[precision]])
            for spec in variants:
                try:
                    cls.check_feasible(spec.options())
                except UsageError:
                    continue
                candidates.append(spec)
    return candidates


def distinct_gpus(host: HostResources) -> list[str]:
    """The host's GPUs, the first of each model: two of one model run the same step, so
    `gpu` is measured once for them. Where CUDA cannot name them (a host described in a
    test), they count as one model."""
    names = _gpu_names(host.cuda_devices)
    return [gpu for gpu, name in zip(host.gpus, names) if names.index(name) == host.gpus.index(gpu)]


def _gpu_names(count: int) -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= count:
        return [torch.cuda.get_device_name(i) for i in range(count)]
    return ["a GPU"] * count


def duplicate_step(spec: StrategySpec, gpus: list[str]) -> bool:
    """A candidate whose step another candidate measures already: `gpu` on a GPU of the
    same model as one measured, and `pipeline` with one micro-batch and both stages on one
    GPU, which runs the `gpu` step's kernels one after the other without its data path."""
    if spec.name == Gpu.name:
        return bool(spec.devices) and spec.devices[0] not in gpus
    if spec.name == Pipeline.name:
        return spec.micro_batches == 1 and len(set(spec.devices or ())) == 1
    return False


def candidate_kind(choice: StrategySpec) -> str:
    """What a candidate computes on, as the tuner groups them: each GPU strategy is a kind
    of its own (gpu, pipeline, ...), every CPU strategy is "cpu"."""
    cls = STRATEGIES.get(choice.name)
    return choice.name if cls is not None and cls.needs_gpu else "cpu"


def scouts(candidates: list[StrategySpec], kinds: list[str]) -> list[int]:
    """Where several kinds compete (a GPU host): the first candidate of each device kind,
    the baseline and the best-guess CPU candidate (the most workers of the first CPU
    strategy listed), measured first in every round so that every kind has a measured step
    before the budget is shared out among the variations. None on a host of one kind."""
    if len(set(kinds)) <= 1:
        return []
    everyone = range(len(candidates))
    devices = [kinds.index(kind) for kind in dict.fromkeys(kinds) if kind != "cpu"]
    baseline = [i for i in everyone if is_the_baseline(candidates[i])]
    cpu = [i for i in everyone if kinds[i] == "cpu" and i not in baseline]
    guess = [max(cpu, key=lambda i: (candidates[i].name == candidates[cpu[0]].name,
                                     candidates[i].workers or 0, -i))] if cpu else []
    return devices + baseline + guess



class TuneInterrupted(TrainingInterrupted):
    """A stop (SIGTERM, SIGINT) while `--strategy auto` tuned this host: no profile saved."""

    def __init__(self, signum: int):
        Exception.__init__(self, f"stopped by {signal_name(signum)} while tuning this host's "
                           "strategy, before any step: no profile or run was written; run "
                           "the same command again")
        self.signum = signum

    ended = "tuned its strategy, before any step"
    again = "nothing was written; run the same command again"


def measure_candidates(candidates: list[StrategySpec], measure: Measure, *, budget: float,
                       warmup: int = 1, steps: int = 5, rounds: int = 1, second_look: int = 0,
                       clock: Callable[[], float] = time.monotonic,
                       observer: TuneObserver | None = None,
                       kind_of: Callable[[StrategySpec], str] = candidate_kind,
                       stop_signal: Callable[[], int | None] = lambda: None
                       ) -> list[CandidateResult]:
    """Measure the candidates in interleaved rounds within the budget (see the module docstring).

    Round r visits every candidate still in the race once (A B C A B C ...): a visit is
    `warmup` steps then up to `steps` timed ones, and its figure is the median of its timed
    steps. Then `second_look` more interleaved rounds visit only the fastest by median
    (`second_look_group`).
    A candidate's seconds per step is the median of its visits' figures; the lowest and
    highest visit figures are its spread.

    A stop (`stop_signal` answers its signal number) ends the visit at its step's end and
    raises TuneInterrupted.
    """
    observer = observer or TuneObserver()
    started = clock()
    states = [_Candidate(choice) for choice in candidates]
    kinds = [kind_of(choice) for choice in candidates]
    first = scouts(candidates, kinds)
    order = first + [i for i in range(len(states)) if i not in first]
    scouting = set(first)

    def outrun(index: int) -> str | None:
        """Why candidate `index` cannot win any more: a measured step of another kind is
        DEVICE_DOMINANCE times faster than the fastest of its own kind; None while it can."""
        fastest: dict[str, float] = {}
        for state, kind in zip(states, kinds):
            # The baseline (one core) says nothing of what its kind's variations can do.
            if state.figures and not is_the_baseline(state.choice):
                fastest[kind] = min(fastest.get(kind, math.inf), statistics.median(state.figures))
        mine = fastest.get(kinds[index])
        best = min(fastest, key=fastest.get, default=None)
        if mine is None or best is None or mine < DEVICE_DOMINANCE * fastest[best]:
            return None
        return (f"a {best} step measured {mine / fastest[best]:.1f}x faster than any "
                f"{kinds[index]} step")

    def baseline_outrun(index: int) -> str | None:
        """Why the baseline's first round is enough: a device kind DEVICE_DOMINANCE times
        faster than every CPU step, the baseline's own included."""
        why = outrun(index)
        if why is not None or any(k == kinds[index] and states[i].figures and i != index
                                  for i, k in enumerate(kinds)):
            return why
        mine = statistics.median(states[index].figures)
        devices = [statistics.median(state.figures) for state, kind in zip(states, kinds)
                   if kind != kinds[index] and state.figures]
        if devices and mine >= DEVICE_DOMINANCE * min(devices):
            return f"a device step measured {mine / min(devices):.1f}x faster"
        return None

    def run_round(number: int, indices: list[int], second: bool) -> bool:
        """Visit the candidates of `indices` still in the race; False: it would not fit."""
        racing = [i for i in order if i in indices and states[i].in_race]
        if number > 1:
            # The baseline is the speedups' reference, not a contender: where a device kind
            # outruns the CPU it is measured once (a VGG16 step on one core took 10-20 s on
            # an H100 host: re-measured, it took the rounds the GPU's candidates needed).
            for i in racing:
                if is_the_baseline(states[i].choice) and states[i].figures and \
                        states[i].once is None and (why := baseline_outrun(i)):
                    states[i].once = why
            racing = [i for i in racing if states[i].once is None]
        if not racing:
            return True
        if number > 1:
            # The last visits predict this round: run it only when it fits what is left.
            if clock() + sum(states[i].visit_seconds for i in racing) > started + budget:
                return False
        observer.on_round_start(number, len(racing), second)
        for position, index in enumerate(racing):
            if signum := stop_signal():
                raise TuneInterrupted(signum)
            state = states[index]
            now = clock()
            left = max(budget - (now - started), 0.0)
            # A scout (the first of each kind) keeps a share for everyone after it.
            share = (left / (len(scouting & set(racing[position:])) + 1) if index in scouting
                     else left / (len(racing) - position))
            observer.on_candidate_start(index, state.choice, share)
            is_baseline = is_the_baseline(state.choice)
            if share <= 0 and not is_baseline:
                state.stop("not started: the budget was spent")
                continue
            if not is_baseline and (index not in scouting or state.figures) and \
                    (why := outrun(index)):
                state.stop(("not started: " if not state.figures else "left the race: ") + why)
                continue
            _visit_one(index, state, measure, now + share, share, is_baseline, warmup, steps,
                       clock, observer, stop_signal)
            state.visit_seconds = clock() - now
        return True

    everyone = list(range(len(states)))
    fitted = 0
    for number in range(1, rounds + 1):
        if not run_round(number, everyone, False):
            break
        fitted = number
    if fitted == rounds:
        fastest = second_look_group({i: states[i].figures for i in everyone
                                     if states[i].in_race and states[i].figures})
        for number in range(rounds + 1, rounds + second_look + 1):
            if not run_round(number, fastest, True):
                for index in fastest:
                    states[index].notes.append(f"second look cut to {number - rounds - 1} of "
                                               f"{second_look} rounds by the budget")
                break
    else:
        for state in states:
            if state.in_race and state.once is None:
                state.notes.append(f"{fitted} of {rounds} rounds fit the budget")
    for state in states:
        if state.once is not None:
            state.notes.append(f"measured in the first round only ({state.once}): the "
                               "speedups' reference, not a contender")
    if signum := stop_signal():  # in the last visit
        raise TuneInterrupted(signum)
    results = [state.result(steps, rounds) for state in states]
    for index, result in enumerate(results):
        observer.on_candidate_end(index, result)
    add_speedups(results)
    return results


def second_look_group(figures: dict[int, list[float]]) -> list[int]:
    """Who gets the second look, from each candidate's visit figures so far: the two
    fastest by median, then any other whose fastest visit is within SECOND_LOOK_SPAN of the
    fastest median (the fastest such first), at most SECOND_LOOK_MOST in all; returned in
    their original order."""
    medians = {i: statistics.median(f) for i, f in figures.items()}
    ranked = sorted(medians, key=medians.get)
    if not ranked:
        return []
    limit = medians[ranked[0]] * (1 + SECOND_LOOK_SPAN)
    hopefuls = sorted((i for i in ranked[2:] if min(figures[i]) <= limit),
                      key=lambda i: min(figures[i]))
    return sorted((ranked[:2] + hopefuls)[:SECOND_LOOK_MOST])


@dataclass
class _Candidate:
    """One candidate's visits so far."""

    choice: StrategySpec
    figures: list[float] = field(default_factory=list)  # each visit's median step
    timed_steps: int = 0
    peak_rss_bytes: int = 0
    batch_size: int = 0
    notes: list[str] = field(default_factory=list)
    stopped: str | None = None  # why it left the race
    failed: bool = False
    visit_seconds: float = 0.0  # the last visit, set-up included
    once: str | None = None  # why the baseline is not visited again

    @property
    def in_race(self) -> bool:
        return self.stopped is None

    def stop(self, why: str, failed: bool = False) -> None:
        self.stopped, self.failed = why, failed

    def result(self, steps: int, rounds: int) -> CandidateResult:
        if not self.figures or self.failed:
            return CandidateResult(self.choice, DROPPED, note=self.stopped or "not measured")
        median = statistics.median(self.figures)
        notes = list(self.notes)
        if self.stopped and len(self.figures) < rounds:
            notes.append(f"{len(self.figures)} of {rounds} rounds: {self.stopped}")
        return CandidateResult(self.choice, MEASURED, seconds_per_step=median,
                               timed_steps=self.timed_steps,
                               images_per_second=self.batch_size / median,
                               peak_rss_bytes=self.peak_rss_bytes or None,
                               round_seconds=list(self.figures),
                               spread_seconds=(min(self.figures), max(self.figures)),
                               note="; ".join(dict.fromkeys(notes)))


def _visit_one(index, state, measure, deadline, share, is_baseline, warmup, steps, clock,
               observer, stop_signal) -> None:
    seen: list[float] = []

    def keep_going(step: int, seconds: float) -> bool:
        seen.append(seconds)
        observer.on_candidate_step(index, step, seconds)
        if stop_signal():
            return False  # measure_candidates raises TuneInterrupted next
        if is_baseline and step + 1 <= warmup:
            return True
        # The fastest step so far predicts the next; the first carries one-off costs.
        return clock() + min(seen) <= deadline

    try:
        timing = measure(state.choice, keep_going)
    except Exception as exc:  # noqa: BLE001
        # e.g. CUDA out of memory, or a worker that failed to start: the others still count.
        state.stop(f"failed: {_first_line(exc)}", failed=True)
        return
    if not timing.step_seconds:
        first = min(seen) if seen else 0.0
        state.stop(f"a step took {first:.2f} s: a timed one would overrun its {share:.1f} s "
                   "share of the budget")
        return
    state.figures.append(statistics.median(timing.step_seconds))
    state.timed_steps += len(timing.step_seconds)
    state.peak_rss_bytes = max(state.peak_rss_bytes, timing.peak_rss_bytes or 0)
    state.batch_size = timing.batch_size
    if len(timing.step_seconds) < steps:
        state.notes.append(f"{len(timing.step_seconds)} of {steps} timed steps fit its "
                           f"{share:.1f} s share of the budget")
    if is_baseline and clock() > deadline:
        state.notes.append("the baseline ran past its share: every speedup is relative to it")


def is_the_baseline(choice: StrategySpec) -> bool:
    """Sequential, in whatever --accumulate the tune measured every candidate with."""
    return replace(choice, accumulate=1) == BASELINE


def add_speedups(results: list[CandidateResult]) -> None:
    """Speedup = t_baseline / t_candidate (the paper's definition), over one core and one GPU."""
    measured = [r for r in results if r.measured]
    cpu = next((r for r in measured if is_the_baseline(r.choice)), None)
    gpus = [r for r in measured if r.choice.name == Gpu.name]
    # The GPU baseline: the plain loop in float32 where it was measured.
    gpu = next((r for r in gpus if (r.choice.precision, r.choice.channels_last) == ("fp32", False)),
               gpus[0] if gpus else None)
    for r in measured:
        r.speedup = cpu.seconds_per_step / r.seconds_per_step if cpu else None
        r.speedup_over_gpu = gpu.seconds_per_step / r.seconds_per_step if gpu else None


def select_pick(results: list[CandidateResult]) -> StrategySpec:
    """The fastest measured candidate by median seconds per step, with a tie rule.

    When the runner-up's median is within the noise of the two (the larger half-spread of
    their visit figures, relative to the median, capped at TIE_TOLERANCE), the two are a
    tie and the one with less peak memory wins; on equal memory the earlier one.
    """
    measured = sorted((r for r in results if r.measured), key=lambda r: r.seconds_per_step)
    if not measured:
        raise UsageError("no candidate could be measured within the budget: give a larger "
                         "--budget (or a smaller --image-size / --batch-size)")
    if len(measured) == 1:
        return measured[0].choice
    first, second = measured[:2]
    gap = second.seconds_per_step / first.seconds_per_step - 1
    if gap <= min(max(first.relative_noise, second.relative_noise), TIE_TOLERANCE):
        if (second.peak_rss_bytes or math.inf) < (first.peak_rss_bytes or math.inf):
            return second.choice
    return first.choice


def embedded_images(settings: Settings) -> ImageSet:
    """The use case's embedded training images: what `hybriddl tune` measures on."""
    return synthetic_split(settings.case.dataset).train


def tune_images(settings: Settings, data: str | None, cache_dir: str | None = None,
                progress=None) -> ImageSet:
    """The training images `hybriddl tune` measures on: `data` as train's --data, or the
    use case's embedded set when None (streamed sources go through the data cache)."""
    if data is None:
        return embedded_images(settings)
    from hybriddl.data.loading import load_data

    return load_data(data, variant=settings.case.dataset,
                     image_size=settings.image_size, cache_dir=cache_dir, progress=progress).train


def tune_host(settings: Settings, images: ImageSet, *, budget: float,
              warmup: int = TUNE_WARMUP_STEPS, steps: int = TUNE_TIMED_STEPS,
              rounds: int = TUNE_ROUNDS, second_look: int = SECOND_LOOK_ROUNDS,
              observer: TuneObserver | None = None, reason: str | None = None,
              host: HostResources | None = None, clock: Callable[[], float] = time.monotonic,
              stop_signal: Callable[[], int | None] = lambda: None) -> Profile:
    """Measure every feasible candidate on real batches of `images`; the profile, unsaved.
    A stop (`stop_signal`) ends it at a step's end: TuneInterrupted."""
    if not 0 < budget < float("inf"):  # nan too
        raise UsageError(f"--budget {budget}: give a positive number of seconds")
    if steps < 1 or warmup < 0:
        raise UsageError(f"{steps} timed steps after {warmup} warm-up steps: give at least 1 "
                         "timed step and no negative warm-up")
    if rounds < 1 or second_look < 0:
        raise UsageError(f"{rounds} rounds and {second_look} second-look rounds: give at least "
                         "1 round and no negative second look")
    num_classes = len(images.classes)
    model = timing_model(settings.model, num_classes)
    check_image_size(model, settings.image_size, num_classes)
    observer = observer or TuneObserver()
    candidates = [replace(spec, accumulate=settings.accumulate)
                  for spec in enumerate_candidates(host or HostResources.here(),
                                                   settings.batch_size,
                                                   precision=settings.precision)
                  if _runs_model(spec, model)]
    x, y = sample_batch(images, settings.batch_size, settings.image_size)

    def measure(choice: StrategySpec, keep_going: KeepGoing) -> StepTiming:
        # The model's own dropout, each step's samples keyed as training keys them: the
        # masks cost a GPU step more than a CPU one (dropout.py), so they count here.
        return measure_strategy(choice.name, choice.options(), settings.model, num_classes, x, y,
                                warmup=warmup, steps=steps, lr=settings.case.lr,
                                momentum=settings.case.momentum, keep_going=keep_going,
                                dropout=None)

    observer.on_tune_start(candidates, reason)
    started = clock()
    results = measure_candidates(candidates, measure, budget=budget, warmup=warmup, steps=steps,
                                 rounds=rounds, second_look=second_look, clock=clock,
                                 observer=observer, stop_signal=stop_signal)
    pick = select_pick(results)
    fastest = min((r for r in results if r.measured), key=lambda r: r.seconds_per_step)
    if pick != fastest.choice:
        chosen = next(r for r in results if r.measured and r.choice == pick)
        chosen.note = "; ".join(filter(None, [chosen.note, (
            f"a tie with {fastest.choice.label} (within the noise): less peak memory")]))
    return Profile(host=this_host(), fingerprint=fingerprint(), settings=settings,
                   candidates=results, pick=pick,
                   measurement={"warmup_steps": warmup, "timed_steps": steps,
                                "rounds": rounds, "second_look_rounds": second_look,
                                "tie_tolerance": TIE_TOLERANCE, "budget_seconds": budget,
                                "seconds_spent": round(clock() - started, 3)})


@dataclass
class AutoDecision:
    """The strategy `--strategy auto` runs, and why."""

    profile: Profile
    path: Path
    tuned_because: str | None = None  # None: an existing profile matched

    @property
    def choice(self) -> StrategySpec:
        return self.profile.pick

    def describe(self) -> dict:
        """For metrics.json: where the choice came from and its measured figures."""
        pick = self.profile.pick_result
        return {"source": "tuned" if self.tuned_because else "profile",
                "profile": str(self.path), "tuned_because": self.tuned_because,
                "label": pick.choice.label, "seconds_per_step": pick.seconds_per_step,
                "images_per_second": pick.images_per_second, "speedup": pick.speedup,
                "speedup_over_gpu": pick.speedup_over_gpu}

    def message(self) -> str:
        """One line: which strategy runs and why (and what bf16 autocast gained, where it
        was measured)."""
        pick = self.profile.pick_result
        why = (f"{pick.speedup:.2f}x sequential on one core" if pick.speedup is not None
               else f"{pick.seconds_per_step:.3f} s/step")
        if pick.speedup_over_gpu is not None:
            why += f", {pick.speedup_over_gpu:.2f}x one GPU"
        where = "measured just now" if self.tuned_because else f"profile of {self.profile.created}"
        gain = bf16_gain(self.profile)
        return (f"strategy auto: {pick.choice.label}, the fastest of "
                f"{sum(c.measured for c in self.profile.candidates)} measured candidates "
                f"({why}; {where}, {self.path})" + (f"; {gain}" if gain else ""))


def bf16_gain(profile: Profile) -> str | None:
    """What bf16 autocast was measured to gain on the pick's kind (gpu, cpu, ...): its
    fastest bf16 candidate against its fastest float32 one; None where either was not
    measured (float32 only unless --precision auto)."""
    kind = candidate_kind(profile.pick)
    fastest = {}
    for r in profile.candidates:
        if r.measured and candidate_kind(r.choice) == kind and not is_the_baseline(r.choice):
            best = fastest.get(r.choice.precision)
            if best is None or r.seconds_per_step < best.seconds_per_step:
                fastest[r.choice.precision] = r
    if "bf16" not in fastest or "fp32" not in fastest:
        return None
    bf16, fp32 = fastest["bf16"], fastest["fp32"]
    return (f"bf16 autocast measured {fp32.seconds_per_step / bf16.seconds_per_step:.2f}x "
            f"float32's speed on {kind} ({bf16.choice.label} {bf16.seconds_per_step:.4g} s/step, "
            f"{fp32.choice.label} {fp32.seconds_per_step:.4g})")


def tune_settings(usecase: str, model: str | None = None, image_size: int | None = None,
                  batch_size: int | None = None, precision: str | None = None,
                  accumulate: int | None = None) -> Settings:
    """What a profile is measured at: the use case's defaults for the workload left out,
    StrategyOptions' for precision and accumulation, every number checked as for training."""
    default = StrategyOptions()
    precision = precision or default.precision
    if precision not in NUMERICS:
        raise UsageError(f"--precision {precision}: choose one of {', '.join(NUMERICS)}")
    model, image_size, batch_size = use_case_workload(usecase, model, image_size, batch_size)
    accumulate = default.accumulate if accumulate is None else accumulate
    check_accumulate(accumulate, batch_size)
    return Settings(usecase=get_usecase(usecase).name, model=model, image_size=image_size,
                    batch_size=batch_size, precision=precision, accumulate=accumulate)


def auto_strategy(settings: Settings, images: ImageSet, *, directory: str | None = None,
                  budget: float = AUTO_BUDGET_SECONDS, steps: int = AUTO_TIMED_STEPS,
                  rounds: int = AUTO_ROUNDS, second_look: int = SECOND_LOOK_ROUNDS,
                  observer: TuneObserver | None = None,
                  stop_signal: Callable[[], int | None] = lambda: None) -> AutoDecision:
    """This host's profiled pick for `settings`; tunes (and saves the profile) when none
    fits. A stop while it tunes (`stop_signal`) saves nothing: TuneInterrupted."""
    lookup = find_profile(profile_dir(directory), settings)
    if lookup.usable:
        return AutoDecision(lookup.profile, lookup.path)
    reason = f"{lookup.problem}: tuning first (budget {budget:.0f} s)"
    # Where the profile will be kept can take it, before the budget is spent.
    check_writable(lookup.path, "--profile-dir", folder=False)
    profile = tune_host(settings, images, budget=budget, steps=steps, rounds=rounds,
                        second_look=second_look, observer=observer, reason=reason,
                        stop_signal=stop_signal)
    save_profile(profile, lookup.path)
    return AutoDecision(profile, lookup.path, tuned_because=lookup.problem)


def _runs_model(spec: StrategySpec, model: torch.nn.Module) -> bool:
    """False for a strategy that cannot run this model at all (layerwise on a ResNet)."""
    try:
        STRATEGIES[spec.name].check_model(model)
    except UsageError:
        return False
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__

"""The auto-tuner: measure every feasible local strategy on this host and pick the fastest.

Lerat et al. (2022) let each host run the local strategy with the best *measured*
speedup, because which one wins depends on the model and the hardware (threads on one
machine, processes on another, a two-GPU pipeline on a third). The tuner enumerates the
candidates this host can run, times each on a real batch of the use case through
`benchmark.measure_strategy` (warm-up, then the median of timed steps), and keeps the
table and its pick as a profile (hybriddl/tuning/profiles.py).

Budget: every candidate gets an equal share of what is left of the budget. After each
step the tuner predicts the next from the fastest step so far; a candidate whose next
step would end past its share stops there: measured if it has at least one timed step,
dropped with a note otherwise. Only the baseline may overrun its share, since every
speedup is relative to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybriddl.tuning.benchmark import StepTiming, measure_strategy, sample_batch, timing_model
from hybriddl.data import ImageSet, synthetic_split
from hybriddl.errors import UsageError
from hybriddl.tuning.profiles import (DROPPED, MEASURED, CandidateResult, Profile, Settings,
                               find_profile, fingerprint, profile_dir,
                               save_profile, this_host)
from hybriddl.strategies import STRATEGIES, Gpu, HostResources, Sequential, StrategySpec
from hybriddl.usecases import check_image_size, get_usecase

AUTO = "auto"
BASELINE = StrategySpec(Sequential.name)  # one CPU core: the paper's reference
# Training tunes first when no profile fits; this keeps that detour short.
AUTO_BUDGET_SECONDS = 120.0
AUTO_TIMED_STEPS = 3

# (step index, seconds of that step) -> take another step?
KeepGoing = Callable[[int, float], bool]
Measure = Callable[[StrategySpec, KeepGoing], StepTiming]


def enumerate_candidates(host: HostResources, batch_size: int,
                         strategies: dict = STRATEGIES) -> list[StrategySpec]:
    """Every candidate this host can run, the baseline first: each strategy names its own."""
    candidates = []
    for cls in strategies.values():
        for spec in cls.tuning_candidates(host, batch_size):
            try:
                cls.check_feasible(spec.options())
            except UsageError:
                continue
            candidates.append(spec)
    return candidates


class TuneObserver:
    """What the tuner reports while it measures; the CLI draws a progress bar from it."""

    def on_tune_start(self, candidates: list[StrategySpec], reason: str | None) -> None: ...
    def on_candidate_start(self, index: int, choice: StrategySpec, share_seconds: float) -> None: ...
    def on_candidate_step(self, index: int, step: int, seconds: float) -> None: ...
    def on_candidate_end(self, index: int, result: CandidateResult) -> None: ...


def measure_candidates(candidates: list[StrategySpec], measure: Measure, *, budget: float,
                       warmup: int = 1, steps: int = 5, clock: Callable[[], float] = time.monotonic,
                       observer: TuneObserver | None = None) -> list[CandidateResult]:
    """Measure each candidate within its share of the budget (see the module docstring)."""
    observer = observer or TuneObserver()
    started = clock()
    results = []
    for index, choice in enumerate(candidates):
        now = clock()
        share = max(budget - (now - started), 0.0) / (len(candidates) - index)
        observer.on_candidate_start(index, choice, share)
        is_baseline = choice == BASELINE
        if share <= 0 and not is_baseline:
            result = CandidateResult(choice, DROPPED, note="not started: the budget was spent")
        else:
            result = _measure_one(index, choice, measure, now + share, share, is_baseline,
                                  warmup, steps, clock, observer)
        results.append(result)
        observer.on_candidate_end(index, result)
    add_speedups(results)
    return results


def _measure_one(index, choice, measure, deadline, share, is_baseline, warmup, steps, clock,
                 observer) -> CandidateResult:
    seen: list[float] = []

    def keep_going(step: int, seconds: float) -> bool:
        seen.append(seconds)
        observer.on_candidate_step(index, step, seconds)
        if is_baseline and step + 1 <= warmup:
            return True
        # The fastest step so far predicts the next; the first carries one-off costs.
        return clock() + min(seen) <= deadline

    try:
        timing = measure(choice, keep_going)
    except Exception as exc:  # noqa: BLE001
        # e.g. CUDA out of memory, or a worker that failed to start: the others still count.
        return CandidateResult(choice, DROPPED, note=f"failed: {_first_line(exc)}")
    if not timing.step_seconds:
        first = min(seen) if seen else 0.0
        return CandidateResult(choice, DROPPED, note=(
            f"a step took {first:.2f} s: a timed one would overrun its {share:.1f} s "
            "share of the budget"))
    notes = []
    if len(timing.step_seconds) < steps:
        notes.append(f"{len(timing.step_seconds)} of {steps} timed steps fit its "
                     f"{share:.1f} s share of the budget")
    if is_baseline and clock() > deadline:
        notes.append("the baseline ran past its share: every speedup is relative to it")
    return CandidateResult(choice, MEASURED, seconds_per_step=timing.seconds_per_step,
                           timed_steps=len(timing.step_seconds),
                           images_per_second=timing.images_per_second,
                           peak_rss_bytes=timing.peak_rss_bytes, note="; ".join(notes))


def add_speedups(results: list[CandidateResult]) -> None:
    """Speedup = t_baseline / t_candidate (the paper's definition), over one core and one GPU."""
    measured = [r for r in results if r.measured]
    cpu = next((r for r in measured if r.choice == BASELINE), None)
    gpu = next((r for r in measured if r.choice.name == Gpu.name), None)
    for r in measured:
        r.speedup = cpu.seconds_per_step / r.seconds_per_step if cpu else None
        r.speedup_over_gpu = gpu.seconds_per_step / r.seconds_per_step if gpu else None


def select_pick(results: list[CandidateResult]) -> StrategySpec:
    """The measured candidate with the lowest seconds per step; the earlier one on a tie."""
    measured = [r for r in results if r.measured]
    if not measured:
        raise UsageError("no candidate could be measured within the budget: give a larger "
                         "--budget (or a smaller --image-size / --batch-size)")
    return min(measured, key=lambda r: r.seconds_per_step).choice


def tune_settings(usecase: str, model: str | None = None, image_size: int | None = None,
                  batch_size: int | None = None) -> Settings:
    """The use case's defaults for what was left out, every number checked."""
    case = get_usecase(usecase)
    settings = Settings(usecase=case.name, model=model or case.model,
                        image_size=image_size if image_size is not None else case.image_size,
                        batch_size=batch_size if batch_size is not None else case.batch_size)
    for flag, value in (("--image-size", settings.image_size), ("--batch-size", settings.batch_size)):
        if value < 1:
            raise UsageError(f"{flag} {value}: give at least 1")
    return settings


def embedded_images(settings: Settings) -> ImageSet:
    """The use case's embedded training images: what `hybriddl tune` measures on."""
    return synthetic_split(get_usecase(settings.usecase).dataset).train


def tune_images(settings: Settings, data: str | None, cache_dir: str | None = None,
                progress=None) -> ImageSet:
    """The training images `hybriddl tune` measures on: `data` as train's --data, or the
    use case's embedded set when None (streamed sources go through the data cache)."""
    if data is None:
        return embedded_images(settings)
    from hybriddl.data.loading import load_data

    return load_data(data, variant=get_usecase(settings.usecase).dataset,
                     image_size=settings.image_size, cache_dir=cache_dir, progress=progress).train


def tune_host(settings: Settings, images: ImageSet, *, budget: float, warmup: int = 1,
              steps: int = 5, observer: TuneObserver | None = None, reason: str | None = None,
              host: HostResources | None = None, clock: Callable[[], float] = time.monotonic) -> Profile:
    """Measure every feasible candidate on real batches of `images`; the profile, unsaved."""
    if budget <= 0:
        raise UsageError(f"--budget {budget}: give a positive number of seconds")
    if steps < 1 or warmup < 0:
        raise UsageError(f"{steps} timed steps after {warmup} warm-up steps: give at least 1 "
                         "timed step and no negative warm-up")
    num_classes = len(images.classes)
    check_image_size(timing_model(settings.model, num_classes), settings.image_size, num_classes)
    observer = observer or TuneObserver()
    candidates = enumerate_candidates(host or HostResources.here(), settings.batch_size)
    x, y = sample_batch(images, settings.batch_size, settings.image_size)

    def measure(choice: StrategySpec, keep_going: KeepGoing) -> StepTiming:
        return measure_strategy(choice.name, choice.options(), settings.model, num_classes, x, y,
                                warmup=warmup, steps=steps, keep_going=keep_going)

    observer.on_tune_start(candidates, reason)
    started = clock()
    results = measure_candidates(candidates, measure, budget=budget, warmup=warmup, steps=steps,
                                 clock=clock, observer=observer)
    return Profile(host=this_host(), fingerprint=fingerprint(), settings=settings,
                   candidates=results, pick=select_pick(results),
                   measurement={"warmup_steps": warmup, "timed_steps": steps,
                                "budget_seconds": budget,
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
        """One line: which strategy runs and why."""
        pick = self.profile.pick_result
        why = (f"{pick.speedup:.2f}x sequential on one core" if pick.speedup is not None
               else f"{pick.seconds_per_step:.3f} s/step")
        if pick.speedup_over_gpu is not None:
            why += f", {pick.speedup_over_gpu:.2f}x one GPU"
        where = "measured just now" if self.tuned_because else f"profile of {self.profile.created}"
        return (f"strategy auto: {pick.choice.label}, the fastest of "
                f"{sum(c.measured for c in self.profile.candidates)} measured candidates "
                f"({why}; {where}, {self.path})")


def auto_strategy(settings: Settings, images: ImageSet, *, directory: str | None = None,
                  budget: float = AUTO_BUDGET_SECONDS, steps: int = AUTO_TIMED_STEPS,
                  observer: TuneObserver | None = None) -> AutoDecision:
    """This host's profiled pick for `settings`; tunes (and saves the profile) when none fits."""
    lookup = find_profile(profile_dir(directory), settings)
    if lookup.usable:
        return AutoDecision(lookup.profile, lookup.path)
    reason = f"{lookup.problem}: tuning first (budget {budget:.0f} s)"
    profile = tune_host(settings, images, budget=budget, steps=steps, observer=observer,
                        reason=reason)
    save_profile(profile, lookup.path)
    return AutoDecision(profile, lookup.path, tuned_because=lookup.problem)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__

"""What the tuner reports while it measures: apart from tuner.py so that display.py, which
every command imports (emulate and launch too, which never load torch), can implement it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybriddl.strategies.spec import StrategySpec
    from hybriddl.tuning.profiles import CandidateResult


class TuneObserver:
    """What the tuner reports while it measures; the CLI draws a progress bar from it."""

    def on_tune_start(self, candidates: list[StrategySpec], reason: str | None) -> None: ...
    # Before each interleaved round: its number (from 1), how many candidates it visits,
    # and whether it is the second look at the two fastest.
    def on_round_start(self, number: int, visits: int, second_look: bool) -> None: ...
    def on_candidate_start(self, index: int, choice: StrategySpec, share_seconds: float) -> None: ...
    def on_candidate_step(self, index: int, step: int, seconds: float) -> None: ...
    def on_candidate_end(self, index: int, result: CandidateResult) -> None: ...

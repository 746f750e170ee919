"""Time to a target accuracy, as DAWNBench and MLPerf Training time a run: `--target-accuracy A`
records the step, epoch, wall seconds and emulated seconds at which validation accuracy first
reaches A (or that it never did); `--eval-every N` validates every N steps besides every
epoch's end; `--stop-at-target` ends the run there, checkpointed.

The clock is the run's training clock: it starts when the first step of this attempt is
about to run, runs through every evaluation (MLPerf counts them), and is carried across a
resume in metrics.json (`target.clock`), so a run stopped and resumed is timed as one
without the time between its attempts. Emulated seconds are wall seconds over the time
scale S·D the emulated hosts run at (`hybriddl.emulation.hosts.time_scale`, 1 on real hosts),
added attempt by attempt, so one attempt under emulation and one on real hosts still add up.
"""

from __future__ import annotations

import time

from hybriddl.emulation.hosts import time_scale


class AccuracyTarget:
    """The run's `target` record in metrics.json, kept up to date as the run goes.

    `record` is the dict metrics.json holds (the checkpoint's metrics carry it across a
    resume): the target `accuracy`, `reached`, and where it was first reached (`step`,
    `epoch`, `wall_seconds`, `emulated_seconds`; null until then), every evaluation made
    (`evaluations`), and the `clock` so far.
    """

    def __init__(self, accuracy: float | None, eval_every: int | None, stop_at_target: bool,
                 record: dict | None = None):
        self.accuracy, self.eval_every, self.stop_at_target = accuracy, eval_every, stop_at_target
        if record is not None and record.get("accuracy") == accuracy:
            self.record = record  # a resumed run goes on with its own target and clock
        else:
            clock = (record or {}).get("clock", {"wall_seconds": 0.0, "emulated_seconds": 0.0})
            self.record = {"accuracy": accuracy, "reached": False, "step": None, "epoch": None,
                           "epochs": None,
                           "wall_seconds": None, "emulated_seconds": None,
                           "eval_every": eval_every, "evaluations": [], "clock": clock}
        self.scale = time_scale()
        self._since: float | None = None

    @property
    def active(self) -> bool:
        return self.accuracy is not None

    @property
    def reached(self) -> bool:
        return bool(self.record["reached"])

    def start(self) -> None:
        """The clock runs from here (this attempt's first step)."""
        self._since = time.perf_counter()

    def tick(self) -> dict:
        """The clock brought up to now; returns it (wall and emulated seconds)."""
        clock = self.record["clock"]
        if self._since is not None:
            now = time.perf_counter()
            clock["wall_seconds"] += now - self._since
            clock["emulated_seconds"] += (now - self._since) / self.scale
            self._since = now
        return clock

    def due(self, steps_done: int) -> bool:
        """Whether validation runs after the step that made `steps_done`."""
        return self.eval_every is not None and steps_done % self.eval_every == 0

    def evaluated(self, accuracy: float, epoch: int, steps_done: int, epochs: float) -> bool:
        """One evaluation's accuracy, made after `steps_done` steps in `epoch` (1-based), that
        is `epochs` epochs of training (a fraction where validation ran inside an epoch);
        True when the run should stop here (`--stop-at-target` and the target reached)."""
        clock = self.tick()
        entry = {"step": steps_done, "epoch": epoch, "epochs": round(epochs, 4),
                 "accuracy": accuracy,
                 "wall_seconds": round(clock["wall_seconds"], 6),
                 "emulated_seconds": round(clock["emulated_seconds"], 6)}
        self.record["evaluations"].append(entry)
        if self.active and not self.reached and accuracy >= self.accuracy:
            self.record.update(reached=True, step=steps_done, epoch=epoch, epochs=entry["epochs"],
                               wall_seconds=entry["wall_seconds"],
                               emulated_seconds=entry["emulated_seconds"])
        return self.should_stop()

    def should_stop(self) -> bool:
        return self.active and self.stop_at_target and self.reached

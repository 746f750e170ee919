"""The training loop: data, forward/backward (by the host's strategy), average, step, log.

One step reads like the paper's description of it: the host takes its part of the
global batch, its local strategy leaves the host's mean gradient in the master
parameters, the hosts average those gradients, and every host applies the same SGD
update. Nothing here knows which strategy ran.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import resource
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from hybriddl import data as datamod
from hybriddl import failpoints
from hybriddl.dropout import MASKS, dropout_keys, sample_keys
from hybriddl.data.cache.building import CacheBuildInterrupted
from hybriddl.data.loading import data_notes, load_data
from hybriddl.data.sharding import split_counts
from hybriddl.run import resumption
from hybriddl.run.checkpointer import Checkpointer
from hybriddl.hosts.cluster import SingleHost
from hybriddl.hosts.compression import EXACT, held_state_bytes, parse_compression
from hybriddl.hosts.scheme import WireScheme
from hybriddl.hosts.replicas import ReplicaCheck
from hybriddl.errors import TrainingError, TrainingInterrupted, UsageError
from hybriddl.hybrid.classifier import NotSplittable
from hybriddl.hybrid.parallel import (DataParallel, HybridParallel, choose, held_bytes,
                                      traffic_bytes)
from hybriddl.monitoring.monitor import Monitor
from hybriddl.rundir import (METRICS, MODEL, check_new_run_dir, check_run_storage,
                             default_run_dir)
from hybriddl.files import atomic_write_json, atomic_torch_save, remove_partial_writes
from hybriddl.run.settings import TrainConfig
from hybriddl.run.shutdown import StopRequest
from hybriddl.run.target import AccuracyTarget
from hybriddl.step import make_optimizer, optimizer_step
from hybriddl.run.weights import load_start_weights
from hybriddl.strategies import LocalStrategy, StepStats, make_strategy
from hybriddl.tuning.tuner import AUTO, TuneInterrupted, auto_strategy, tune_settings
from hybriddl.usecases import build_model, check_image_size


class TrainingObserver:
    """What the trainer reports while it runs (and tunes, for auto); the CLI draws it."""

    def on_tune_start(self, candidates, reason) -> None: ...
    def on_round_start(self, number, visits, second_look) -> None: ...
    def on_candidate_start(self, index, choice, share_seconds) -> None: ...
    def on_candidate_step(self, index, step, seconds) -> None: ...
    def on_candidate_end(self, index, result) -> None: ...

    def on_data_progress(self, done: int, total: int) -> None: ...
    def on_start(self, info: dict) -> None: ...
    def on_epoch_start(self, epoch: int, steps: int) -> None: ...
    # loss: the mean per-sample loss of the steps since it was last read back from the
    # device (every step on a CPU; about every LossReader.READ_SECONDS on a GPU), or None.
    def on_step(self, epoch: int, step: int, samples: int, seconds: float,
                loss: float | None) -> None: ...
    def on_epoch_end(self, record: dict) -> None: ...
    # a validation inside an epoch (--eval-every): its record in metrics.json's target
    def on_evaluation(self, entry: dict) -> None: ...
    # the target record (run/target.py) when --target-accuracy is first reached
    def on_target(self, record: dict) -> None: ...
    # one line the user should read (hosts found holding different models, resynced)
    def on_warning(self, line: str) -> None: ...


@dataclass
class PreparedRun:
    """Everything checked and loaded; nothing written yet."""

    config: TrainConfig
    split: datamod.DataSplit
    model: torch.nn.Module
    strategy: LocalStrategy
    run_dir: Path
    strategy_choice: dict | None = None  # auto: the profile and figures behind the strategy
    resume: resumption.Checkpoint | None = None
    start_weights: dict | None = None  # --weights: name, file, sha256, the head replaced


def prepare(config: TrainConfig, observer: TrainingObserver | None = None,
            resume: resumption.Checkpoint | None = None, hosts=None,
            stop: StopRequest | None = None) -> PreparedRun:
    """Check the run's settled configuration (`config`, resolved) against its model, data
    and run directory, and load the data, before any file is written.

    With `resume`, the run goes on in config.run_dir from that checkpoint (see
    resumption.resumed_settings for how its settings and the flags given combine).
    The `hosts` (connected; default: this one alone) share each global batch: auto
    profiles this host's share of it; without --run-dir every rank names rank 0's new
    run directory. A `stop` requested while a data cache is built ends the build, resumable;
    one while `--strategy auto` tunes ends the tune, nothing kept (every host stops).
    """
    if None in (config.model, config.image_size, config.batch_size, config.epochs, config.lr,
                config.momentum):
        raise ValueError("trainer.prepare takes a settled TrainConfig: its resolved()")
    observer = observer or TrainingObserver()
    hosts = hosts or SingleHost()
    run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(config.usecase)
    if config.run_dir is None and hosts.size > 1:
        # Every rank names rank 0's run directory (its monitors write there too).
        run_dir = Path(hosts.broadcast_object(str(run_dir) if hosts.rank == 0 else None))
        config = replace(config, run_dir=str(run_dir))
    if resume is None:
        check_new_run_dir(run_dir)
    else:
        remove_partial_writes(run_dir)  # what a kill -9 during a write left
    # A compressed run's errors: in rank 0's two checkpoints, in files of its own elsewhere.
    copies = 2 if hosts.rank == 0 else resumption.ERRORS_KEPT
    check_run_storage(run_dir, config.model, config.classes,
                      lambda model: copies * held_state_bytes(config.compression, model))
    auto = config.strategy == AUTO
    strategy = None if auto else make_strategy(config.strategy, config.strategy_options)
    split = _data_on_every_host(config, observer, hosts, stop)
    if config.batch_size > len(split.train):
        # A global batch cut down to the data would silently train another model.
        raise UsageError(f"--batch-size {config.batch_size} is larger than the "
                         f"{len(split.train)} training images of {split.source}: give at most "
                         f"{len(split.train)}")
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(split.classes), config.dropout)
    check_image_size(model, config.image_size, len(split.classes))
    # A resumed run's model comes from its checkpoint, whatever it started from.
    start = (load_start_weights(model, config.weights, len(split.classes), config.model)
             if config.weights and resume is None else None)
    if strategy is not None:
        strategy.check_model(model)  # before the run directory exists
        check_host_parallel(config, model, strategy)
    choice, picked, interrupted = None, None, None
    if auto:
        # Tuning draws random numbers of its own; the run's stream must not see them.
        with torch.random.fork_rng(devices=[]):
            try:
                picked, choice = auto_pick(config, split.train, observer, hosts.size,
                                           lambda: stop.signum if stop else None)
            except TuneInterrupted as exc:
                interrupted = exc
        if picked is not None:
            strategy = make_strategy(picked.strategy, picked.strategy_options)
            check_host_parallel(config, model, strategy)
            # The run stays "auto" (a resume picks again); the host's weight is the pick's.
            config = replace(config, throughput=picked.throughput)
    # Every host, tuning or not (the hosts' exchanges stay the same on each).
    _stopped_together(hosts, interrupted, TuneInterrupted.on_another_host)
    if resume is not None:
        resumption.check_same_data(resume, datamod.describe(split))
        model.load_state_dict(resume.model)  # before setup, so local workers start from it
    return PreparedRun(config, split, model, strategy, run_dir, choice, resume, start)


def _data_on_every_host(config: TrainConfig, observer, hosts, stop: StopRequest | None):
    """The run's data, or a stop on every host (`_stopped_together`)."""
    split, interrupted = None, None
    try:
        split = load_data(config.data, variant=config.case.dataset, image_size=config.image_size,
                          classes=config.classes, val_fraction=config.val_fraction,
                          progress=observer.on_data_progress, cache_dir=config.data_cache,
                          stop_signal=lambda: stop.signum if stop else None,
                          strict=config.strict_data)
    except CacheBuildInterrupted as exc:
        interrupted = exc
    for line in data_notes(split) if split else ():  # files skipped, images converted
        observer.on_warning(line)
    if failpoints.fires("die-data", hosts.rank):
        failpoints.die()
    _stopped_together(hosts, interrupted, CacheBuildInterrupted.on_another_host)
    return split


def _stopped_together(hosts, interrupted: TrainingInterrupted | None, elsewhere) -> None:
    """A stop that ended one host's own work before the first step (its data cache build,
    its tune) ends every host here, together; `elsewhere(signum, rank)` is what the others
    raise. A host that went on would otherwise wait in the hosts' next exchange while that
    one left (a collective against its closing barrier)."""
    signums = hosts.allgather(int(interrupted.signum) if interrupted else 0)
    if interrupted:
        raise interrupted
    for rank, signum in enumerate(signums):
        if signum:
            raise elsewhere(signum, rank)


@dataclass(frozen=True)
class SettledRun:
    """A run as its hosts train it, settled once before its first step and not changed
    after: the prepared run (its resolved TrainConfig: the flags and a resumed checkpoint's
    settings, `run/settings.py`; this host's local strategy, the profile's pick under
    --strategy auto), the scheme across hosts with the planner's plan (hybrid/parallel.py
    `choose`: --host-parallel, --compression and --feature-dtype settled where auto) and
    the wire-scheme object the gradients travel as (hosts/compression.py)."""

    prepared: PreparedRun
    scheme: DataParallel
    wire: WireScheme


def settle(prepared: PreparedRun, hosts) -> SettledRun:
    """The hosts agree on the run (the same settings everywhere, each host's share of the
    global batch) and the planner settles the exchange, the same on every host; the
    strategy is set up (the planner may time a step on it)."""
    config = prepared.config
    hosts.agree(settings_hosts_share(prepared), config.balance, config.throughput)
    host_batch = hosts.samples_of(config.batch_size)  # its weight's share (--balance)
    # The exchange planned per link (hybrid/planner.py): --host-parallel, --compression
    # and --feature-dtype settled together where they are auto.
    scheme = choose(config.host_parallel, prepared.model, prepared.strategy, hosts,
                    config.batch_size, config.image_size,
                    host_batch / config.throughput if config.throughput else None,
                    config.compression, config.feature_dtype,
                    config.strategy_options.accumulate)
    return SettledRun(prepared, scheme, parse_compression(scheme.compression))


def auto_pick(config: TrainConfig, images, observer, hosts_count: int,
              stop_signal=lambda: None) -> tuple[TrainConfig, dict]:
    """`--strategy auto` settled: this host's profiled pick (tuned first when no profile fits).

    The profile is measured at this host's share of the global batch. Returns the
    config naming the picked strategy (and, unless given, this host's images/s for
    --balance throughput) and the record of the choice for metrics.json.
    """
    host_batch = -(-config.batch_size // hosts_count)
    decision = auto_strategy(tune_settings(config.usecase, config.model, config.image_size,
                                           host_batch, config.strategy_options.precision,
                                           config.strategy_options.accumulate),
                             images, directory=config.profile_dir, budget=config.tune_budget,
                             observer=observer, stop_signal=stop_signal)
    throughput = (config.throughput if config.throughput is not None
                  else decision.profile.pick_result.images_per_second)
    # The profile was measured with the run's --accumulate (it is one of its settings).
    settled = replace(config, strategy=decision.choice.name, throughput=throughput,
                      strategy_options=decision.choice.options(config.strategy_options.oversubscribe))
    return settled, {**decision.describe(), "message": decision.message()}


def run(prepared: PreparedRun, observer: TrainingObserver | None = None,
        hosts=None, stop: StopRequest | None = None, *, figures_only: bool = False) -> dict:
    """Train; returns the metrics dict that is also written to metrics.json.

    Between steps, a `stop` requested on any host (a signal, see hybriddl.run.shutdown)
    writes a checkpoint and raises TrainingInterrupted. With `figures_only` (hybriddl
    compare's ranks, `train --measure-only`: their output is what the steps measured) no
    checkpoint, validation pass or model.pt is made: AlexNet's took 2.9 of a contender rank's 3.8 s in trainer.run,
    and the checkpoint's staging buffers were filled beside its timed steps.
    """
    observer = observer or TrainingObserver()
    hosts = hosts or SingleHost()
    stop = stop or StopRequest()
    config, split, model, strategy = prepared.config, prepared.split, prepared.model, prepared.strategy
    if prepared.resume is not None and (why := _nothing_left(prepared)):
        # The hosts agree first, as `settle` does on a run that goes on: hosts given other
        # settings are refused together, not split between this return and `settle`.
        hosts.agree(settings_hosts_share(prepared), config.balance, config.throughput)
        # Nothing written: its checkpoint leaves out an epoch it stopped inside (to resume
        # inside it), which metrics.json holds; rewritten from it, that record was lost.
        observer.on_warning(f"the run in {prepared.run_dir} {why}: nothing left to train, "
                            "nothing written (give more --epochs or --max-steps to go on)")
        try:
            return json.loads((prepared.run_dir / METRICS).read_text())
        except (OSError, ValueError):  # gone or damaged: its checkpoint's record
            return prepared.resume.metrics
    transform = datamod.BatchTransform(config.image_size)
    run_dir = prepared.run_dir
    with strategy, contextlib.ExitStack() as monitoring, _out_of_memory_named():
        settled = settle(prepared, hosts)
        scheme = settled.scheme
        hosts.use_compression(settled.wire)
        # Weights from a file (--weights, --resume) travel from rank 0, as before.
        scheme.setup(model, strategy, hosts, built_from_seed=prepared.resume is None
                     and prepared.start_weights is None)
        replicas = ReplicaCheck(hosts, [] if figures_only else scheme.replicated(model),
                                config.check_every, config.strict_equal)
        optimizer = make_optimizer(model.parameters(), config.lr, config.momentum)
        # Started only now: every rank is past prepare()'s check that the run dir is new.
        monitor = monitoring.enter_context(Monitor(run_dir, hosts.rank, config.monitor_interval))
        metrics = resumed_metrics(prepared, hosts, scheme) if prepared.resume else {
            "config": config_record(prepared, hosts, scheme), "epochs": []}
        if figures_only:  # `train --measure-only`: the record says what was left out
            metrics["config"]["measure_only"] = "no checkpoint, validation pass or model.pt"
        target = AccuracyTarget(config.target_accuracy, config.eval_every,
                                config.stop_at_target, metrics.get("target"))
        if not figures_only:  # every validation, on the run's clock; kept in every checkpoint
            metrics["target"] = target.record
        keeper = monitoring.enter_context(Checkpointer(
            run_dir, hosts, stop, model, optimizer, metrics, checkpoint_about(prepared, metrics),
            config.checkpoint_every, layout=scheme, writes=not figures_only))
        if prepared.resume:
            keeper.restore(prepared.resume, config.lr, config.momentum)
        if hosts.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / METRICS, metrics)
        observer.on_start(metrics["config"])
        target.start()
        for epoch in range(keeper.position.epoch, config.epochs):
            if target.should_stop():  # resumed after it stopped at its target: nothing to do
                break
            progress = keeper.epoch_progress(epoch)
            batches = datamod.epoch_batches(len(split.train), config.batch_size, config.seed, epoch)
            todo = batches[progress.steps:]
            if config.max_steps is not None:
                todo = todo[: config.max_steps - keeper.position.steps_done]
            if not todo and progress.steps == 0:
                break
            validate = Validation(strategy, split.val, transform, 2 * config.batch_size,
                                  target, observer, len(batches), hosts, scheme)
            steps_before = progress.steps  # an attempt before this one took them
            record = train_epoch(epoch, todo, progress, split, transform, model, strategy,
                                 optimizer, hosts, observer, keeper, config.seed, scheme,
                                 None if figures_only else validate, replicas)
            if steps_before:  # its sums are the epoch's; its per-step figures this attempt's
                record["resumed_after_step"] = steps_before
            record["val_accuracy"] = None if figures_only else validate.at_epoch_end(
                epoch, keeper.position.steps_done, progress.steps)
            if validate.shared_by is not None:
                record["validation_shared_by"] = validate.shared_by
            metrics["epochs"].append(record)
            if hosts.rank == 0:
                atomic_write_json(run_dir / METRICS, metrics)
            observer.on_epoch_end(record)
            if line := replicas.check(f"at the end of epoch {epoch + 1}"):  # its checkpoint's
                observer.on_warning(line)
            target.tick()  # the clock the checkpoint carries
            keeper.epoch_done(progress, complete=progress.steps == len(batches))
            if config.max_steps is not None and keeper.position.steps_done >= config.max_steps:
                break
            if target.should_stop():
                break
        target.tick()
        if replicas.enabled:
            metrics["replicas"] = replicas.describe()
        metrics["monitor"] = monitor.stop()
        metrics["memory"] = memory_record(model, optimizer)
        keeper.wait_for_write()  # one large write at a time: the space check counts on it
        # Collective where the classifier is split (figures_only and holds_the_model are the
        # same on every host): the checkpoint just staged holds the model where no step came
        # after it, and its classifier is not gathered a second time.
        if figures_only:
            whole = None
        elif keeper.holds_the_model():
            whole = keeper.staged_model()
        else:
            whole = scheme.model_state(model, hosts)
        if hosts.rank == 0:
            atomic_write_json(run_dir / METRICS, metrics)
            if whole is not None:
                # On the CPU whatever device trained it: a plain torch.load works anywhere.
                atomic_torch_save(run_dir / MODEL, {name: tensor.cpu()
                                                    for name, tensor in whole.items()})
    return metrics


def _nothing_left(prepared: PreparedRun) -> str | None:
    """Why a resumed run has no step left to take with the settings given (None: it has)."""
    config, done = prepared.config, prepared.resume.position
    if AccuracyTarget(config.target_accuracy, config.eval_every, config.stop_at_target,
                      prepared.resume.metrics.get("target")).should_stop():
        return f"stopped at its target, val accuracy {config.target_accuracy:g}"
    if config.max_steps is not None and done.steps_done >= config.max_steps:
        return f"has done its {config.max_steps} steps (--max-steps)"
    if done.epoch >= config.epochs:
        return f"has done its {config.epochs} epochs"
    return None


@contextlib.contextmanager
def _out_of_memory_named():
    """A device or host out of memory mid-run is one line saying what to lower, not
    torch's traceback (the tuner drops such a candidate; a named strategy meets it here)."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).strip()
        where = ("GPU" if isinstance(exc, torch.OutOfMemoryError) else
                 "host" if "can't allocate memory" in text else None)
        if where is None:
            raise
        raise TrainingError(f"out of {where} memory ({text.splitlines()[0][:200]}): lower "
                            "--batch-size, or give --accumulate N (the same step in N chunks); "
                            "any checkpoint written is kept") from None


# torch's message when a training-mode BatchNorm gets one value per channel.
_BATCHNORM_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def train_epoch(epoch, batches, progress, split, transform, model, strategy, optimizer, hosts,
                observer, keeper, seed: int, scheme, validate: Validation | None = None,
                replicas: ReplicaCheck | None = None) -> dict:
    """The epoch's remaining `batches`; `progress` holds the sums of the steps before them.
    With `validate`, validation runs after the steps it is due at (`--eval-every`), and the
    epoch ends early where the run stops at its target (`--stop-at-target`)."""
    model.train()
    observer.on_epoch_start(epoch, len(batches))
    started_at = time.time()  # wall clock, to mark epochs on the monitors' time axis
    last = time.perf_counter()
    waited_before = progress.data_wait_seconds
    hosts.traffic.begin_epoch()
    step_seconds = []
    loss = LossReader(progress)
    with datamod.BatchPrefetcher(split.train, batches, transform, share=hosts.share,
                                 prepare=strategy.prepare_batch,
                                 rows=strategy.batch_rows) as prefetch:
        for share, x, y in prefetch:
            step = share.batch.step
            step_started = time.perf_counter()
            with hosts.averaging(share) as average_over_hosts, \
                    dropout_keys(sample_keys(seed, epoch, share.part.indices)):

                def average(stats: StepStats) -> None:
                    average_over_hosts(stats.samples)

                def gradients(strategy, x, y, share=share):
                    if len(hosts.logical_ranks) > 1:
                        return logical_gradients(scheme, strategy, hosts, x, y, share,
                                                 sample_keys(seed, epoch, share.part.indices))
                    return scheme.gradients(strategy, x, y, share)

                try:
                    stats = optimizer_step(strategy, optimizer, x, y, average, gradients)
                except ValueError as exc:
                    if _BATCHNORM_ONE_SAMPLE not in str(exc):
                        raise
                    raise TrainingError(
                        f"epoch {epoch + 1}, step {step + 1}: a forward pass of one sample "
                        f"reached BatchNorm, which needs two or more to train: give a larger "
                        f"--batch-size, or fewer --workers or --accumulate chunks; "
                        f"{keeper.kept()}") from None
            now = time.perf_counter()
            progress.add_step(share.global_samples, stats.samples, stats.loss_sum, now - last)
            progress.data_wait_seconds = waited_before + prefetch.wait_seconds
            last = now
            step_seconds.append(now - step_started)
            if loss.due(stats.loss_sum, now) or keeper.saves_next_step():
                loss.read(progress, now, f"epoch {epoch + 1}, step {step + 1}", keeper.kept)
            observer.on_step(epoch, step, share.global_samples, now - step_started, loss.last)
            at_target = False
            # A validation due at this step comes before its checkpoint, which keeps it (a
            # stop or --checkpoint-every there lost it: the resumed run never made it).
            if validate is not None and validate.due(keeper.position.steps_done + 1):
                # A GPU step returns once queued: the work it left is the epoch's time, not
                # the validation's, whose first read-back would wait for it.
                strategy.synchronize()
                progress.seconds += time.perf_counter() - last
                at_target = validate.after_step(epoch, keeper.position.steps_done + 1,
                                                progress.steps)
                last = time.perf_counter()  # validation is not the next step's time
            if validate is not None:
                validate.target.tick()  # the clock a checkpoint of this step carries
            keeper.step_done(progress)
            inject_faults(hosts.rank, keeper.position.steps_done, model)
            if replicas is not None and (line := replicas.after_step(
                    keeper.position.steps_done, step_seconds[-1])):
                observer.on_warning(line)
            if at_target:
                break
    # A GPU step returns once queued: the epoch's clock stops when its last step has run.
    strategy.synchronize()
    progress.seconds += time.perf_counter() - last
    loss.read(progress, time.perf_counter(), f"the end of epoch {epoch + 1}", keeper.kept)
    # mpi_bytes_sent, comm/compute seconds, per step and per rank
    traffic = hosts.traffic.epoch_record(hosts.allgather)
    traffic["per_step"]["seconds"] = [round(s, 6) for s in step_seconds]
    return {"epoch": epoch + 1, "steps": progress.steps, "samples": progress.global_samples,
            "seconds": progress.seconds,
            "images_per_second": progress.global_samples / max(progress.seconds, 1e-9),
            "train_loss": hosts.mean_over_hosts(progress.settle(), progress.samples),
            "data_wait_seconds": progress.data_wait_seconds,
            "started_at": started_at, "ended_at": time.time(), **traffic}


def logical_gradients(scheme, strategy, hosts, x, y, share, keys) -> StepStats:
    """The step's gradients on a host that runs several logical ranks (a compressed run
    resumed on fewer hosts: `Hosts.use_logical`): each one's rows in turn, as its own host
    computed them, handed to the averaging before the next."""
    samples, loss_sum = 0, 0.0
    for part, (start, stop) in enumerate(hosts.parts(share)):
        with dropout_keys(keys[start:stop]):
            stats = scheme.gradients(strategy, x[start:stop], y[start:stop], share)
        hosts.part_done(part, stats.samples, share.global_samples)
        samples, loss_sum = samples + stats.samples, loss_sum + stats.loss_sum
    return StepStats(samples, loss_sum)


def inject_faults(rank: int, steps_done: int, model) -> None:
    """HYBRIDDL_FAILPOINTS's faults of a step (hybriddl/failpoints.py); none when unset."""
    if failpoints.fires("drift", rank, steps_done):
        with torch.no_grad():
            first = next(model.parameters()).view(-1)[:1]
            first.copy_(torch.nextafter(first, torch.full_like(first, math.inf)))
    if failpoints.fires("busy", rank, steps_done):
        failpoints.hold_the_gil(failpoints.seconds("busy"))
    for stall in ("stall-inside", "stall-ahead"):
        if failpoints.fires(stall, rank, steps_done):
            failpoints.arm(stall)  # MPIHosts.wait: the next exchange (or the one after) stalls
    if failpoints.fires("stall-exchange", rank, steps_done):
        failpoints.stall_for_ever()  # the heartbeat's thread goes on beating


class LossReader:
    """The epoch's running loss, read back where a strategy leaves it on a device only
    every READ_SECONDS (for the progress bar) and before a checkpoint: a read makes the
    host wait for the device, and a read every step kept a GPU step from being queued
    while the last one ran. A loss on the CPU is read every step. A loss that is not
    finite stops the run at its read, before the next checkpoint, naming the step."""

    READ_SECONDS = 0.5

    def __init__(self, progress):
        self.last: float | None = None
        self.read_at = -math.inf
        self._sum, self._samples = progress.settle(), progress.samples

    @staticmethod
    def on_device(loss_sum) -> bool:
        return isinstance(loss_sum, torch.Tensor) and loss_sum.device.type != "cpu"

    def due(self, loss_sum, now: float) -> bool:
        return not self.on_device(loss_sum) or now - self.read_at >= self.READ_SECONDS

    def read(self, progress, now: float, where: str, kept) -> None:
        on_device = self.on_device(progress.loss_sum)
        total = progress.settle()
        if not math.isfinite(total):
            # Read every step on a CPU: at that step; from a device: by it.
            raise TrainingError(f"loss became {total} {'by' if on_device else 'at'} {where}: "
                                f"lower --lr; {kept()}")
        if progress.samples > self._samples:
            # The mean over the steps since the last read (the step's own on a CPU).
            self.last = (total - self._sum) / (progress.samples - self._samples)
        self._sum, self._samples, self.read_at = total, progress.samples, now


class Validation:
    """Validation of a run's epoch, where `--eval-every` and `--target-accuracy` want it (see
    `evaluate`), and the target's record (run/target.py) takes each accuracy."""

    def __init__(self, strategy, images, transform, batch_size: int, target: AccuracyTarget,
                 observer: TrainingObserver, epoch_steps: int, hosts=None, scheme=None):
        self.strategy, self.images, self.transform = strategy, images, transform
        self.batch_size, self.target, self.observer = batch_size, target, observer
        self.epoch_steps, self.hosts, self.scheme = epoch_steps, hosts, scheme
        self.shared_by: int | None = None  # how many hosts shared the last validation
        self._last: tuple[int, float] | None = None  # (steps done, accuracy) just measured

    def due(self, steps_done: int) -> bool:
        return self.target.due(steps_done)

    def after_step(self, epoch: int, steps_done: int, epoch_steps_done: int) -> bool:
        """Validate now; True when the run stops at its target here."""
        accuracy, self.shared_by = evaluate(self.strategy, self.images, self.transform,
                                            self.batch_size, self.hosts, self.scheme)
        self._last = (steps_done, accuracy)
        # Shown as made, inside an epoch: the epoch's own line shows its last.
        return self._taken(accuracy, epoch, steps_done, epoch_steps_done,
                           shown=epoch_steps_done != self.epoch_steps)

    def at_epoch_end(self, epoch: int, steps_done: int, epoch_steps_done: int) -> float:
        """The epoch's validation accuracy: the one just measured when validation was due at
        its last step, else measured now."""
        if self._last is not None and self._last[0] == steps_done:
            return self._last[1]
        accuracy, self.shared_by = evaluate(self.strategy, self.images, self.transform,
                                            self.batch_size, self.hosts, self.scheme)
        if epoch_steps_done == self.epoch_steps or self.target.due(steps_done):
            # Not where --max-steps cut an epoch off the validations' grid: the run that
            # went on made none there, and its record must be the resumed run's.
            self._taken(accuracy, epoch, steps_done, epoch_steps_done)
        return accuracy

    def _taken(self, accuracy: float, epoch: int, steps_done: int, epoch_steps_done: int,
               shown: bool = False) -> bool:
        reached_before = self.target.reached
        stop = self.target.evaluated(accuracy, epoch + 1, steps_done,
                                     epoch + epoch_steps_done / max(self.epoch_steps, 1))
        if shown:
            self.observer.on_evaluation(self.target.record["evaluations"][-1])
        if self.target.reached and not reached_before:
            self.observer.on_target(self.target.record)
        return stop


def evaluate(strategy: LocalStrategy, images: datamod.ImageSet, transform, batch_size: int,
             hosts=None, scheme=None) -> tuple[float, int]:
    """Validation accuracy of the current master parameters (no augmentation), and how many
    hosts shared it. Across hosts, MLPerf's clock runs through validation: the images go in
    batches of `batch_size` rows per host, and each host takes its share of every batch the
    way its scheme says (`validation_logits`: with the whole model, its rows; with the
    classifier split, its rows' convolutions where that pays); the correct counts are
    summed. Where a scheme shares nothing, every host takes every row."""
    model = strategy.model
    was_training = model.training
    model.eval()
    parts, logits_of = 1, None
    if hosts is not None and scheme is not None and hosts.size > 1:
        scheme.average_statistics(model, hosts)  # (BatchNorm's: each host's own till now)

        def sample():  # a batch to time, where the scheme has yet to settle how to share
            return transform(images.images[:batch_size])
        if (logits_of := scheme.validation_logits(strategy, sample)) is not None:
            parts = hosts.size
    if logits_of is None:
        def logits_of(x, counts):
            return strategy.evaluate(x)
    rank = hosts.rank if parts > 1 else 0
    correct = 0
    for start in range(0, len(images), batch_size * parts):
        counts = split_counts(min(batch_size * parts, len(images) - start), [1.0] * parts)
        first = start + sum(counts[:rank])
        last = first + counts[rank]
        x = transform(images.images[first:last]) if last > first else torch.zeros((0,))
        logits = logits_of(x, counts)
        correct += int((logits.argmax(1) == images.labels[first:last]).sum()) if len(x) else 0
    model.train(was_training)
    if parts > 1:
        correct = sum(hosts.allgather(correct))
    elif hosts is not None and hosts.size > 1:
        # Every host took every row: rank 0's count is every host's, so that a
        # --stop-at-target stops all alike (the hybrid scheme's replicated last layer
        # may differ by an ulp between replica checks; a host that stopped alone hung).
        correct = hosts.allgather(correct)[0]
    return correct / len(images), parts


def resumed_metrics(prepared: PreparedRun, hosts, scheme) -> dict:
    """The checkpoint's metrics, noting where this run took over and how it runs."""
    config, metrics = prepared.config, prepared.resume.metrics
    position = prepared.resume.position
    # A resumed run may be extended or given another learning rate: the record follows,
    # and the resume says what it changed (from, to), so the steps before keep theirs.
    now = {"epochs": config.epochs, "max_steps": config.max_steps, "lr": config.lr,
           "momentum": config.momentum, "dropout": config.dropout,
           "checkpoint_every": config.checkpoint_every}
    changed = {name: [metrics["config"].get(name), value] for name, value in now.items()
               if metrics["config"].get(name) != value}
    metrics["config"].update(now)
    resume = {
        "epoch": position.epoch + 1, "step": position.step, "steps_done": position.steps_done,
        "strategy": prepared.strategy.describe(), "hosts": hosts.describe(),
        "host_parallel": host_parallel_record(prepared, hosts, scheme), "plan": scheme.plan,
        **({"changed": changed} if changed else {})}
    ran = saved_compression(prepared.resume)
    # A compressed run goes on with fewer hosts than it started on as its logical ranks.
    started_on = resumption.logical_count(prepared.resume)
    more = None
    if (started_on and ran == hosts.compression.name and scheme.runs_logical_ranks
            and hosts.use_logical(started_on)):
        saved, more, unread = resumption.compression_by_logical_rank(
            prepared.resume, prepared.run_dir, hosts.logical_ranks)
        holds_error = saved.get("error") is not None
        resume["logical_hosts"] = started_on
    else:
        saved, holds_error, unread = resumption.compression_for_host(
            prepared.resume, prepared.run_dir, hosts.rank, hosts.size)
    # A scheme other than the checkpoint's says so alone: it takes none of the errors.
    if note := hosts.restore_compression(ran, saved, holds_error, more) or unread:
        resume["compression"] = note
        metrics["config"]["hosts"].setdefault("notes", []).append(note)  # shown at start
    metrics["config"]["compression"] = config.compression
    if metrics["config"].get("dropout_masks") != MASKS:
        resume["note"] = (f"dropout masks drawn by {MASKS} from here on, by "
                          f"{metrics['config'].get('dropout_masks') or 'mt19937 per sample'} "
                          "before: the steps after this resume differ from the uninterrupted run")
        metrics["config"]["dropout_masks"] = MASKS
    metrics.setdefault("resumes", []).append(resume)
    return metrics


def saved_compression(resume: resumption.Checkpoint) -> str:
    """The compression a checkpoint's last steps ran with: the one its hosts settled at
    the latest start (--compression auto is "auto" in its config), else the one asked."""
    starts = [resume.metrics.get("config", {}), *resume.metrics.get("resumes", [])]
    settled = starts[-1].get("hosts", {}).get("compression")
    return settled or resume.config.get("compression", EXACT)


def checkpoint_about(prepared: PreparedRun, metrics: dict) -> dict:
    """What a checkpoint of this run records besides its state."""
    config = asdict(prepared.config)
    return {"config": config, "strategy": prepared.strategy.describe(),
            "identity": resumption.run_identity(config, datamod.describe(prepared.split)),
            "profile": metrics["config"].get("profile")}


def settings_hosts_share(prepared: PreparedRun) -> dict:
    """What every host must have identically (the data's path may differ, not its size):
    the model's numbers, and what decides when the hosts enter a collective (a validation,
    a checkpoint, a replica check, a stop at the target): hosts given other values hung."""
    config = prepared.config
    return {**{key: getattr(config, key) for key in (
        "usecase", "model", "image_size", "batch_size", "epochs", "max_steps", "lr",
        "momentum", "dropout", "seed", "host_parallel", "compression", "feature_dtype",
        "eval_every", "target_accuracy", "stop_at_target", "checkpoint_every", "check_every")},
        "train_images": len(prepared.split.train)}


def check_host_parallel(config: TrainConfig, model, strategy: LocalStrategy) -> None:
    """--host-parallel hybrid with a strategy that cannot run it: refused before anything
    starts (a model that cannot be split falls back to data, said when the run starts)."""
    if config.host_parallel == "hybrid":
        try:
            HybridParallel.check(model, strategy)
        except NotSplittable:
            pass


def memory_record(model, optimizer) -> dict:
    """What this host (rank 0's, in metrics.json) held at the end: parameter and optimizer
    state bytes, the classifier's and the rest's (a split classifier holds 1/H), and the
    process's peak resident memory."""
    return {**held_bytes(model, optimizer),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def host_parallel_record(prepared: PreparedRun, hosts, scheme) -> dict:
    """The scheme, why, what this host holds, and each scheme's bytes per host per step
    in theory (the measured ones are the epochs' mpi_bytes_sent and the NIC counters)."""
    record = {"asked": prepared.config.host_parallel, **scheme.describe(prepared.model),
              "theory_bytes_per_host_per_step": traffic_bytes(
                  prepared.model if scheme.name == "data" else _whole_shape(prepared),
                  hosts.size, prepared.config.batch_size)}
    if hosts.link_bytes_per_second:
        record["link_bytes_per_second"] = hosts.link_bytes_per_second
    return record


def _whole_shape(prepared: PreparedRun):
    """The whole model's shape, on the meta device (the run's holds a slice)."""
    with torch.device("meta"):
        return build_model(prepared.config.model, len(prepared.split.classes), prepared.config.dropout)


def config_record(prepared: PreparedRun, hosts, scheme) -> dict:
    config = prepared.config
    return {
        "host_parallel": host_parallel_record(prepared, hosts, scheme), "plan": scheme.plan,
        "usecase": config.usecase, "model": config.model, "data": datamod.describe(prepared.split),
        "strategy": prepared.strategy.describe(), "strategy_choice": prepared.strategy_choice,
        "hosts": hosts.describe(), "compression": config.compression,
        "global_batch": config.batch_size, "image_size": config.image_size,
        "epochs": config.epochs, "max_steps": config.max_steps,
        "checkpoint_every": config.checkpoint_every, "lr": config.lr,
        "momentum": config.momentum, "dropout": config.dropout, "dropout_masks": MASKS,
        "seed": config.seed,
        "weights": prepared.start_weights,
        "torch": torch.__version__, "python": platform.python_version(),
    }

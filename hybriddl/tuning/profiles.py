"""Profiles: the tuner's measured table for one host and setting, and its pick.

A profile lives at ``<profile dir>/<host>-<usecase>-<model>-b<batch>-<size>px.json``
(profile dir: ``--profile-dir``, else ``$HYBRIDDL_PROFILES``, else ``./profiles``), one
file per host, use case, model, host batch and image size, written atomically. A profile
under the old name ``<host>-<usecase>.json`` is still read when its settings match; new
tunes never write that name. Schema, version 2 (``SCHEMA_VERSION``; version 1, without
rounds, is still read)::

    {
      "schema_version": 2,
      "host": "node07",                       # naming.host_name() of the measured host
      "created": "2026-11-21T05:30:00Z",       # UTC, when the tune finished
      "hybriddl": "0.1.0",
      "fingerprint": {                         # a change in any field makes the profile stale
        "cpu_model": "Intel(R) Xeon(R) ...", "cores_usable": 2, "ram_gib": 7.8,
        "gpus": ["NVIDIA H100 80GB HBM3"], "torch": "2.14.1",
        "allocator": "tcmalloc"                # what the tune ran on (absent in older
      },                                       # profiles: glibc, all hybriddl ran on then)
      "settings": {                            # what was measured; train matches all six
        "usecase": "ComplexSmall", "model": "vgg16", "image_size": 224, "batch_size": 16,
        "precision": "fp32",                   # --precision: fp32, bf16 or auto
        "accumulate": 1                        # --accumulate (absent in older profiles: 1)
      },
      "measurement": {"warmup_steps": 1, "timed_steps": 2,   # per visit of a candidate
                      "rounds": 3, "second_look_rounds": 2, "tie_tolerance": 0.03,
                      "budget_seconds": 600.0, "seconds_spent": 312.5},
      "candidates": [                          # every candidate tried, in enumeration order
        {
          "strategy": {"name": "threads", "workers": 2, "micro_batches": null, "devices": []},
          "label": "threads K=2",
          "status": "measured",                # or "dropped" (budget, error): see "note"
          "seconds_per_step": 5.31,            # median over rounds of each visit's median step
          "rounds": 5,                         # visits measured (second look included)
          "round_seconds": [5.2, 5.4, 5.31, 5.6, 5.3],
          "spread_seconds": [5.2, 5.6],        # lowest and highest of round_seconds
          "timed_steps": 10,                   # over all visits
          "images_per_second": 3.01,
          "speedup": 1.88,                     # over sequential on one core (the baseline)
          "speedup_over_gpu": null,            # over the gpu strategy on one GPU; GPU hosts only
          "peak_rss_bytes": 2147483648,        # the tuning process and its workers
          "note": ""
        }
      ],
      "pick": {"name": "threads", "workers": 2, "micro_batches": null, "devices": []}
      # A strategy dict carries "precision": "bf16", "channels_last": true and "accumulate": N
      # only where they differ from float32 / the default memory format / 1, so older
      # profiles read the same.
    }

``pick`` is the measured candidate with the lowest median seconds per step, unless the
runner-up is within the noise of it (see tuner.select_pick): then the one with less peak
memory. A profile that cannot be read (truncated JSON, an unknown schema version, missing
fields) raises ProfileError, a UsageError whose message says to re-tune; `find_profile`
turns every such problem into a lookup that explains why the profile cannot be used.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from hybriddl import __version__
from hybriddl.errors import UsageError
from hybriddl.machine.allocator import GLIBC, loaded_allocator
from hybriddl.machine.hostinfo import cpu_model, gpus, usable_cores
from hybriddl.machine.naming import host_name
from hybriddl.files import atomic_write_json
from hybriddl.strategies import StrategySpec
from hybriddl.usecases import NamesAUseCase

SCHEMA_VERSION = 2
# Version 1 had no rounds: each candidate one pass; it reads as one round without a spread.
READABLE_VERSIONS = (1, 2)
DEFAULT_DIR = "profiles"
DIR_ENV = "HYBRIDDL_PROFILES"
MEASURED, DROPPED = "measured", "dropped"


class ProfileError(UsageError):
    """A profile file that cannot be used as it is; the remedy is to tune again."""


def profile_dir(given: str | os.PathLike | None = None) -> Path:
    """--profile-dir if given, else $HYBRIDDL_PROFILES, else ./profiles."""
    return Path(given or os.environ.get(DIR_ENV) or DEFAULT_DIR)


def this_host() -> str:
    return host_name()


def profile_path(directory: str | os.PathLike, settings: Settings, host: str | None = None) -> Path:
    """<host>-<usecase>-<model>-b<batch>-<size>px[-bf16|-auto][-accN].json: one file per
    measured setting, so
    tuning at one image size or batch never overwrites the profile of another."""
    host = (host or this_host()).replace(os.sep, "_")
    s = settings
    numerics = "" if s.precision == "fp32" else f"-{s.precision}"  # a bf16 tune keeps fp32's
    chunks = "" if s.accumulate == 1 else f"-acc{s.accumulate}"
    name = (f"{host}-{s.usecase}-{s.model}-b{s.batch_size}-{s.image_size}px{numerics}"
            f"{chunks}.json")
    return Path(directory) / name.replace(os.sep, "_")


def legacy_profile_path(directory: str | os.PathLike, usecase: str, host: str | None = None) -> Path:
    """Where hybriddl before per-setting names kept a host's one profile per use case."""
    host = (host or this_host()).replace(os.sep, "_")
    return Path(directory) / f"{host}-{usecase}.json"


def fingerprint() -> dict:
    """The hardware and software facts a measurement depends on."""
    return {
        "cpu_model": cpu_model(),
        "cores_usable": usable_cores(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": [g["name"] for g in gpus()],
        "torch": torch.__version__,
        "allocator": loaded_allocator(),  # steps differ by allocator (machine/allocator.py)
    }


@dataclass(frozen=True)
class Settings(NamesAUseCase):
    """What a profile was measured at; a training run uses a profile only at the same."""

    usecase: str
    model: str
    image_size: int
    batch_size: int
    precision: str = "fp32"  # what the user allows: fp32, bf16 or auto (the tuner tries both)
    accumulate: int = 1  # every candidate computes the batch in this many chunks

    def describe(self) -> str:
        precision = "" if self.precision == "fp32" else f", precision {self.precision}"
        chunks = "" if self.accumulate == 1 else f", accumulate {self.accumulate}"
        return (f"{self.usecase} ({self.model}), {self.image_size} px, batch {self.batch_size}"
                f"{precision}{chunks}")


@dataclass
class CandidateResult:
    choice: StrategySpec
    status: str  # MEASURED or DROPPED
    seconds_per_step: float | None = None
    timed_steps: int = 0
    images_per_second: float | None = None
    speedup: float | None = None  # over sequential on one core
    speedup_over_gpu: float | None = None  # over the gpu strategy on one device
    peak_rss_bytes: int | None = None
    note: str = ""
    round_seconds: list[float] = field(default_factory=list)  # each round's median step
    spread_seconds: tuple[float, float] | None = None  # (lowest, highest) of round_seconds

    @property
    def measured(self) -> bool:
        return self.status == MEASURED

    @property
    def relative_noise(self) -> float:
        """Half the spread over the median: 0 when one round was measured (or none kept)."""
        if not self.spread_seconds or not self.seconds_per_step:
            return 0.0
        low, high = self.spread_seconds
        return (high - low) / (2 * self.seconds_per_step)

    def to_dict(self) -> dict:
        return {"strategy": self.choice.to_dict(), "label": self.choice.label,
                "status": self.status, "seconds_per_step": self.seconds_per_step,
                "timed_steps": self.timed_steps, "images_per_second": self.images_per_second,
                "speedup": self.speedup, "speedup_over_gpu": self.speedup_over_gpu,
                "peak_rss_bytes": self.peak_rss_bytes, "note": self.note,
                "rounds": len(self.round_seconds), "round_seconds": self.round_seconds,
                "spread_seconds": list(self.spread_seconds) if self.spread_seconds else None}

    @classmethod
    def from_dict(cls, record: dict) -> CandidateResult:
        status = record["status"]
        if status not in (MEASURED, DROPPED):
            raise ValueError(f"candidate status {status!r}")
        result = cls(choice=StrategySpec.from_dict(record["strategy"]), status=status,
                     seconds_per_step=_optional_float(record.get("seconds_per_step")),
                     timed_steps=int(record.get("timed_steps") or 0),
                     images_per_second=_optional_float(record.get("images_per_second")),
                     speedup=_optional_float(record.get("speedup")),
                     speedup_over_gpu=_optional_float(record.get("speedup_over_gpu")),
                     peak_rss_bytes=_optional_int(record.get("peak_rss_bytes")),
                     note=str(record.get("note") or ""),
                     round_seconds=[float(v) for v in record.get("round_seconds") or []],
                     spread_seconds=_optional_pair(record.get("spread_seconds")))
        if result.measured and not (result.seconds_per_step and result.seconds_per_step > 0):
            raise ValueError(f"measured candidate {result.choice.label} has no seconds_per_step")
        return result


@dataclass
class Profile:
    host: str
    fingerprint: dict
    settings: Settings
    candidates: list[CandidateResult]
    pick: StrategySpec
    measurement: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    hybriddl: str = __version__

    @property
    def pick_result(self) -> CandidateResult:
        for candidate in self.candidates:
            if candidate.measured and candidate.choice == self.pick:
                return candidate
        raise ProfileError(f"the profile's pick {self.pick.label} is not among its measured "
                           "candidates: run 'hybriddl tune' again")

    @property
    def pick_throughput(self) -> float:
        """The pick's images per second: this host's weight when hosts share a global batch."""
        return float(self.pick_result.images_per_second)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "host": self.host, "created": self.created,
                "hybriddl": self.hybriddl, "fingerprint": self.fingerprint,
                "settings": asdict(self.settings), "measurement": self.measurement,
                "candidates": [c.to_dict() for c in self.candidates],
                "pick": self.pick.to_dict()}

    @classmethod
    def from_dict(cls, record: dict, source: str = "profile") -> Profile:
        if not isinstance(record, dict):
            raise ProfileError(f"{source} is not a profile (a JSON object is expected): "
                               "run 'hybriddl tune' to write a new one")
        version = record.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise ProfileError(f"{source} has schema version {version!r}, this hybriddl reads "
                               f"versions {', '.join(map(str, READABLE_VERSIONS))}: run 'hybriddl tune' to measure again")
        try:
            # Before allocators were chosen every tune ran on glibc's.
            profile = cls(host=str(record["host"]),
                          fingerprint={"allocator": GLIBC, **record["fingerprint"]},
                          settings=Settings(**record["settings"]),
                          candidates=[CandidateResult.from_dict(c) for c in record["candidates"]],
                          pick=StrategySpec.from_dict(record["pick"]),
                          measurement=dict(record.get("measurement") or {}),
                          created=str(record.get("created", "")),
                          hybriddl=str(record.get("hybriddl", "")))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # int(Infinity)
            raise ProfileError(f"{source} is damaged ({type(exc).__name__}: {exc}): "
                               "run 'hybriddl tune' to write a new one") from None
        profile.pick_result  # a pick that names no measured candidate is damage too
        return profile


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, profile.to_dict())
    return path


def load_profile(path: str | os.PathLike) -> Profile:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"no profile at {path}: run 'hybriddl tune' first") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path} ({exc}): run 'hybriddl tune' "
                           "to write a new one") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid JSON ({exc.msg} at line {exc.lineno}; "
                           "truncated?): run 'hybriddl tune' to write a new one") from None
    return Profile.from_dict(record, source=f"profile {path}")


def fingerprint_changes(recorded: dict, current: dict) -> list[str]:
    """'cores_usable 2 -> 4' for every fact that differs."""
    return [f"{key} {recorded.get(key)!r} -> {current.get(key)!r}"
            for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key)]


@dataclass
class ProfileLookup:
    """The outcome of looking for a usable profile; `problem` says why there is none."""

    path: Path
    profile: Profile | None = None
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.profile is not None and self.problem is None


def find_profile(directory: str | os.PathLike, settings: Settings, *, host: str | None = None,
                 current_fingerprint: dict | None = None) -> ProfileLookup:
    """This host's profile for `settings`, or why it cannot be used. Never raises for a bad file.

    Looks at the per-setting name first; a profile under the old per-use-case name is used
    when it was measured at the same settings. A new tune is always saved under the
    per-setting name (`lookup.path` when no usable profile was found).
    """
    host = host or this_host()
    path = profile_path(directory, settings, host)
    legacy = legacy_profile_path(directory, settings.usecase, host)
    try:
        found, old = path.exists(), legacy.exists()
    except OSError as exc:  # a folder this user cannot search: auto's write check says what to do
        return ProfileLookup(path, problem=f"cannot look in {path.parent} ({exc.strerror or exc})")
    if not found:
        if old:
            found = _check_profile(legacy, settings, host, current_fingerprint)
            return found if found.usable else ProfileLookup(path, problem=found.problem)
        return ProfileLookup(path, problem=f"no profile at {path}")
    return _check_profile(path, settings, host, current_fingerprint)


def _check_profile(path: Path, settings: Settings, host: str,
                   current_fingerprint: dict | None) -> ProfileLookup:
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        return ProfileLookup(path, problem=str(exc))
    if profile.host != host:
        return ProfileLookup(path, profile, f"{path} was measured on host {profile.host!r}, "
                                            f"not on {host!r}")
    if profile.settings != settings:
        return ProfileLookup(path, profile, f"{path} was measured at {profile.settings.describe()}, "
                                            f"not at {settings.describe()}")
    changes = fingerprint_changes(profile.fingerprint, current_fingerprint or fingerprint())
    if changes:
        return ProfileLookup(path, profile, f"{path} is stale: this host changed since it was "
                                            f"measured ({'; '.join(changes)})")
    reason = profile.pick.infeasibility()
    if reason:
        return ProfileLookup(path, profile, f"{path} picks {profile.pick.label}, which this host "
                                            f"cannot run ({reason})")
    return ProfileLookup(path, profile)


def profiled_throughput(settings: Settings, directory: str | os.PathLike | None = None) -> float | None:
    """Images/s of this host's pick at `settings`, or None without a usable profile.

    Hosts of different speed get shares of the global batch in proportion to this.
    """
    lookup = find_profile(profile_dir(directory), settings)
    return lookup.profile.pick_throughput if lookup.usable else None


def _optional_pair(value) -> tuple[float, float] | None:
    if value is None:
        return None
    low, high = value
    return float(low), float(high)


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)

"""What a strategy is asked to be: its name and options, as given, tuned, recorded and profiled."""

from __future__ import annotations

from dataclasses import dataclass

from hybriddl.errors import UsageError

# name -> strategy class; filled by hybriddl.strategies, the registry, when it is imported.
# It lives here so that a spec can check itself against the registry without a cycle.
STRATEGIES: dict[str, type] = {}


@dataclass(frozen=True)
class StrategyOptions:
    """What the command line can say about a local strategy."""

    workers: int | None = None  # K local workers; None: the strategy's default
    micro_batches: int = 4  # pipeline only
    devices: tuple[str, ...] = ()  # gpu / pipeline / gpu-threads; () = the strategy's default
    oversubscribe: bool = False  # allow more workers than usable cores
    # Numerics (strategies/base.py:run_forward): "bf16" autocasts the forward pass; master
    # weights, gradients and the optimizer stay float32. channels_last stores images and
    # conv weights NHWC, which oneDNN's CPU convolutions prefer; still float32.
    precision: str = "fp32"
    channels_last: bool = False
    # Gradient accumulation (base.py:host_gradients): the host batch is computed in this
    # many sequential chunks whose gradients add up to the batch's, so activations are
    # held for one chunk at a time. Same step, less memory; 1 = the whole batch at once.
    accumulate: int = 1


PRECISIONS = ("fp32", "bf16")


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class StrategySpec:
    """One strategy with its parameters: a tuner candidate, a profile's pick, a report's row."""

    name: str
    workers: int | None = None
    micro_batches: int | None = None  # pipeline only
    devices: tuple[str, ...] = ()
    precision: str = "fp32"
    channels_last: bool = False
    accumulate: int = 1

    def options(self, oversubscribe: bool = False) -> StrategyOptions:
        default = StrategyOptions()
        return StrategyOptions(workers=self.workers,
                               micro_batches=self.micro_batches or default.micro_batches,
                               devices=self.devices, oversubscribe=oversubscribe,
                               precision=self.precision, channels_last=self.channels_last,
                               accumulate=self.accumulate)

    @property
    def label(self) -> str:
        parts = [self.name]
        if self.devices:
            parts.append(",".join(self.devices))
        if self.workers is not None:
            parts.append(f"K={self.workers}")
        if self.micro_batches is not None:
            parts.append(f"M={self.micro_batches}")
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.channels_last:
            parts.append("channels_last")
        if self.accumulate != 1:
            parts.append(f"accumulate={self.accumulate}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        record = {"name": self.name, "workers": self.workers,
                  "micro_batches": self.micro_batches, "devices": list(self.devices)}
        # Only where they differ from the default: profiles of fp32 picks read as before.
        if self.precision != "fp32":
            record["precision"] = self.precision
        if self.channels_last:
            record["channels_last"] = True
        if self.accumulate != 1:
            record["accumulate"] = self.accumulate
        return record

    @classmethod
    def from_dict(cls, record: dict) -> StrategySpec:
        return cls(name=str(record["name"]), workers=_optional_int(record.get("workers")),
                   micro_batches=_optional_int(record.get("micro_batches")),
                   devices=tuple(str(d) for d in record.get("devices") or ()),
                   precision=str(record.get("precision") or "fp32"),
                   channels_last=bool(record.get("channels_last", False)),
                   accumulate=int(record.get("accumulate") or 1))

    def infeasibility(self) -> str | None:
        """Why this host cannot run it, or None when it can."""
        if self.name not in STRATEGIES:
            return f"strategy {self.name!r} is not one this hybriddl has"
        try:
            STRATEGIES[self.name].check_feasible(self.options())
        except UsageError as exc:
            return str(exc)
        return None


def check_accumulate(accumulate: int, batch_size: int) -> None:
    """--accumulate N cuts each host batch in N chunks: each needs a sample."""
    if not 1 <= accumulate <= batch_size:
        raise UsageError(f"--accumulate {accumulate}: give 1 to the batch size ({batch_size}); "
                         "each chunk needs a sample")

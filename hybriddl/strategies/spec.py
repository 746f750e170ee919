"""What a strategy is asked to be: its name and options, as given, recorded and profiled."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StrategyOptions:
    """What the command line can say about a local strategy."""

    workers: int | None = None  # K local workers; None: the strategy's default
    micro_batches: int = 4  # pipeline only
    devices: tuple[str, ...] = ()  # gpu / pipeline / gpu-threads; () = the strategy's default
    oversubscribe: bool = False  # allow more workers than usable cores

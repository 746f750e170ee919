"""Emulated hosts: H machines with their own network, on one machine (see hosts.py)."""

from hybriddl.emulation.hosts import (Dilation, EmulatedHosts, EmulatedRun, EmulationFailed,
                                      EmulationUnavailable, NicCounters, bits_per_second,
                                      check_available, check_speedup, duration_seconds,
                                      remove_leftovers, seconds_of, speedup_for_step)

__all__ = ["Dilation", "EmulatedHosts", "EmulatedRun", "EmulationFailed",
           "EmulationUnavailable", "NicCounters", "bits_per_second", "check_available",
           "check_speedup", "duration_seconds", "remove_leftovers", "seconds_of",
           "speedup_for_step"]

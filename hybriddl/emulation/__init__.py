"""Emulated hosts: H machines with their own network, on one machine (see hosts.py)."""

from hybriddl.emulation.hosts import (EmulatedHosts, EmulatedRun, EmulationFailed,
                                      EmulationUnavailable, NicCounters, bits_per_second,
                                      check_available, remove_leftovers, seconds_of)

__all__ = ["EmulatedHosts", "EmulatedRun", "EmulationFailed", "EmulationUnavailable",
           "NicCounters", "bits_per_second", "check_available", "remove_leftovers",
           "seconds_of"]

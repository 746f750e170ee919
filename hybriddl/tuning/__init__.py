"""Choosing a host's strategy: timing candidates (benchmark), the tuner, profiles."""

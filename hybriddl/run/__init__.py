"""One training run: its settings, the epoch loop, checkpoints, stopping."""

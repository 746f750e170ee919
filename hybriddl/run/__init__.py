"""One training run: the step loop, checkpoints, the run directory, stopping."""

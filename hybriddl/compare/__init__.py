"""Side by side: hybrid, flat MPI and PyTorch DDP on the same workload across emulated hosts,
and the PyTorch peers a strategy is timed against on one host."""

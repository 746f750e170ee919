"""Side-by-side runs: hybrid, flat MPI and PyTorch DDP on the same workload."""

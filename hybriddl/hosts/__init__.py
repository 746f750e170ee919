"""The host layer: one MPI rank per host, gradient averaging, the collectives between hosts.

Only this package imports mpi4py.
"""

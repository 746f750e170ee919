"""The host layer: one MPI rank per host, gradient averaging, what a host has.

Only this package imports mpi4py.
"""

"""hybriddl: local-first hybrid-parallel training (Lerat, Mahmoudi & Mahmoudi, 2022).

One MPI rank per host; each host computes its batch's gradient with its fastest
local strategy; hosts average gradients with MPI.
"""

__version__ = "0.1.0"

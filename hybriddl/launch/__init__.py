"""`hybriddl launch`: mpirun -npernode 1 under a supervisor that relaunches without a lost host."""

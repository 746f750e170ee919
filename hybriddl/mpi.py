"""Everything MPI. No other module imports mpi4py."""

from __future__ import annotations


def library_versions() -> dict:
    """mpi4py's and the MPI library's versions, without initialising MPI."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError as exc:
        return {"mpi4py": None, "mpi_library": f"unavailable ({exc})"}
    return {"mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0]}

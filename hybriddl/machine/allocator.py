"""The one owner of how this process's C allocator hands freed memory back.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
mmap and unmaps it on free. A training step allocates the same large tensors every time
(AlexNet's classifier gradients alone are 218 MB), so each step touches hundreds of MB of
new pages: 65,000-77,000 page faults and 0.10-0.13 s of kernel time per AlexNet step at
224 px (README, "Memory kept between steps"). Keeping freed memory in the heap (no mmap
for large blocks, no trimming) lets the next step reuse the same pages.

`keep_freed_memory()` does that with glibc's own `mallopt`, at run time, in this process
only; worker processes call it themselves. The price is memory: the heap keeps the
largest step's blocks, and holes between them (README gives the high-water marks). glibc
was seen not to reuse a freed block for the next 64-byte-aligned request of the same size
(strace: the heap grew by the block each time), so the heap grows during the first steps,
until it holds what a step needs (tests/test_allocator.py checks that it then stops). Set HYBRIDDL_MALLOC=system to
leave glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The largest trim threshold mallopt takes (an int): freed memory is never given back.
NEVER_TRIM = 2**31 - 1

_kept = False


def keep_freed_memory() -> bool:
    """From now on, keep freed memory for reuse instead of returning it to the kernel.

    Returns True when this process now keeps it (glibc, and HYBRIDDL_MALLOC is not
    'system'); False elsewhere (another C library, or the user opted out). Idempotent.
    """
    global _kept
    if _kept:
        return True
    if os.environ.get("HYBRIDDL_MALLOC", "keep") == "system":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to tell
        return False
    # mallopt returns 1 on success; both, or neither (the first alone changes nothing).
    _kept = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _kept


def give_back_freed_memory() -> bool:
    """Return the heap's free pages to the kernel now (glibc's malloc_trim).

    For measurements taken one after another in one process (the tuner's candidates):
    with freed memory kept, the process would otherwise still hold the pages of every
    earlier candidate, and each one's peak would read as the largest so far. True when
    glibc gave something back.
    """
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
    except (OSError, AttributeError, TypeError):  # not glibc
        return False


def reset_high_water_mark() -> bool:
    """Set this process's VmHWM to its current RSS (Linux >= 4.0: /proc/self/clear_refs),
    so that a peak read later is the peak since now. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False

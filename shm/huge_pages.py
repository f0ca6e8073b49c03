"""Large read-mostly arrays in memory advised for transparent huge pages (2 MiB), where Linux gives them.

A CPU decode step streams every dense matrix once, the lm_head above all
(151936 x 2048 Q6_K: 254 MB a token in the Q4_K_M file). In 4 KiB pages that
is 62 000 pages a token, a TLB miss and a page walk every 4 KiB. Anonymous
memory gets huge pages where /sys/kernel/mm/transparent_hugepage/enabled is
``always``, or ``madvise`` (the common default) and the range
is advised MADV_HUGEPAGE; ``never`` leaves it in small pages, unharmed. Shared
memory (/dev/shm) follows ``shmem_enabled`` instead, ``never`` by default,
so the expert segments keep small pages unless the owner allows it.

NumPy advises its own allocations from 4 MB too, but an array read through
that can hold no huge page at all (glibc's mapping, not aligned to 2 MiB);
copied here, nearly all of it is in huge pages (/proc/self/smaps).
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


def advised_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes], not initialised: from a huge page boundary in an anonymous mapping advised MADV_HUGEPAGE
    when it spans at least one huge page (else, or where the advice does not exist, np.empty)."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, np.uint8)
    # private: a shared anonymous mapping is shmem, which follows shmem_enabled. Room to start on a boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = np.frombuffer(region, np.uint8)  # keeps the mapping alive; unmapped when the last view goes
    start = -flat.ctypes.data % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)  # start: a page boundary, as mmap's address is one
    except OSError:  # a kernel without transparent huge pages: small pages, as np.empty gives
        pass
    return flat[start : start + nbytes]


def advised_copy(a: np.ndarray) -> np.ndarray:
    """a's bytes as uint8 [a.nbytes] in advised_empty's memory."""
    out = advised_empty(a.nbytes)
    out[:] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return out

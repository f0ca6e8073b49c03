"""A STREAM-style read of memory by a node's own threads (numba's team, as the expert kernels run): the
bandwidth the expert kernels are measured against.

The array is first written by the same threads (first touch puts its pages on their node), then read whole
REPEATS times, each thread summing its chunks; the best read counts.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from shm.jit import FAST

CHUNK = 2 << 20  # float32 values a task writes or reads: 8 MiB, so the chunks spread over the threads


@njit(parallel=True, **FAST)
def fill(data) -> None:
    for c in prange((data.size + CHUNK - 1) // CHUNK):
        data[c * CHUNK:(c + 1) * CHUNK] = 1.0


@njit(parallel=True, **FAST)
def read(data) -> float:
    """The sum of data [n] float32, chunk by chunk over the threads (fastmath: the loop is vectorised; the value
    only keeps the reads from being optimised away)."""
    chunks = (data.size + CHUNK - 1) // CHUNK
    sums = np.zeros(chunks, np.float32)
    for c in prange(chunks):
        acc = np.float32(0.0)
        for i in range(c * CHUNK, min((c + 1) * CHUNK, data.size)):
            acc += data[i]
        sums[c] = acc
    return sums.sum()


def read_bandwidth(threads: int, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(best seconds, GB/s) to read ``nbytes`` of float32 with ``threads`` of numba's threads."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    data = np.empty(max(1, nbytes // 4), np.float32)  # [n]
    fill(data)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read(data)
        best = min(best, time.perf_counter() - t0)
    return best, data.nbytes / best / 1e9


def warm_up() -> None:
    """Compile (or load from the disk cache) the two loops before a benchmark asks for them."""
    data = np.zeros(4, np.float32)
    fill(data)
    read(data)

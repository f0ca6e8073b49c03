"""A STREAM-style read of memory by a node's own pinned threads: the bandwidth
the expert kernels are measured against."""

from __future__ import annotations

import time

import numpy as np

from .tasks import TaskRunner

CHUNK_BYTES = 8 << 20


def read_bandwidth(runner: TaskRunner, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(best seconds, GB/s) to read ``nbytes`` of float32, split in chunks over the runner's threads.

    The array is first written by the same threads (first touch puts it on their node).
    """
    n = max(1, nbytes // 4)
    data = np.empty(n, np.float32)  # [n]
    chunks = [(a, min(a + CHUNK_BYTES // 4, n)) for a in range(0, n, CHUNK_BYTES // 4)]
    runner.run(len(chunks), lambda i: data[chunks[i][0]:chunks[i][1]].fill(1.0))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.run(len(chunks), lambda i: float(np.add.reduce(data[chunks[i][0]:chunks[i][1]])))
        best = min(best, time.perf_counter() - t0)
    return best, n * 4 / best / 1e9

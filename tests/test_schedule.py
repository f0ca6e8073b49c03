"""node_worker/kernels/schedule.py: a parallel loop's tasks handed out by an atomic counter."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from node_worker.kernels.schedule import take


@njit(parallel=True, cache=False)
def _visit(n, order, seen, taken_by):
    """schedule.py's loop: task order[i] for each value i the counter hands out; seen counts each task's runs,
    taken_by records the iteration (of prange) that took it."""
    counter = np.zeros(1, np.int64)
    for w in prange(n):
        i = take(counter, 0)
        while i < n:
            seen[order[i]] += 1
            taken_by[order[i]] = w
            i = take(counter, 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_counter_hands_out_every_task_once(threads):
    """Each task runs once, whatever the thread count and the number of tasks (more or fewer than the
    threads), and only a thread's first iteration of the loop takes any: the others find the counter past
    the end."""
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for n in (1, 2, 3, 64, 1001):
            order = np.random.default_rng(n).permutation(n)
            seen, taken_by = np.zeros(n, np.int64), np.full(n, -1, np.int64)
            _visit(n, order, seen, taken_by)
            assert (seen == 1).all(), n
            assert len(set(taken_by.tolist())) <= numba.get_num_threads(), (n, sorted(set(taken_by.tolist())))
    finally:
        numba.set_num_threads(before)

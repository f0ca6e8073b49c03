"""node_worker/kernel_threads.py: whether this process's threads spin, and numba's thread count set once a
thread and count."""

from __future__ import annotations

import threading

import numba
import pytest

from node_worker import kernel_threads


@pytest.mark.parametrize("env, spins", [({"GOMP_SPINCOUNT": "10000"}, True), ({"GOMP_SPINCOUNT": "0"}, False),
                                        ({"OMP_WAIT_POLICY": "passive"}, False), ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
                                        ({}, True)])
def test_spinning_reads_the_wait_policy(monkeypatch, env, spins):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert kernel_threads.spinning() is spins


def test_use_sets_numbas_count_once_a_thread_and_count(monkeypatch):
    """The count is set where it changes, on the calling thread, and skipped where use() set it so already."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    calls = []
    real = numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: (calls.append(n), real(n)))
    monkeypatch.setattr(kernel_threads, "_SET", threading.local())
    try:
        for n in (1, 1, 2, 2, 1):
            kernel_threads.use(n)
            assert numba.get_num_threads() == n
        assert calls == [1, 2, 1]
        seen = []
        other = threading.Thread(target=lambda: (kernel_threads.use(1), seen.append(numba.get_num_threads())))
        other.start()
        other.join()
        assert seen == [1] and calls == [1, 2, 1, 1]  # another thread: numba's count there is its own
    finally:
        real(numba.config.NUMBA_NUM_THREADS)

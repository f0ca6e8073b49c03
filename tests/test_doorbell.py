"""shm/doorbell.py's team wait: every one of numba's threads sleeps on the doorbell word itself, and one ring
wakes them all (the worker's and the spinning coordinator's way to wait: node_worker/kernel_threads.py)."""

from __future__ import annotations

import os
import platform
import threading
import time

import numba
import numpy as np
import pytest

from shm import doorbell

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or numba.config.NUMBA_NUM_THREADS < 2,
    reason="reads x86_64 syscall numbers from /proc; a team needs two of numba's threads")

SYS_FUTEX = 202


def _asleep_on(address: int) -> int:
    """How many of this process's threads are in futex(FUTEX_WAIT) on ``address``."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{task}/syscall").read().split()
        except OSError:  # the thread ended
            continue
        if (len(fields) > 3 and int(fields[0]) == SYS_FUTEX and int(fields[1], 16) == address
                and int(fields[2], 16) == doorbell.FUTEX_WAIT):
            n += 1
    return n


def _wait_in_thread(words: np.ndarray, seen: int, timeout_s: float) -> threading.Thread:
    waiter = threading.Thread(target=doorbell.wait_ring_team, args=(words, 0, seen, timeout_s, 2), daemon=True)
    waiter.start()
    return waiter


def test_one_ring_wakes_a_team_that_sleeps_on_the_word_itself():
    doorbell.warm_up()
    words = np.zeros(16, np.uint32)
    address = doorbell.word_address(words, 0)
    waiter = _wait_in_thread(words, int(words[0]), 120.0)
    deadline = time.monotonic() + 60
    while _asleep_on(address) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)  # polling the threads' state, not waiting for them to act
    assert _asleep_on(address) == 2  # both threads of the team, each on the word
    doorbell.ring(words, 0)
    waiter.join(60)  # far below the 120 s timeout: the ring woke both
    assert not waiter.is_alive() and _asleep_on(address) == 0


def test_a_ring_before_the_team_sleeps_is_not_lost():
    words = np.zeros(16, np.uint32)
    seen = int(words[0])
    doorbell.ring(words, 0)  # between the caller's check and its sleep
    waiter = _wait_in_thread(words, seen, 120.0)
    waiter.join(60)
    assert not waiter.is_alive()


def test_a_team_wait_ends_at_its_timeout_without_a_ring():
    words = np.zeros(16, np.uint32)
    started = time.monotonic()
    doorbell.wait_ring_team(words, 0, int(words[0]), 0.05, 2)
    assert time.monotonic() - started >= 0.05 and words[0] == 0


def test_spin_until_pauses_between_looks_and_stops_when_ready_or_out_of_time(monkeypatch):
    """Every spinning wait (the coordinator's socket, a worker's request word and socket) is spin_until: it
    yields the CPU (spin_pause) after each look that finds nothing, stops at the first true look, and gives up
    when its time is spent."""
    pauses, looks = [], []
    monkeypatch.setattr(doorbell, "spin_pause", lambda: pauses.append(1))

    def ready():
        looks.append(1)
        return len(looks) == 5

    assert doorbell.spin_until(60.0, ready) is True
    assert (len(looks), len(pauses)) == (5, 4)
    assert doorbell.spin_until(0.0, ready) is False and len(looks) == 5  # no time: no look

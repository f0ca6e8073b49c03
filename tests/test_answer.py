"""node_worker/answer.py: the layer computed, the answer published in the node's line, the coordinator rung,
all in one compiled call that then sleeps with the whole team on the node's doorbell."""

from __future__ import annotations

import time

import numpy as np
import pytest

from node_worker.answer import compute_answer_sleep
from node_worker.kernels.layer import layer_moe
from shm import doorbell, pool_io


def _layer(rng, hidden=64, R=32, experts=3, T=5):
    """layer_moe's arguments: ``experts`` float32 experts of R rows stored one after another, random routing."""
    mats = [rng.standard_normal((R, hidden)), rng.standard_normal((R, hidden)), rng.standard_normal((hidden, R))]
    data = np.concatenate([np.concatenate([m.astype(np.float32).ravel() for m in mats]) for _ in range(experts)])
    size = 4 * (2 * R * hidden + hidden * R)
    offsets = np.array([[e * size, e * size + 4 * R * hidden, e * size + 8 * R * hidden] for e in range(experts)],
                       np.int64)
    shapes = np.array([[R, 0, 4 * hidden, 0, 4 * hidden, 0, R, 4 * R]] * experts, np.int64)
    tokens = np.repeat(np.arange(T), 2).astype(np.int64)
    chosen = rng.integers(0, experts, tokens.size).astype(np.int64)
    return (data.view(np.uint8), hidden, rng.standard_normal((T, hidden)).astype(np.float32), tokens, chosen,
            rng.random(tokens.size).astype(np.float32), offsets, shapes, np.zeros((T, hidden), np.float32), False)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_answer_is_layer_moes_published_and_rung(threads):
    args = _layer(np.random.default_rng(threads))
    want = args[8].copy()
    nbytes = layer_moe(*args[:8], want, args[9])
    line, ring, bell = np.zeros(8, np.int64), np.zeros(16, np.uint32), np.zeros(1, np.uint32)
    seen = 1  # not the bell's count: the sleep ends at once
    started = time.monotonic_ns()
    got = compute_answer_sleep(*args, line, 7, started - 1, started, ring, bell.ctypes.data, seen,
                               doorbell.timespec(60.0).ctypes.data, threads)
    assert got == nbytes > 0 and np.array_equal(args[8], want)  # the same bits as the layer's kernel
    assert line[pool_io.NODE_DONE] == 7 and line[pool_io.NODE_STATUS] == pool_io.STATUS_OK
    assert line[pool_io.NODE_BYTES] == nbytes and line[pool_io.NODE_RECEIVED_NS] == started - 1
    assert line[pool_io.NODE_SENT_NS] - started == line[pool_io.NODE_COMPUTE_NS] > 0
    assert line[pool_io.NODE_SENT_NS] <= time.monotonic_ns()  # the same clock as the coordinator's stamps
    assert ring[0] == 1  # the coordinator's doorbell, rung once


def test_a_bad_token_publishes_nothing_and_rings_nothing():
    args = list(_layer(np.random.default_rng(0)))
    args[3] = args[3].copy()
    args[3][0] = 99  # outside [0, T)
    line, ring, bell = np.zeros(8, np.int64), np.zeros(16, np.uint32), np.zeros(1, np.uint32)
    got = compute_answer_sleep(*args, line, 7, 0, 0, ring, bell.ctypes.data, 1, doorbell.timespec(60.0).ctypes.data,
                               2)
    assert got == -1 and not line.any() and ring[0] == 0

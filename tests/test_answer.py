"""node_worker/answer.py: the layer computed, the answer published in the node's line, the coordinator rung,
all in one compiled call that then sleeps with the whole team on the node's doorbell."""

from __future__ import annotations

import time

import numpy as np
import pytest
from numba import njit

from node_worker.answer import compute_answer_sleep
from node_worker.kernels.kernel_set import KernelSet, compiled_cover
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
    # the f32 loops, in the compiled set that holds them (the suite compiles every loop once)
    return (compiled_cover(KernelSet.of(["f32"], False)), data.view(np.uint8), hidden,
            rng.standard_normal((T, hidden)).astype(np.float32), tokens, chosen, rng.random(tokens.size).astype(np.float32),
            offsets, shapes, np.zeros((T, hidden), np.float32))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_answer_is_layer_moes_published_and_rung(threads):
    args = _layer(np.random.default_rng(threads))
    want = args[9].copy()
    nbytes = layer_moe(*args[:9], want)
    line, ring, bell = np.zeros(8, np.int64), np.zeros(16, np.uint32), np.zeros(1, np.uint32)
    seen = 1  # not the bell's count: the sleep ends at once
    started = time.monotonic_ns()
    got = compute_answer_sleep(*args, line, 7, started - 1, started, ring, bell.ctypes.data, seen,
                               doorbell.timespec(60.0).ctypes.data, threads)
    assert got == nbytes > 0 and np.array_equal(args[9], want)  # the same bits as the layer's kernel
    assert line[pool_io.NODE_DONE] == 7 and line[pool_io.NODE_STATUS] == pool_io.STATUS_OK
    assert line[pool_io.NODE_BYTES] == nbytes and line[pool_io.NODE_RECEIVED_NS] == started - 1
    assert line[pool_io.NODE_SENT_NS] - started == line[pool_io.NODE_COMPUTE_NS] > 0
    assert line[pool_io.NODE_SENT_NS] <= time.monotonic_ns()  # the same clock as the coordinator's stamps
    assert ring[0] == 1  # the coordinator's doorbell, rung once


def test_a_bad_token_publishes_nothing_and_rings_nothing():
    args = list(_layer(np.random.default_rng(0)))
    args[4] = args[4].copy()
    args[4][0] = 99  # outside [0, T)
    line, ring, bell = np.zeros(8, np.int64), np.zeros(16, np.uint32), np.zeros(1, np.uint32)
    got = compute_answer_sleep(*args, line, 7, 0, 0, ring, bell.ctypes.data, 1, doorbell.timespec(60.0).ctypes.data,
                               2)
    assert got == -1 and not line.any() and ring[0] == 0


@njit(fastmath=True, cache=False)
def _pairs_in_order(y, contrib, sorted_tokens, sorted_weights, hidden):
    """The serial sum weigh_and_sum replaces: every pair in order, into its token's row."""
    y[:, :] = 0
    for p in range(sorted_tokens.size):
        for i in range(hidden):
            y[sorted_tokens[p], i] += sorted_weights[p] * contrib[p * hidden + i]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_weighted_sum_by_token_rows_adds_each_tokens_pairs_in_pair_order(threads):
    """layer.weigh_and_sum: each token's row by a thread, its contributions in pair (group) order, so y is the
    serial loop's bits whatever the threads; a token routed nowhere gets a row of zeros."""
    import numba

    from node_worker.kernels.layer import weigh_and_sum

    from node_worker.kernels.layer import SUM_PAIRS

    rng = np.random.default_rng(3)
    T, hidden = 9, 70
    for P in (5, SUM_PAIRS + 13):  # decode's few pairs serially, a prefill's in parallel
        sorted_tokens = rng.integers(0, T - 1, P).astype(np.int64)  # token T - 1: none
        weights = rng.random(P).astype(np.float32)
        contrib = rng.standard_normal(P * hidden).astype(np.float32)
        want = np.full((T, hidden), np.nan, np.float32)
        _pairs_in_order(want, contrib, sorted_tokens, weights, hidden)
        before = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            got = np.full((T, hidden), np.nan, np.float32)
            weigh_and_sum(got, contrib, sorted_tokens, weights, hidden)
        finally:
            numba.set_num_threads(before)
        assert np.array_equal(got, want) and not got[-1].any(), P
        ref = np.zeros((T, hidden))
        np.add.at(ref, sorted_tokens, weights[:, None].astype(np.float64) * contrib.reshape(P, hidden))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

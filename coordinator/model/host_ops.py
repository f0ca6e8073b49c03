"""Compiled host versions of ops.py's per-row reductions, for a CPU (NumPy) device side.

At decode a row is one token: rms_norm's NumPy form is five calls of about 10 µs
each for a few hundred multiplies, and route_top_k's a softmax, a stable argsort
and a gather. On the deep preset (48 layers, hidden 512) they were 16 ms of a
52 ms decode step (cProfile, q8). Here each is one compiled loop over the rows;
the results equal ops.py's to float32 rounding (tests/test_ops.py), ties in
the top-k going to the lower expert id as there.

    rms_norm(x [N, D], weight [D], eps, out [N, D])          float32, C-contiguous
    top_k(logits [T, E], k, normalize, ids [T, k], weights [T, k])
"""

from __future__ import annotations

import numpy as np
from numba import njit

from node_worker.kernels.common import JIT


@njit(**JIT)
def rms_norm(x, weight, eps, out) -> None:
    N, D = x.shape
    for n in range(N):
        s = 0.0
        for d in range(D):
            s += np.float64(x[n, d]) * x[n, d]
        r = np.float32(np.sqrt(np.float32(s / D) + eps))
        for d in range(D):
            out[n, d] = (x[n, d] / r) * weight[d]


@njit(**JIT)
def top_k(logits, k, normalize, ids, weights) -> None:
    T, E = logits.shape
    probs = np.empty(E, np.float32)
    taken = np.empty(E, np.bool_)
    for t in range(T):
        m = logits[t, 0]
        for e in range(1, E):
            m = max(m, logits[t, e])
        total = np.float32(0.0)
        for e in range(E):
            probs[e] = np.exp(logits[t, e] - m)
            total += probs[e]
        taken[:] = False
        chosen = np.float32(0.0)
        for j in range(k):
            best = -1
            for e in range(E):  # the largest not yet taken; the lower id on a tie
                if not taken[e] and (best < 0 or probs[e] > probs[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = probs[best] / total
            chosen += weights[t, j]
        if normalize:
            for j in range(k):
                weights[t, j] /= chosen

"""Compiled host versions of ops.py's per-row reductions, for a CPU (NumPy) device side.

At decode a row is one token: rms_norm's NumPy form is five calls of about 10 µs
each for a few hundred multiplies, and route_top_k's a softmax, a stable argsort
and a gather, so the calls cost more than the arithmetic. Here each is one compiled loop over the rows;
the results equal ops.py's to float32 rounding (tests/test_ops.py), ties in
the top-k going to the lower expert id as there.

    rms_norm(x [N, D], weight [D], eps, out [N, D])          float32, C-contiguous
    top_k(logits [T, E], k, normalize, ids [T, k], weights [T, k])
    rope(x [T, heads, hd], cos [T, d], sin [T, d], out)       d <= hd; the rest copied
    gqa_attention(q [T, nh, hd], k, v [S, nkv, hd], mask [T, S], scale, out [T, nh*hd])
    gqa_attention_parallel(the same)                         the (token, KV head) pairs over the threads

At decode gqa_attention's NumPy form is several calls (a broadcast batched matmul, a masked
softmax, another matmul, transposes); here the heads that share a KV
head read each key and value row once, one loop for all of them, and the
softmax's e^x is silu.exp (float32 operations LLVM vectorises; libm's expf is a
call per value).

A sum is never taken in a loop that also stores (the softmax's total is added
up after e^x is written): LLVM vectorises such a loop behind a run-time check
that the stored and the loaded arrays do not overlap, with the scalar loop as
the fallback, and the two add in different orders, so the function loaded from
numba's disk cache could give other last bits than the same function compiled
in the process. A loop that only adds has no such check (tests/test_ops.py
runs on a warm cache to check it).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from node_worker.kernels.common import JIT
from node_worker.kernels.silu import exp


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


@njit(**JIT)
def rope(x, cos, sin, out) -> None:
    T, heads, hd = x.shape
    d = cos.shape[1]
    half = d // 2
    for t in range(T):
        for h in range(heads):
            for j in range(half):
                out[t, h, j] = x[t, h, j] * cos[t, j] - x[t, h, j + half] * sin[t, j]
            for j in range(half, d):
                out[t, h, j] = x[t, h, j] * cos[t, j] + x[t, h, j - half] * sin[t, j]
            for j in range(d, hd):
                out[t, h, j] = x[t, h, j]


@njit(inline="always", **JIT)
def _kv_group(q, k, v, mask, scale, out, t, kh, scores, acc) -> None:
    """Token t's heads that share KV head kh: scores [g, S] and acc [g, hd] are scratch."""
    g, S = scores.shape
    hd = acc.shape[1]
    for j in range(S):
        seen = mask[t, j]
        for a in range(g):
            s = np.float32(-np.inf)
            if seen:
                s = np.float32(0.0)
                for d in range(hd):
                    s += q[t, kh * g + a, d] * k[j, kh, d]
                s *= scale
            scores[a, j] = s
    for a in range(g):
        m = scores[a, 0]
        for j in range(1, S):
            m = max(m, scores[a, j])
        for j in range(S):  # silu.exp: float32 operations that LLVM vectorises, where libm's is a call
            scores[a, j] = exp(scores[a, j] - m) if mask[t, j] else np.float32(0.0)
        total = np.float32(0.0)
        for j in range(S):  # apart from the stores: see the module docstring
            total += scores[a, j]
        for j in range(S):
            scores[a, j] /= total
        acc[a, :] = 0.0
    for j in range(S):
        if mask[t, j]:  # a masked key's weight is 0: its products are skipped (half of a causal prompt's)
            for a in range(g):
                p = scores[a, j]
                for d in range(hd):
                    acc[a, d] += p * v[j, kh, d]
    for a in range(g):
        for d in range(hd):
            out[t, (kh * g + a) * hd + d] = acc[a, d]


@njit(**JIT)
def gqa_attention(q, k, v, mask, scale, out) -> None:
    T, nh, hd = q.shape
    nkv = k.shape[1]
    scores = np.empty((nh // nkv, k.shape[0]), np.float32)  # [g, S] the group's heads over the keys
    acc = np.empty((nh // nkv, hd), np.float32)
    for t in range(T):
        for kh in range(nkv):
            _kv_group(q, k, v, mask, scale, out, t, kh, scores, acc)


@njit(inline="always", **JIT)
def zigzag(i, T) -> int:
    """The i-th token of the order 0, T - 1, 1, T - 2, ...: prange hands each thread one run of consecutive
    iterations, and a causal prompt's later tokens see more keys; in this order every run holds early and
    late tokens alike."""
    return i // 2 if i % 2 == 0 else T - 1 - i // 2


@njit(parallel=True, **JIT)
def gqa_attention_parallel(q, k, v, mask, scale, out) -> None:
    """gqa_attention with the (token, KV head) pairs shared among the threads (tokens in zigzag order): long
    contexts, and prompts. The zigzag order balances the threads' runs of a causal prompt, and the masked
    keys' zero-weight products are skipped."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    for i in prange(T * nkv):
        scores = np.empty((nh // nkv, k.shape[0]), np.float32)
        acc = np.empty((nh // nkv, hd), np.float32)
        _kv_group(q, k, v, mask, scale, out, zigzag(i // nkv, T), i % nkv, scores, acc)


def warm_up() -> None:
    """Compile (or load from the disk cache) every loop here before the first request, on the types ops.py
    passes. Left to the first use, a prompt long enough for gqa_attention_parallel (PARALLEL_ATTENTION_MACS)
    would load it inside the request and pay for the load in its latency."""
    x = np.ones((2, 8), np.float32)
    weight = np.ones(8, np.float32)
    rms_norm(x, weight, np.float32(1e-6), np.empty_like(x))
    weight.flags.writeable = False  # a checkpoint's norm weights: read-only views of the file, another type
    rms_norm(x, weight, np.float32(1e-6), np.empty_like(x))
    top_k(x, 2, True, np.empty((2, 2), np.int64), np.empty((2, 2), np.float32))
    heads = np.ones((2, 2, 8), np.float32)  # [T, heads, hd]
    rope(heads, x, x, np.empty_like(heads))
    mask = np.ones((2, 2), np.bool_)  # [T, S]
    out = np.empty((2, 16), np.float32)
    for loop in (gqa_attention, gqa_attention_parallel):
        loop(heads, heads[:, :1].copy(), heads[:, :1].copy(), mask, np.float32(0.5), out)

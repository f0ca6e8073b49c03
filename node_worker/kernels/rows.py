"""One compiled call per node per layer for the groups of few tokens (decode).

Every task is (expert group g, a block of rows [a, b) of the node's slice of
that expert). For one token, four rows at a time, the task takes the dot
products of the gate and up rows with the token's row, reading the store's
format in place (simd.py: each block widened and scaled in registers); for n
of 2..8 tokens (prefill) one row at a time, each block widened once for the n; then it adds the rows of W_down[:, R]ᵀ weighted by
silu(gate) * up into its own contribution [n, H]. Tasks run in parallel
(numba's threads, the node's CPUs: the dynamic schedule of prange); each
writes only its own contribution, and the caller adds them in task order, so
the result does not depend on the thread count or timing.

Inputs (C-contiguous):
    data            [bytes] uint8   the store's buffer (shm/expert_store.py's layout)
    x               [T, H] float32  the layer's rows
    tokens          [P] int64       rows of x, grouped: group g owns tokens[tok_start[g]:tok_stop[g]]
    offsets         [G, 3] int64    byte offsets of group g's expert's gate, up and down_t matrices
    task_group      [K] int64, task_rows [K, 2] int64: (group, row block) per task
    contrib_start   [K] int64       where task k's [n, H] contribution starts in ``contrib`` (float32)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import simd
from .common import JIT

FORMAT_IDS = {"f32": 0, "bf16": 1, "q8": 2, "q4": 3}


@njit(inline="always", **JIT)
def row_decode(fmt, data, o, hidden, out) -> None:
    """out [H] float32 <- the row at byte offset o of the store, dequantised (exactly shm.formats' decode)."""
    if fmt == 0:
        simd.decode_f32(data, o, hidden, out)
    elif fmt == 1:
        simd.decode_bf16(data, o, hidden, out)
    elif fmt == 2:
        simd.decode_q8(data, o, hidden, out)
    else:
        simd.decode_q4(data, o, hidden, out)


@njit(inline="always", **JIT)
def silu(s: np.float32) -> np.float32:
    return s * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * s)))  # the tanh form of blas.py


@njit(inline="always", **JIT)
def rows_dot4(fmt, data, o0, o1, o2, o3, hidden, x):
    """Dot products with x of the four rows at byte offsets o0..o3 of the store, in its format."""
    if fmt == 0:
        return simd.dot4_f32(data, o0, o1, o2, o3, hidden, x)
    if fmt == 1:
        return simd.dot4_bf16(data, o0, o1, o2, o3, hidden, x)
    if fmt == 2:
        return simd.dot4_q8(data, o0, o1, o2, o3, hidden, x)
    return simd.dot4_q4(data, o0, o1, o2, o3, hidden, x)


@njit(inline="always", **JIT)
def rows_axpy4(fmt, data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out) -> None:
    """out += c0 * row0 + ... + c3 * row3, the rows at byte offsets o0..o3 of the store, in its format."""
    if fmt == 0:
        simd.axpy4_f32(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out)
    elif fmt == 1:
        simd.axpy4_bf16(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out)
    elif fmt == 2:
        simd.axpy4_q8(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out)
    else:
        simd.axpy4_q4(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out)


@njit(inline="always", **JIT)
def row_dotn(fmt, data, o, hidden, xg, out) -> None:
    """out [n] = xg [n, H] · the row at byte offset o (n <= simd.MAX_TOKENS)."""
    if fmt == 0:
        simd.dotn_f32(data, o, hidden, xg, out)
    elif fmt == 1:
        simd.dotn_bf16(data, o, hidden, xg, out)
    elif fmt == 2:
        simd.dotn_q8(data, o, hidden, xg, out)
    else:
        simd.dotn_q4(data, o, hidden, xg, out)


@njit(inline="always", **JIT)
def row_axpyn(fmt, data, o, hidden, c, out) -> None:
    """out [n, H] += c [n] ⊗ the row at byte offset o."""
    if fmt == 0:
        simd.axpyn_f32(data, o, hidden, c, out)
    elif fmt == 1:
        simd.axpyn_bf16(data, o, hidden, c, out)
    elif fmt == 2:
        simd.axpyn_q8(data, o, hidden, c, out)
    else:
        simd.axpyn_q4(data, o, hidden, c, out)


@njit(inline="always", **JIT)
def task_tokens(fmt, data, hidden, row_bytes, xg, og, ou, od, a, b, out) -> None:
    """A task of n >= 2 tokens (xg [n, H], gathered): row by row, each block widened once for all n."""
    n = xg.shape[0]
    h = np.empty((b - a, n), np.float32)  # silu(gate) * up, per row and token
    gv = np.empty(n, np.float32)
    uv = np.empty(n, np.float32)
    for r in range(a, b):
        row_dotn(fmt, data, og + r * row_bytes, hidden, xg, gv)
        row_dotn(fmt, data, ou + r * row_bytes, hidden, xg, uv)
        for j in range(n):
            h[r - a, j] = silu(gv[j]) * uv[j]
    for r in range(a, b):
        row_axpyn(fmt, data, od + r * row_bytes, hidden, h[r - a], out)


ROWS = 4  # rows used together: the last group of a block may be short and repeats its first row (weight 0)


@njit(parallel=True, **JIT)
def layer_rows(fmt, data, hidden, row_bytes, x, tokens, tok_start, tok_stop, offsets, task_group, task_rows,
               contrib, contrib_start):
    for k in prange(task_group.size):
        g = task_group[k]
        a, b = task_rows[k, 0], task_rows[k, 1]
        t0, t1 = tok_start[g], tok_stop[g]
        n = t1 - t0
        out = contrib[contrib_start[k]:contrib_start[k] + n * hidden].reshape((n, hidden))
        out[:, :] = 0
        if n > 1:  # prefill's small groups
            xg = np.empty((n, hidden), np.float32)
            for j in range(n):
                xg[j] = x[tokens[t0 + j]]
            task_tokens(fmt, data, hidden, row_bytes, xg, offsets[g, 0], offsets[g, 1], offsets[g, 2], a, b, out)
            continue
        h = np.zeros((b - a + ROWS, n), np.float32)  # silu(gate) * up, per row and token
        for r in range(a, b, ROWS):
            m = min(ROWS, b - r)
            step = (0, min(1, m - 1) * row_bytes, min(2, m - 1) * row_bytes, min(3, m - 1) * row_bytes)
            og = offsets[g, 0] + r * row_bytes
            ou = offsets[g, 1] + r * row_bytes
            for j in range(n):
                xj = x[tokens[t0 + j]]
                g0, g1, g2, g3 = rows_dot4(fmt, data, og, og + step[1], og + step[2], og + step[3], hidden, xj)
                u0, u1, u2, u3 = rows_dot4(fmt, data, ou, ou + step[1], ou + step[2], ou + step[3], hidden, xj)
                h[r - a, j] = silu(g0) * u0
                if m > 1:
                    h[r - a + 1, j] = silu(g1) * u1
                if m > 2:
                    h[r - a + 2, j] = silu(g2) * u2
                if m > 3:
                    h[r - a + 3, j] = silu(g3) * u3
        for r in range(a, b, ROWS):
            m = min(ROWS, b - r)  # h of the rows past b is 0: they add nothing
            step = (0, min(1, m - 1) * row_bytes, min(2, m - 1) * row_bytes, min(3, m - 1) * row_bytes)
            od = offsets[g, 2] + r * row_bytes
            for j in range(n):
                c0, c1, c2, c3 = h[r - a, j], h[r - a + 1, j], h[r - a + 2, j], h[r - a + 3, j]
                rows_axpy4(fmt, data, od, od + step[1], od + step[2], od + step[3], hidden, c0, c1, c2, c3, out[j])


def warm_up() -> None:
    """Compile the kernel (about 20 s the first time on a machine) or load it from numba's disk cache (well
    under a second), so that no request waits for it: node workers call this before they say hello."""
    hidden = 32
    data = np.zeros(3 * 4 * hidden, np.uint8)
    one = np.zeros(1, np.int64)
    layer_rows(0, data, hidden, 4 * hidden, np.zeros((1, hidden), np.float32), one, one, one + 1,
               np.array([[0, 4 * hidden, 8 * hidden]], np.int64), one, np.array([[0, 1]], np.int64),
               np.zeros(hidden, np.float32), one)

"""One compiled call per node per layer: every routed expert's rows, decode and prefill.

Every task is (expert group g, a block of rows [a, b) of the node's slice of
that expert). For one token, four rows at a time, the task takes the dot
products of the gate and up rows with the token's row, reading the store's
format in place (simd.py: each block widened and scaled in registers), then it
adds the rows of W_down[:, R]ᵀ weighted by silu(gate) * up into its own
contribution [1, H]. For n >= 2 tokens (prefill, padded to a multiple of 4)
the gate and up rows go two at a time against four tokens (each block widened
once for the four, their accumulators in registers), and the contribution
[n, H] is built from tiles of 32 down rows, column block by column block,
each block summing the tile's rows in registers (a tile stays in cache while
every chunk of tokens reads it). Tasks run in parallel
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
    return s * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * s)))  # the tanh form of coordinator/model/ops.py


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
def dot_chunks(fmt, data, o, row_bytes, rows, hidden, xg, out) -> None:
    """out [n, R + 1] <- xg [n, H] · the R rows from byte offset o (n a multiple of 4): two rows and four
    tokens at a time (x read once for the two rows, four tokens' x in L1); an odd last row fills column R."""
    n = xg.shape[0]
    for r in range(0, rows, 2):
        step = row_bytes if r + 1 < rows else 0
        for t0 in range(0, n, 4):
            simd.dot2r4(fmt, data, o + r * row_bytes, step, hidden, xg, t0, out, r)


@njit(inline="always", **JIT)
def cols_chunks(fmt, data, o, row_bytes, rows, hidden, h, h_col, out) -> None:
    """out [n, H] += h[:, h_col:h_col + R] · the R rows from byte offset o, n a multiple of 4: tokens 8 at a
    time, then 4."""
    n, h_stride = h.shape[0], h.shape[1]
    for t0 in range(0, n - 7, 8):
        simd.cols8(fmt, data, o, row_bytes, rows, hidden, h, h_stride, h_col, t0, out)
    if n % 8:
        simd.cols4(fmt, data, o, row_bytes, rows, hidden, h, h_stride, h_col, n - 4, out)


DOWN_TILE = 32  # W_down rows summed per pass over out: the tile stays in cache while every token chunk reads it


@njit(inline="always", **JIT)
def task_tokens(fmt, data, hidden, row_bytes, xg, og, ou, od, a, b, out) -> None:
    """A task of n tokens, a multiple of 4 (xg [n, H], gathered): gate and up two rows by four tokens at a
    time; then W_down's rows, 32 at a time, summed column block by column block into out [n, H]."""
    n = xg.shape[0]
    R = b - a
    gate = np.empty((n, R + 1), np.float32)  # [n, R] (+ a column for an odd R's repeated last row)
    up = np.empty((n, R + 1), np.float32)
    dot_chunks(fmt, data, og + a * row_bytes, row_bytes, R, hidden, xg, gate)
    dot_chunks(fmt, data, ou + a * row_bytes, row_bytes, R, hidden, xg, up)
    h = np.empty((n, R), np.float32)  # silu(gate) * up, per token and row
    for j in range(n):
        for r in range(R):
            h[j, r] = silu(gate[j, r]) * up[j, r]
    out[:, :] = 0
    for r in range(a, b, DOWN_TILE):
        cols_chunks(fmt, data, od + r * row_bytes, row_bytes, min(DOWN_TILE, b - r), hidden, h, r - a, out)


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
        if n > 1:  # prefill's groups, padded with rows of zeros to a multiple of 4 tokens
            padded = (n + 3) // 4 * 4
            xg = np.zeros((padded, hidden), np.float32)
            for j in range(n):
                xg[j] = x[tokens[t0 + j]]
            yg = out if padded == n else np.empty((padded, hidden), np.float32)
            task_tokens(fmt, data, hidden, row_bytes, xg, offsets[g, 0], offsets[g, 1], offsets[g, 2], a, b, yg)
            if padded != n:
                out[:, :] = yg[:n]
            continue
        out[:, :] = 0
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

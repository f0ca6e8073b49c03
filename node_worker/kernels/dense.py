"""Whole stored matrices times a few token rows, and stored rows decoded for BLAS.

A dense matrix W [R, K] stored in a format (shm/formats: rows of K weights,
``row_bytes`` apart from byte ``base`` of ``data``) serves the coordinator's
CPU device side (coordinator/host/packed.py) the way the expert kernels serve
the pool: x [T, K] -> x·Wᵀ [T, R] in one compiled call, four rows at a time (bf16
rows: four streams, the matrix's quarters, rows.stream_quad), rows split over numba's threads.

Each takes the kernel set first (kernel_set.py: the formats compiled in; its int_act, the integer loops):

    matmul_rows(ks, fmt, data, base, row_bytes, R, K, x, out)
                                                            out [T, R] = x [T, K] · Wᵀ  (T small; int_act:
                                                            integer dot products for Q8_0 and Q4_0)
    matmul_tiles(ks, fmt, data, base, row_bytes, R, K, x, out)
                                                            out [T, R + 1] = the same for f32 or bf16 rows (or
                                                            bf16dp's: by bf16 activations), T a multiple of 4:
                                                            four rows by four tokens at a time (rows.dot_chunks)
    matmul_tokens_int(ks, fmt, data, base, row_bytes, R, K, x, out)
                                                            the same for a K type or IQ4_XS (rows.SUPER_IDS), T = 1
                                                            (four rows at a time) or not 1 mod 4 (a row by eight
                                                            tokens, then four, three, two), on x quantised per
                                                            super-block; or for q8 or q4, any T, per block
                                                            (iblock.py)
    decode_rows(ks, fmt, data, base, row_bytes, first, out) out [n, K] = W[first:first + n] as float32
    (q8 matrices of whole groups of eight rows with integer activations: rows8.py's interleaved layout and loop)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import rows8
from . import simd
from .common import JIT, serial_twin
from .activations import quantize_rows_biased, quantize_rows_super
from .rows import (BF16DP, FORMAT_IDS, WIDE_IDS, block_int, dot4, dot_chunks, quad_super, quantised_if, rounded_if,
                   row_tokens_block, row_tokens_int, stream_quad, streamed)


@njit(parallel=True, **JIT)
def matmul_rows(ks, fmt, data, base, row_bytes, R, K, x, out):
    use_int = block_int(ks, fmt)  # integer dot products on x quantised per block (the K types: matmul_tokens_int)
    if streamed(fmt, use_int):  # bf16 rows: the matrix's four quarters as four streams
        for q in prange((R + 3) // 4):
            for t in range(x.shape[0]):
                stream_quad(ks, fmt, data, base, row_bytes, R, K, x[t], out[t], q)
        return
    xq, xd = quantised_if(use_int, x)
    for q in prange((R + 3) // 4):
        r = 4 * q
        o = base + r * row_bytes  # rows past R repeat row R - 1: computed, not stored
        o1 = base + min(r + 1, R - 1) * row_bytes
        o2 = base + min(r + 2, R - 1) * row_bytes
        o3 = base + min(r + 3, R - 1) * row_bytes
        for t in range(x.shape[0]):
            a0, a1, a2, a3 = dot4(ks, fmt, use_int, data, o, o1, o2, o3, K, x[t], xq[t], xd[t])
            out[t, r] = a0
            if r + 1 < R:
                out[t, r + 1] = a1
            if r + 2 < R:
                out[t, r + 2] = a2
            if r + 3 < R:
                out[t, r + 3] = a3


TILE_ROWS = 24  # rows a task of matmul_tiles: four of dot6r4's tiles
# A task takes the tokens in blocks of at most this many bytes of x, so that a block stays in a core's L2 (1 MiB
# on Zen 4 and 5, 1-2 MiB on Xeons) for all of the task's tiles, beside the task's rows
TOKEN_BLOCK_BYTES = 512 * 1024


@njit(inline="always", **JIT)
def token_block(K, T) -> int:
    """Tokens (a multiple of 4) of rows of K float32 values in a TOKEN_BLOCK_BYTES block, at most T rounded up
    to 4.

    Each six-row tile reads its four tokens' rows from L2 or further; 64 tokens of 4096 (an attention output
    projection's x: 1 MiB) would spill out of L2 at every tile."""
    return max(4, min(TOKEN_BLOCK_BYTES // (4 * K) // 4 * 4, (T + 3) // 4 * 4))


@njit(parallel=True, **JIT)
def matmul_tiles(ks, fmt, data, base, row_bytes, R, K, x, out):
    """out [T, R + 1] = x [T, K] · Wᵀ (column R: scratch) for f32 or bf16 rows (or bf16dp's), T a multiple of 4:
    the experts' prefill loop (rows.dot_chunks: four or six rows by four tokens, each block widened once for
    them), TILE_ROWS rows a task over the threads, each task's tokens in blocks (token_block)."""
    xb = rounded_if(fmt == BF16DP, x)  # bf16dp's: x rounded to bf16 once
    T = x.shape[0]
    block = token_block(K, T)
    for c in prange((R + TILE_ROWS - 1) // TILE_ROWS):
        r = c * TILE_ROWS
        rows = min(TILE_ROWS, R - r)
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            dot_chunks(ks, fmt, data, base + r * row_bytes, row_bytes, rows, K, x[t0:t1], xb[t0:t1], out[t0:t1], r,
                       t1 - t0)


@njit(parallel=True, **JIT)
def matmul_tokens_int(ks, fmt, data, base, row_bytes, R, K, x, out):
    if block_int(ks, fmt):  # q8 or q4: a row by eight tokens (then four to one), on x quantised per block
        xu, xd = quantize_rows_biased(x)
        for r in prange(R):
            row_tokens_block(ks, fmt, data, base + r * row_bytes, row_bytes, K, xu, xd, out, r, x.shape[0])
        return
    xq, xd, bs = quantize_rows_super(x)  # [T, K] once for every row
    if x.shape[0] == 1:  # decode
        for q in prange((R + 3) // 4):
            quad_super(ks, fmt, data, base, row_bytes, R, K, xq, xd, bs, out, 4 * q)
        return
    for r in prange(R):
        row_tokens_int(ks, fmt, data, base + r * row_bytes, row_bytes, K, xq, xd, bs, out, r, x.shape[0])


@njit(parallel=True, **JIT)
def decode_rows(ks, fmt, data, base, row_bytes, first, out):
    for i in prange(out.shape[0]):
        simd.decode(ks, fmt, data, base + (first + i) * row_bytes, out.shape[1], out[i])


# The loops one row of x takes through a stored matrix (coordinator/host/packed.py's one_row_kind), by kind: the
# row loop, a K type's or IQ4_XS's integer loop on x quantised per super-block, q8's interleaved groups of eight
# rows (rows8.py); kind + SERIAL: the same loop on the calling thread (serial_twin), for a matrix whose read takes
# less time than a parallel region's start
ROW_PLAIN, ROW_SUPER, ROW_GROUPS = 0, 1, 2
SERIAL = 3
matmul_rows_serial = serial_twin(matmul_rows, "matmul_rows_serial")
matmul_tokens_int_serial = serial_twin(matmul_tokens_int, "matmul_tokens_int_serial")
ONE_ROW_LOOPS = {ROW_PLAIN: matmul_rows, ROW_SUPER: matmul_tokens_int, ROW_GROUPS: rows8.matmul_groups,
                 ROW_PLAIN + SERIAL: matmul_rows_serial, ROW_SUPER + SERIAL: matmul_tokens_int_serial,
                 ROW_GROUPS + SERIAL: rows8.matmul_groups_serial}


@njit(**JIT)
def one_row(kind, m, x, out) -> None:
    """out [1, R] = x [1, K] · Wᵀ by ONE_ROW_LOOPS[kind]; ``kind`` a literal (shm/jit_entry.py), so only its
    branch is compiled. m: (kernel set, format id, data, row bytes, R, K)."""
    ks, fmt, data, row_bytes, R, K = m
    if kind == ROW_GROUPS:
        rows8.matmul_groups(ks, data, R, K, x, out)
    elif kind == ROW_GROUPS + SERIAL:
        rows8.matmul_groups_serial(ks, data, R, K, x, out)
    elif kind == ROW_SUPER:
        matmul_tokens_int(ks, fmt, data, 0, row_bytes, R, K, x, out)
    elif kind == ROW_SUPER + SERIAL:
        matmul_tokens_int_serial(ks, fmt, data, 0, row_bytes, R, K, x, out)
    elif kind == ROW_PLAIN + SERIAL:
        matmul_rows_serial(ks, fmt, data, 0, row_bytes, R, K, x, out)
    else:
        matmul_rows(ks, fmt, data, 0, row_bytes, R, K, x, out)


def warm_up(ks) -> None:
    """Compile (or load from the disk cache) what coordinator/host/packed.py calls for matrices of the kernel
    set ``ks`` (kernel_set.KernelSet), on the types it passes, before the first request: the few-token rows and
    the decoded rows (every format), the integer loops (int_act), each with its serial twin (SERIAL), the float
    tiles (f32, bf16, bf16dp), rows8.py's interleaved q8 and q4 loops."""
    fmt = FORMAT_IDS[ks.loops[0]]
    data = np.zeros(4 * 256 * 4, np.uint8)  # room for four rows of 256 in any format
    x, out = np.zeros((1, 256), np.float32), np.zeros((1, 1), np.float32)
    for loop in (matmul_rows, matmul_rows_serial):
        loop(ks, fmt, data, 0, 4 * 256, 1, 256, x, out)
    decode_rows(ks, fmt, data, 0, 4 * 256, 0, np.zeros((1, 256), np.float32))
    if ks.int_act:
        for loop in (matmul_tokens_int, matmul_tokens_int_serial):
            loop(ks, fmt, data, 0, 4 * 256, 1, 256, np.zeros((4, 256), np.float32), np.zeros((4, 1), np.float32))
    if any(FORMAT_IDS[name] in WIDE_IDS for name in ks.loops):
        matmul_tiles(ks, fmt, data, 0, 4 * 256, 1, 256, np.zeros((4, 256), np.float32), np.zeros((4, 2), np.float32))
    rows8.warm_up(ks)

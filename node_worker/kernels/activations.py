"""Activations quantised per block of 32 for the integer dot products (idot.py), as llama.cpp's Q8_0.

    a row of K activations (K a multiple of 32), nb = K / 32 blocks:
      xq [K]   int8     q[i] = round(x[i] / d[b]) in [-127, 127], b = i // 32 (ties to even)
      xd [nb]  float32  d[b] = max |x| over block b / 127 (0 for a block of zeros)
      sums [nb] int32   the sum of q over block b (rows8.py's unsigned q4 values: their offset's share)
    the row as the kernels see it: x'[i] = d[b] * q[i]

That is Q8_0 and Q4_0 weights' form (isimd.py), as llama.cpp's. Prefill's loop for them (iblock.py) takes
the values biased for its vpdpbusd, beside the same scales:

      xu  [K]      uint8    q[i] + 128
      xd  [nb]     float32  d[b], as above

The K types' and IQ4_XS's (isuper.py, decode and prefill) is Q8_K's, as llama.cpp's for those types: one
scale per super-block of 256, so that a super-block's products add up in integers, and the sums of every
16 values for the weights' offsets:

    a row of K activations (K a multiple of 256), ns = K / 256 super-blocks:
      xq [K]       int8     q[i] = round(x[i] / d[s]) in [-127, 127], s = i // 256 (ties to even)
      xd [ns]      float32  d[s] = max |x| over super-block s / 127 (0 for one of zeros)
      bs [K / 16]  int16    the sum of q over each 16 values (|bs| <= 16 x 127 = 2032)
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT

BLOCK = 32
EXACT_JIT = dict(JIT, fastmath=False)  # no reciprocal for the division: the same bits as quantize_reference


@njit(inline="always", **EXACT_JIT)
def quantize_block(x, lo, hi, xq):
    """xq[lo:hi] <- x[lo:hi] quantised to [-127, 127] by one scale; returns (the scale, the sum of xq[lo:hi])."""
    amax = np.float32(0.0)
    for i in range(lo, hi):
        amax = max(amax, abs(x[i]))
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    total = 0
    for i in range(lo, hi):
        q = min(max(np.round(x[i] * inv), np.float32(-127.0)), np.float32(127.0))
        xq[i] = np.int8(q)
        total += np.int32(q)
    return amax / np.float32(127.0), total


@njit(**EXACT_JIT)  # a call of its own, not inlined: its flags, not the caller's fastmath
def quantize_rows_summed(x):
    """x [n, K] float32 -> (xq [n, K] int8, xd [n, K / 32] float32, sums [n, K / 32] int32): the values, the
    scales, and each block's sum of xq as an integer (rows8.py's unsigned values)."""
    n, K = x.shape
    xq = np.empty((n, K), np.int8)
    xd = np.empty((n, K // BLOCK), np.float32)
    sums = np.empty((n, K // BLOCK), np.int32)
    for t in range(n):
        for b in range(K // BLOCK):
            xd[t, b], sums[t, b] = quantize_block(x[t], BLOCK * b, BLOCK * b + BLOCK, xq[t])
    return xq, xd, sums


@njit(**EXACT_JIT)
def quantize_rows_biased(x):
    """x [n, K] float32 -> (xu [n, K] uint8, xd [n, K / 32] float32): quantize_rows_summed's values biased by 128, and
    its scales (module docstring)."""
    n, K = x.shape
    xq = np.empty(K, np.int8)
    xu = np.empty((n, K), np.uint8)
    xd = np.empty((n, K // BLOCK), np.float32)
    for t in range(n):
        for b in range(K // BLOCK):
            xd[t, b], _ = quantize_block(x[t], BLOCK * b, BLOCK * b + BLOCK, xq)
        for i in range(K):
            xu[t, i] = np.uint8(np.int32(xq[i]) + 128)
    return xu, xd


SUPER = 256
SUB = 16


@njit(**EXACT_JIT)
def quantize_rows_super(x):
    """x [n, K] float32 -> (xq [n, K] int8, xd [n, K / 256] float32, bs [n, K / 16] int16) (module docstring)."""
    n, K = x.shape
    xq = np.empty((n, K), np.int8)
    xd = np.empty((n, K // SUPER), np.float32)
    bs = np.zeros((n, K // SUB), np.int16)
    for t in range(n):
        for s in range(K // SUPER):
            xd[t, s], _ = quantize_block(x[t], SUPER * s, SUPER * s + SUPER, xq[t])
        for k in range(K // SUB):
            total = 0
            for i in range(SUB * k, SUB * k + SUB):
                total += np.int32(xq[t, i])
            bs[t, k] = np.int16(total)
    return xq, xd, bs


def _blocks_reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy form of quantize_block over every block of x [n, K]: (q int8 [n, K / block, block], scales)."""
    n, K = x.shape
    blocks = x.reshape(n, K // block, block).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)
    return np.clip(np.round(blocks * inv[..., None]), -127, 127).astype(np.int8), amax / np.float32(127.0)


def quantize_super_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy form of quantize_rows_super (tests): x [n, K] -> (xq, xd, bs)."""
    n, K = x.shape
    q, d = _blocks_reference(x, SUPER)
    return q.reshape(n, K), d, q.reshape(n, K // SUB, SUB).sum(axis=2, dtype=np.int32).astype(np.int16)


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy form of quantize_rows_summed (tests): x [n, K] -> (xq, xd, sums)."""
    n, K = x.shape
    q, d = _blocks_reference(x, BLOCK)
    return q.reshape(n, K), d, q.sum(axis=2, dtype=np.int32)

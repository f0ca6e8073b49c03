"""bf16 rows (shm/formats/bf16.py): H uint16, each the top half of a float32.

The weights are widened in the registers (zero-extend, shift, bitcast) inside the
dot and axpy loops: no decoded copy of the row is written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT, as_float

SHIFT = np.uint32(16)


@njit(inline="always", **JIT)
def row(data: np.ndarray, off: int, hidden: int) -> np.ndarray:
    return data[off:off + 2 * hidden].view(np.uint16)


@njit(inline="always", **JIT)
def dot4(data, o0, o1, o2, o3, hidden, x):
    """The dot products with x of the four rows at byte offsets o0..o3 (exact widening to float32)."""
    w0, w1, w2, w3 = row(data, o0, hidden), row(data, o1, hidden), row(data, o2, hidden), row(data, o3, hidden)
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(hidden):
        xi = x[i]
        a0 += as_float(np.uint32(w0[i]) << SHIFT) * xi
        a1 += as_float(np.uint32(w1[i]) << SHIFT) * xi
        a2 += as_float(np.uint32(w2[i]) << SHIFT) * xi
        a3 += as_float(np.uint32(w3[i]) << SHIFT) * xi
    return a0, a1, a2, a3


@njit(inline="always", **JIT)
def axpy4(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out):
    """out += c0 * row0 + c1 * row1 + c2 * row2 + c3 * row3."""
    w0, w1, w2, w3 = row(data, o0, hidden), row(data, o1, hidden), row(data, o2, hidden), row(data, o3, hidden)
    for i in range(hidden):
        out[i] += (c0 * as_float(np.uint32(w0[i]) << SHIFT) + c1 * as_float(np.uint32(w1[i]) << SHIFT)
                   + c2 * as_float(np.uint32(w2[i]) << SHIFT) + c3 * as_float(np.uint32(w3[i]) << SHIFT))


@njit(inline="always", **JIT)
def decode_row(data: np.ndarray, off: int, hidden: int, buf: np.ndarray) -> None:
    """buf [H] float32 <- the row at byte ``off`` of ``data`` (exact)."""
    src = row(data, off, hidden)
    for i in range(hidden):
        buf[i] = as_float(np.uint32(src[i]) << SHIFT)

"""f32 rows (shm/formats/f32.py): H float32, used in place."""

from __future__ import annotations

import numpy as np
from numba import njit

from . import common
from .common import JIT


@njit(inline="always", **JIT)
def row(data: np.ndarray, off: int, hidden: int) -> np.ndarray:
    """The row at byte ``off`` of ``data`` as float32 [H], in place (no decoding, no copy)."""
    return data[off:off + 4 * hidden].view(np.float32)


@njit(inline="always", **JIT)
def dot4(data, o0, o1, o2, o3, hidden, x):
    """The dot products with x of the four rows at byte offsets o0..o3."""
    return common.dot4(row(data, o0, hidden), row(data, o1, hidden), row(data, o2, hidden), row(data, o3, hidden), x)


@njit(inline="always", **JIT)
def axpy4(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out):
    """out += c0 * row0 + c1 * row1 + c2 * row2 + c3 * row3."""
    common.axpy4(c0, row(data, o0, hidden), c1, row(data, o1, hidden), c2, row(data, o2, hidden), c3,
                 row(data, o3, hidden), out)

"""q8 rows (shm/formats/q8.py): H int8 values, then H/32 float16 scales."""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT

BLOCK = 32


@njit(inline="always", **JIT)
def decode_row(data: np.ndarray, off: int, hidden: int, buf: np.ndarray, halves: np.ndarray) -> None:
    """buf [H] float32 <- d[i // 32] * q[i] of the row at byte ``off``."""
    q = data[off:off + hidden].view(np.int8)
    scales = data[off + hidden:off + hidden + 2 * (hidden // BLOCK)].view(np.uint16)
    for b in range(hidden // BLOCK):
        d = halves[scales[b]]  # the float16 scale, by table
        for j in range(BLOCK):
            buf[BLOCK * b + j] = np.float32(q[BLOCK * b + j]) * d

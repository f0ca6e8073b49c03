"""q4 rows (shm/formats/q4.py): 16 bytes of nibbles per block of 32 (low: j, high: j + 16), then H/32
float16 scales."""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT

BLOCK = 32


@njit(inline="always", **JIT)
def decode_row(data: np.ndarray, off: int, hidden: int, buf: np.ndarray, halves: np.ndarray) -> None:
    """buf [H] float32 <- d[i // 32] * (nibble - 8) of the row at byte ``off``."""
    packed = data[off:off + hidden // 2]
    scales = data[off + hidden // 2:off + hidden // 2 + 2 * (hidden // BLOCK)].view(np.uint16)
    for b in range(hidden // BLOCK):
        d = halves[scales[b]]  # the float16 scale, by table
        for j in range(BLOCK // 2):
            v = packed[(BLOCK // 2) * b + j]
            buf[BLOCK * b + j] = np.float32(np.int32(v & np.uint8(15)) - 8) * d
            buf[BLOCK * b + j + BLOCK // 2] = np.float32(np.int32(v >> np.uint8(4)) - 8) * d

"""bf16 rows (shm/formats/bf16.py): H uint16, each the top half of a float32."""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT


@njit(inline="always", **JIT)
def decode_row(data: np.ndarray, off: int, hidden: int, buf: np.ndarray) -> None:
    """buf [H] float32 <- the row at byte ``off`` of ``data`` (exact)."""
    src = data[off:off + 2 * hidden].view(np.uint16)
    bits = buf.view(np.uint32)
    for i in range(hidden):
        bits[i] = np.uint32(src[i]) << np.uint32(16)

"""f32 rows (shm/formats/f32.py): H float32, copied as they are."""

from __future__ import annotations

import numpy as np
from numba import njit

from .common import JIT


@njit(inline="always", **JIT)
def row(data: np.ndarray, off: int, hidden: int) -> np.ndarray:
    """The row at byte ``off`` of ``data`` as float32 [H], in place (no decoding, no copy)."""
    return data[off:off + 4 * hidden].view(np.float32)

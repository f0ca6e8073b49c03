"""f32: float32 weights, 4 bytes each, stored as they are computed with.

    row: H x float32 (little-endian)
"""

from __future__ import annotations

import numpy as np

NAME = "f32"
BLOCK = 1
STORED_DTYPE = np.float32
BYTES_PER_WEIGHT = 4.0


def row_bytes(hidden: int) -> int:
    return 4 * hidden


def hidden_of(stored_width: int) -> int:
    return stored_width


def encode_into(dest: np.ndarray, src: np.ndarray) -> None:
    dest[...] = src


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    dest[...] = src

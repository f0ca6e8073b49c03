"""f32: float32 weights, 4 bytes each, stored as they are computed with.

    row: H x float32 (little-endian)
"""

from __future__ import annotations

import numpy as np

from . import traits

TRAITS = traits.BY_NAME["f32"]  # name, block, bytes, GGUF type: traits.py
NAME, BLOCK = TRAITS.name, TRAITS.block
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.float32


def row_bytes(hidden: int) -> int:
    return 4 * hidden


def hidden_of(stored_width: int) -> int:
    return stored_width


def encode_into(dest: np.ndarray, src: np.ndarray) -> None:
    dest[...] = src


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    dest[...] = src

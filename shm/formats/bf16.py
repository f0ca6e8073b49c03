"""bf16: bfloat16 weights, 2 bytes each: the top 16 bits of a float32.

    row: H x uint16 (little-endian); weight = float32 with these bits on top, zeros below

A BF16 checkpoint's weights are kept bit for bit (no widening, no rounding):
decoding gives exactly the float32 values an f32 store holds. Other sources are
rounded to nearest, ties to even (NaN stays NaN).
"""

from __future__ import annotations

import numpy as np

from . import traits

TRAITS = traits.BY_NAME["bf16"]  # name, block, bytes, GGUF type: traits.py
NAME, BLOCK = TRAITS.name, TRAITS.block
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint16


def row_bytes(hidden: int) -> int:
    return 2 * hidden


def hidden_of(stored_width: int) -> int:
    return stored_width


def encode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """float32 [R, H] -> bfloat16 bits [R, H], round to nearest even."""
    bits = np.ascontiguousarray(src, np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(src)
    dest[...] = np.where(nan, (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """bfloat16 bits [R, H] -> float32 [R, H], exact."""
    halves = dest.view(np.uint16).reshape(*dest.shape, 2)  # [..., (low, high)] of each little-endian float32
    halves[..., 0] = 0
    halves[..., 1] = src

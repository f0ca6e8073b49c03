"""What the formats that hold a GGUF file's super-blocks of 256 as they are (q4k, q5k, q6k, iq4xs) share: the
row arithmetic, and the refusal to quantise floats into them. Each format's module draws its own layout."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .traits import FormatTraits


def functions(record: FormatTraits) -> tuple[Callable, Callable, Callable]:
    """(row_bytes, hidden_of, encode_into) of a format of super-blocks (its traits record: block, block_bytes)."""
    name, ggml, block, super_bytes = record.name, record.ggml, record.block, record.block_bytes

    def row_bytes(hidden: int) -> int:
        return hidden // block * super_bytes

    def hidden_of(stored_width: int) -> int:
        return stored_width // super_bytes * block

    def encode_into(dest: np.ndarray, src: np.ndarray) -> None:
        raise ValueError(f"{name} holds a GGUF file's {ggml} blocks as they are; float weights are not quantised "
                         "to it")

    return row_bytes, hidden_of, encode_into


def halves(f16_bytes: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 little-endian float16 -> [n, 1] float32."""
    return np.ascontiguousarray(f16_bytes).view(np.float16).astype(np.float32)

"""q4: 4-bit weights in blocks of 32 along the row, one float16 scale per block (0.5625 bytes a weight).

    row of H weights, nb = H / 32 blocks:
      bytes [0, H/2)            16 bytes per block: byte j of block b holds
                                  low nibble  = q[32 b + j] + 8,  high nibble = q[32 b + j + 16] + 8
      bytes [H/2, H/2 + 2 nb)   float16 d[b], little-endian, one per block
    weight i = d[i // 32] * q[i],  q in [-8, 7]

Symmetric, as ggml's Q4_0: d = m / -8 where m is the block's value of largest magnitude (its sign
kept), so that value is exactly -8 d and the others round to the nearest step.
"""

from __future__ import annotations

import numpy as np

from . import traits

TRAITS = traits.BY_NAME["q4"]  # name, block, bytes, GGUF type: traits.py
NAME, BLOCK = TRAITS.name, TRAITS.block
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint8


def row_bytes(hidden: int) -> int:
    return hidden // 2 + 2 * (hidden // BLOCK)


def hidden_of(stored_width: int) -> int:
    return stored_width * BLOCK // (BLOCK // 2 + 2)


def encode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """float32 [R, H] -> stored rows [R, row_bytes(H)]."""
    R, H = src.shape
    nb = H // BLOCK
    blocks = src.reshape(R, nb, BLOCK).astype(np.float32)
    at = np.abs(blocks).argmax(axis=2)[..., None]
    m = np.take_along_axis(blocks, at, axis=2)[..., 0]  # [R, nb] signed value of largest magnitude
    d = (m / -8).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(m), where=d != 0)
    q = (np.clip(np.rint(blocks * inv[..., None]), -8, 7) + 8).astype(np.uint8)  # [R, nb, 32] in [0, 15]
    packed = q[..., :16] | (q[..., 16:] << 4)  # [R, nb, 16]
    dest[:, : H // 2] = packed.reshape(R, H // 2)
    dest[:, H // 2 :] = d.view(np.uint8).reshape(R, -1)


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """stored rows [R, row_bytes(H)] -> float32 [R, H]."""
    R, H = dest.shape
    nb = H // BLOCK
    packed = src[:, : H // 2].reshape(R, nb, 16)
    d = np.ascontiguousarray(src[:, H // 2 :]).view(np.float16).astype(np.float32)  # [R, nb]
    out = dest.reshape(R, nb, BLOCK)
    out[..., :16] = (packed & np.uint8(15)).astype(np.int8) - 8
    out[..., 16:] = (packed >> 4).astype(np.int8) - 8
    out *= d[..., None]

"""q8: 8-bit weights in blocks of 32 along the row, one float16 scale per block (1.0625 bytes a weight).

    row of H weights, nb = H / 32 blocks:
      bytes [0, H)          int8 q[i]                 all the row's values first, one long contiguous run
      bytes [H, H + 2 nb)   float16 d[b], little-endian, one per block
    weight i = d[i // 32] * q[i]

Symmetric: d = max |w| / 127 over the block (0 for an all-zero block), q = round(w / d), |q| <= 127.
"""

from __future__ import annotations

import numpy as np

from . import traits

TRAITS = traits.BY_NAME["q8"]  # name, block, bytes, GGUF type: traits.py
NAME, BLOCK = TRAITS.name, TRAITS.block
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint8


def row_bytes(hidden: int) -> int:
    return hidden + 2 * (hidden // BLOCK)


def hidden_of(stored_width: int) -> int:
    return stored_width * BLOCK // (BLOCK + 2)


def encode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """float32 [R, H] -> stored rows [R, row_bytes(H)]."""
    R, H = src.shape
    blocks = src.reshape(R, H // BLOCK, BLOCK).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)  # [R, nb]
    d = (amax / 127).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(amax), where=d != 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    dest[:, :H] = q.reshape(R, H).view(np.uint8)
    dest[:, H:] = d.view(np.uint8).reshape(R, -1)


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """stored rows [R, row_bytes(H)] -> float32 [R, H]."""
    R, H = dest.shape
    q = src[:, :H].view(np.int8).reshape(R, H // BLOCK, BLOCK)
    d = np.ascontiguousarray(src[:, H:]).view(np.float16).astype(np.float32)  # [R, nb]
    np.multiply(q, d[..., None], out=dest.reshape(R, H // BLOCK, BLOCK))

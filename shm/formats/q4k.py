"""q4k: a GGUF file's Q4_K blocks, stored as the file has them (4.5 bits a weight).

    super-block of 256 weights along the row, 144 bytes:
      bytes [0, 2)      float16 d
      bytes [2, 4)      float16 dmin
      bytes [4, 16)     scales: 8 pairs (sc[j], m[j]) of 6-bit unsigned values, j the 32-weight group:
                          j < 4:  sc = s[j] & 63                       m = s[j + 4] & 63
                          j >= 4: sc = s[j + 4] & 15 | s[j - 4] >> 6 << 4   m = s[j + 4] >> 4 | s[j] >> 6 << 4
      bytes [16, 144)   qs: four runs of 32 bytes; run k holds group 2k in its low nibbles, 2k + 1 in the high
    weight 32 j + i of the super-block = (d * sc[j]) * q - (dmin * m[j]),  q = the nibble in [0, 15]

Each product in brackets is one float32 multiply, then one multiply and one
subtraction: gguf.quants' dequantize, operation for operation, so the stored
weights are the file's, bit for bit. Rows are only ever filled from a GGUF
file's Q4_K rows (a lossless copy); float weights are never quantised to it.
"""

from __future__ import annotations

import numpy as np

from . import file_blocks, traits
from .file_blocks import halves

TRAITS = traits.BY_NAME["q4k"]  # name, block, bytes, GGUF type: traits.py
NAME, GGML, BLOCK, SUPER_BYTES = TRAITS.name, TRAITS.ggml, TRAITS.block, TRAITS.block_bytes
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint8

row_bytes, hidden_of, encode_into = file_blocks.functions(TRAITS)


def scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scales [n, 12] uint8 -> (sc, m) [n, 8] uint8, the 6-bit values of the layout above (Q4_K and Q5_K)."""
    s = scales.astype(np.uint8)
    low, high = s[:, 0:4], s[:, 4:8]
    tail = s[:, 8:12]
    sc = np.concatenate([low & 63, (tail & 15) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=1)
    return sc, m


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """stored rows [R, row_bytes(H)] -> float32 [R, H]."""
    blocks = src.reshape(-1, SUPER_BYTES)  # [n, 144], n = R H / 256
    n = blocks.shape[0]
    sc, m = scale_min(blocks[:, 4:16])
    scale = halves(blocks[:, 0:2]) * sc.astype(np.float32)  # [n, 8]
    offset = halves(blocks[:, 2:4]) * m.astype(np.float32)
    runs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = ((runs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)).reshape(n, 8, 32)
    dest.reshape(n, 8, 32)[...] = scale[..., None] * q.astype(np.float32) - offset[..., None]

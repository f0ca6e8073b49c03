"""iq4xs: a GGUF file's IQ4_XS blocks, stored as the file has them (4.25 bits a weight).

    super-block of 256 weights along the row, 136 bytes:
      bytes [0, 2)      float16 d
      bytes [2, 4)      uint16 scales_h: bits 2j..2j+1 = the high 2 bits of group j's 6-bit scale
      bytes [4, 8)      scales_l: the low 4 bits of group j's scale, in the low nibble of byte j // 2 for even
                        j, the high nibble for odd j
      bytes [8, 136)    qs: 16 bytes per group j of 32; byte i: low nibble = index of weight 32 j + i, high
                        nibble = that of weight 32 j + 16 + i
    weight 32 j + i = (d * (scale_j - 32)) * KVALUES[index],  KVALUES the 16 non-uniform int8 levels below

gguf.quants' dequantize operation for operation; filled only from a GGUF file's
IQ4_XS rows.
"""

from __future__ import annotations

import numpy as np

from . import file_blocks, traits
from .file_blocks import halves

TRAITS = traits.BY_NAME["iq4xs"]  # name, block, bytes, GGUF type: traits.py
NAME, GGML, BLOCK, SUPER_BYTES = TRAITS.name, TRAITS.ggml, TRAITS.block, TRAITS.block_bytes
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint8
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl

row_bytes, hidden_of, encode_into = file_blocks.functions(TRAITS)


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """stored rows [R, row_bytes(H)] -> float32 [R, H]."""
    blocks = src.reshape(-1, SUPER_BYTES)
    n = blocks.shape[0]
    high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)  # [n, 1]
    low = blocks[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)  # [n, 4, 2]
    scale = (low.reshape(n, 8) & np.uint8(15)) | (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3)
                                                  .astype(np.uint8) << np.uint8(4))
    dl = halves(blocks[:, 0:2]) * (scale.astype(np.int8) - np.int8(32)).astype(np.float32)  # [n, 8]
    qs = blocks[:, 8:].reshape(n, 8, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    levels = np.array(KVALUES, np.int8)[(qs & np.uint8(15)).reshape(n, 8, 32)].astype(np.float32)
    dest.reshape(n, 8, 32)[...] = dl[..., None] * levels

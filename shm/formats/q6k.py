"""q6k: a GGUF file's Q6_K blocks, stored as the file has them (6.5625 bits a weight).

    super-block of 256 weights along the row, 210 bytes:
      bytes [0, 128)    ql: two halves of 64 bytes; half h, byte i: low nibble = low 4 bits of weight
                        128 h + i, high nibble = those of weight 128 h + 64 + i
      bytes [128, 192)  qh: two halves of 32 bytes; half h, byte i, bits 2k..2k+1 = high 2 bits of weight
                        128 h + 32 k + i
      bytes [192, 208)  int8 scales[16], one per 16 weights
      bytes [208, 210)  float16 d
    weight w = (d * scales[w // 16]) * (q - 32),  q = low | high << 4 in [0, 63]

gguf.quants' dequantize operation for operation; filled only from a GGUF file's
Q6_K rows.
"""

from __future__ import annotations

import numpy as np

from . import file_blocks, traits
from .file_blocks import halves

TRAITS = traits.BY_NAME["q6k"]  # name, block, bytes, GGUF type: traits.py
NAME, GGML, BLOCK, SUPER_BYTES = TRAITS.name, TRAITS.ggml, TRAITS.block, TRAITS.block_bytes
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint8

row_bytes, hidden_of, encode_into = file_blocks.functions(TRAITS)


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """stored rows [R, row_bytes(H)] -> float32 [R, H]."""
    blocks = src.reshape(-1, SUPER_BYTES)
    n = blocks.shape[0]
    scale = halves(blocks[:, 208:210]) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & np.uint8(15)).reshape(n, 8, 32) | ((qh & np.uint8(3)).reshape(n, 8, 32) << np.uint8(4)))
    q = (q.astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 16, 16)
    dest.reshape(n, 16, 16)[...] = scale[..., None] * q

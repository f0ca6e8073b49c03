"""q5k: a GGUF file's Q5_K blocks, stored as the file has them (5.5 bits a weight).

    super-block of 256 weights along the row, 176 bytes:
      bytes [0, 2)      float16 d
      bytes [2, 4)      float16 dmin
      bytes [4, 16)     scales: (sc[j], m[j]) packed as Q4_K's (q4k.py)
      bytes [16, 48)    qh: bit j of byte i is the fifth bit of weight 32 j + i
      bytes [48, 176)   qs: four runs of 32 bytes; run k holds group 2k's low 4 bits in its low nibbles,
                        group 2k + 1's in the high ones
    weight 32 j + i = (d * sc[j]) * q - (dmin * m[j]),  q = nibble | qh bit << 4 in [0, 31]

gguf.quants' dequantize operation for operation; filled only from a GGUF file's
Q5_K rows.
"""

from __future__ import annotations

import numpy as np

from . import file_blocks, traits
from .file_blocks import halves
from .q4k import scale_min

TRAITS = traits.BY_NAME["q5k"]  # name, block, bytes, GGUF type: traits.py
NAME, GGML, BLOCK, SUPER_BYTES = TRAITS.name, TRAITS.ggml, TRAITS.block, TRAITS.block_bytes
BYTES_PER_WEIGHT = TRAITS.bytes_per_weight
STORED_DTYPE = np.uint8

row_bytes, hidden_of, encode_into = file_blocks.functions(TRAITS)


def decode_into(dest: np.ndarray, src: np.ndarray) -> None:
    """stored rows [R, row_bytes(H)] -> float32 [R, H]."""
    blocks = src.reshape(-1, SUPER_BYTES)
    n = blocks.shape[0]
    sc, m = scale_min(blocks[:, 4:16])
    scale = halves(blocks[:, 0:2]) * sc.astype(np.float32)  # [n, 8]
    offset = halves(blocks[:, 2:4]) * m.astype(np.float32)
    runs = blocks[:, 48:].reshape(n, 4, 1, 32)
    low = ((runs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)).reshape(n, 8, 32)
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = (low | (high << np.uint8(4))).astype(np.float32)
    dest.reshape(n, 8, 32)[...] = scale[..., None] * q - offset[..., None]

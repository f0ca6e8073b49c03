"""What the per-format row decoders share: numba's options and the float16 scale table."""

from __future__ import annotations

import numpy as np

JIT = dict(nogil=True, cache=True, fastmath=True)  # compiled once per machine, kept in numba's disk cache

# float16 bits -> float32, for every one of the 65536 bit patterns (256 KiB): a scale is one lookup
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

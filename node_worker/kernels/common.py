"""What the per-format row decoders share: numba's options and the float16 scale table."""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

JIT = dict(nogil=True, cache=True, fastmath=True)  # compiled once per machine, kept in numba's disk cache

# float16 bits -> float32, for every one of the 65536 bit patterns (256 KiB): a scale is one lookup
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@intrinsic
def as_float(typingctx, bits):
    """float32 with these 32 bits (a register bitcast: the vectorizer keeps it in the loop)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen

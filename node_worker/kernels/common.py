"""What the per-format row decoders share: numba's options and the float16 scale table."""

from __future__ import annotations

import numpy as np
from numba import njit, types
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


@njit(inline="always", **JIT)
def dot4(w0, w1, w2, w3, x):
    """Four float32 rows' dot products with x at once: x is read once for the four."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(x.size):
        xi = x[i]
        a0 += w0[i] * xi
        a1 += w1[i] * xi
        a2 += w2[i] * xi
        a3 += w3[i] * xi
    return a0, a1, a2, a3


@njit(inline="always", **JIT)
def axpy4(c0, w0, c1, w1, c2, w2, c3, w3, out):
    """out += c0 * w0 + c1 * w1 + c2 * w2 + c3 * w3 (float32 rows)."""
    for i in range(out.size):
        out[i] += c0 * w0[i] + c1 * w1[i] + c2 * w2[i] + c3 * w3[i]

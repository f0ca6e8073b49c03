"""q4k rows (shm/formats/q4k.py: a GGUF file's Q4_K super-blocks of 256, 144 bytes) for simd.py's loops.

    32-group b of the row: super-block b // 8 at byte 144 (b // 8), group j = b % 8 in it
      d, dmin   float16 at bytes 0 and 2;  (sc, m) = the 6-bit pair j of bytes [4, 16)
      q         the nibbles of the 32 bytes at 16 + 32 (j // 2): low ones for even j, high for odd
    weights = (d * sc) * float(q) - (dmin * m), each operation as gguf.quants does it (no contraction: the
    weights are the file's bit for bit); returned whole, no scale apart.
"""

from __future__ import annotations

from fractions import Fraction

from llvmlite import ir

from .ir import EXACT, F32, I8, LANES, VF, const, half_at, k_scale_min, splat, super_block, vec_load

SCALED = True  # whole blocks only (no partial last block to read value by value)
BLOCK_BYTES = Fraction(144, 8)  # bytes of the row per group of 32 values: the prefetch's stride
V32 = ir.VectorType(I8, LANES)


def nibbles(builder, run, j):
    """The 32 nibbles of group j from its run of 32 bytes: low ones for even j, high ones for odd j."""
    shift = builder.trunc(builder.mul(builder.and_(j, const(1)), const(4)), I8)
    return builder.and_(builder.lshr(vec_load(builder, run, V32), splat(builder, shift, V32)),
                        ir.Constant(V32, [15] * LANES))


def block(builder, row, b, hidden):
    base, j = super_block(builder, row, b, 144)
    sc, m = k_scale_min(builder, builder.gep(base, [const(4)]), j)
    scale = builder.fmul(half_at(builder, base), builder.uitofp(sc, F32), flags=EXACT)
    offset = builder.fmul(half_at(builder, builder.gep(base, [const(2)])), builder.uitofp(m, F32), flags=EXACT)
    q = nibbles(builder, builder.gep(base, [builder.add(const(16), builder.mul(builder.udiv(j, const(2)),
                                                                                const(32)))]), j)
    w = builder.fmul(builder.uitofp(q, VF), splat(builder, scale), flags=EXACT)
    return builder.fsub(w, splat(builder, offset), flags=EXACT), None
